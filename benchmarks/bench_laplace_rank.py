"""Error of FactorLaplace's covariance against the dense Laplace approximation, against the rank K.

Softmax regression (2 classes, D = 62 weights) on scikit-learn's breast_cancer, standardised, at its MAP
for prior precision 1 (L-BFGS). The reference is the dense Laplace approximation, the inverse of the Hessian of
the negative log joint from ``torch.autograd.functional.hessian`` (equal to the GGN: the model is linear in its
weights). Printed: the relative Frobenius error of the posterior covariance and the largest relative error of a
marginal variance, for FactorLaplace at several ranks and for laplace-torch's ``diag``, ``kron`` and ``full``
(all weights, same prior precision, its default backend), with the fit times, in one run (float64, CPU).

    python benchmarks/bench_laplace_rank.py
"""
from __future__ import annotations

import time

import torch
from torch import nn


def main() -> None:
    from sklearn.datasets import load_breast_cancer

    torch.manual_seed(0)
    X, y = load_breast_cancer(return_X_y=True)
    X = torch.tensor((X - X.mean(0)) / X.std(0), dtype=torch.float64)
    y = torch.tensor(y)
    C, delta = 2, 1.0
    net = nn.Linear(30, C).double()

    def neg_log_joint(theta):
        z = X @ theta[:30 * C].view(C, 30).T + theta[30 * C:]
        return nn.functional.cross_entropy(z, y, reduction="sum") + 0.5 * delta * theta.pow(2).sum()

    theta = torch.zeros(31 * C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], max_iter=500, tolerance_grad=1e-11, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = neg_log_joint(theta)
        loss.backward()
        return loss

    opt.step(closure)
    theta = theta.detach()
    with torch.no_grad():
        net.weight.copy_(theta[:30 * C].view(C, 30))
        net.bias.copy_(theta[30 * C:])
    S = torch.linalg.inv(torch.autograd.functional.hessian(neg_log_joint, theta))
    D = theta.numel()

    def report(name, cov, seconds):
        frob = float((cov - S).norm() / S.norm())
        var = float(((cov.diagonal() - S.diagonal()).abs() / S.diagonal()).max())
        print(f"{name:<24} {frob:>10.4f} {var:>12.4f} {seconds:>9.3f}")

    print(f"breast_cancer softmax regression, D = {D}; errors against the dense Hessian Laplace")
    print(f"{'method':<24} {'rel frob':>10} {'max var rel':>12} {'fit s':>9}")
    from pyro_fa.laplace import FactorLaplace

    for K in (1, 2, 5, 10, 20, 40, D - 1):
        t = time.perf_counter()
        la = FactorLaplace(net, "classification", rank=K, prior_precision=delta, chunk_size=600).fit([(X, y)])
        cov = la.get_posterior().covariance_matrix
        report(f"FactorLaplace K={K}", cov, time.perf_counter() - t)
    from laplace import Laplace

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=600)
    for structure in ("diag", "kron", "full"):
        t = time.perf_counter()
        la = Laplace(net, "classification", subset_of_weights="all", hessian_structure=structure,
                     prior_precision=delta)
        la.fit(loader)
        if structure == "diag":
            cov = torch.diag(la.posterior_variance)
        elif structure == "kron":
            cov = torch.linalg.inv(la.posterior_precision.to_matrix())
        else:
            cov = la.posterior_covariance
        report(f"laplace-torch {structure}", cov.to(S.dtype), time.perf_counter() - t)


if __name__ == "__main__":
    main()
