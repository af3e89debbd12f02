"""Checks of the vifa-synthetic experiment's ingredients against independent numbers."""
import math

import torch

from pyro_fa import LaplacePrior
from pyro_fa.experiments.vifa_synthetic import ALPHA, BETA, laplace_posterior_moments, laplace_scale, make_data


def test_laplace_prior_has_the_gaussian_priors_variance():
    """Regression test: Jiang (2023) §3.1 matches variances, 2 b^2 = 1 / alpha (rate sqrt(2 alpha), not sqrt(2) alpha)."""
    b = laplace_scale(ALPHA)
    assert math.isclose(2 * b * b, 1 / ALPHA)
    assert math.isclose(float(LaplacePrior(scale=b).distribution(torch.zeros(1)).base_dist.variance), 1 / ALPHA)
    # Jiang (2023) §3.1.3: precisions [0.01, 10] give rates [0.141, 4.472]
    assert [round(1 / laplace_scale(a), 3) for a in (0.01, 10.0)] == [0.141, 4.472]


def test_laplace_posterior_quadrature_flat_prior_limit():
    """b -> infinity: the quadrature gives the flat-prior posterior N((beta X^T X)^-1 beta X^T y, (beta X^T X)^-1)."""
    X, y, m, S = make_data(1)
    mean, cov = laplace_posterior_moments(X, y, 1e12, m, S)
    P = BETA * X.T @ X
    assert torch.allclose(mean, torch.linalg.solve(P, BETA * X.T @ y), rtol=1e-8)
    assert torch.allclose(cov, torch.linalg.inv(P), rtol=1e-6)


def test_laplace_posterior_quadrature_matches_importance_sampling():
    """A strong Laplace prior (b = 0.05) with a mean near 0: quadrature vs self-normalised importance sampling."""
    X, y, m, S = make_data(0)  # m = [1.97, -0.06]: the second coordinate straddles the kink at 0
    b = 0.05
    mean, cov = laplace_posterior_moments(X, y, b, m, S)
    g = torch.Generator().manual_seed(0)
    L = torch.linalg.cholesky(4 * S)
    draws = m + torch.randn(400_000, 2, generator=g, dtype=m.dtype) @ L.T
    P, lin = BETA * X.T @ X, BETA * X.T @ y
    log_target = -0.5 * ((draws @ P) * draws).sum(-1) + draws @ lin - draws.abs().sum(-1) / b
    log_proposal = torch.distributions.MultivariateNormal(m, 4 * S).log_prob(draws)
    w = torch.softmax(log_target - log_proposal, 0)
    is_mean = w @ draws
    assert torch.allclose(mean, is_mean, atol=5e-3)
    assert (mean - m).abs().max() > 0.02  # the prior does move the posterior: the check is not vacuous
    d = draws - is_mean
    assert torch.allclose(cov, (d * w.unsqueeze(-1)).T @ d, atol=5e-4)
