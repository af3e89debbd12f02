"""FactorLaplace's fit time against the MAP training of the same network, from D = 10^2 to 10^6 weights.

One-hidden-layer tanh MLPs on scikit-learn's breast-cancer data (30 standardised features, 2 classes, the first
341 points as training data, as a user's first try), hidden width ``h`` giving D = 33h + 2 weights: h = 3, 30,
61, 303, 3030, 30300 (D = 101, 992, 2015, 10001, 99992, 999902). float32, CPU, one thread, batches of 64.
Each network is first trained to its MAP (Adam, lr 1e-2, weight decay as a Gaussian prior of precision 1,
``--epochs`` epochs over the 341 points), timed; then ``FactorLaplace(net, "classification", rank=K).fit(loader)``
with the default ``curvature_fit="auto"`` (``"exact"`` up to D = 1024, ``"randomized"`` above), timed; printed
are both times and their ratio, measured in the same run. ``--fits`` adds other curvature fits for comparison
(``scatter`` is skipped above D = 2048, where it would form a D x D matrix).

Measured 2026-11-28 (a loaded, shared 2-core machine; ``--fits auto scatter``, all six widths, about 7 minutes)::

           D        fit     method    MAP s    fit s fit / MAP
         101       auto      exact     1.02     0.21      0.21
         101    scatter    scatter     1.02     1.55      1.52
         992       auto      exact     0.93     1.00      1.08
         992    scatter    scatter     0.93    20.21     21.76
        2015       auto randomized     0.89     0.33      0.37
        2015    scatter    scatter     0.89    50.58     57.08
       10001       auto randomized     1.23     1.11      0.90
       99992       auto randomized     4.32    11.02      2.55
      999902       auto randomized    32.29   239.80      7.43

At D = 10^5 about half of the fit is the batch FA's iterations (33 of them, O(DK^2) each at 3K columns), the
rest the two passes. ``--widths 3 30 61 303`` (D up to 10^4) takes about a minute.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_cost.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_cost.py --widths 3 30 61 --fits auto scatter
"""
from __future__ import annotations

import argparse
import time


def _data():
    import torch
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X[:341])
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y[:341])


def _map(width: int, X, y, epochs: int, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(X.shape[1], width), nn.Tanh(), nn.Linear(width, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1.0 / X.shape[0])  # prior precision 1
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(X.shape[0], generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(X[idx]), y[idx]).backward()
            opt.step()
    return net.eval(), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[3, 30, 61, 303, 3030, 30300])
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--fits", nargs="+", default=["auto"])
    args = parser.parse_args(argv)

    import torch

    from pyro_fa.laplace import FactorLaplace

    torch.set_num_threads(1)
    X, y = _data()
    loader = [(X[i:i + 64], y[i:i + 64]) for i in range(0, X.shape[0], 64)]
    print(f"breast cancer, N = {X.shape[0]}, rank {args.rank}, MAP: {args.epochs} epochs of Adam, batches of 64; "
          "float32, one thread")
    print(f"{'D':>8} {'fit':>10} {'method':>10} {'MAP s':>8} {'fit s':>8} {'fit / MAP':>9}")
    for width in args.widths:
        net, t_map = _map(width, X, y, args.epochs)
        D = sum(p.numel() for p in net.parameters())
        for fit in args.fits:
            if fit == "scatter" and D > 2048:
                continue
            start = time.perf_counter()
            la = FactorLaplace(net, "classification", rank=args.rank, curvature_fit=fit).fit(loader)
            t_fit = time.perf_counter() - start
            print(f"{D:>8} {fit:>10} {la.fit_info['method']:>10} {t_map:8.2f} {t_fit:8.2f} {t_fit / t_map:9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
