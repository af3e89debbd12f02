"""PyroFactorLaplace on models whose log joint Pyro weighs: a subsampled plate (scale N/B), poutine.scale and
poutine.mask. The precision must be the full data set's, as the Hessian of the ELBO (Pyro's
AutoLaplaceApproximation) and the closed form of a Bayesian linear regression give it."""
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer.autoguide import AutoLaplaceApproximation

from pyro_fa import PyroFactorLaplace

B, COPIES, D, SIGMA, TAU = 20, 4, 3, 0.5, 2.0
N = B * COPIES


def _data():
    """B distinct rows, repeated COPIES times: the first B rows, at scale N / B, are the whole data set exactly."""
    g = torch.Generator().manual_seed(0)
    XB = torch.randn(B, D, generator=g, dtype=torch.float64)
    yB = XB @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + SIGMA * torch.randn(B, generator=g,
                                                                                         dtype=torch.float64)
    return XB.repeat(COPIES, 1), yB.repeat(COPIES)


def regression(X, y, subsample=None, subsample_size=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), TAU).to_event(1))
    with pyro.plate("data", X.shape[0], subsample=subsample, subsample_size=subsample_size) as i:
        pyro.sample("y", dist.Normal(X[i] @ w, SIGMA), obs=y[i])


def regression_as_factor(X, y, subsample=None, mask=True):
    """The same log joint with the likelihood as a pyro.factor term, whose curvature is kept exactly."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), TAU).to_event(1))
    with pyro.plate("data", X.shape[0], subsample=subsample) as i, poutine.mask(mask=mask):
        pyro.factor("lik", -0.5 * ((y[i] - X[i] @ w) / SIGMA).pow(2))


def _exact_precision(X, scale=1.0):
    """The posterior precision of w on the whole data set: (I / tau^2 + X^T X / sigma^2), times a tempering."""
    return scale * (torch.eye(D, dtype=X.dtype) / TAU ** 2 + X.T @ X / SIGMA ** 2)


def _precision(la):
    return torch.linalg.inv(la.get_posterior().covariance_matrix)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def _map():
    pyro.clear_param_store()
    pyro.param("AutoDelta.w", torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    yield
    pyro.clear_param_store()


def test_factor_in_a_subsampled_plate_is_scaled_exactly():
    X, y = _data()
    la = PyroFactorLaplace(regression_as_factor, rank=D).fit(X, y, torch.arange(B))
    torch.testing.assert_close(_precision(la), _exact_precision(X), rtol=1e-10, atol=0)


def test_masked_terms_drop_out_exactly():
    X, y = _data()
    keep = torch.arange(N) < 2 * B
    la = PyroFactorLaplace(regression_as_factor, rank=D).fit(X, y, None, keep)
    torch.testing.assert_close(_precision(la), _exact_precision(X[:2 * B]), rtol=1e-10, atol=0)


def test_fixed_subsample_gives_the_full_data_posterior():
    X, y = _data()
    full = _precision(PyroFactorLaplace(regression, rank=D, num_samples=1000).fit(X, y))
    sub = _precision(PyroFactorLaplace(regression, rank=D, num_samples=1000).fit(X, y, torch.arange(B)))
    exact = _exact_precision(X)
    # the Monte Carlo Fisher of 1000 simulated data sets: relative error about sqrt(2 / 1000); without the
    # plate's scale the likelihood's part would be a quarter of it
    assert _rel(full, exact) < 0.1
    assert _rel(sub, exact) < 0.1
    # Pyro's AutoLaplaceApproximation: the Hessian of the ELBO loss, the plate's scale included
    guide = AutoLaplaceApproximation(regression)
    guide(X, y, torch.arange(B))
    dense = torch.linalg.inv(guide.laplace_approximation(X, y, torch.arange(B)).get_posterior()
                             .covariance_matrix.detach())
    torch.testing.assert_close(dense, exact, rtol=1e-10, atol=1e-10)
    assert _rel(sub, dense) < 0.1


def test_random_subsample_estimates_the_full_data_fisher():
    X, y = _data()
    state = torch.get_rng_state()
    la = PyroFactorLaplace(regression, rank=D, num_samples=1000).fit(X, y, None, B)
    assert torch.equal(torch.get_rng_state(), state)  # the subsamples were drawn from the fit's seed
    # each simulated data set on a subsample of B of N rows (scores weighted by sqrt(N / B)): unbiased
    assert _rel(_precision(la), _exact_precision(X)) < 0.15
    again = PyroFactorLaplace(regression, rank=D, num_samples=1000).fit(X, y, None, B)
    assert torch.equal(again.get_posterior().prec_factor, la.get_posterior().prec_factor)


def test_poutine_scale_tempers_prior_and_likelihood():
    X, y = _data()
    la = PyroFactorLaplace(poutine.scale(regression, scale=3.0), rank=D, num_samples=1000).fit(X, y)
    assert _rel(_precision(la), _exact_precision(X, scale=3.0)) < 0.1
    torch.testing.assert_close(la.prior_curvature, torch.full((D,), 3.0 / TAU ** 2, dtype=torch.float64))


def test_plate_without_subsample_is_as_before():
    """A plate whose subsample is all its indices, given or drawn, is scale 1: the fit is the plain plate's."""
    X, y = _data()
    plain = PyroFactorLaplace(regression, rank=2, num_samples=50).fit(X, y)
    for args in ((None, N), (torch.arange(N), None)):
        whole = PyroFactorLaplace(regression, rank=2, num_samples=50).fit(X, y, *args)
        for a, b in zip((whole.loc, whole.get_posterior().prec_factor, whole.get_posterior().prec_diag),
                        (plain.loc, plain.get_posterior().prec_factor, plain.get_posterior().prec_diag)):
            assert torch.equal(a, b)


def random_effects(X, y, subsample_size=None):
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), TAU).to_event(1))
    with pyro.plate("data", X.shape[0], subsample_size=subsample_size) as i:
        z = pyro.sample("z", dist.Normal(X.new_zeros(()), 1.0))
        pyro.sample("y", dist.Normal(X[i] @ w + z, SIGMA), obs=y[i])


def unused_random_effects(X, y, subsample_size=None):
    """A local latent site that the likelihood does not use: the model runs on a subsample of its values."""
    w = pyro.sample("w", dist.Normal(X.new_zeros(D), TAU).to_event(1))
    with pyro.plate("data", X.shape[0], subsample_size=subsample_size) as i:
        pyro.sample("z", dist.Normal(X.new_zeros(()), 1.0))
        pyro.sample("y", dist.Normal(X[i] @ w, SIGMA), obs=y[i])


@pytest.mark.parametrize("local_model", [random_effects, unused_random_effects])
def test_latent_site_in_a_subsampled_plate_is_refused(local_model):
    X, y = _data()
    pyro.param("AutoDelta.z", torch.zeros(N, dtype=torch.float64))
    # random_effects fails in the model on the whole plate's values of z; the refusal comes first
    with pytest.raises(ValueError, match=r"the subsample of plate 'data' must be the whole plate for its latent site "
                                         r"'z' \(the posterior is over its 80 values\), got 20 of 80\. Call fit with "
                                         r"the model arguments that give pyro.plate no subsample_size or subsample"):
        PyroFactorLaplace(local_model, rank=4).fit(X, y, B)
    la = PyroFactorLaplace(local_model, rank=4, num_samples=20).fit(X, y)  # the whole plate
    assert la.loc.shape == (D + N,)
