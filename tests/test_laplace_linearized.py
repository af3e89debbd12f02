"""The linearised model's evidence, ``log_marginal_likelihood(mode="linearized")`` (Antorán et al. 2022), against
independent computations: Bayesian linear regression's evidence in closed form at weights that are *not* the
posterior mode, and, for a softmax model, the Laplace evidence of the second-order model of the loss computed
densely at its own mode (its gradient from autograd of the plain loss). Also the fitted temperature's round trip
through ``state_dict``."""
import math

import pytest
import torch
from scipy.optimize import minimize_scalar
from torch import nn
from torch.distributions import MultivariateNormal

from pyro_fa.laplace import FactorLaplace



def _regression(N=40, d=3, sigma=0.4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, d, generator=g, dtype=torch.float64)
    y = X @ torch.randn(d, generator=g, dtype=torch.float64) + 0.3 + sigma * torch.randn(N, generator=g,
                                                                                           dtype=torch.float64)
    net = nn.Linear(d, 1).double()
    with torch.no_grad():  # weights far from any posterior mode: a network not trained with this prior
        net.weight.copy_(torch.randn(1, d, generator=g, dtype=torch.float64) * 3)
        net.bias.fill_(-2.0)
    return X, y, torch.cat([X, torch.ones(N, 1, dtype=torch.float64)], 1), net


def _closed_form(Z, y, delta, sigma):
    """log N(y; 0, Z diag(1/delta) Z^T + sigma^2 I): Bayesian linear regression's evidence."""
    N = len(y)
    return MultivariateNormal(torch.zeros(N, dtype=y.dtype),
                              Z @ torch.diag(1 / delta) @ Z.T + sigma ** 2 * torch.eye(N, dtype=y.dtype)).log_prob(y)


def test_linear_regression_evidence_is_exact_away_from_the_mode():
    X, y, Z, net = _regression()
    la = FactorLaplace(net, "regression", rank=4).fit([(X[:25], y[:25]), (X[25:], y[25:])])
    for pp, sigma in ((torch.tensor([2.0, 0.5]), 0.4), (torch.tensor([0.1, 3.0]), 0.9), (torch.tensor([7.0]), 0.25)):
        delta = pp.expand(4) if pp.numel() == 1 else torch.cat([pp[0].expand(3), pp[1:]])
        exact = _closed_form(Z, y, delta.double(), sigma)
        ours = la.log_marginal_likelihood(pp.double(), torch.tensor(sigma, dtype=torch.float64), mode="linearized")
        assert abs(float(ours) / float(exact) - 1) < 1e-9
        # the evidence at theta_* is not: theta_* is not the posterior mode of this prior
        at_map = la.log_marginal_likelihood(pp.double(), torch.tensor(sigma, dtype=torch.float64))
        assert float(exact - at_map) > 1.0


def test_linear_regression_evidence_gradients_equal_the_closed_forms():
    X, y, Z, net = _regression(seed=1)
    la = FactorLaplace(net, "regression", rank=4).fit([(X, y)])
    pp = torch.tensor([1.5, 3.0], dtype=torch.float64, requires_grad=True)
    sg = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    ours = la.log_marginal_likelihood(pp, sg, mode="linearized")
    exact = _closed_form(Z, y, torch.cat([pp[0].expand(3), pp[1:]]), sg)
    torch.testing.assert_close(ours, exact)
    for a, b in zip(torch.autograd.grad(ours, (pp, sg)), torch.autograd.grad(exact, (pp, sg))):
        torch.testing.assert_close(a, b)


def test_both_evidences_agree_at_the_exact_posterior_mode():
    X, y, Z, net = _regression(seed=2)
    delta, sigma = torch.tensor([2.0, 2.0, 2.0, 0.5], dtype=torch.float64), 0.4
    m = torch.linalg.solve(torch.diag(delta) + Z.T @ Z / sigma ** 2, Z.T @ y / sigma ** 2)
    with torch.no_grad():
        net.weight.copy_(m[:3][None])
        net.bias.copy_(m[3:])
    la = FactorLaplace(net, "regression", rank=4, prior_precision=torch.tensor([2.0, 0.5]), sigma_noise=sigma)
    la.fit([(X, y)])
    torch.testing.assert_close(la.log_marginal_likelihood(mode="linearized"), la.log_marginal_likelihood())


def test_marglik_with_the_linearized_evidence_finds_the_closed_form_optimum():
    X, y, Z, net = _regression(seed=3)
    la = FactorLaplace(net, "regression", rank=4, sigma_noise=0.4).fit([(X, y)])
    chosen = float(la.optimize_prior_precision("marglik", n_steps=400, lr=0.05, mode="linearized"))
    best = minimize_scalar(lambda t: -float(_closed_form(Z, y, torch.full((4,), math.exp(t), dtype=torch.float64),
                                                         0.4)), bounds=(-8, 8), method="bounded",
                           options={"xatol": 1e-8})
    assert chosen == pytest.approx(math.exp(best.x), rel=1e-3)
    # the evidence at theta_* chooses another value here (theta_* is far from every posterior mode)
    other = float(FactorLaplace(net, "regression", rank=4, sigma_noise=0.4).fit([(X, y)])
                  .optimize_prior_precision("marglik", n_steps=400, lr=0.05))
    assert abs(math.log(other / chosen)) > 0.5


def _softmax_problem(seed=0, N=60, d=3, C=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, d, generator=g, dtype=torch.float64)
    y = (X @ torch.randn(d, C, generator=g, dtype=torch.float64)).argmax(-1)
    net = nn.Linear(d, C).double()
    with torch.no_grad():
        net.weight.copy_(torch.randn(C, d, generator=g, dtype=torch.float64))
        net.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    return X, y, net


def test_softmax_evidence_equals_the_dense_second_order_model_at_its_mode():
    X, y, net = _softmax_problem()
    la = FactorLaplace(net, "classification", rank=11, curvature_fit="scatter").fit([(X[:30], y[:30]), (X[30:], y[30:])])
    theta = torch.cat([net.weight.detach().reshape(-1), net.bias.detach()])
    D = theta.numel()

    def loss(th):
        return nn.functional.cross_entropy(X @ th[:9].reshape(3, 3).T + th[9:], y, reduction="sum")

    th = theta.clone().requires_grad_(True)
    g = torch.autograd.grad(loss(th), th)[0]
    torch.testing.assert_close(la.loss_grad, g)
    # the fitted curvature, dense: G = N (F F^T + Psi) (of rank D - 1 at most; not the exact Hessian, whose
    # comparison is in test_laplace.py)
    G = la.n_data * (la.cov_factor @ la.cov_factor.T + torch.diag(la.cov_diag))
    for pp in (torch.tensor([0.3]), torch.tensor([2.0, 0.05])):
        delta = torch.cat([pp[0].expand(9), pp[-1].expand(3)]).double()
        P = G + torch.diag(delta)
        mode = theta - torch.linalg.solve(P, g + delta * theta)  # of the quadratic model + prior
        step = mode - theta
        fit = float(loss(theta)) + g @ step + 0.5 * step @ G @ step
        dense = (-fit - 0.5 * (delta * mode.pow(2)).sum() + 0.5 * delta.log().sum() - 0.5 * torch.logdet(P))
        torch.testing.assert_close(la.log_marginal_likelihood(pp.double(), mode="linearized"), dense)
    assert D == 12


def test_linearized_mode_is_refused_where_it_does_not_apply():
    X, y, net = _softmax_problem(seed=1)
    la = FactorLaplace(net, "classification", rank=2).fit([(X, y)])
    before = {k: v.clone() for k, v in la.state_dict().items()}
    with pytest.raises(ValueError, match=r"mode must be one of \('map', 'linearized'\), got 'linear'"):
        la.log_marginal_likelihood(mode="linear")
    with pytest.raises(ValueError, match=r"mode must be one of"):
        la.optimize_prior_precision("marglik", mode="mode")
    with pytest.raises(ValueError, match=r"mode='linearized' chooses the evidence of method='marglik'"):
        la.optimize_prior_precision("gridsearch", val_loader=[(X, y)], mode="linearized")
    for k, v in la.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_fitted_temperature_round_trips_through_state_dict():
    X, y, net = _softmax_problem(seed=2, N=80)
    la = FactorLaplace(net, "classification", rank=2).fit([(X[:50], y[:50])])
    assert la.temperature is None
    la.optimize_prior_precision("gridsearch", val_loader=[(X[50:], y[50:])], grid=[0.1, 1.0, 10.0], temperature=True)
    t = la.temperature
    assert t is not None and t > 0
    state = la.state_dict()
    fresh = FactorLaplace(net, "classification", rank=2)
    fresh.load_state_dict(state)
    assert fresh.temperature == pytest.approx(t)
    torch.testing.assert_close(fresh.prior_precision, la.prior_precision)
    # a choice without a temperature clears it, and that too is saved
    la.optimize_prior_precision("marglik", n_steps=5)
    assert la.temperature is None
    fresh.load_state_dict(la.state_dict())
    assert fresh.temperature is None
    bad = {k: v.clone() for k, v in state.items()}
    bad["fitted_temperature"] = torch.tensor(-1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fitted_temperature.*must be non-negative"):
        fresh.load_state_dict(bad)
    assert fresh.temperature is None  # nothing loaded
