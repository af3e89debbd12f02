"""LowRankPrecisionNormal (the Laplace approximation's Gaussian) against dense torch algebra."""
import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from pyro_fa.laplace import LowRankPrecisionNormal


def _random(D=7, K=3, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(D, generator=g, dtype=dtype).to(device)
    U = torch.randn(D, K, generator=g, dtype=dtype).to(device)
    a = (torch.rand(D, generator=g, dtype=dtype) + 0.5).to(device)
    return loc, U, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_dense_multivariate_normal(dtype, device):
    loc, U, a = _random(dtype=dtype, device=device)
    q = LowRankPrecisionNormal(loc, U, a)
    P = torch.diag(a) + U @ U.T
    dense = MultivariateNormal(loc.double(), precision_matrix=P.double())
    x = torch.randn(5, 7, dtype=dtype, device=device)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(q.log_prob(x).double(), dense.log_prob(x.double()), **tol)
    torch.testing.assert_close(q.entropy().double(), dense.entropy(), **tol)
    torch.testing.assert_close(q.variance.double(), dense.covariance_matrix.diagonal(), **tol)
    torch.testing.assert_close(q.covariance_matrix.double(), dense.covariance_matrix, **tol)
    torch.testing.assert_close(q.precision_matrix.double(), P.double(), **tol)
    torch.testing.assert_close(q.log_det_precision().double(), torch.logdet(P.double()), **tol)
    v = torch.randn(7, dtype=dtype, device=device)
    torch.testing.assert_close(q.covariance_matvec(v).double(), dense.covariance_matrix @ v.double(), **tol)
    torch.testing.assert_close(q.precision_matvec(v).double(), P.double() @ v.double(), **tol)
    torch.testing.assert_close(q.covariance_quadratic(v).double(), v.double() @ dense.covariance_matrix @ v.double(),
                               **tol)
    # the factor form handed to the GLM predictive: P^-1 = diag(cov_diag) - B B^T
    B = q.cov_factor.double()
    torch.testing.assert_close(torch.diag(q.cov_diag.double()) - B @ B.T, dense.covariance_matrix, **tol)
    assert q.rsample((3,)).dtype == dtype and q.rsample((3,)).device.type == torch.device(device).type


def test_draws_have_the_inverse_precision_as_covariance():
    loc, U, a = _random(D=4, K=2)
    q = LowRankPrecisionNormal(loc, U, a)
    torch.manual_seed(0)
    S = 40_000
    x = q.rsample((S,))
    cov = q.covariance_matrix
    emp = torch.cov(x.T)
    # each entry of the empirical covariance has standard error sqrt((s_ii s_jj + s_ij^2) / S)
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov ** 2) / S).sqrt()
    assert bool(((emp - cov).abs() < 4.5 * se).all())
    assert bool(((x.mean(0) - loc).abs() < 4.5 * (cov.diagonal() / S).sqrt()).all())


def test_log_det_is_differentiable_like_dense():
    loc, U, a = _random(D=5, K=2)
    U.requires_grad_(True)
    a.requires_grad_(True)
    g1 = torch.autograd.grad(LowRankPrecisionNormal(loc, U, a).log_det_precision(), (U, a))
    g2 = torch.autograd.grad(torch.logdet(torch.diag(a) + U @ U.T), (U, a))
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y)


def test_dense_matrices_refused_at_large_dim():
    D = 20_001
    q = LowRankPrecisionNormal(torch.zeros(D), torch.zeros(D, 1), torch.ones(D))
    with pytest.raises(ValueError, match="covariance_matrix forms a dense D x D matrix .* got 20001"):
        q.covariance_matrix
    with pytest.raises(ValueError, match="precision_matrix forms a dense D x D matrix .* got 20001"):
        q.precision_matrix
    assert q.variance.shape == (D,) and math.isfinite(float(q.entropy()))


def test_bad_shapes_named():
    with pytest.raises(ValueError, match=r"loc must have shape \(D,\), got \(2, 2\)"):
        LowRankPrecisionNormal(torch.zeros(2, 2), torch.zeros(2, 1), torch.ones(2))
    with pytest.raises(ValueError, match=r"prec_factor must have shape \(3, K\), got \(2, 1\)"):
        LowRankPrecisionNormal(torch.zeros(3), torch.zeros(2, 1), torch.ones(3))
    with pytest.raises(ValueError, match=r"prec_diag must have shape \(3,\), got \(2,\)"):
        LowRankPrecisionNormal(torch.zeros(3), torch.zeros(3, 1), torch.ones(2))


@pytest.mark.parametrize("name", ["laplace", "curvature", "moment"])
def test_doctests(name):
    import doctest
    import importlib

    module = importlib.import_module(f"pyro_fa.laplace.{name}")
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS, extraglobs={"torch": torch}).failed == 0
