"""Cost of one online-EM update at D = 10^6, K = 20, float32, CPU.

Prints the time of one ``OnlineFactorAnalysis.update`` (method "em" and "sga")
as a multiple of the time of two D x K matrix-vector products measured in the
same process (the physical reference: an update must at least read F twice),
with the M-step after every update and with the default (every 10th at D = 10^6),
each also with the plain EM M-step (``expand=False``) for comparison, and the peak resident memory added by the model as a multiple of D*K*4 bytes.
``method="sketch"`` (the scatter sketch, issue 29) is timed over whole periods of K updates (one
compression each) and its refit, done once when the posterior is read, is timed on its own.

    python benchmarks/bench_online_em.py            # D = 10^6, K = 20
    python benchmarks/bench_online_em.py --dim 100000 --repeats 20
    python benchmarks/bench_online_em.py --methods sga   # online SGA's steps only
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from pyro_fa import OnlineFactorAnalysis


def _rss_peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _mean_time(fn, repeats):
    # the mean, not the median: with m_step_every > 1 the M-step lands on some updates only
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1_000_000)
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--repeats", type=int, default=30, help="a multiple of 10 (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    p.add_argument("--methods", nargs="+", choices=("em", "sga", "sketch"), help="only these methods (default all)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    D, K = args.dim, args.rank
    g = torch.Generator().manual_seed(0)
    F = torch.randn(D, K, generator=g)
    xs = [torch.randn(D, generator=g) for _ in range(4)]
    v = torch.randn(K, generator=g)

    def two_matvecs():
        F.T @ xs[0]
        F @ v

    for _ in range(3):
        two_matvecs()
    ref = _mean_time(two_matvecs, args.repeats)
    unit = D * K * 4
    print(f"D = {D}, K = {K}, float32, {torch.get_num_threads()} threads")
    print(f"two D x K matrix-vector products: {ref * 1e3:.2f} ms")
    # the thesis's plain M-step (expand=False) beside ours, in the same process
    configs = (
        ("em", {"m_step_every": 1}),
        ("em", {"m_step_every": 1, "expand": False}),
        ("em", {}),
        ("em", {"expand": False}),
        ("sga", {}),
        # SGA's natural-gradient step (EM-preconditioned), every m_step_every-th update (10th here) and every update
        ("sga", {"optimizer": "natural"}),
        ("sga", {"optimizer": "natural", "optimizer_kwargs": {"step": 0.5}}),
        ("sga", {"optimizer": "natural", "m_step_every": 1}),
        ("sga", {"optimizer": "natural", "optimizer_kwargs": {"step": 0.5}, "m_step_every": 1}),
        ("sketch", {}),
    )
    for method, kwargs in configs:
        if args.methods and method not in args.methods:
            continue
        _reset_peak()
        base = _rss_peak_kib()
        fa = OnlineFactorAnalysis(D, K, method=method, warmup=K, seed=0, dtype=torch.float32, **kwargs)
        # past the warm-up (EM, SGA) or a full buffer (sketch), so the timed updates are full updates
        for i in range(3 * K + 2 if method == "sketch" else K + 2):
            fa.update(xs[i % len(xs)] + 0.01 * i)
        stream = itertools.cycle(xs)
        # the sketch compresses once every K updates: time whole periods
        repeats = -(-args.repeats // K) * K if method == "sketch" else args.repeats
        t = _mean_time(lambda fa=fa: fa.update(next(stream)), repeats)
        peak = (_rss_peak_kib() - base) * 1024
        print(
            f"{method:>3} {kwargs or ''}: one update {t * 1e3:.2f} ms = {t / ref:.2f} x two matvecs; "
            f"peak memory added {peak / unit:.2f} x D*K*4 bytes"
        )
        if method == "sketch":
            # the refit iterates until the log-likelihood gains < 0.01: time it on a sketch of 3K fresh
            # Gaussian vectors (a full-rank buffer), not of the few cycled ones above
            for _ in range(3 * K):
                fa.update(torch.randn(D, generator=g))
            iters = [0]
            eigh = torch.linalg.eigh

            def counted(*a, **kw):
                iters[0] += 1
                return eigh(*a, **kw)

            torch.linalg.eigh = counted  # one eigendecomposition per refit iteration
            try:
                t0 = time.perf_counter()
                fa.cov_factor
                t_fit = time.perf_counter() - t0
            finally:
                torch.linalg.eigh = eigh
            peak = (_rss_peak_kib() - base) * 1024
            print(f"       the refit when the posterior is read: {t_fit:.2f} s = {t_fit / ref:.0f} x two matvecs "
                  f"({iters[0]} iterations, {t_fit / max(iters[0], 1) / ref:.0f} x two matvecs each); peak memory "
                  f"added with it {peak / unit:.2f} x D*K*4 bytes")
        assert torch.isfinite(fa.cov_factor).all()
        del fa  # free the state before the next method's baseline


if __name__ == "__main__":
    main()
