import copy

import pytest
import torch
from torch.distributions import LowRankMultivariateNormal

from pyro_fa import OnlineFactorAnalysis
from pyro_fa.fa import linalg


def _fa_data(D=12, K=3, T=500, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=dtype)
    psi = torch.rand(D, generator=g, dtype=dtype) + 0.1
    c = torch.randn(D, generator=g, dtype=dtype)
    X = c + torch.randn(T, K, generator=g, dtype=dtype) @ F.T + torch.randn(T, D, generator=g, dtype=dtype) * psi.sqrt()
    return c, F, psi, X


def _reference_online_em(X, K, warmup, F0, a, m_step_every=1, ramp=24, expand=True):
    """Online EM written densely (explicit inverses), the reference for the class.

    Brownlie (2021) Algorithm 2 with the step gamma_t = a_t / (t + a_t - 1), a_t ramping
    from 1 to a over the first 2 D observations (a = 1 is the thesis's 1/t), two documented differences: H averages the expected statistic
    Sigma_t + m_t m_t^T (Cappé & Moulines 2009) instead of adding the current
    Sigma to an average of m m^T, and diag(S) is the exact variance about the
    current mean instead of an average of squared deviations from stale means.
    With ``expand`` the M-step is PX-EM's: with H = L L^T (Cholesky), F = A H^-1 L,
    and the statistics are rewritten in the latent coordinates h' = L^-1 h.
    During the warm-up, at t = 2, 4, 8, ..., the rows of F are rescaled to squared norm
    var_d / 2 and psi = var / 2 (the initial model in the units of the data).
    """
    T, D = X.shape
    F, psi = F0.clone(), torch.ones(D)
    A, H = torch.zeros(D, K), torch.zeros(K, K)
    for t in range(1, T + 1):
        mean = X[:t].mean(0)
        d = X[t - 1] - mean
        if 2 <= t <= warmup and t & (t - 1) == 0:
            var = X[:t].var(0, unbiased=False)
            F = F * (0.5 * var / F.pow(2).sum(1)).sqrt()[:, None]
            psi = 0.5 * var
        C = (F / psi[:, None]).T
        Sigma = torch.linalg.inv(torch.eye(K) + C @ F)
        m = Sigma @ C @ d
        a_t = 1 + (a - 1) * min(1.0, t / ramp)
        gamma = min(1.0, a_t / (t + a_t - 1))
        A = A + gamma * (torch.outer(d, m) - A)
        H = H + gamma * (Sigma + torch.outer(m, m) - H)
        if t > warmup and (t - warmup) % m_step_every == 0:
            F = A @ torch.linalg.inv(H)
            if expand:
                L = torch.linalg.cholesky(H)
                F = F @ L
                A, H = A @ torch.linalg.inv(L).T, torch.linalg.inv(L) @ H @ torch.linalg.inv(L).T
            var = X[:t].var(0, unbiased=False)
            psi = torch.maximum(var + ((F @ H) * F - 2 * F * A).sum(1), 1e-4 * var)  # the floor
    return mean, F, psi


@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("a, every", [(1.0, 1), (2.0, 1), (3.5, 1), (2.0, 3)])
def test_online_em_matches_dense_reference(a, every, expand):
    _, _, _, X = _fa_data(T=300)
    fa = OnlineFactorAnalysis(12, 3, warmup=20, step_scale=a, m_step_every=every, expand=expand, seed=3)
    F0 = fa.cov_factor.clone()
    for x in X[:-1]:
        fa.update(x)
    fa.update(X[-1])
    mean, F, psi = _reference_online_em(X, 3, 20, F0, a, every, expand=expand)
    assert torch.allclose(fa.loc, mean)
    assert torch.allclose(fa.cov_factor, F)
    assert torch.allclose(fa.cov_diag, psi)


def test_sga_reports_step_weighted_average_of_iterates():
    _, _, _, X = _fa_data(T=60)
    fa = OnlineFactorAnalysis(12, 3, method="sga", warmup=10, seed=0, lr=1e-2)
    last = OnlineFactorAnalysis(12, 3, method="sga", warmup=10, seed=0, lr=1e-2, average=False)
    iterates = []
    for x in X:
        fa.update(x)
        last.update(x)
        if fa.n_updates > 10:
            iterates.append((fa._F.detach().clone(), fa._log_psi.detach().clone()))
    weights = torch.arange(1, len(iterates) + 1, dtype=torch.float64)
    weights = weights / weights.sum()
    F_bar = sum(w * F for w, (F, _) in zip(weights, iterates))
    log_psi_bar = sum(w * lp for w, (_, lp) in zip(weights, iterates))
    scale = fa._scale
    assert torch.allclose(fa.cov_factor, F_bar * scale.unsqueeze(-1))
    assert torch.allclose(fa.cov_diag, log_psi_bar.exp() * scale**2)
    # without averaging the last iterate is reported, and the trajectories are the same
    assert torch.allclose(last.cov_factor, iterates[-1][0] * scale.unsqueeze(-1))


def test_m_step_every_default_scales_with_dim():
    assert OnlineFactorAnalysis(1000, 5).fitter.m_step_interval(1000) == 1
    big = OnlineFactorAnalysis(1_000_000, 1, dtype=torch.float32)
    assert big.fitter.m_step_interval(big.dim) == 10
    assert OnlineFactorAnalysis(1000, 5, m_step_every=4).fitter.m_step_interval(1000) == 4


def test_running_moments_exact_for_mixed_batches():
    _, _, _, X = _fa_data(T=101)
    fa = OnlineFactorAnalysis(12, 3, warmup=5, seed=0)
    fa.update(X[0])
    fa.update(X[1:40])
    fa.update(X[40:41])
    fa.update(X[41:])
    assert fa.n_updates == 101
    assert torch.allclose(fa.loc, X.mean(0))
    assert torch.allclose(fa.variance, X.var(0, unbiased=False))


@pytest.mark.parametrize("batch", [1, 4])
def test_sga_step_is_gradient_of_log_prob(batch):
    _, _, _, X = _fa_data(T=1 + batch)
    fa = OnlineFactorAnalysis(12, 3, method="sga", warmup=1, seed=0, optimizer=torch.optim.SGD, lr=1.0, lr_decay_after=0)
    fa.update(X[0])  # warm-up: only the running moments move
    # keep the initial point to compare with autograd
    fa.fitter.step_for(fa._ctx)._rescale_to_data = lambda state, ctx: None
    F0 = fa._F.detach().clone().requires_grad_()
    log_psi0 = fa._log_psi.detach().clone().requires_grad_()
    new_mean = (fa.loc + X[1:].sum(0)) / (1 + batch)
    LowRankMultivariateNormal(new_mean, F0, log_psi0.exp()).log_prob(X[1:]).mean().backward()
    fa.update(X[1:])
    assert torch.allclose(fa._F.detach() - F0.detach(), F0.grad)
    assert torch.allclose(fa._log_psi.detach() - log_psi0.detach(), log_psi0.grad)


@pytest.mark.slow
def test_online_em_approaches_batch_fa():
    from sklearn.decomposition import FactorAnalysis

    # A moderately conditioned model; measured at T = 10 000: 0.033 against
    # scikit-learn's 0.035 (plain EM, expand=False: 0.057).
    g = torch.Generator().manual_seed(1)
    F = 0.5 * torch.randn(20, 3, generator=g)
    psi = torch.rand(20, generator=g) + 0.5
    X = torch.randn(10_000, 3, generator=g) @ F.T + torch.randn(10_000, 20, generator=g) * psi.sqrt()
    fa = OnlineFactorAnalysis(20, 3, warmup=100, seed=0)
    errors = []
    for chunk in X.split(1000):
        for x in chunk:
            fa.update(x)
        errors.append(linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag).item())
    sk = FactorAnalysis(3, random_state=0, tol=1e-8, max_iter=5000).fit(X.numpy())
    sk_err = linalg.relative_frobenius_distance(F, psi, torch.tensor(sk.components_.T), torch.tensor(sk.noise_variance_))
    assert errors[-1] < 0.6 * errors[0]
    assert errors[-1] < 1.5 * sk_err, (errors, sk_err)
    assert torch.allclose(fa.loc, X.mean(0))


@pytest.mark.slow
def test_online_sga_approaches_truth():
    c, F, psi, X = _fa_data(D=10, K=2, T=20_000, seed=2)
    fa = OnlineFactorAnalysis(10, 2, method="sga", warmup=100, seed=0, lr=1e-2, lr_decay_after=0)
    start = None
    for i, chunk in enumerate(X.split(10)):
        fa.update(chunk)
        if i == 10:
            start = linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag)
    end = linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag)
    assert end < 0.1 < start


@pytest.mark.parametrize("method", ["em", "sga"])
def test_state_dict_resume_equals_uninterrupted(method):
    _, _, _, X = _fa_data(T=300)
    full = OnlineFactorAnalysis(12, 3, method=method, warmup=50, seed=4)
    for chunk in X.split(7):
        full.update(chunk)
    first = OnlineFactorAnalysis(12, 3, method=method, warmup=50, seed=4)
    chunks = X.split(7)
    for chunk in chunks[:20]:
        first.update(chunk)
    saved = copy.deepcopy(first.state_dict())
    resumed = OnlineFactorAnalysis(12, 3, method=method, warmup=50, seed=99)
    resumed.load_state_dict(saved)
    for chunk in chunks[20:]:
        resumed.update(chunk)
    assert resumed.n_updates == full.n_updates == 300
    assert torch.equal(resumed.cov_factor, full.cov_factor)
    assert torch.equal(resumed.cov_diag, full.cov_diag)
    assert torch.equal(resumed.loc, full.loc)


@pytest.mark.parametrize("method", ["em", "sga"])
def test_non_finite_input_refused_state_unchanged(method):
    _, _, _, X = _fa_data(T=200)
    fa = OnlineFactorAnalysis(12, 3, method=method, warmup=50, seed=0)
    fa.update(X)
    before = copy.deepcopy(fa.state_dict())
    bad = X[:3].clone()
    bad[1, 4] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        fa.update(bad)
    bad[1, 4] = float("inf")
    with pytest.raises(ValueError, match="x must be finite"):
        fa.update(bad[1])
    after = fa.state_dict()
    assert fa.n_updates == 200
    for k, v in before.items():
        if torch.is_tensor(v):
            assert torch.equal(v, after[k]), k


def test_distribution_sample_and_covariance():
    _, _, _, X = _fa_data(T=400)
    fa = OnlineFactorAnalysis(12, 3, warmup=20, seed=0)
    fa.update(X)
    dist = fa.get_posterior()
    assert isinstance(dist, LowRankMultivariateNormal)
    dense = torch.distributions.MultivariateNormal(fa.loc, fa.covariance())
    assert torch.allclose(fa.log_prob(X[:5]), dense.log_prob(X[:5]))
    torch.manual_seed(0)
    S = fa.sample(200_000)
    assert S.shape == (200_000, 12)
    emp = torch.cov(S.T)
    # large Monte Carlo: second moments within a few standard errors
    se = (fa.covariance().diagonal().outer(fa.covariance().diagonal()) / 200_000).sqrt()
    assert ((emp - fa.covariance()).abs() < 5 * se + 1e-12).all()
    assert ((S.mean(0) - fa.loc).abs() < 5 * (fa.covariance().diagonal() / 200_000).sqrt()).all()


def test_to_dtype_and_float32_updates():
    _, _, _, X = _fa_data(T=300)
    fa = OnlineFactorAnalysis(12, 3, warmup=20, seed=0)
    fa.update(X[:100])
    fa = fa.to(torch.float32)
    assert fa.cov_factor.dtype == torch.float32 and fa.loc.dtype == torch.float32
    fa.update(X[100:].float())
    assert torch.isfinite(fa.cov_factor).all() and (fa.cov_diag > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "sga"])
def test_float32_tiny_iterates_short_warmup(method):
    # SGD iterates late in training: variances ~1e-8, warm-up shorter than the rank
    # (a Heywood start for EM; for SGA, steps of lr far above the data's scale)
    D, K = 50_000, 20
    g = torch.Generator().manual_seed(0)
    F = torch.randn(D, K, generator=g) * 1e-4 / K**0.5
    centre = torch.randn(D, generator=g)
    # EM refuses warmup < rank (a degenerate first M-step); it starts at the shortest warm-up it takes
    fa = OnlineFactorAnalysis(D, K, method=method, warmup=5 if method == "sga" else K, seed=0, dtype=torch.float32)
    for _ in range(200):
        x = centre + F @ torch.randn(K, generator=g) + 3e-5 * torch.randn(D, generator=g)
        fa.update(x.float())
    assert torch.isfinite(fa.cov_factor).all() and (fa.cov_diag > 0).all()
    total = fa.cov_diag.sum() + fa.cov_factor.pow(2).sum()
    truth = (F.pow(2).sum() + D * 9e-10).float()
    assert 0.2 < float(total / truth) < 5


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "sga"])
def test_float32_large_dim_stays_finite(method):
    D, K = 100_000, 5
    g = torch.Generator().manual_seed(0)
    F = torch.randn(D, K, generator=g) * 0.1
    fa = OnlineFactorAnalysis(D, K, method=method, warmup=10, seed=0, dtype=torch.float32)
    for _ in range(300):
        x = (F @ torch.randn(K, generator=g) + 1e-3 * torch.randn(D, generator=g)).float()
        fa.update(x)
    assert torch.isfinite(fa.cov_factor).all()
    assert (fa.cov_diag > 0).all() and torch.isfinite(fa.cov_diag).all()
    assert torch.isfinite(fa.get_posterior().log_prob(x))


@pytest.mark.parametrize("tiny", [1e-22, 3e-22, 1e-21])
def test_float32_a_coordinate_that_barely_moves_then_moves(tiny):
    # a weight of a dead unit: it moves by ~1e-22 early in the warm-up (its variance a float32 denormal, its
    # rescaled row ~1e-23), then moves for real. The warm-up's rescale at n = 8 once divided by the row's
    # squared norm, a float32 denormal, to inf (the capacitance then refused), as SWAG-EM did on an MNIST-1D MLP
    g = torch.Generator().manual_seed(0)
    X = 0.1 * torch.randn(60, 40, generator=g, dtype=torch.float32)
    X[:, 0] = 0.0
    X[1, 0] = tiny
    X[7:, 0] = 0.05 * torch.randn(53, generator=g, dtype=torch.float32)
    fa = OnlineFactorAnalysis(40, 3, "em", 10, seed=0, dtype=torch.float32)
    for x in X:
        fa.update(x[None])
    F, psi = fa.cov_factor, fa.cov_diag
    assert torch.isfinite(F).all() and torch.isfinite(psi).all()
    # past the warm-up the model's variances are the running variances (psi = var - rowsum(F * F)); numpy's
    import numpy as np

    var = np.var(X.double().numpy(), axis=0, ddof=0)
    np.testing.assert_allclose((F.double().pow(2).sum(1) + psi.double()).numpy(), var, rtol=2e-3)


def test_constructor_errors():
    with pytest.raises(ValueError, match="dim must be an integer >= 2"):
        OnlineFactorAnalysis(1, 1)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, dim\)"):
        OnlineFactorAnalysis(5, 5)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, dim\)"):
        OnlineFactorAnalysis(5, 0)
    with pytest.raises(ValueError, match="method must be one of"):
        OnlineFactorAnalysis(5, 2, method="svd")
    with pytest.raises(ValueError, match="warmup must be a positive integer"):
        OnlineFactorAnalysis(5, 2, warmup=0)
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        OnlineFactorAnalysis(5, 2, method="sga", lr=0.0)
    with pytest.raises(ValueError, match="step_scale must be a finite number >= 1"):
        OnlineFactorAnalysis(5, 2, step_scale=0.5)
    with pytest.raises(ValueError, match="step_ramp must be a positive integer or None"):
        OnlineFactorAnalysis(5, 2, step_ramp=0)
    with pytest.raises(ValueError, match="lr_decay_after must be a non-negative integer or None"):
        OnlineFactorAnalysis(5, 2, method="sga", lr_decay_after=-1)
    with pytest.raises(ValueError, match="m_step_every must be a positive integer or None"):
        OnlineFactorAnalysis(5, 2, m_step_every=0)
    with pytest.raises(ValueError, match="init_scale must be a positive finite number"):
        OnlineFactorAnalysis(5, 2, init_scale=-1.0)
    with pytest.raises(ValueError, match=r"min_variance must be in \(0, 1\)"):
        OnlineFactorAnalysis(5, 2, min_variance=0.0)
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        OnlineFactorAnalysis(5, 2, dtype=torch.int64)


def test_update_and_use_errors():
    fa = OnlineFactorAnalysis(5, 2, seed=0)
    with pytest.raises(RuntimeError, match="needs at least one update"):
        fa.get_posterior()
    with pytest.raises(RuntimeError, match="needs at least one update"):
        fa.sample(3)
    with pytest.raises(RuntimeError, match="needs at least one update"):
        fa.covariance()
    with pytest.raises(ValueError, match=r"x must have shape \(D,\) or \(B, D\) with D=5"):
        fa.update(torch.randn(4))
    with pytest.raises(ValueError, match="at least one observation"):
        fa.update(torch.randn(0, 5))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fa.update([1.0] * 5)
    with pytest.raises(TypeError, match="x must have dtype torch.float64"):
        fa.update(torch.randn(5, dtype=torch.float32))
    fa.update(torch.randn(5))
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1 or None, got 0"):
        fa.sample(0)
    big = OnlineFactorAnalysis(20_001, 1, seed=0, dtype=torch.float32)
    big.update(torch.randn(20_001, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"Use get_posterior\(\)"):
        big.covariance()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_and_device_error():
    _, _, _, X = _fa_data(T=200)
    fa = OnlineFactorAnalysis(12, 3, warmup=20, seed=0, device="cuda")
    fa.update(X.cuda())
    assert fa.cov_factor.is_cuda and fa.get_posterior().loc.is_cuda
    with pytest.raises(ValueError, match="x must be on device"):
        fa.update(X[0])


@pytest.mark.slow
def test_online_em_small_noise_regime():
    # noise small against the signal: plain EM adjusts the scale of F by about
    # 1 + psi / (s^2 + psi) per iteration and crawls; the expanded (PX-EM) M-step does not
    from pyro_fa.fa.batch import BatchFactorAnalysis

    g = torch.Generator().manual_seed(0)
    D, K, T, noise = 200, 5, 3000, 0.1
    F = torch.randn(D, K, generator=g) / K**0.5
    X = torch.randn(T, K, generator=g) @ F.T + noise * torch.randn(T, D, generator=g)
    psi = torch.full((D,), noise**2)
    errors = {}
    for expand in (True, False):
        fa = OnlineFactorAnalysis(D, K, expand=expand, seed=0)
        for x in X:
            fa.update(x)
        errors[expand] = linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag).item()
    batch = BatchFactorAnalysis(D, K).fit(X)
    batch_err = linalg.relative_frobenius_distance(F, psi, batch.cov_factor, batch.cov_diag).item()
    # measured: expanded 0.059, batch FA 0.046, plain EM 0.91
    assert errors[True] < 1.5 * batch_err, (errors, batch_err)
    assert errors[False] > 5 * errors[True], errors


@pytest.mark.slow
def test_online_em_strong_signal_matches_sample_covariance():
    # ten strong factors (communality about 10 against psi in [0.5, 1]): the sample
    # covariance of the same T draws is the reference an O(DK) estimate should approach
    g = torch.Generator().manual_seed(0)
    D, K, T = 401, 10, 3000
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi = 0.5 + 0.5 * torch.rand(D, generator=g, dtype=torch.float64)
    X = torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T
    X += torch.randn(T, D, generator=g, dtype=torch.float64) * psi.sqrt()
    fa = OnlineFactorAnalysis(D, K, seed=0, dtype=torch.float64)
    for x in X:
        fa.update(x)
    true = linalg.dense_covariance(F, psi)
    sample = torch.cov(X.T, correction=0)
    sample_err = torch.linalg.norm(sample - true) / torch.linalg.norm(true)
    err = linalg.relative_frobenius_distance(F, psi, fa.cov_factor, fa.cov_diag)
    # measured: 0.071 against the sample covariance's 0.062 (plain EM: 0.97)
    assert err < 1.5 * sample_err, (err, sample_err)
    ratio = fa.covariance().diagonal() / true.diagonal()
    assert 0.85 < ratio.median() < 1.15


@pytest.mark.parametrize("cls", ["online", "batch"])
def test_sample_follows_the_posterior_protocol(cls):
    # sample(num_samples=None, *, generator=None): (D,) without a count, reproducible on a generator, and the
    # draws are the family distribution's own draws on that generator
    from pyro_fa import BatchFactorAnalysis

    X = torch.randn(200, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    if cls == "online":
        fa = OnlineFactorAnalysis(6, 2, seed=0)
        fa.update(X)
    else:
        fa = BatchFactorAnalysis(6, 2).fit(X)
    assert fa.sample().shape == (6,)
    a = fa.sample(5, generator=torch.Generator().manual_seed(3))
    b = fa.get_posterior().sample((5,), generator=torch.Generator().manual_seed(3))
    assert a.shape == (5, 6) and torch.equal(a, b)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1 or None, got True"):
        fa.sample(True)
