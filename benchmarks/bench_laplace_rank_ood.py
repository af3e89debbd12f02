"""FactorLaplace's rank against laplace-torch's full GGN Laplace, at fixed prior precisions (digits MLP).

Does the rank-K plus diagonal curvature give the dense GGN Laplace's predictive spread on OOD inputs? The MAP
network is the digits MLP of ``pyro-fa classify`` (64-100-10 ReLU, D = 7 510), trained by its recipe at the prior
precision its validation chose for the seed (0.01 on seeds 0, 1, 3; 1 on seeds 2, 4). Then, at each fixed prior
precision δ (no marginal likelihood: the curvature alone is compared), the GLM predictive with the probit link
of laplace-torch's all-weights full GGN Laplace (Daxberger et al. 2021, ``hessian_structure="full"``) and of
:class:`pyro_fa.laplace.FactorLaplace` (its default curvature fit) at several ranks: test NLL / AUROC of the
predictive entropy on the test digits against the rotated ones. Fit times beside each, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_rank_ood.py [--seed 0] [--ranks 20 100 300]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

#: MAP's prior precision chosen on validation by ``pyro-fa classify`` (docs/classify/results.json), per seed
MAP_PRIOR = {0: 0.01, 1: 0.01, 2: 1.0, 3: 0.01, 4: 1.0}


def main() -> None:
    from laplace import Laplace

    from pyro_fa import metrics
    from pyro_fa.experiments.classify.data import load_classify
    from pyro_fa.experiments.classify.methods import Budget, _map_net
    from pyro_fa.experiments.classify.networks import make_network
    from pyro_fa.laplace import FactorLaplace

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, choices=sorted(MAP_PRIOR))
    parser.add_argument("--ranks", type=int, nargs="+", default=[20, 100, 300])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0, 10.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_classify("digits", args.seed)
    net = _map_net(lambda: make_network("mlp", data), data, Budget(), args.seed, MAP_PRIOR[args.seed], None).eval()
    y, n = data.y_test, len(data.y_test)
    x_eval = torch.cat([data.x_test, data.ood["rotated"]])
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256)

    def score(p):
        h = metrics.predictive_entropy(p.double())
        return (float(metrics.negative_log_likelihood(p[:n].double(), y)), float(metrics.ood_auroc(h[:n], h[n:])))

    rows = {}
    t = time.perf_counter()
    full = Laplace(net, "classification", subset_of_weights="all", hessian_structure="full")
    full.fit(loader)
    label = f"laplace-torch full ({time.perf_counter() - t:.0f} s)"
    for d in args.deltas:
        full.prior_precision = d
        with torch.no_grad():
            rows.setdefault(label, []).append(score(full(x_eval, pred_type="glm", link_approx="probit")))
    for k in args.ranks:
        t = time.perf_counter()
        la = FactorLaplace(net, "classification", rank=k, seed=args.seed).fit(loader)
        label = f"FactorLaplace K={k} ({time.perf_counter() - t:.0f} s)"
        for d in args.deltas:
            la.prior_precision = torch.tensor(d)
            with torch.no_grad():
                rows.setdefault(label, []).append(score(la.predict_proba(x_eval, pred_type="glm",
                                                                          link_approx="probit")))
    print(f"digits MLP, seed {args.seed}; test NLL / AUROC rotated at prior precision", args.deltas)
    for label, values in rows.items():
        print(f"{label:32s} " + "  ".join(f"{a:.3f}/{b:.3f}" for a, b in values))


if __name__ == "__main__":
    main()
