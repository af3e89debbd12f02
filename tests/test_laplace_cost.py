"""FactorLaplace(curvature_fit="exact"), the default for small networks: the exact D x D curvature, its exact top
3K eigenpairs and diagonal refitted by batch FA; against a dense autograd GGN, the dense batch FA of the same
matrix, the randomized fit it is the limit of, and the scatter fit."""
import pytest
import torch
from torch import nn

from pyro_fa.fa.batch import gaussian_loglike
from pyro_fa.laplace import FactorLaplace, fit_second_moment


def _mlp_data(n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(3, (n,), generator=g)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()  # D = 30 + 21 = 51
    return X, y, net


def _dense_ggn(net, X):
    """sum_n J_n^T (diag p_n - p_n p_n^T) J_n from torch.autograd.functional.jacobian (float64), divided by N."""
    params = list(net.parameters())
    shapes = [p.shape for p in params]
    theta = torch.cat([p.detach().reshape(-1) for p in params])

    def f(th, x):
        pieces, at = [], 0
        for s in shapes:
            pieces.append(th[at:at + s.numel()].view(s))
            at += s.numel()
        return torch.func.functional_call(net, dict(zip([n for n, _ in net.named_parameters()], pieces)), (x,))

    G = torch.zeros(theta.numel(), theta.numel(), dtype=torch.float64)
    for x in X:
        J = torch.autograd.functional.jacobian(lambda th: f(th, x[None])[0], theta)  # (C, D)
        p = f(theta, x[None])[0].softmax(-1)
        G += J.T @ (torch.diag(p) - p.outer(p)) @ J
    return G / X.shape[0]


def _cov(la):
    return la.cov_factor @ la.cov_factor.T + torch.diag(la.cov_diag)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_exact_fit_at_full_rank_is_the_dense_autograd_ggn():
    X, y, net = _mlp_data()
    G = _dense_ggn(net, X)
    la = FactorLaplace(net, "classification", rank=51, curvature_fit="exact").fit([(X[:50], y[:50]), (X[50:], y[50:])])
    assert la.fit_info["method"] == "exact"
    torch.testing.assert_close(_cov(la), G, rtol=1e-10, atol=1e-12)
    assert float(la.cov_diag.abs().max()) == 0.0


def _dense_fa_iteration(E, s, n, K, psi, floor, iters=400):
    """The batch FA of ``"randomized"`` written densely (as tests/test_laplace_randomized.py checks it): eigenpairs
    of Psi^-1/2 (E E^T / n) Psi^-1/2, F = Psi^1/2 U_K (Lambda_K - 1)_+^1/2, psi = s - diag(F F^T) floored."""
    M = E @ E.T / n
    for _ in range(iters):
        lam, U = torch.linalg.eigh(M / psi.sqrt().outer(psi.sqrt()))
        F = psi.sqrt().unsqueeze(-1) * U[:, -K:].flip(-1) * (lam[-K:].flip(-1) - 1).clamp_min(0).sqrt()
        psi = (s - F.pow(2).sum(-1)).clamp_min(floor)
    return F, psi


def test_exact_fit_is_the_batch_fa_of_the_dense_ggn_top_3k_eigenpairs():
    """The estimand written densely from the autograd GGN S: its top W = 3K eigenpairs E and its diagonal s,
    Barber's iteration to its fixed point from the two starts (psi = s, and probabilistic PCA's isotropic noise),
    the one of larger likelihood of M = E E^T + diag(s - diag E E^T) kept."""
    X, y, net = _mlp_data()
    S = _dense_ggn(net, X)
    K, n_vec, D = 4, 3 * X.shape[0], S.shape[0]
    lam, U = torch.linalg.eigh(S * n_vec)
    E = U[:, -3 * K:] * lam[-3 * K:].clamp_min(0).sqrt()
    s = S.diagonal()
    M = E @ E.T / n_vec
    M = M - torch.diag(M.diagonal()) + torch.diag(s)
    floor = float(s.max()) * torch.finfo(torch.float64).eps ** 0.5
    starts = (s.clone(), torch.full_like(s, float(lam.clamp_min(0)[:D - K].sum()) / (D - K) / n_vec))
    refs = [_dense_fa_iteration(E, s, n_vec, K, psi, floor) for psi in starts]
    F_ref, psi_ref = max(refs, key=lambda r: float(gaussian_loglike(r[0], r[1], M, n_vec)))
    la = FactorLaplace(net, "classification", rank=K, curvature_fit="exact").fit([(X, y)])
    assert la.fit_info["method"] == "exact" and la.fit_info["converged"] and la.fit_info["n_vectors"] == n_vec
    assert _rel(_cov(la), F_ref @ F_ref.T + torch.diag(psi_ref)) < 1e-3
    # FA keeps the moment's diagonal where psi is above its floor
    torch.testing.assert_close(_cov(la).diagonal(), s, rtol=1e-9, atol=1e-12)


def test_auto_picks_the_exact_fit_for_small_networks_and_randomized_above_1024():
    X, y, net = _mlp_data()
    la = FactorLaplace(net, "classification", rank=3).fit([(X, y)])
    assert la.fit_info["method"] == "exact" and la.curvature_fit == "auto"
    torch.testing.assert_close(_cov(la), _cov(FactorLaplace(net, "classification", rank=3,
                                                            curvature_fit="exact").fit([(X, y)])), rtol=0, atol=0)

    def passes(D):
        return lambda: iter([torch.randn(5, D, dtype=torch.float64)])

    assert fit_second_moment(passes(1024), 1024, 2, dtype=torch.float64)[2]["method"] == "exact"
    assert fit_second_moment(passes(1025), 1025, 2, dtype=torch.float64)[2]["method"] == "randomized"


def test_exact_fit_is_the_limit_of_the_randomized_fit():
    X, y, net = _mlp_data(n=200, seed=3)
    data = [(X[:120], y[:120]), (X[120:], y[120:])]
    K = 5
    exact = FactorLaplace(net, "classification", rank=K, curvature_fit="exact").fit(data)
    # the randomized range finder's power iteration converges to the exact top 3K eigenspace: its fit to this one
    rand = FactorLaplace(net, "classification", rank=K, curvature_fit="randomized", num_passes=12).fit(data)
    assert _rel(_cov(exact), _cov(rand)) < 2e-3


def test_exact_fit_equals_scatter_where_the_curvature_has_rank_below_3k():
    """Softmax regression on inputs in a 2-dimensional subspace of R^6: G has rank <= 9 of D = 21, so at K = 4
    (W = 12) the truncation drops nothing and "exact" and "scatter" fit the same matrix by batch FA."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    y = torch.randint(3, (300,), generator=g)
    torch.manual_seed(0)
    net = nn.Linear(6, 3).double()
    data = [(X[:150], y[:150]), (X[150:], y[150:])]
    exact = FactorLaplace(net, "classification", rank=4, curvature_fit="exact").fit(data)
    scatter = FactorLaplace(net, "classification", rank=4, curvature_fit="scatter").fit(data)
    assert _rel(_cov(exact), _cov(scatter)) < 2e-3


def test_exact_fit_handles_a_curvature_of_rank_below_k():
    """Softmax regression on inputs in a 2-dimensional subspace: G has rank <= 9 of D = 21; at K = 12 the fit keeps
    it (psi at the floor), as the full-rank fit does."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    y = torch.randint(3, (300,), generator=g)
    torch.manual_seed(0)
    net = nn.Linear(6, 3).double()
    full = FactorLaplace(net, "classification", rank=21, curvature_fit="exact").fit([(X, y)])
    low = FactorLaplace(net, "classification", rank=12, curvature_fit="exact").fit([(X, y)])
    assert _rel(_cov(low), _cov(full)) < 1e-6


def test_exact_fit_refuses_what_it_cannot_hold():
    def passes():
        yield torch.randn(3, 4, dtype=torch.float64)

    with pytest.raises(ValueError, match=r"curvature vectors must have shape \(V, 5\), got \(3, 4\)"):
        fit_second_moment(passes, 5, 2, method="exact", dtype=torch.float64)
    with pytest.raises(ValueError, match="train_loader must yield at least one example, got none"):
        fit_second_moment(lambda: iter([]), 5, 2, method="exact", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fit\(curvature_fit='exact'\) forms a dense D x D matrix .* needs D <= "
                       r"20000, got 30000\. Use curvature_fit='randomized'"):
        fit_second_moment(lambda: iter([]), 30000, 2, method="exact", dtype=torch.float64)
