"""PyroFactorLaplace (a Laplace approximation of a Pyro model at AutoDelta's MAP) against Pyro's dense
AutoLaplaceApproximation, and its guide in pyro.infer.Predictive."""
import warnings

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


# ------------------------------------------------------------------ flat priors, deterministic sites, rank >= D
def _orthogonal_design(N=50):
    """X with orthogonal columns of scales 1, 2, 3: the likelihood's Fisher (= its Hessian at the MLE) is diagonal,
    so a rank-2 factor fit of the 4 x 4 curvature is exact up to Monte Carlo error."""
    g = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(N, 3, generator=g, dtype=torch.float64))
    X = Q * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * N ** 0.5 / 4
    y = X @ torch.tensor([0.5, -1.0, 0.2], dtype=torch.float64) + 0.7 * torch.randn(N, generator=g,
                                                                                    dtype=torch.float64)
    return X, y


def flat_model(X, y=None, extra=False):
    """Stan's implicit flat priors: beta flat on R^3, sigma flat on (0, inf) (log prior linear in log sigma)."""
    beta = pyro.sample("beta", dist.ImproperUniform(dist.constraints.real, (), (3,)))
    sigma = pyro.sample("sigma", dist.ImproperUniform(dist.constraints.positive, (), ()))
    if extra:  # a flat site the likelihood ignores: an improper posterior
        pyro.sample("c", dist.ImproperUniform(dist.constraints.real, (), ()))
    with pyro.plate("n", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


def _flat_map(X, y):
    """The MAP in closed form (least squares, sigma^2 = RSS / N), in Pyro's param store as AutoDelta's."""
    beta = torch.linalg.lstsq(X, y.unsqueeze(-1)).solution.squeeze(-1)
    sigma = ((y - X @ beta) ** 2).mean().sqrt()
    pyro.clear_param_store()
    pyro.param("AutoDelta.beta", beta)
    pyro.param("AutoDelta.sigma", sigma, constraint=dist.constraints.positive)
    return torch.cat([beta, sigma.log().reshape(1)])


def _dense_covariance(neg_log_joint, u):
    """The inverse of the dense Hessian of the negative log joint in unconstrained coordinates, at u."""
    return torch.linalg.inv(torch.autograd.functional.hessian(neg_log_joint, u))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("rank", [2, 5])  # rank < D = 4, and rank >= D (the Fisher kept exactly, psi = 0)
def test_flat_prior_matches_dense_hessian(rank):
    X, y = _orthogonal_design()
    u = _flat_map(X, y)
    la = PyroFactorLaplace(flat_model, rank=rank, num_samples=2000).fit(X, y)
    torch.testing.assert_close(la.loc, u)
    # log joint in u = (beta, log sigma): the Normal likelihood plus the log-Jacobian log sigma; flat priors add 0
    C = _dense_covariance(lambda v: -(dist.Normal(X @ v[:3], v[3].exp()).log_prob(y).sum() + v[3]), u)
    # the prior's curvature: zero (beta flat, and sigma's log prior is linear in log sigma)
    torch.testing.assert_close(la.prior_curvature, torch.zeros(4, dtype=torch.float64))
    # the Monte Carlo Fisher of 2000 simulated data sets: relative error about sqrt(2 / 2000) = 0.03
    assert _rel(la.get_posterior().covariance_matrix, C) < 0.1


@pytest.mark.parametrize("rank", [2, 5])
def test_flat_site_without_likelihood_is_improper(rank):
    X, y = _orthogonal_design()
    _flat_map(X, y)
    pyro.param("AutoDelta.c", torch.zeros((), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"no curvature from the prior \(flat\) nor the likelihood at \['c'\]: the "
                                         "posterior is improper"):
        PyroFactorLaplace(flat_model, rank=rank, num_samples=20).fit(X, y, extra=True)


def deterministic_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype), 2.0).to_event(1))
    mean = pyro.deterministic("mean", X @ w, event_dim=1)
    pyro.sample("y", dist.Normal(mean, 0.5).to_event(1), obs=y)


@pytest.mark.parametrize("rank", [2, 3])
def test_deterministic_site_is_not_data(rank):
    X, y = _data()
    # the MAP in closed form (ridge): (X^T X / 0.25 + I / 4) w = X^T y / 0.25
    P = X.T @ X / 0.25 + torch.eye(3, dtype=torch.float64) / 4
    w = torch.linalg.solve(P, X.T @ y / 0.25)
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", w)
    la = PyroFactorLaplace(deterministic_model, rank=rank, num_samples=2000).fit(X, y)
    assert la.site_names() == ["w"]
    C = _dense_covariance(lambda v: -(dist.Normal(0.0, 2.0).log_prob(v).sum()
                                     + dist.Normal(X @ v, 0.5).log_prob(y).sum()), w)
    torch.testing.assert_close(C, torch.linalg.inv(P))
    assert _rel(la.get_posterior().covariance_matrix, C) < 0.1


def sum_model(y=None, a_prior=None, scale=1.0):
    """a and b flat (or a_prior for a): the likelihood sees only scale * a + b."""
    a = pyro.sample("a", a_prior if a_prior is not None else dist.ImproperUniform(dist.constraints.real, (), ()))
    b = pyro.sample("b", dist.ImproperUniform(dist.constraints.real, (), ()))
    with pyro.plate("n", 10):
        pyro.sample("y", dist.Normal(scale * a + b, 1.0), obs=y)


def _sum_map(a=0.0):
    pyro.clear_param_store()
    pyro.param("AutoDelta.a", torch.tensor(a, dtype=torch.float64))
    pyro.param("AutoDelta.b", torch.tensor(0.0, dtype=torch.float64))
    return torch.zeros(10, dtype=torch.float64)


def test_improper_direction_is_named():
    y = _sum_map()
    with pytest.raises(ValueError, match=r"positive definite, got a smallest scaled eigenvalue of .* along "
                                         r"\['a', 'b'\]: the posterior is improper"):
        PyroFactorLaplace(sum_model, rank=5, num_samples=20).fit(y)


def test_negative_prior_curvature_is_refused():
    # a Cauchy prior at a = 10, in its tails: -log p has curvature 2 (1 - a^2) / (1 + a^2)^2 < 0 there, more than
    # the likelihood's 10 * 1e-3^2 makes up
    y = _sum_map(10.0)
    with pytest.raises(ValueError, match=r"positive definite, got a diagonal of -0\.01.* at \['a'\]"):
        PyroFactorLaplace(sum_model, rank=5, num_samples=20).fit(y, a_prior=dist.Cauchy(
            torch.tensor(0.0, dtype=torch.float64), 1.0), scale=1e-3)


def test_no_dense_resplit_above_the_dense_limit(monkeypatch):
    import pyro_fa.laplace.pyro_guide as pyro_guide

    monkeypatch.setattr(pyro_guide, "_DENSE_MAX_DIM", 2)
    X, y = _orthogonal_design()
    _flat_map(X, y)
    with pytest.raises(ValueError, match=r"Fisher's diagonal must be positive at D > 2, got 0\.0 at "
                                         r"\['beta\[0\]', 'beta\[1\]', 'beta\[2\]', 'sigma'\]"):
        PyroFactorLaplace(flat_model, rank=5, num_samples=20).fit(X, y)


# ------------------------------------------------------------------ coupled priors, pyro.factor: the full prior Hessian
_Y8 = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=torch.float64)
_S8 = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=torch.float64)


def eight_schools(y=None):
    """Centred eight schools (tau ~ LogNormal for a proper mode): theta's prior couples theta, mu and log tau."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 5.0))
    tau = pyro.sample("tau", dist.LogNormal(torch.tensor(1.0, dtype=torch.float64), 0.5))
    with pyro.plate("J", 8):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("y", dist.Normal(theta, _S8), obs=y)


def _eight_schools_neg_log_joint(v):
    """In u = (mu, log tau, theta), with log tau's Jacobian."""
    mu, s, theta = v[0], v[1], v[2:]
    return -(dist.Normal(0.0, 5.0).log_prob(mu) + dist.LogNormal(1.0, 0.5).log_prob(s.exp()) + s
             + dist.Normal(mu, s.exp()).log_prob(theta).sum() + dist.Normal(theta, _S8).log_prob(_Y8).sum())


def _mode(neg_log_joint, v):
    """The mode in unconstrained coordinates, by L-BFGS (independent of the code under test)."""
    v = v.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([v], max_iter=500, tolerance_grad=1e-12, tolerance_change=0, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = neg_log_joint(v)
        loss.backward()
        return loss

    opt.step(closure)
    return v.detach()


@pytest.mark.parametrize("rank", [2, 12])  # rank < D = 10, and rank >= D
def test_centred_hierarchical_prior_matches_dense_hessian(rank):
    u = _mode(_eight_schools_neg_log_joint, torch.cat([_Y8.mean().reshape(1), torch.ones(1, dtype=torch.float64),
                                                       _Y8]))
    pyro.clear_param_store()
    pyro.param("AutoDelta.mu", u[0].clone())
    pyro.param("AutoDelta.tau", u[1].exp(), constraint=dist.constraints.positive)
    pyro.param("AutoDelta.theta", u[2:].clone())
    la = PyroFactorLaplace(eight_schools, rank=rank, num_samples=2000).fit(_Y8)
    torch.testing.assert_close(la.loc, u)
    H = torch.autograd.functional.hessian(_eight_schools_neg_log_joint, u)
    # the prior's curvature is the dense Hessian's diagonal less the likelihood's 1 / sigma^2 (theta only)
    torch.testing.assert_close(la.prior_curvature, H.diagonal() - torch.cat([torch.zeros(2, dtype=torch.float64),
                                                                              _S8 ** -2]))
    assert la.fit_info["prior_hessian"] == "dense" and la.fit_info["prior_hvps"] == 10
    # the Fisher of y ~ N(theta, sigma) is its Hessian, diag(1 / sigma^2): Monte Carlo error sqrt(2 / 2000) on it
    assert _rel(la.get_posterior().covariance_matrix, torch.linalg.inv(H)) < 0.02
    assert _rel(la.get_posterior().precision_matrix, H) < 0.02


_SIGMA_W = 0.3 * torch.tensor([[1.0, 0.9, 0.8], [0.9, 1.0, 0.9], [0.8, 0.9, 1.0]], dtype=torch.float64)
_M_W = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)


def mvn_model(X, y=None):
    """A correlated MultivariateNormal prior and a Gaussian linear likelihood (known noise 2)."""
    w = pyro.sample("w", dist.MultivariateNormal(_M_W, _SIGMA_W))
    with pyro.plate("n", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, 2.0), obs=y)


@pytest.mark.parametrize("rank", [1, 3])
def test_correlated_multivariate_normal_prior_matches_dense_hessian(rank):
    X, y = _data(N=20)
    # the posterior in closed form: P = Sigma^-1 + X^T X / 4, w = P^-1 (Sigma^-1 m + X^T y / 4)
    P = torch.linalg.inv(_SIGMA_W) + X.T @ X / 4
    w = torch.linalg.solve(P, torch.linalg.solve(_SIGMA_W, _M_W) + X.T @ y / 4)
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", w)
    la = PyroFactorLaplace(mvn_model, rank=rank, num_samples=2000).fit(X, y)
    H = torch.autograd.functional.hessian(
        lambda v: -(dist.MultivariateNormal(_M_W, _SIGMA_W).log_prob(v) + dist.Normal(X @ v, 2.0).log_prob(y).sum()),
        w)
    torch.testing.assert_close(H, P)
    torch.testing.assert_close(la.prior_curvature, torch.linalg.inv(_SIGMA_W).diagonal())
    # the Monte Carlo Fisher of 2000 simulated data sets: relative error about sqrt(2 / 2000) on X^T X / 4
    assert _rel(la.get_posterior().covariance_matrix, torch.linalg.inv(H)) < 0.1


_A = torch.tensor([[2.0, 1.0, 0.0], [1.0, 2.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)


def factor_model(X, y=None, likelihood_as_factor=False):
    """w ~ N(0, 2^2 I) with a coupled quadratic pyro.factor penalty; the likelihood (noise 2) observed, or itself
    a factor."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype), 2.0).to_event(1))
    pyro.factor("penalty", -0.5 * w @ _A @ w)
    if likelihood_as_factor:
        pyro.factor("lik", dist.Normal(X @ w, 2.0).log_prob(y).sum())
    else:
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 2.0), obs=y)


@pytest.mark.parametrize("likelihood_as_factor", [False, True])
def test_factor_sites_are_part_of_the_log_joint(likelihood_as_factor):
    X, y = _data(N=10)
    P = _A + torch.eye(3, dtype=torch.float64) / 4 + X.T @ X / 4
    w = torch.linalg.solve(P, X.T @ y / 4)  # the MAP in closed form
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", w)
    la = PyroFactorLaplace(factor_model, rank=3, num_samples=2000).fit(X, y, likelihood_as_factor)
    H = torch.autograd.functional.hessian(lambda v: -(dist.Normal(0.0, 2.0).log_prob(v).sum() - 0.5 * v @ _A @ v
                                                     + dist.Normal(X @ v, 2.0).log_prob(y).sum()), w)
    torch.testing.assert_close(H, P)
    if likelihood_as_factor:  # all of the log joint's curvature is the exact prior-like Hessian: no Fisher
        assert la.fit_info["passes"] == 0
        torch.testing.assert_close(la.get_posterior().covariance_matrix, torch.linalg.inv(H))
    else:
        torch.testing.assert_close(la.prior_curvature, _A.diagonal() + 0.25)
        # the Monte Carlo Fisher of 2000 simulated data sets: relative error about sqrt(2 / 2000) on X^T X / 4
        assert _rel(la.get_posterior().covariance_matrix, torch.linalg.inv(H)) < 0.1


def latent_only_model():
    pyro.sample("w", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))


def test_model_without_likelihood_is_refused():
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", torch.tensor(0.0, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"must have observed sites or pyro\.factor terms \(its likelihood\), got "
                                           "none"):
        PyroFactorLaplace(latent_only_model, rank=1).fit()
    with pytest.raises(ValueError, match="prior_probes must be an integer >= 1, got 0"):
        PyroFactorLaplace(model, prior_probes=0)


def test_above_the_dense_limit_a_diagonal_prior_is_exact(monkeypatch):
    import pyro_fa.laplace.pyro_guide as pyro_guide

    monkeypatch.setattr(pyro_guide, "_DENSE_MAX_DIM", 2)
    X, y = _data()
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", torch.tensor([0.9, -1.9, 0.4], dtype=torch.float64))
    pyro.param("AutoDelta.s", torch.tensor(0.6, dtype=torch.float64), constraint=dist.constraints.positive)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la = PyroFactorLaplace(model, rank=2, num_samples=20).fit(X, y)
    assert la.fit_info["prior_hessian"] == "diagonal" and la.fit_info["prior_hvps"] == 2
    # 1/4 for w ~ N(0, 2^2); for log s, s ~ LogNormal(0, 1) with its Jacobian: 1
    torch.testing.assert_close(la.prior_curvature, torch.tensor([0.25, 0.25, 0.25, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("probes", [100, 400])
def test_above_the_dense_limit_a_coupled_prior_warns_and_keeps_hutchinsons_diagonal(monkeypatch, probes):
    import pyro_fa.laplace.pyro_guide as pyro_guide

    monkeypatch.setattr(pyro_guide, "_DENSE_MAX_DIM", 2)
    X, y = _data(N=20)
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", torch.zeros(3, dtype=torch.float64))
    with pytest.warns(UserWarning, match=rf"only its diagonal is kept \(Hutchinson's estimate, {probes} probes\): the "
                                         "prior's off-diagonal coupling is dropped"):
        la = PyroFactorLaplace(mvn_model, rank=3, num_samples=20, prior_probes=probes).fit(X, y)
    assert la.fit_info["prior_hessian"] == "hutchinson" and la.fit_info["prior_hvps"] == 2 + probes
    Q = torch.linalg.inv(_SIGMA_W)
    # Hutchinson's error in coordinate i: standard deviation |Q[i, -i]| / sqrt(probes); within 4 of them
    sd = (Q - torch.diag(Q.diagonal())).norm(dim=1) / probes ** 0.5
    assert bool(((la.prior_curvature - Q.diagonal()).abs() < 4 * sd).all())
    assert float((la.prior_curvature - Q.diagonal()).abs().max()) > 0  # an estimate, not the exact diagonal
