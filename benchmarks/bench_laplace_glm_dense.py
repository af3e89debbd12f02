"""Dense GGN Laplace against FactorLaplace on the digits MLP of ``pyro-fa classify`` (64-100-10 ReLU, D = 7 510).

Where does FactorLaplace's underconfidence with the marginal-likelihood prior precision come from: the rank-K
plus diagonal approximation of the curvature, or the Laplace / marginal-likelihood model itself? The MAP network
is trained as ``pyro-fa classify`` trains it (Adam, constant rate 1e-2, 150 epochs, weight decay = prior
precision / N, the prior precision of least validation NLL over 0.01, 1, 10, 30), seed 0. Then, on the test part
(GLM predictive, probit link, Immer, Korzepa & Bauer 2021): test NLL, and the OOD AUROC by predictive entropy on
the rotated and shuffled digits, for

* the exact dense GGN Laplace, :math:`P = \\delta I + G` (float64, eigendecomposition of :math:`G`), at the
  scalar prior precision maximising the Laplace evidence (MacKay 1992), at a per-layer prior precision (MacKay's
  fixed point :math:`\\delta_l = \\gamma_l / \\lVert\\theta_l\\rVert^2`), and at fixed prior precisions;
* :class:`pyro_fa.laplace.FactorLaplace` (its default curvature fit, the sketch, at D = 7 510) at rank 20, 100,
  500: marglik (scalar and per layer) and the same fixed prior precisions; with its curvature's relative
  Frobenius error against :math:`G / N`.

Run on one core (39 minutes on a loaded shared 2-core CPU; the dense per-layer fixed point and K = 500 take most):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_glm_dense.py [--ranks 20 100 500]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch.func import jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset


def _nll(p, y):
    return float(-p.gather(-1, y[:, None]).clamp_min(1e-300).log().mean())


def _scores(probs, y, metrics):
    """Test NLL, accuracy and the AUROC by entropy of each OOD set; ``probs`` = [test, *OOD]."""
    h = metrics.predictive_entropy(probs[0].double())
    out = {"nll": _nll(probs[0], y), "acc": float((probs[0].argmax(-1) == y).double().mean())}
    for name, q in zip(("rotated", "shuffled"), probs[1:]):
        out[name] = float(metrics.ood_auroc(h, metrics.predictive_entropy(q.double())))
    return out


def _row(label, s, extra=""):
    print(f"{label:<44} NLL {s['nll']:.4f}  acc {s['acc']:.3f}  AUROC rot {s['rotated']:.3f}  "
          f"shuf {s['shuffled']:.3f}  {extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[20, 100, 500])
    ap.add_argument("--fixed", type=float, nargs="+", default=[1.0, 10.0, 30.0, 100.0, 1000.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pyro_fa import metrics
    from pyro_fa.experiments.classify.data import load_classify
    from pyro_fa.experiments.classify.methods import Budget, _choose, _map_net, _probs
    from pyro_fa.experiments.classify.networks import make_network
    from pyro_fa.laplace import FactorLaplace, curvature_vectors, flat_network, select_parameters
    from pyro_fa.predictive.glm import probit_proba

    t_start = time.perf_counter()
    data = load_classify("digits", seed=args.seed)
    budget = Budget()
    inputs = [data.x_test, data.ood["rotated"], data.ood["shuffled"]]
    y = data.y_test

    def fit_map(value):
        net = _map_net(lambda: make_network("mlp", data), data, budget, args.seed, value, None)
        return net, _probs(net, [data.x_val])[0]

    pp_map, net, val = _choose(budget.prior_precisions, fit_map, data.y_val)
    net.eval()
    print(f"digits: N_train {len(data.y_train)}, N_val {len(data.y_val)}, N_test {len(y)}; MAP prior precision "
          f"{pp_map} (val NLL {val}); {time.perf_counter() - t_start:.0f} s", flush=True)
    _row("MAP", _scores(_probs(net, inputs), y, metrics))

    named = select_parameters(net, "all", "bench")
    sizes = [p.numel() for _, p in named]
    f = flat_network(net, named)
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    D, N = theta.numel(), len(data.y_train)

    # ---------------------------------------------------------------- the dense GGN, float64
    t0 = time.perf_counter()
    G = torch.zeros(D, D, dtype=torch.float64)
    for lo in range(0, N, 64):
        V = curvature_vectors(f, theta, data.x_train[lo:lo + 64], "classification", "ggn").double()
        G.addmm_(V.T, V)
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(f(theta, data.x_train), data.y_train, reduction="sum"))
    lam, U = torch.linalg.eigh(G)
    lam = lam.clamp_min(0)
    print(f"dense GGN: D {D}, trace {float(lam.sum()):.4g}, largest {float(lam[-1]):.4g}, eigenvalues > 1: "
          f"{int((lam > 1).sum())}, > 1e-3: {int((lam > 1e-3).sum())}; loss at the MAP {loss:.4f}; |theta|^2 "
          f"{float(theta.pow(2).sum()):.2f}; {time.perf_counter() - t0:.0f} s", flush=True)
    th2 = float(theta.double().pow(2).sum())

    # Jacobians of the test / OOD outputs, once
    def one(th, xi):
        return f(th, xi.unsqueeze(0)).squeeze(0)

    jac = [torch.cat([vmap(jacrev(one), in_dims=(None, 0))(theta, x[i:i + 64]) for i in range(0, len(x), 64)])
           .double() for x in inputs]  # (n, C, D)
    with torch.no_grad():
        means = [f(theta, x).double() for x in inputs]

    def dense_probs(cov_of):
        return [probit_proba(m, cov_of(J)) for m, J in zip(means, jac)]

    def scalar_cov(delta):
        def cov_of(J):
            JU = J @ U  # (n, C, D)
            return (JU / (lam + delta)) @ JU.transpose(-1, -2)
        return cov_of

    def evidence(delta):  # the Laplace evidence at scalar delta (MacKay 1992)
        return -loss - 0.5 * (float(torch.log1p(lam / delta).sum()) + delta * th2)

    logs = torch.linspace(-6, 6, 241, dtype=torch.float64)
    best = float(10 ** logs[int(torch.tensor([evidence(10 ** float(v)) for v in logs]).argmax())])
    lo_, hi_ = math.log(best) - 0.06, math.log(best) + 0.06
    for _ in range(60):  # golden section on log delta
        a, b = lo_ + 0.382 * (hi_ - lo_), lo_ + 0.618 * (hi_ - lo_)
        lo_, hi_ = (lo_, b) if evidence(math.exp(a)) > evidence(math.exp(b)) else (a, hi_)
    d_ml = math.exp(0.5 * (lo_ + hi_))
    gamma = float((lam / (lam + d_ml)).sum())
    _row("dense GGN, marglik scalar", _scores(dense_probs(scalar_cov(d_ml)), y, metrics),
         f"delta {d_ml:.4g}, gamma {gamma:.1f}, log evidence {evidence(d_ml):.2f}")
    for d in args.fixed:
        _row(f"dense GGN, delta = {d:g}", _scores(dense_probs(scalar_cov(d)), y, metrics),
             f"log evidence {evidence(d):.2f}")

    # per layer: MacKay's fixed point, Cholesky of G + diag(delta)
    t0 = time.perf_counter()
    idx = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    th2_l = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, idx, theta.double().pow(2))
    delta_l = torch.full((len(sizes),), d_ml, dtype=torch.float64)
    eye = torch.arange(D)
    for it in range(12):
        P = G.clone()
        P[eye, eye] += delta_l[idx]
        L = torch.linalg.cholesky(P)
        Linv = torch.linalg.solve_triangular(L, torch.eye(D, dtype=torch.float64), upper=False)
        var = Linv.pow(2).sum(0)
        gamma_l = torch.tensor(sizes, dtype=torch.float64) - delta_l * torch.zeros_like(delta_l).index_add_(0, idx, var)
        new = gamma_l / th2_l
        change = float((new / delta_l).log().abs().max())
        delta_l = new
        if change < 1e-3:
            break
    P = G.clone()
    P[eye, eye] += delta_l[idx]
    L = torch.linalg.cholesky(P)
    Linv = torch.linalg.solve_triangular(L, torch.eye(D, dtype=torch.float64), upper=False)
    ev_l = -loss - 0.5 * (2 * float(L.diagonal().log().sum()) - float(delta_l[idx].log().sum())
                          + float((delta_l[idx] * theta.double().pow(2)).sum()))

    def layer_cov(J):
        JL = J @ Linv.T
        return JL @ JL.transpose(-1, -2)
    _row("dense GGN, marglik per layer", _scores(dense_probs(layer_cov), y, metrics),
         f"delta {[round(float(v), 3) for v in delta_l]}, log evidence {ev_l:.2f}, {it + 1} iterations, "
         f"{time.perf_counter() - t0:.0f} s")
    del P, L, Linv

    # ---------------------------------------------------------------- FactorLaplace at rank K
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=256)
    GN = G / N
    for K in args.ranks:
        t0 = time.perf_counter()
        la = FactorLaplace(net, "classification", rank=K, seed=args.seed).fit(loader)
        t_fit = time.perf_counter() - t0
        approx = la.cov_factor.double() @ la.cov_factor.double().T
        approx[eye, eye] += la.cov_diag.double()
        err = float((approx - GN).norm() / GN.norm())
        del approx
        print(f"FactorLaplace K = {K}: fit {t_fit:.0f} s ({la.fit_info['method']}), curvature error {err:.3f}",
              flush=True)

        def probs_of(la):
            with torch.no_grad():
                return [la.predict_proba(x, pred_type="glm").detach() for x in inputs]
        for per_layer in (False, True):
            la.prior_precision = torch.ones(len(sizes) if per_layer else 1)
            la.optimize_prior_precision("marglik")
            pp = [round(float(v), 3) for v in la.prior_precision]
            _row(f"FactorLaplace K = {K}, marglik {'per layer' if per_layer else 'scalar'}",
                 _scores(probs_of(la), y, metrics),
                 f"delta {pp}, log evidence {float(la.log_marginal_likelihood()):.2f}")
        for d in args.fixed:
            la.prior_precision = torch.tensor([float(d)])
            _row(f"FactorLaplace K = {K}, delta = {d:g}", _scores(probs_of(la), y, metrics),
                 f"log evidence {float(la.log_marginal_likelihood()):.2f}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
