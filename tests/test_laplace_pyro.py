"""PyroFactorLaplace (a Laplace approximation of a Pyro model at AutoDelta's MAP) against Pyro's dense
AutoLaplaceApproximation, and its guide in pyro.infer.Predictive."""
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoLaplaceApproximation

from pyro_fa.laplace import PyroFactorLaplace


def _data(N=40, d=3):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, d, generator=g, dtype=torch.float64)
    return X, X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.5 * torch.randn(N, generator=g,
                                                                                         dtype=torch.float64)


def model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype), 2.0).to_event(1))
    s = pyro.sample("s", dist.LogNormal(torch.zeros((), dtype=X.dtype), 1.0))
    with pyro.plate("n", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, s), obs=y)


def _fit(guide, X, y):
    """The guide's point by L-BFGS on its (deterministic, for a point-mass guide) ELBO loss."""
    loss_fn = Trace_ELBO().differentiable_loss
    loss_fn(model, guide, X, y)  # creates the guide's parameters
    params = list(guide.parameters())
    opt = torch.optim.LBFGS(params, max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, guide, X, y)
        loss.backward()
        return loss

    opt.step(closure)
    return guide


@pytest.mark.slow
def test_matches_pyro_dense_laplace_and_serves_predictive():
    X, y = _data()
    pyro.set_rng_seed(0)
    _fit(AutoDelta(model), X, y)
    la = PyroFactorLaplace(model, rank=4, num_samples=300).fit(X, y)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    dense = _fit(AutoLaplaceApproximation(model), X, y).laplace_approximation(X, y)
    # AutoDelta's MAP is in the constrained space, Pyro's Laplace mode in the unconstrained one: w agrees, log s
    # moves by the Jacobian's pull
    torch.testing.assert_close(la.loc[:3], dense.loc.detach()[:3], rtol=0, atol=1e-3)
    S = dense.get_posterior().covariance_matrix.detach()[:3, :3]
    # the Monte Carlo Fisher of 300 simulated data sets: relative error about sqrt(2 / 300)
    assert float((la.get_posterior().covariance_matrix[:3, :3] - S).norm() / S.norm()) < 0.15
    # the prior's curvature in unconstrained coordinates: 1/4 for w ~ N(0, 2^2); 1 for log s, s ~ LogNormal(0, 1)
    torch.testing.assert_close(la.prior_curvature, torch.tensor([0.25, 0.25, 0.25, 1.0], dtype=torch.float64))
    torch.manual_seed(0)
    draws = Predictive(model, guide=la.to_guide(), num_samples=1000)(X)
    w = draws["w"].reshape(1000, 3)
    assert draws["y"].shape == (1000, 40)
    emp = torch.cov(w.T)
    assert float((emp - la.get_posterior().covariance_matrix[:3, :3]).norm() / emp.norm()) < 0.15
    assert bool((draws["s"] > 0).all())  # draws of s mapped to its support


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        PyroFactorLaplace(model, rank=0)
    with pytest.raises(TypeError, match="model must be a callable Pyro model, got int"):
        PyroFactorLaplace(3)
    la = PyroFactorLaplace(model, rank=2)
    with pytest.raises(RuntimeError, match=r"to_guide\(\) needs fit"):
        la.to_guide()
    X, y = _data()
    with pytest.raises(RuntimeError, match=r"param store must hold the MAP as 'AutoDelta\.\*' entries"):
        la.fit(X, y)
