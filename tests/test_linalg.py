import pytest
import torch

from pyro_fa.fa import linalg


def _fa(D=30, K=4, batch=(), device="cpu"):
    F = torch.randn(*batch, D, K, device=device)
    psi = torch.rand(*batch, D, device=device) + 0.2
    return F, psi


@pytest.mark.parametrize("batch", [(), (3,)])
def test_logdet_matches_dense(batch, device):
    F, psi = _fa(batch=batch, device=device)
    dense = torch.logdet(linalg.dense_covariance(F, psi))
    assert torch.allclose(linalg.logdet(F, psi), dense)


def test_solve_matches_dense(device):
    F, psi = _fa(device=device)
    S = linalg.dense_covariance(F, psi)
    b = torch.randn(5, 30, device=device)
    assert torch.allclose(linalg.solve(F, psi, b), torch.linalg.solve(S, b.T).T)
    assert torch.allclose(linalg.solve(F, psi, b[0]), torch.linalg.solve(S, b[0]))


def test_inverse_diag_matches_dense(device):
    F, psi = _fa(device=device)
    S = linalg.dense_covariance(F, psi)
    assert torch.allclose(linalg.inverse_diag(F, psi), torch.linalg.inv(S).diagonal())


def test_latent_posterior_matches_bayes_rule(device):
    F, psi = _fa(device=device)
    d = torch.randn(6, 30, device=device)
    m, cov = linalg.latent_posterior(F, psi, d)
    # joint Gaussian of (h, theta): h | theta = N(F^T S^-1 d, I - F^T S^-1 F)
    S = linalg.dense_covariance(F, psi)
    Sinv_F = torch.linalg.solve(S, F)
    assert torch.allclose(m, d @ Sinv_F)
    assert torch.allclose(cov, torch.eye(4, device=device) - F.T @ Sinv_F)


def test_relative_frobenius_matches_dense(device):
    F1, p1 = _fa(K=3, device=device)
    F2, p2 = _fa(K=5, device=device)
    S1, S2 = linalg.dense_covariance(F1, p1), linalg.dense_covariance(F2, p2)
    dense = torch.linalg.norm(S1 - S2) / torch.linalg.norm(S1)
    assert torch.allclose(linalg.relative_frobenius_distance(F1, p1, F2, p2), dense)
    assert torch.allclose(linalg.frobenius_norm(F1, p1), torch.linalg.norm(S1))
    assert linalg.relative_frobenius_distance(F1, p1, F1, p1) < 1e-6


def test_relative_frobenius_rotation_invariant():
    F, psi = _fa()
    Q, _ = torch.linalg.qr(torch.randn(4, 4))
    assert linalg.relative_frobenius_distance(F, psi, F @ Q, psi) < 1e-6


def test_relative_frobenius_large_dim_float32():
    D = 200_000
    F = torch.randn(D, 5, dtype=torch.float32)
    psi = torch.rand(D, dtype=torch.float32) + 1
    F2 = F * 1.01
    # ||S1 - S2|| = ||0.0201 F F^T||, computed through traces in float64 as reference
    F64 = F.double()
    G = F64.T @ F64
    ref = 0.0201 * torch.sqrt((G * G).sum()) / linalg.frobenius_norm(F64, psi.double())
    got = linalg.relative_frobenius_distance(F, psi, F2, psi)
    assert torch.allclose(got.double(), ref, rtol=1e-2)


def test_wasserstein_diagonal_closed_form():
    a, b = torch.rand(5) + 0.1, torch.rand(5) + 0.1
    m1, m2 = torch.randn(5), torch.randn(5)
    expected = ((m1 - m2).pow(2).sum() + (a.sqrt() - b.sqrt()).pow(2).sum()).sqrt()
    got = linalg.gaussian_wasserstein2(m1, torch.diag(a), m2, torch.diag(b))
    assert torch.allclose(got, expected)


def test_wasserstein_general_against_definition():
    # W2 is a metric: zero on identical inputs, symmetric, and matches the closed form
    # for a rotated pair: W2(N(0, R A R^T), N(0, R B R^T)) = W2(N(0, A), N(0, B)).
    a, b = torch.rand(4) + 0.1, torch.rand(4) + 0.1
    R, _ = torch.linalg.qr(torch.randn(4, 4))
    z = torch.zeros(4)
    rot = linalg.gaussian_wasserstein2(z, R @ torch.diag(a) @ R.T, z, R @ torch.diag(b) @ R.T)
    assert torch.allclose(rot, linalg.gaussian_wasserstein2(z, torch.diag(a), z, torch.diag(b)))
    C = torch.randn(4, 4)
    S = C @ C.T + torch.eye(4)
    assert linalg.gaussian_wasserstein2(z, S, z, S) < 1e-6
    assert torch.allclose(
        linalg.gaussian_wasserstein2(z, S, z, torch.eye(4)), linalg.gaussian_wasserstein2(z, torch.eye(4), z, S)
    )


def test_orthogonal_init():
    Q = linalg.orthogonal_init(50, 6, scale=2.0, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(Q.T @ Q, 4 * torch.eye(6), atol=1e-10)
    with pytest.raises(ValueError, match="rank must be in"):
        linalg.orthogonal_init(5, 6)


def test_fa_distribution_log_prob():
    F, psi = _fa(D=6, K=2)
    loc = torch.randn(6)
    x = torch.randn(3, 6)
    dense = torch.distributions.MultivariateNormal(loc, linalg.dense_covariance(F, psi))
    assert torch.allclose(linalg.fa_distribution(loc, F, psi).log_prob(x), dense.log_prob(x))


def test_errors():
    F, psi = _fa()
    with pytest.raises(ValueError, match="cov_diag must have length D=30"):
        linalg.logdet(F, psi[:-1])
    with pytest.raises(ValueError, match=r"cov_factor must have shape \(\.\.\., D, K\)"):
        linalg.logdet(psi, psi)
    with pytest.raises(ValueError, match="rhs must have last dimension D=30"):
        linalg.solve(F, psi, torch.randn(29))
    with pytest.raises(ValueError, match="same dimension D"):
        linalg.relative_frobenius_distance(F, psi, F[:-1], psi[:-1])
    with pytest.raises(ValueError, match="cov1 must be a square matrix"):
        linalg.gaussian_wasserstein2(torch.zeros(3), torch.zeros(3, 2), torch.zeros(3), torch.eye(3))
    with pytest.raises(ValueError, match="loc1, loc2 must have shape"):
        linalg.gaussian_wasserstein2(torch.zeros(2), torch.eye(3), torch.zeros(3), torch.eye(3))
