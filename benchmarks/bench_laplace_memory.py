"""Peak memory and fit time of a Laplace approximation against the number of weights D: FactorLaplace vs laplace-torch.

An MLP (32 inputs, one hidden layer whose width sets D, 10 classes) on 512 random examples, float32, CPU. Each
(method, D) runs in its own process, fits once on a few examples (lazy imports and allocator pools), then resets
the peak resident memory (VmHWM) and fits on all the data; printed is the peak added by that fit over the
resident memory before it, and the fit time, each also as a ratio to
FactorLaplace's at the same D, measured in one run:

* FactorLaplace, all weights, K = 20 (``--rank``), exact GGN vectors: ``factor`` with its default curvature fit
  (``"auto"``: above D = 2 048 the randomized range finder, two passes, refitted by batch FA; the tables in
  ``docs/laplace.md`` before 2026-11-26 ran when the default was the one-pass scatter sketch), ``factor-em`` with
  online EM, one pass;
* laplace-torch 0.3, all weights, ``diag``, ``kron`` and ``full`` (its default backend).

``full`` is not started where its D x D float32 matrix alone would exceed half the machine's memory: the
point where a peer cannot run is part of the result.

    python benchmarks/bench_laplace_memory.py                       # D ~ 1e4, 1e5
    python benchmarks/bench_laplace_memory.py --dims 10000 100000 1000000
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = ("factor", "factor-em", "diag", "kron", "full")


def _rss_peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
        f.write("5")


def run_worker(script: str, argv: list, env: dict):
    """Run ``script argv`` in a fresh Python process: the JSON its last output line holds, or why it failed."""
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["?"])[-1][:100]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _hidden_for(dim: int, d_in: int = 32, c: int = 10) -> int:
    return max(1, round((dim - c) / (d_in + 1 + c)))


def worker(method: str, dim: int, rank: int, n: int) -> dict:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = _hidden_for(dim)
    net = nn.Sequential(nn.Linear(32, h), nn.Tanh(), nn.Linear(h, 10))
    D = sum(p.numel() for p in net.parameters())
    X, y = torch.randn(n, 32), torch.randint(10, (n,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=128)
    if method.startswith("factor"):
        from pyro_fa.laplace import FactorLaplace

        fit = dict(curvature_fit="online", num_passes=1) if method == "factor-em" else {}
        la = FactorLaplace(net, "classification", rank=rank, chunk_size=16, **fit)
    else:
        from laplace import Laplace

        la = Laplace(net, "classification", subset_of_weights="all", hessian_structure=method)
    batches = [(X[i:i + 128], y[i:i + 128]) for i in range(0, n, 128)]
    # warm-up on 8 examples, alike for every method: lazy imports and allocator pools
    la.fit([(X[:8], y[:8])] if method.startswith("factor") else torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X[:8], y[:8]), batch_size=8))
    import gc

    gc.collect()
    _reset_peak()  # the peak from here on
    base = _rss_kib()
    t = time.perf_counter()
    la.fit(batches if method.startswith("factor") else loader)
    if method.startswith("factor"):
        la.get_posterior().variance  # the posterior is usable: the capacitance and the variances are formed
    else:
        {"diag": lambda: la.posterior_variance, "kron": lambda: la.posterior_precision,
         "full": lambda: la.posterior_covariance}[method]()
    seconds = time.perf_counter() - t
    return {"method": method, "D": D, "seconds": seconds, "peak_mib": (_rss_peak_kib() - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "DIM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.rank, args.n)))
        return
    total = _mem_total_bytes()
    print(f"{'D':>9} {'method':<8} {'fit s':>9} {'peak MiB':>10} {'time / ours':>12} {'memory / ours':>14}"
          f"   (the posterior's D x K float32 factor: D * {args.rank} * 4 bytes)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for dim in args.dims:
        ours = None
        for method in args.methods:
            D = _hidden_for(dim) * 43 + 10
            if method == "full" and 4 * D * D > total / 2:
                print(f"{D:>9} {method:<8} cannot run: its D x D matrix alone is {4 * D * D / 2 ** 30:.1f} GiB "
                      f"(machine {total / 2 ** 30:.0f} GiB)")
                continue
            r = run_worker(__file__, ["--worker", method, str(dim), "--rank", str(args.rank), "--n", str(args.n)],
                           env)
            if isinstance(r, str):
                print(f"{D:>9} {method:<8} failed: {r}")
                continue
            if method == "factor":
                ours = r
            ratio_t = f"{r['seconds'] / ours['seconds']:.2f}" if ours else "-"
            ratio_m = f"{r['peak_mib'] / ours['peak_mib']:.2f}" if ours and ours["peak_mib"] >= 1 else "-"
            print(f"{r['D']:>9} {method:<8} {r['seconds']:>9.2f} {r['peak_mib']:>10.1f} {ratio_t:>12} {ratio_m:>14}",
                  flush=True)


if __name__ == "__main__":
    main()
