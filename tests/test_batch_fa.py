"""Batch EM for factor analysis (pyro_fa.fa.batch) against dense algebra and scikit-learn."""
import warnings

import pytest
import torch

from pyro_fa.fa import linalg
from pyro_fa.fa.batch import (
    BatchFactorAnalysis,
    ConvergenceWarning,
    ScatterStatistics,
    em_from_covariance,
    gaussian_loglike,
    initial_factors,
)


def fa_data(n=2000, dim=12, rank=3, seed=0, device="cpu", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(dim, rank, generator=g, dtype=dtype)
    psi = 0.2 + torch.rand(dim, generator=g, dtype=dtype)
    c = torch.randn(dim, generator=g, dtype=dtype)
    h = torch.randn(n, rank, generator=g, dtype=dtype)
    e = torch.randn(n, dim, generator=g, dtype=dtype)
    x = c + h @ F.T + e * psi.sqrt()
    return x.to(device), F.to(device), psi.to(device)


# ----------------------------------------------------------------- statistics
@pytest.mark.parametrize("chunk_size", [1, 7, 5000])
def test_statistics_match_dense(device, chunk_size):
    x, _, _ = fa_data(n=300, device=device)
    stats = ScatterStatistics(12, chunk_size=chunk_size, device=device)
    for part in torch.split(x, 41):
        stats.update(part)
    stats.update(x[0])  # a single vector
    full = torch.cat([x, x[:1]])
    assert int(stats.n_samples) == 301
    torch.testing.assert_close(stats.mean, full.mean(0))
    torch.testing.assert_close(stats.covariance(), torch.cov(full.T, correction=0))


def test_statistics_merge_and_reset():
    x, _, _ = fa_data(n=100)
    a, b = ScatterStatistics(12).update(x[:30]), ScatterStatistics(12).update(x[30:])
    a.merge(b).merge(ScatterStatistics(12))  # merging an empty stream is a no-op
    torch.testing.assert_close(a.covariance(), torch.cov(x.T, correction=0))
    a.reset()
    assert int(a.n_samples) == 0 and bool((a.scatter == 0).all())


def test_statistics_refuse_non_finite_and_keep_state():
    x, _, _ = fa_data(n=50)
    stats = ScatterStatistics(12).update(x)
    before = {k: v.clone() for k, v in stats.state_dict().items()}
    bad = x[:5].clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        stats.update(bad)
    bad[2, 3] = float("inf")
    with pytest.raises(ValueError, match="x must be finite"):
        stats.update(bad)
    for k, v in stats.state_dict().items():
        assert torch.equal(v, before[k])


def test_statistics_errors():
    with pytest.raises(TypeError, match="ScatterStatistics: dim must be an int, got 2.0"):
        ScatterStatistics(2.0)
    with pytest.raises(ValueError, match="ScatterStatistics: dim must be >= 1, got 0"):
        ScatterStatistics(0)
    with pytest.raises(TypeError, match="chunk_size must be an int or None, got 'a'"):
        ScatterStatistics(2, chunk_size="a")
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        ScatterStatistics(2, chunk_size=0)
    stats = ScatterStatistics(3)
    with pytest.raises(RuntimeError, match="no data seen yet"):
        stats.covariance()
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got 'list'"):
        stats.update([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"x must have shape \(D,\) or \(B, D\) with D=3, got \(2, 4\)"):
        stats.update(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="x must be on device cpu"):
        stats.update(torch.zeros(2, 3, device="meta"))
    with pytest.raises(TypeError, match="other must be a ScatterStatistics, got 'Tensor'"):
        stats.merge(torch.zeros(3))
    with pytest.raises(ValueError, match="other must have dim=3, got 4"):
        stats.merge(ScatterStatistics(4))


# --------------------------------------------------------------- log-likelihood
def test_gaussian_loglike_matches_dense():
    x, F, psi = fa_data(n=500)
    S = torch.cov(x.T, correction=0)
    dense = torch.distributions.MultivariateNormal(x.mean(0), linalg.dense_covariance(F, psi))
    expected = dense.log_prob(x).sum()
    torch.testing.assert_close(gaussian_loglike(F, psi, S, 500), expected)


# ------------------------------------------------------------------------ EM
@pytest.mark.parametrize("method, svd_method", [("em", "randomized"), ("svd", "randomized"), ("svd", "lapack")])
def test_em_loglike_increases_and_recovers_exact_covariance(device, method, svd_method):
    _, F, psi = fa_data(dim=40, device=device)
    S = linalg.dense_covariance(F, psi)  # population covariance: the MLE is exact
    result = em_from_covariance(S, 3, 1000, tol=1e-10, max_iter=5000, method=method, svd_method=svd_method)
    assert result.converged
    diffs = result.loglike.diff()
    assert bool((diffs >= -1e-8 * result.loglike.abs().max()).all())  # EM never decreases the likelihood
    dist = linalg.relative_frobenius_distance(F, psi, result.cov_factor, result.cov_diag)
    assert float(dist) < 1e-5
    assert result.cov_factor.device == S.device


@pytest.mark.parametrize("method", ["svd", "em"])
def test_em_matches_sklearn_covariance(method):
    from sklearn.decomposition import FactorAnalysis as SKFactorAnalysis

    x, _, _ = fa_data(n=3000)
    S = torch.cov(x.T, correction=0)
    result = em_from_covariance(S, 3, 3000, tol=1e-9, max_iter=10000, method=method)
    sk = SKFactorAnalysis(3, tol=1e-9, svd_method="lapack", max_iter=10000).fit(x.numpy())
    W = torch.from_numpy(sk.components_.T.copy())
    psi = torch.from_numpy(sk.noise_variance_)
    assert float(linalg.relative_frobenius_distance(W, psi, result.cov_factor, result.cov_diag)) < 1e-5
    ll_sklearn = float(gaussian_loglike(W, psi, S, 3000))
    assert float(result.loglike[-1]) == pytest.approx(ll_sklearn, rel=1e-9)


def test_initial_factors_ppca_and_given_noise():
    x, _, psi0 = fa_data(n=1000)
    S = torch.cov(x.T, correction=0)
    # PPCA (Tipping & Bishop 1999, eqs. 7-8)
    evals, evecs = torch.linalg.eigh(S)
    sigma2 = evals[:-3].mean()
    F, psi = initial_factors(S, 3, svd_method="lapack")
    expected = evecs[:, -3:] @ torch.diag(evals[-3:] - sigma2) @ evecs[:, -3:].T
    torch.testing.assert_close(F @ F.T, expected)
    torch.testing.assert_close(psi, sigma2.expand(12))
    # randomized subspace iteration agrees on a separated spectrum
    gen = torch.Generator().manual_seed(1)
    F_r, _ = initial_factors(S, 3, svd_method="randomized", iterated_power=6, generator=gen)
    torch.testing.assert_close(F_r @ F_r.T, expected, rtol=1e-6, atol=1e-6)
    # given the noise: scikit-learn's first SVD step (Barber Algorithm 21.1)
    from sklearn.decomposition import FactorAnalysis as SKFactorAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk = SKFactorAnalysis(3, svd_method="lapack", max_iter=1, noise_variance_init=psi0.numpy()).fit(x.numpy())
    F_psi, psi_out = initial_factors(S, 3, cov_diag=psi0, svd_method="lapack")
    W = torch.from_numpy(sk.components_.T.copy())
    torch.testing.assert_close(F_psi @ F_psi.T, W @ W.T)
    torch.testing.assert_close(psi_out, psi0)


# ------------------------------------------------------------ BatchFactorAnalysis
@pytest.mark.parametrize("method", ["svd", "em"])
def test_batch_fit_equals_streamed_fit(device, method):
    x, _, _ = fa_data(device=device)
    one = BatchFactorAnalysis(12, 3, method, device=device).fit(x)
    streamed = BatchFactorAnalysis(12, 3, method, device=device, chunk_size=64)
    for part in torch.split(x, 333):
        streamed.update(part)
    streamed.fit()
    assert streamed.n_updates == one.n_updates == 2000
    assert one.converged and one.n_iter == streamed.n_iter
    torch.testing.assert_close(streamed.cov_factor, one.cov_factor)
    torch.testing.assert_close(streamed.cov_diag, one.cov_diag)
    torch.testing.assert_close(one.loc, x.mean(0))
    assert one.cov_factor.device == x.device


def test_batch_fit_reset_by_new_data_and_refuse_nan():
    x, _, _ = fa_data()
    fa = BatchFactorAnalysis(12, 3).fit(x[:1000]).fit(x)
    assert fa.n_updates == 2000  # fit(x) replaced the statistics
    before = {k: v.clone() for k, v in fa.state_dict().items()}
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        fa.fit(bad)
    with pytest.raises(ValueError, match="x must be finite"):
        fa.update(bad)
    for k, v in fa.state_dict().items():
        assert torch.equal(v, before[k])


def test_batch_distribution_and_latents():
    x, _, _ = fa_data(n=500)
    fa = BatchFactorAnalysis(12, 3).fit(x)
    d = fa.get_posterior()
    assert isinstance(d, torch.distributions.LowRankMultivariateNormal)
    torch.testing.assert_close(fa.log_prob(x).sum(), fa.loglike[-1])
    assert fa.sample(4).shape == (4, 12)
    mean, cov = fa.latent_posterior(x[:5])
    assert mean.shape == (5, 3) and cov.shape == (3, 3)
    # a fitted state reloads into a fresh module
    other = BatchFactorAnalysis(12, 3)
    other.load_state_dict(fa.state_dict())
    torch.testing.assert_close(other.cov_factor, fa.cov_factor)


def test_batch_float32_and_rank_zero_and_full_rank():
    x, _, _ = fa_data(n=500)
    fa32 = BatchFactorAnalysis(12, 3, dtype=torch.float32).fit(x.float())
    fa64 = BatchFactorAnalysis(12, 3).fit(x)
    assert fa32.cov_factor.dtype == torch.float32
    F32, psi32 = fa32.cov_factor.double(), fa32.cov_diag.double()
    assert float(linalg.relative_frobenius_distance(fa64.cov_factor, fa64.cov_diag, F32, psi32)) < 1e-3
    diag = BatchFactorAnalysis(12, 0).fit(x)
    torch.testing.assert_close(diag.cov_diag, x.var(0, unbiased=False))
    full = BatchFactorAnalysis(12, 12, max_iter=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        full.fit(x)
    assert bool(torch.isfinite(full.cov_factor).all()) and bool((full.cov_diag > 0).all())


def test_batch_convergence_warning():
    x, _, _ = fa_data(n=500)
    with pytest.warns(ConvergenceWarning, match=r"EM did not converge in max_iter=2 iterations"):
        fa = BatchFactorAnalysis(12, 3, "em", max_iter=2).fit(x)
    assert fa.n_iter == 2 and not fa.converged


def test_batch_noise_variance_init_is_used():
    x, _, psi = fa_data(n=500)
    fa = BatchFactorAnalysis(12, 3, "em", noise_variance_init=psi, max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fa.fit(x)
    S = torch.cov(x.T, correction=0)
    F0, psi0 = initial_factors(S, 3, cov_diag=psi)
    expected = em_from_covariance(S, 3, 500, cov_factor=F0, cov_diag=psi0, max_iter=1)
    torch.testing.assert_close(fa.cov_diag, expected.cov_diag)
    torch.testing.assert_close(fa.loglike[0], gaussian_loglike(F0, psi0, S, 500))


def test_batch_errors():
    with pytest.raises(TypeError, match="BatchFactorAnalysis: dim must be an int, got '3'"):
        BatchFactorAnalysis("3", 1)
    with pytest.raises(TypeError, match="BatchFactorAnalysis: rank must be an int, got 1.5"):
        BatchFactorAnalysis(3, 1.5)
    with pytest.raises(ValueError, match="BatchFactorAnalysis: dim must be >= 1, got 0"):
        BatchFactorAnalysis(0, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, dim=3\], got 4"):
        BatchFactorAnalysis(3, 4)
    with pytest.raises(ValueError, match="tol must be a non-negative number, got -1"):
        BatchFactorAnalysis(3, 1, tol=-1)
    with pytest.raises(ValueError, match="max_iter must be >= 1, got 0"):
        BatchFactorAnalysis(3, 1, max_iter=0)
    with pytest.raises(ValueError, match="iterated_power must be >= 0, got -1"):
        BatchFactorAnalysis(3, 1, iterated_power=-1)
    with pytest.raises(ValueError, match=r"svd_method must be one of \('randomized', 'lapack'\), got 'arpack'"):
        BatchFactorAnalysis(3, 1, svd_method="arpack")
    with pytest.raises(ValueError, match=r"method must be one of \('svd', 'em'\), got 'sga'"):
        BatchFactorAnalysis(3, 1, "sga")
    with pytest.raises(ValueError, match=r"em_from_covariance: method must be one of \('svd', 'em'\), got 'x'"):
        em_from_covariance(torch.eye(3), 1, 10, method="x")
    with pytest.raises(ValueError, match=r"noise_variance_init must have shape \(3,\), got \(2,\)"):
        BatchFactorAnalysis(3, 1, noise_variance_init=torch.ones(2))
    with pytest.raises(ValueError, match="noise_variance_init must be finite and positive"):
        BatchFactorAnalysis(3, 1, noise_variance_init=torch.tensor([1.0, 0.0, 1.0]))
    fa = BatchFactorAnalysis(3, 1)
    with pytest.raises(RuntimeError, match="no data seen yet"):
        fa.fit()
    for call in (fa.distribution, lambda: fa.latent_posterior(torch.zeros(3))):
        with pytest.raises(RuntimeError, match="BatchFactorAnalysis: not fitted yet"):
            call()


@pytest.mark.slow
def test_batch_recovers_generating_covariance():
    x, F, psi = fa_data(n=200_000, dim=30, rank=4, seed=3)
    fa = BatchFactorAnalysis(30, 4, tol=1e-6).fit(x)
    # sampling error of S is O(n^{-1/2}) ~ 2e-3
    assert float(linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag)) < 0.02
