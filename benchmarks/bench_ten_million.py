"""SWAG-EM at 10^7 weights on one CPU: state, peak memory, collection cost and the payoff over SWA.

A 40-H-H-10 ReLU MLP (H = 3150: D = 10 084 660 weights) is trained on MNIST-1D (Greydanus
2020; the ``mnist1d`` package's default data set, 10 % of the training part held out for
validation, :func:`pyro_fa.experiments.classify.data.load_classify`) by SGD with momentum 0.9
(batch 100, cross-entropy): ``--pre-epochs`` epochs at lr 0.05, then ``--swag-epochs`` epochs
at the constant rate lr / 2 with ``SWAG(net, rank=20, method="em", warmup=20, m_step_every=1)``
attached and collecting once per epoch (Maddox et al. 2019, §3: one collection per epoch at a
constant rate). The M-step runs at every collection: the default ``m_step_every`` (one M-step
every D / 10^5 = 100 collections) is for collections at every step.

Printed, from one run:

- the posterior's state (the SWAG's buffers) in bytes and as a multiple of D*K*4 bytes;
- the process's peak resident memory (VmHWM) and the network's parameters + SGD state;
- the mean time of one collection (``SWAG.collect()``, the online-EM update) beside the mean
  time of the bare optimizer step (``opt.step()``) and of a whole training step;
- test NLL and accuracy of the SWA mean (scale 0) and of the SWAG-EM model average (30 draws),
  whose scale is chosen on the validation part by ``SWAG.tune_scale`` (never worse there
  than the mean), with the paired standard error of the per-point difference;
- the computed memory at which each of these posteriors stops fitting in this machine's
  memory (``MemTotal``), for an MLP of this shape grown in width: classic SWAG's
  K x D deviation matrix (Maddox et al. 2019), laplace-torch's full and KFAC Hessians
  (Daxberger et al. 2021) and Pyro's ``AutoLowRankMultivariateNormal`` trained by SVI with
  Adam (formulas in :func:`memory_table`).

    python benchmarks/bench_ten_million.py            # D = 1.0e7, about 8 CPU minutes at 1 thread
    python benchmarks/bench_ten_million.py --quick    # H = 400 (D = 1.8e5), under a minute
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from pyro_fa import SWAG


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return -1


def mlp(in_features: int, hidden: int, classes: int = 10) -> nn.Module:
    """The 40-H-H-10 ReLU MLP."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def n_weights(in_features: int, hidden: int, classes: int = 10) -> int:
    """D of :func:`mlp`."""
    return (in_features + 1) * hidden + (hidden + 1) * hidden + (hidden + 1) * classes


def memory_table(in_features: int, classes: int, rank: int, budget: float):
    r"""Bytes each posterior needs for the MLP of width H, and the largest D that fits in ``budget`` bytes.

    float32 (4 bytes per number), counting the posterior's own arrays (not the network):

    - SWAG-EM (ours): :math:`F, \bar A` (2DK), :math:`c, \psi` (2D) and the float64 running mean
      and squared deviations (4D numbers of 4 bytes): :math:`(2K + 6)\,4D`;
    - classic SWAG (Maddox et al. 2019): the K x D deviation matrix, the mean and the second
      moment: :math:`(K + 2)\,4D`;
    - Pyro ``AutoLowRankMultivariateNormal(rank=K)`` trained by SVI with Adam: parameters
      ``loc, cov_factor, scale`` (:math:`(K+2)D`), their gradients (:math:`(K+2)D`) and Adam's two
      moments (:math:`2(K+2)D`), plus the draw's :math:`D\times K`-free temporaries ignored:
      :math:`4(K + 2)\,4D`;
    - laplace-torch ``FullLaplace``: the D x D Hessian and its Cholesky factor / inverse for the
      posterior: :math:`2\cdot 4D^2`;
    - laplace-torch ``KronLaplace`` (KFAC): per linear layer the factors :math:`(n_{in}+1)^2` and
      :math:`n_{out}^2` and their eigendecompositions (twice): :math:`2\cdot 4(\sum (n_{in}+1)^2 + n_{out}^2)`.

    Returns
    -------
    list of (str, callable H -> bytes, float)
        The name, the bytes at width H, and the largest D (of :func:`n_weights`) that fits.
    """
    def d(H):
        return n_weights(in_features, H, classes)

    def kron(H):
        layers = ((in_features, H), (H, H), (H, classes))
        return 2 * 4 * sum((i + 1) ** 2 + o ** 2 for i, o in layers)

    rows = [
        ("SWAG-EM (pyro_fa, K = %d)" % rank, lambda H: (2 * rank + 6) * 4 * d(H)),
        ("classic SWAG deviations (K = %d)" % rank, lambda H: (rank + 2) * 4 * d(H)),
        ("Pyro AutoLowRankMultivariateNormal + Adam (rank %d)" % rank, lambda H: 4 * (rank + 2) * 4 * d(H)),
        ("laplace-torch full", lambda H: 2 * 4 * d(H) ** 2),
        ("laplace-torch KFAC", kron),
    ]
    out = []
    for name, need in rows:
        lo, hi = 1, 1
        while need(hi) <= budget and hi < 1 << 40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # the largest width that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
        out.append((name, need, float(d(lo))))
    return out


def _nll_acc(probs, y):
    p = probs[torch.arange(y.shape[0]), y].clamp_min(1e-12).double()
    return -p.log(), (probs.argmax(-1) == y).double().mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="H = 400, 4 + 24 epochs (under a minute)")
    p.add_argument("--hidden", type=int, default=3150)
    p.add_argument("--pre-epochs", type=int, default=10)
    p.add_argument("--swag-epochs", type=int, default=30)
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--method", default="em", help="the SWAG method (default em)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.pre_epochs, args.swag_epochs = 400, 4, 24
    torch.set_num_threads(args.threads)
    from pyro_fa.experiments.classify.data import load_classify

    t_start = time.perf_counter()
    data = load_classify("mnist1d", seed=args.seed)
    torch.manual_seed(args.seed)
    net = mlp(data.in_features, args.hidden, data.num_classes)
    D = sum(q.numel() for q in net.parameters())
    K = args.rank
    unit = D * K * 4
    print(f"MNIST-1D: {data.x_train.shape[0]} train / {data.x_val.shape[0]} validation / {data.x_test.shape[0]} test; "
          f"MLP {data.in_features}-{args.hidden}-{args.hidden}-{data.num_classes}, D = {D:,} weights, K = {K}, "
          f"float32, {torch.get_num_threads()} thread(s)")
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x, y = data.x_train, data.y_train
    step_times, train_times = [], []

    def epoch():
        perm = torch.randperm(x.shape[0], generator=gen)
        for idx in perm.split(100):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            step_times.append(t2 - t1)
            train_times.append(t2 - t0)

    for _ in range(args.pre_epochs):
        epoch()
    for g in opt.param_groups:
        g["lr"] = args.lr / 2
    rss_before = _status_kib("VmRSS") * 1024
    swag = SWAG(net, rank=K, method=args.method, warmup=K, seed=args.seed,
                **({"m_step_every": 1} if args.method == "em" else {}))
    collect_times = []
    for _ in range(args.swag_epochs):
        epoch()
        t0 = time.perf_counter()
        swag.collect()
        collect_times.append(time.perf_counter() - t0)
    t_train = time.perf_counter() - t_start
    state = sum(b.numel() * b.element_size() for b in swag.buffers())
    rss_after = _status_kib("VmRSS") * 1024
    # the collections past the warm-up are full online-EM updates (E-step, statistics, M-step)
    full = collect_times[K:] or collect_times
    t_step = sum(step_times) / len(step_times)
    t_train_step = sum(train_times) / len(train_times)
    t_coll = sum(full) / len(full)
    print(f"trained {args.pre_epochs} + {args.swag_epochs} epochs ({len(step_times)} steps) in {t_train:.0f} s; "
          f"{swag.n_collected} collections")
    print(f"posterior state (SWAG buffers): {state / 2 ** 20:.0f} MiB = {state / unit:.2f} x D*K*4 bytes; "
          f"resident memory grew by {(rss_after - rss_before) / 2 ** 20:.0f} MiB "
          f"({(rss_after - rss_before) / unit:.2f} x D*K*4) when the SWAG was built and fed")
    print(f"peak resident memory of the process while training and collecting: {_status_kib('VmHWM') / 2 ** 20:.2f} "
          f"GiB (network + SGD momentum: {2 * D * 4 / 2 ** 30:.2f} GiB)")
    print(f"one collection (past the warm-up): {t_coll * 1e3:.0f} ms = {t_coll / t_step:.1f} x the bare optimizer "
          f"step ({t_step * 1e3:.1f} ms) = {t_coll / t_train_step:.2f} x a training step ({t_train_step * 1e3:.0f} ms) "
          f"= {t_coll / (t_train_step * len(step_times) / (args.pre_epochs + args.swag_epochs)) * 100:.1f} % "
          "of an epoch")

    # held-out payoff: the SWA mean (scale 0) against the model average at the validated scale
    with torch.no_grad():
        t0 = time.perf_counter()
        search = swag.tune_scale(data.x_val, data.y_val, num_samples=args.samples, seed=args.seed)
        t_tune = time.perf_counter() - t0
        scale = swag.scale
        probs = swag.predict_proba(data.x_test, num_samples=args.samples,
                                   generator=torch.Generator().manual_seed(args.seed + 2))
        swag.scale = 0.0
        probs_swa = swag.predict_proba(data.x_test, num_samples=1)
        swag.scale = scale
    nll, acc = _nll_acc(probs, data.y_test)
    nll_swa, acc_swa = _nll_acc(probs_swa, data.y_test)
    diff = nll - nll_swa
    se = diff.std().item() / math.sqrt(diff.numel())
    print(f"scale chosen on validation: {scale:g} ({search.reason}; {t_tune:.0f} s)")
    print("| posterior | test NLL | test accuracy |")
    print("| --- | --- | --- |")
    print(f"| SWA (the mean, scale 0) | {nll_swa.mean():.4f} | {acc_swa:.4f} |")
    print(f"| SWAG-{args.method.upper()} (K = {K}, scale {scale:g}, {args.samples} draws) | {nll.mean():.4f} | "
          f"{acc:.4f} |")
    print(f"paired difference SWAG - SWA in test NLL: {diff.mean():+.4f} +- {se:.4f} (s.e. over "
          f"{diff.numel()} test points)")
    print(f"peak resident memory of the process with the predictions: {_status_kib('VmHWM') / 2 ** 20:.2f} GiB")

    budget = _mem_total_bytes()
    print()
    print(f"Where each posterior stops fitting in this machine's {budget / 2 ** 30:.1f} GiB, for the "
          f"{data.in_features}-H-H-{data.num_classes} MLP grown in width (posterior's arrays only, float32):")
    print("| posterior | bytes at this D | largest D that fits |")
    print("| --- | --- | --- |")
    for name, need, dmax in memory_table(data.in_features, data.num_classes, K, budget):
        print(f"| {name} | {need(args.hidden) / 2 ** 30:.2f} GiB | {dmax:.2e} |")
    print(f"({time.perf_counter() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
