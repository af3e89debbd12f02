"""Step time and memory of FactorIVON (rank K) against ivon-opt's IVON on an MLP with about 10^6 parameters.

One training step is what a user runs: ``sampled_params(train=True)`` (draw), ``zero_grad``, forward,
cross-entropy, backward, leave the block (restore, collect), ``step()``. Each optimizer runs ``--warm`` untimed
steps, then ``--steps`` timed ones, interleaved (IVON, FactorIVON, IVON, ...) so that drift on a shared machine
hits both; the median and the mean (which counts the refresh steps at their rate) are reported, and also the median of
the optimizer's own part (the step minus forward and
backward). FactorIVON runs at each ``--update-every`` T (the low-rank part and the factorisation refreshed every T
steps; the timed median then mixes T - 1 cheap steps and one refresh, as training does). Memory: the bytes of
every tensor the optimizer holds between steps (its state, FactorIVON's factorisation buffers (U^T, psi, ...) and
spare basis, and, for IVON, the tensors it keeps in its param groups); the peak of the transient tensors of one
step is not counted.

    OMP_NUM_THREADS=1 python benchmarks/bench_factor_ivon.py   # 784-1000-200-10 MLP, K = 10, batch 128, T = 1, 10, 50
    OMP_NUM_THREADS=1 python benchmarks/bench_factor_ivon.py --rank 20 --batch 512 --update-every 10
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pyro_fa.optim import FactorIVON


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 200), nn.ReLU(), nn.Linear(200, 10))


def _held_bytes(opt) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for value in opt.state.values():
        add(value)
    for value in getattr(opt, "_factor_buffers", {}).values():  # FactorIVON's factorisation and its spare basis
        add(value)
    for group in opt.param_groups:
        for key, value in group.items():
            if key != "params":
                add(value)
    return total


def _one_step(opt, net, x, y):
    """(seconds of the whole step, seconds of forward + backward)."""
    t0 = time.perf_counter()
    with opt.sampled_params(train=True):
        t1 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return t3 - t0, t2 - t1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--update-every", type=int, nargs="+", default=[1, 10, 50])
    args = parser.parse_args(argv)
    import ivon

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(10, (args.batch,), generator=g)
    names = [f"FactorIVON(K={args.rank}, update_every={T})" for T in args.update_every]
    nets = {name: _mlp() for name in ["IVON"] + names}
    D = sum(p.numel() for p in nets["IVON"].parameters())
    kw = dict(lr=0.1, ess=60000.0, hess_init=0.1, weight_decay=1e-4)
    opts = {"IVON": ivon.IVON(nets["IVON"].parameters(), **kw)}
    for name, T in zip(names, args.update_every):
        opts[name] = FactorIVON(nets[name].parameters(), **kw, rank=args.rank, update_every=T)
    times = {name: [] for name in opts}
    own = {name: [] for name in opts}
    for i in range(args.warm + args.steps):
        for name, opt in opts.items():
            total, fb = _one_step(opt, nets[name], x, y)
            if i >= args.warm:
                times[name].append(total)
                own[name].append(total - fb)
    base = statistics.median(times["IVON"])
    base_own = statistics.median(own["IVON"])
    base_bytes = _held_bytes(opts["IVON"])
    print(f"MLP 784-1000-200-10, D = {D}, batch {args.batch}, {torch.get_num_threads()} thread(s), "
          f"{args.warm} warm + {args.steps} timed steps (median)")
    base_mean = statistics.mean(times["IVON"])
    print("| optimizer | median step (ms) | / IVON | mean step (ms) | / IVON | median optimizer part (ms) | / IVON "
          "| held bytes | added bytes / (D K 4) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, opt in opts.items():
        step, part, held = statistics.median(times[name]), statistics.median(own[name]), _held_bytes(opt)
        added = "" if name == "IVON" else f"{(held - base_bytes) / (D * args.rank * 4):.2f}"
        mean = statistics.mean(times[name])
        print(f"| {name} | {1e3 * step:.1f} | {step / base:.2f} | {1e3 * mean:.1f} | {mean / base_mean:.2f} | "
              f"{1e3 * part:.1f} | {part / base_own:.2f} | {held} | {added} |")


if __name__ == "__main__":
    main()
