"""Error of FactorLaplace's fitted curvature against the exact GGN, per curvature fit, with the fit times.

The MNIST-1D reference MLP of ``pyro-fa classify`` (:class:`ResidualMLP`) made narrow enough that the exact
D x D GGN fits in memory (hidden width 20: D = 1 450; 30: D = 2 470), trained on MNIST-1D's training split (3 600
points, Adam 1e-2, batches of 100, 20 epochs), float32, CPU, one thread. Reference: the exact per-example GGN
moment S = G / N accumulated in float64. Printed for K = 20: the relative Frobenius error
||S - (F F^T + diag psi)|| / ||S|| of every curvature fit (``scatter``: batch FA to convergence on the exact S,
the best a rank-K factor analysis can do; ``sketch``, the default above D = 2048; online EM; ``randomized``
with 1, 2 and 3 passes), its relative distance to the first row's fit (batch FA on the exact S, what the
others approximate) and its fit time, measured in one run.

With ``--predictive`` (the full-width MLP, D = 15 210, where the exact GGN is out of reach): the sketch and the
randomized fit side by side, their relative Frobenius distance, and what a user sees of each, the prior precision
chosen by marginal likelihood and the GLM-probit predictive's test NLL and accuracy at it.

    PYRO_FA_DATA=/work/shared/data/uci OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_fit_error.py
    PYRO_FA_DATA=/work/shared/data/uci OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_fit_error.py \
        --hidden 100 --predictive
"""
from __future__ import annotations

import argparse
import os
import time

FITS = (("scatter", {}), ("sketch", {}), ("online", {"num_passes": 4}), ("randomized", {"num_passes": 1}),
        ("randomized", {"num_passes": 2}), ("randomized", {"num_passes": 3}))


def main() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_fa.experiments.classify.data import load_classify
    from pyro_fa.experiments.classify.networks import ResidualMLP
    from pyro_fa.laplace import FactorLaplace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[20, 30])
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--predictive", action="store_true",
                        help="compare the sketch and the randomized fit by their predictives (no exact GGN)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_classify("mnist1d", seed=0)
    print(f"load average {os.getloadavg()[0]:.2f}; N = {len(data.y_train)}, K = {args.rank}")
    for hidden in args.hidden:
        torch.manual_seed(0)
        net = ResidualMLP(data.in_features, data.num_classes, hidden=hidden)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        train = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=100, shuffle=True)
        for _ in range(args.epochs):
            for x, y in train:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
        net.eval()
        loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256)
        if args.predictive:
            _predictive(net, loader, data, args.rank)
            continue
        exact = FactorLaplace(net, "classification", rank=10 ** 9, curvature_fit="scatter").fit(loader)
        S = exact.cov_factor.double() @ exact.cov_factor.double().T  # the exact G / N (full rank: psi = 0)
        norm = float(S.norm())
        print(f"hidden {hidden}: D = {exact.dim}, ||S||_F = {norm:.4g}, trace {float(S.trace()):.4g}")
        print(f"  {'fit':<14} {'passes':>6} {'rel. error':>11} {'vs exact FA':>12} {'fit s':>8}")
        best = None
        for fit, options in FITS:
            t = time.perf_counter()
            la = FactorLaplace(net, "classification", rank=args.rank, curvature_fit=fit, **options).fit(loader)
            seconds = time.perf_counter() - t
            F, psi = la.cov_factor.double(), la.cov_diag.double()
            fitted = F @ F.T + torch.diag(psi)
            err = float((S - fitted).norm()) / norm
            best = fitted if best is None else best  # the first row: batch FA on the exact S
            to_best = float((best - fitted).norm() / best.norm())
            print(f"  {fit:<14} {la.fit_info.get('passes', 1):>6} {err:>11.4f} {to_best:>12.4f} {seconds:>8.2f}",
                  flush=True)


def _predictive(net, loader, data, rank: int) -> None:
    import torch

    from pyro_fa.fa.linalg import relative_frobenius_distance
    from pyro_fa.laplace import FactorLaplace

    with torch.no_grad():
        map_nll = float(torch.nn.functional.cross_entropy(net(data.x_test), data.y_test))
    print(f"D = {sum(p.numel() for p in net.parameters())}; MAP test NLL {map_nll:.4f}")
    print(f"  {'fit':<11} {'fit s':>7} {'marglik delta':>14} {'test NLL':>9} {'accuracy':>9}")
    fits = {}
    for fit in ("sketch", "randomized"):
        t = time.perf_counter()
        la = FactorLaplace(net, "classification", rank=rank, curvature_fit=fit).fit(loader)
        seconds = time.perf_counter() - t
        delta = float(la.optimize_prior_precision("marglik"))
        with torch.no_grad():
            p = la.predict_proba(data.x_test, pred_type="glm")
        nll = float(-p.gather(-1, data.y_test.reshape(-1, 1)).clamp_min(1e-300).log().mean())
        acc = float((p.argmax(-1) == data.y_test).double().mean())
        print(f"  {fit:<11} {seconds:>7.1f} {delta:>14.4g} {nll:>9.4f} {acc:>9.4f}", flush=True)
        fits[fit] = la
    a, b = fits["sketch"], fits["randomized"]
    dist = float(relative_frobenius_distance(a.cov_factor.double(), a.cov_diag.double(), b.cov_factor.double(),
                                             b.cov_diag.double()))
    print(f"  relative Frobenius distance of the two fitted curvatures: {dist:.4f}")


if __name__ == "__main__":
    main()
