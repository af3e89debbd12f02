"""Batch and match with a factor-analysis patch (pBaM): the BaM update against the paper's dense closed form, the
patch against dense EM for factor analysis, recovery of a Gaussian target, Pyro models, guides, argument checks."""
import pyro
import pyro.distributions as dist
import pytest
import scipy.linalg
import torch

from pyro_fa.infer import AutoLowRankFactorGuide, BatchAndMatch
from pyro_fa.infer.batch_match import _bam_step, _patch

DT = torch.float64


def _gaussian_target(D, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=DT)
    psi = 0.1 + torch.rand(D, generator=g, dtype=DT)
    m = torch.randn(D, generator=g, dtype=DT)
    return m, F @ F.T + torch.diag(psi), torch.distributions.LowRankMultivariateNormal(m, F, psi)


def _state_and_batch(D, K, B, seed=1):
    """A state (mu, F, psi) of q_t, a batch drawn from it and its scores under a dense Gaussian target."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(D, generator=g, dtype=DT)
    F = torch.randn(D, K, generator=g, dtype=DT)
    psi = 0.5 + torch.rand(D, generator=g, dtype=DT)
    z = mu + torch.randn(B, D, generator=g, dtype=DT) @ torch.linalg.cholesky(F @ F.T + torch.diag(psi)).T
    A = torch.randn(D, D, generator=g, dtype=DT)
    prec = A @ A.T / D + torch.eye(D, dtype=DT)
    m = torch.randn(D, generator=g, dtype=DT)
    scores = -(z - m) @ prec  # grad log N(m, prec^{-1})
    return mu, F, psi, z, scores


def _dense_bam(mu, Sigma, z, g, lam):
    """Cai et al. (2024), Algorithm 1, written out densely: U, V, Sigma' = 2V(I + (I + 4UV)^{1/2})^{-1}, mu'."""
    B = z.shape[0]
    zbar, gbar = z.mean(0), g.mean(0)
    C = (z - zbar).T @ (z - zbar) / B
    Gam = (g - gbar).T @ (g - gbar) / B
    U = lam * Gam + lam / (1 + lam) * torch.outer(gbar, gbar)
    V = Sigma + lam * C + lam / (1 + lam) * torch.outer(mu - zbar, mu - zbar)
    eye = torch.eye(len(mu), dtype=DT)
    root = torch.as_tensor(scipy.linalg.sqrtm((eye + 4 * U @ V).numpy()).real)
    S = 2 * V @ torch.linalg.inv(eye + root)
    return mu / (1 + lam) + lam / (1 + lam) * (S @ gbar + zbar), S


@pytest.mark.parametrize("B", [3, 12])  # B < D: U of low rank; B > D
@pytest.mark.parametrize("lam", [0.5, 40.0])
def test_the_bam_update_matches_the_dense_closed_form(B, lam):
    D, K = 7, 2
    mu, F, psi, z, g = _state_and_batch(D, K, B)
    mu_new, cov = _bam_step(mu, F, psi, z, g, lam)
    mu_ref, S_ref = _dense_bam(mu, F @ F.T + torch.diag(psi), z, g, lam)
    torch.testing.assert_close(cov.dense(), S_ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(mu_new, mu_ref, rtol=1e-8, atol=1e-10)
    # the implicit covariance answers diagonal() and products as its dense form does
    W = torch.randn(D, 3, dtype=DT)
    torch.testing.assert_close(cov @ W, S_ref @ W)
    torch.testing.assert_close(cov.diagonal(), S_ref.diagonal())
    assert torch.linalg.eigvalsh(S_ref).min() > 0


def _dense_em(S, F, psi, n):
    """Ghahramani & Hinton (1996) EM for factor analysis on a covariance S, densely:
    beta = F^T (FF^T + Psi)^{-1}, F' = S beta^T (I - beta F + beta S beta^T)^{-1}, psi' = diag(S - F' beta S)."""
    K = F.shape[1]
    for _ in range(n):
        beta = F.T @ torch.linalg.inv(F @ F.T + torch.diag(psi))
        F_new = S @ beta.T @ torch.linalg.inv(torch.eye(K, dtype=DT) - beta @ F + beta @ S @ beta.T)
        psi = torch.diagonal(S - F_new @ beta @ S)
        F = F_new
    return F, psi


@pytest.mark.parametrize("n", [1, 5])
def test_the_patch_is_dense_em_for_factor_analysis_on_the_updated_covariance(n):
    D, K, B = 8, 2, 4
    mu, F, psi, z, g = _state_and_batch(D, K, B, seed=3)
    _, cov = _bam_step(mu, F, psi, z, g, 5.0)
    F_p, psi_p = _patch(cov, F, psi, n, torch.tensor(1e-12, dtype=DT))
    F_d, psi_d = _dense_em(cov.dense(), F, psi, n)
    torch.testing.assert_close(F_p, F_d, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(psi_p, psi_d, rtol=1e-8, atol=1e-10)


def test_the_patch_lowers_the_kl_projection_objective_to_its_stationary_point():
    # EM ascends the likelihood: KL(N(0, S) || N(0, FF^T + Psi)) falls with every step, to a stationary point
    D, K, B = 8, 2, 4
    mu, F, psi, z, g = _state_and_batch(D, K, B, seed=4)
    _, cov = _bam_step(mu, F, psi, z, g, 5.0)
    S = cov.dense()

    def kl(F, psi):
        fit = F @ F.T + torch.diag(psi)
        return 0.5 * (torch.trace(torch.linalg.solve(fit, S)) - D + torch.logdet(fit) - torch.logdet(S))

    floor = torch.tensor(1e-12, dtype=DT)
    kls = [float(kl(*_patch(cov, F, psi, n, floor))) for n in (1, 2, 5, 20, 200)]
    assert float(kl(F, psi)) > kls[0] and all(a >= b - 1e-12 for a, b in zip(kls, kls[1:]))
    F_p, psi_p = _patch(cov, F, psi, 5000, floor)
    fit = F_p @ F_p.T + torch.diag(psi_p)
    torch.testing.assert_close(fit.diagonal(), S.diagonal(), rtol=1e-3, atol=0)  # the psi stationarity
    grad = (S - fit) @ torch.linalg.solve(fit, F_p)  # the F stationarity: (S - Sigma) Sigma^{-1} F = 0
    assert grad.abs().max() < 1e-3 * S.abs().max()


@pytest.mark.slow
def test_recovers_a_rank_three_gaussian_target_in_fifty_dimensions():
    D, K = 50, 3
    m, Sigma, target = _gaussian_target(D, K)
    bam = BatchAndMatch(log_density=target.log_prob, dim=D, rank=K, batch_size=16, max_grad_evals=800)
    q = bam.fit(generator=torch.Generator().manual_seed(1)).get_posterior()
    assert bam.num_grad_evals_ == 800 and bam.num_density_evals_ == 0 and bam.num_skipped_ == 0
    assert torch.linalg.norm(q.covariance_matrix - Sigma) / torch.linalg.norm(Sigma) < 0.02
    assert (q.mean - m).norm() / m.norm() < 0.01


def test_is_exact_on_a_badly_scaled_correlated_gaussian_far_from_its_start():
    # kidiq-like scales (mean 26, s.d. 0.03-4, correlation -0.99) from N(0, I): on a Gaussian target BaM's
    # score match is exact, so the posteriordb stall there comes from the target's non-Gaussian tails
    m = torch.tensor([26.0, 0.6, 2.9], dtype=DT)
    sd = torch.tensor([4.0, 0.04, 0.03], dtype=DT)
    corr = torch.tensor([[1.0, -0.99, 0.0], [-0.99, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=DT)
    Sigma = sd[:, None] * corr * sd
    target = torch.distributions.MultivariateNormal(m, Sigma)
    bam = BatchAndMatch(log_density=target.log_prob, dim=3, rank=2, max_grad_evals=320)
    q = bam.fit(generator=torch.Generator().manual_seed(0)).get_posterior()
    assert bam.num_skipped_ == 0
    torch.testing.assert_close(q.mean, m, rtol=0, atol=1e-3 * float(sd.min()))
    torch.testing.assert_close(q.covariance_matrix / torch.outer(sd, sd), corr, rtol=0, atol=1e-3)


def test_counts_every_gradient_evaluation_and_draws_from_the_fit():
    D = 4
    _, _, target = _gaussian_target(D, 1, seed=2)
    calls = []

    def log_density(z):
        calls.append(1)
        return target.log_prob(z)

    bam = BatchAndMatch(log_density=log_density, dim=D, rank=2, batch_size=5, num_iters=7, learning_rate=3.0)
    bam.fit(generator=torch.Generator().manual_seed(0))
    assert bam.num_grad_evals_ == len(calls) == 35
    assert BatchAndMatch(log_density=log_density, dim=D, batch_size=6, max_grad_evals=50, rank=1).num_iters == 8
    q = bam.get_posterior()
    draws = bam.sample(200000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(draws.mean(0), q.mean, atol=0.02, rtol=0)
    torch.testing.assert_close(torch.cov(draws.T), q.covariance_matrix, atol=0.03, rtol=0)
    assert bam.sample(generator=torch.Generator().manual_seed(1)).shape == (D,)


def test_a_batch_with_a_bad_score_is_skipped_and_the_state_kept():
    D = 3
    _, _, target = _gaussian_target(D, 1, seed=2)

    def log_density(z):  # undefined (an error, as a model's support check) left of -3 in the first coordinate
        if z[0] < -3:
            raise ValueError("outside the support")
        return target.log_prob(z)

    bam = BatchAndMatch(log_density=log_density, dim=D, rank=1, batch_size=4, num_iters=30,
                        init_loc=torch.tensor([-3.0, 0.0, 0.0], dtype=DT))
    bam.fit(generator=torch.Generator().manual_seed(0))
    assert bam.num_skipped_ > 0 and bam.num_grad_evals_ == 120
    assert torch.isfinite(bam.loc_).all() and (bam.cov_diag_ > 0).all()


def _hierarchical(J=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(J, generator=g, dtype=DT) * 2 + 1
    sigma = torch.full((J,), 1.0, dtype=DT)

    def model(y, sigma):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=DT), 5.0))
        tau = pyro.sample("tau", dist.HalfNormal(torch.tensor(2.0, dtype=DT)))  # constrained: positive
        with pyro.plate("groups", J):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    return model, y, sigma


def test_fits_a_hierarchical_pyro_model_and_sets_the_factor_guide():
    model, y, sigma = _hierarchical()
    pyro.clear_param_store()
    bam = BatchAndMatch(model, rank=2, batch_size=8, num_iters=15, num_em_iters=10)
    bam.fit(y, sigma, generator=torch.Generator().manual_seed(0))
    assert bam.dim == 8 and bam.num_grad_evals_ == 120
    q = bam.get_posterior()
    assert torch.isfinite(q.loc).all() and (q.cov_diag > 0).all()
    guide = AutoLowRankFactorGuide(model, rank=2)
    guide(y, sigma)
    bam.init_guide(guide)
    torch.testing.assert_close(guide.get_posterior().loc, q.loc)
    torch.testing.assert_close(guide.get_posterior().covariance_matrix, q.covariance_matrix)
    pyro.clear_param_store()
    built = bam.to_guide(None, y, sigma)
    torch.testing.assert_close(built.get_posterior().covariance_matrix, q.covariance_matrix)
    draws = pyro.infer.Predictive(model, guide=built, num_samples=300)(y, sigma)
    assert (draws["tau"] > 0).all()
    torch.testing.assert_close(draws["mu"].mean(), q.mean[0], atol=4 * float(q.stddev[0]) / 300 ** 0.5, rtol=0)


@pytest.mark.slow
def test_matches_the_exact_linear_regression_posterior_of_a_pyro_model():
    g = torch.Generator().manual_seed(0)
    N, D, sig = 40, 5, 0.5
    X = torch.randn(N, D, generator=g, dtype=DT)
    y = X @ torch.randn(D, generator=g, dtype=DT) + sig * torch.randn(N, generator=g, dtype=DT)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        pyro.sample("y", dist.Normal((w * X).sum(-1), sig).to_event(1), obs=y)

    cov = torch.linalg.inv(X.T @ X / sig ** 2 + torch.eye(D, dtype=DT))
    mean = cov @ X.T @ y / sig ** 2
    bam = BatchAndMatch(model, rank=D, batch_size=8, max_grad_evals=400)
    q = bam.fit(X, y, generator=torch.Generator().manual_seed(2)).get_posterior()
    assert (q.mean - mean).abs().max() < 1e-3 * mean.abs().max() + 1e-4
    assert torch.linalg.norm(q.covariance_matrix - cov) / torch.linalg.norm(cov) < 0.02


def test_refuses_bad_arguments_and_unfitted_use():
    def lp(z):
        return torch.distributions.Normal(torch.zeros(3, dtype=DT), 1.0).log_prob(z).sum()

    with pytest.raises(ValueError, match="BatchAndMatch: exactly one of model and log_density must be given"):
        BatchAndMatch()
    with pytest.raises(ValueError, match="BatchAndMatch: exactly one of model and log_density must be given"):
        BatchAndMatch(lambda: None, log_density=lp, dim=3)
    with pytest.raises(ValueError, match="BatchAndMatch: dim must be an integer >= 1 with log_density, got None"):
        BatchAndMatch(log_density=lp)
    with pytest.raises(ValueError, match=r"BatchAndMatch: dim must be an integer >= 1, got 0\."):
        BatchAndMatch(log_density=lp, dim=0)
    with pytest.raises(ValueError, match=r"BatchAndMatch: rank must be an integer >= 1, got 0\."):
        BatchAndMatch(log_density=lp, dim=3, rank=0)
    with pytest.raises(ValueError, match=r"BatchAndMatch: rank must be at most dim=3, got 4\."):
        BatchAndMatch(log_density=lp, dim=3, rank=4)
    with pytest.raises(ValueError, match=r"BatchAndMatch: batch_size must be an integer >= 1, got 2\.5\."):
        BatchAndMatch(log_density=lp, dim=3, rank=1, batch_size=2.5)
    with pytest.raises(ValueError, match=r"BatchAndMatch: num_iters must be an integer >= 1, got True\."):
        BatchAndMatch(log_density=lp, dim=3, rank=1, num_iters=True)
    with pytest.raises(ValueError, match=r"BatchAndMatch: max_grad_evals must be an integer >= 16, got 10\."):
        BatchAndMatch(log_density=lp, dim=3, rank=1, max_grad_evals=10)
    with pytest.raises(ValueError, match=r"BatchAndMatch: learning_rate must be a finite positive number, got -1"):
        BatchAndMatch(log_density=lp, dim=3, rank=1, learning_rate=-1)
    with pytest.raises(ValueError, match=r"BatchAndMatch: num_em_iters must be an integer >= 1, got 0\."):
        BatchAndMatch(log_density=lp, dim=3, rank=1, num_em_iters=0)
    with pytest.raises(ValueError, match=r"BatchAndMatch: init_scale must be a finite positive number, got inf\."):
        BatchAndMatch(log_density=lp, dim=3, rank=1, init_scale=float("inf"))
    with pytest.raises(ValueError, match=r"BatchAndMatch: init_loc must be a finite tensor of shape \(D,\)"):
        BatchAndMatch(log_density=lp, dim=3, rank=1, init_loc=torch.zeros(2))
    with pytest.raises(ValueError, match=r"BatchAndMatch: init_loc must be a finite tensor of shape \(D,\)"):
        BatchAndMatch(log_density=lp, dim=3, rank=1, init_loc=torch.tensor([0.0, float("nan"), 0.0]))
    bad_rate = BatchAndMatch(log_density=lp, dim=3, rank=1, num_iters=2, learning_rate=lambda t: 1.0 - t)
    with pytest.raises(ValueError, match=r"BatchAndMatch: learning_rate\(1\) must be a finite positive number, got 0"):
        bad_rate.fit(generator=torch.Generator().manual_seed(0))
    model, y, sigma = _hierarchical()
    with pytest.raises(ValueError, match=r"BatchAndMatch: rank must be at most the model's latent dimension 8, got 9"):
        BatchAndMatch(model, rank=9).fit(y, sigma)
    with pytest.raises(ValueError, match=r"BatchAndMatch: init_loc must be a finite tensor of shape \(8,\), got "
                                         r"shape \(3,\)"):
        BatchAndMatch(model, rank=1, init_loc=torch.zeros(3)).fit(y, sigma)
    unfitted = BatchAndMatch(log_density=lp, dim=3, rank=1)
    for call, what in ((unfitted.get_posterior, "get_posterior"), (unfitted.sample, "sample"),
                       (unfitted.to_guide, "to_guide"), (lambda: unfitted.init_guide(None), "init_guide")):
        with pytest.raises(RuntimeError, match=rf"BatchAndMatch: {what}\(\) needs a fitted BatchAndMatch"):
            call()
    fitted = BatchAndMatch(log_density=lp, dim=3, rank=1, num_iters=2).fit()
    with pytest.raises(RuntimeError, match="BatchAndMatch: to_guide\\(\\) needs a model, got one built on log_density"):
        fitted.to_guide()
    with pytest.raises(ValueError, match=r"BatchAndMatch: num_samples must be an integer >= 1 or None, got 0\."):
        fitted.sample(0)
    pyro.clear_param_store()
    guide = AutoLowRankFactorGuide(model, rank=1)
    guide(y, sigma)
    with pytest.raises(ValueError, match="BatchAndMatch: the guide's latent dimension must be 3, got 8"):
        fitted.init_guide(guide)
    with pytest.raises(RuntimeError, match=r"BatchAndMatch.init_guide\(\)"):  # the guide's own check: not run yet
        fitted.init_guide(AutoLowRankFactorGuide(model, rank=1))
    never = BatchAndMatch(log_density=lambda z: z.sum() * float("nan"), dim=2, rank=1, num_iters=3)
    with pytest.raises(RuntimeError, match="BatchAndMatch: every batch had a non-finite score or update"):
        never.fit()
