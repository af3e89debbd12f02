"""Online SGA's natural-gradient step (method="sga", optimizer="natural") against independent computations."""
import warnings

import numpy as np
import pytest
import torch
from sklearn.decomposition import FactorAnalysis

from pyro_fa import SWAG, OnlineFactorAnalysis
from pyro_fa.fa.fitters.sga_natural import NaturalStep


def _fa_stream(D, K, T, seed=0, noise=None):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi = torch.rand(D, generator=g, dtype=torch.float64) + 0.5 if noise is None else noise
    X = 3.0 + torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T
    return X + torch.randn(T, D, generator=g, dtype=torch.float64) * psi.sqrt(), F, psi


def _natural(D, K, step=1.0, **kw):
    kw.setdefault("warmup", 20)
    return OnlineFactorAnalysis(D, K, method="sga", optimizer="natural", optimizer_kwargs={"step": step}, seed=0,
                                dtype=torch.float64, step_scale=1.0, **kw)


def _rel(F, psi, C):
    return float(torch.linalg.norm(F @ F.T + torch.diag(psi) - C) / torch.linalg.norm(C))


@pytest.mark.parametrize("batch", [1, 4])
def test_exact_scatter_is_the_empirical_covariance(batch):
    # D <= 3K keeps the D x D scatter: against numpy's covariance of all vectors seen
    X, _, _ = _fa_stream(6, 2, 203)
    fa = _natural(6, 2)
    assert fa.fit_state.S is not None and fa.fit_state.A is None and "_A" not in dict(fa.named_buffers())
    for chunk in X.split(batch):
        fa.update(chunk)
    S = np.cov(X.numpy(), rowvar=False, bias=True)
    assert np.allclose(fa._S.numpy() / len(X), S, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_exact_step_is_the_preconditioned_gradient_of_the_gaussian_log_likelihood(step):
    # one step from a given (F, psi): F moves by step * Psi grad_F H^-1, with grad_F the autograd gradient of the
    # Gaussian log-likelihood of the exact running moments, then by the latent covariance's Cholesky factor
    X, _, _ = _fa_stream(6, 2, 80, seed=1)
    fa = _natural(6, 2, step=step, m_step_every=10**9)  # no step while we feed the vectors
    fa.update(X)
    natural, state, ctx = NaturalStep(step), fa.fit_state, fa._ctx
    F0, psi0 = fa._F.clone(), fa._psi.clone()
    S = torch.from_numpy(np.cov(X.numpy(), rowvar=False, bias=True))
    Fg = F0.clone().requires_grad_(True)
    C = Fg @ Fg.T + torch.diag(psi0)
    loglik = -0.5 * (torch.logdet(C) + torch.trace(torch.linalg.solve(C, S)))
    (grad,) = torch.autograd.grad(loglik, Fg)
    A, H = natural._exact_statistics(state, ctx)
    beta = torch.linalg.solve(C.detach(), F0).T  # F^T C^-1
    assert torch.allclose(A, S @ beta.T, atol=1e-12)
    assert torch.allclose(H, torch.eye(2, dtype=torch.float64) - beta @ F0 + beta @ S @ beta.T, atol=1e-12)
    F_half = F0 + step * torch.diag(psi0) @ grad @ torch.linalg.inv(H)
    L = torch.linalg.cholesky(torch.eye(2, dtype=torch.float64) + step * (H - torch.eye(2, dtype=torch.float64)))
    e = torch.diagonal(S - 2 * F_half @ A.T + F_half @ H @ F_half.T)
    psi_expected = torch.maximum(psi0 + step * (e - psi0), ctx.floor_values(fa.variance))
    natural._m_step(state, ctx)
    assert torch.allclose(fa._F, F_half @ L, atol=1e-10)
    assert torch.allclose(fa._psi, psi_expected, atol=1e-12)
    dense = torch.eye(2, dtype=torch.float64) + fa._F.T @ torch.diag(1 / fa._psi) @ fa._F
    assert torch.allclose(fa._cap, dense, atol=1e-10)  # the next E-step's capacitance


def test_unit_exact_steps_reach_batch_fa():
    # with the exact scatter and step 1 each update is one PX-EM iteration on all vectors seen: the fit ends at
    # scikit-learn's maximum-likelihood covariance
    X, _, _ = _fa_stream(9, 3, 3000, seed=2)
    fa = _natural(9, 3)
    for x in X:
        fa.update(x)
    S = torch.from_numpy(np.cov(X.numpy(), rowvar=False, bias=True))
    sk = FactorAnalysis(n_components=3, tol=1e-10, max_iter=10000).fit(X.numpy())
    C_sk = torch.from_numpy(sk.components_.T @ sk.components_ + np.diag(sk.noise_variance_))
    assert _rel(fa.cov_factor, fa.cov_diag, C_sk) < 0.02
    assert _rel(fa.cov_factor, fa.cov_diag, S) < 1.02 * float(torch.linalg.norm(C_sk - S) / torch.linalg.norm(S))


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_statistics_step_near_scikit_learn_on_an_fa_stream(step):
    # D > 3K: the E-step statistics (online EM's) and the preconditioned step; against scikit-learn on the truth
    X, F, psi = _fa_stream(40, 3, 3000, seed=3)
    truth = F @ F.T + torch.diag(psi)
    fa = _natural(40, 3, step=step)
    assert fa.fit_state.S is None
    for chunk in X.split(5):
        fa.update(chunk)
    sk = FactorAnalysis(n_components=3).fit(X.numpy())
    err_sk = _rel(torch.from_numpy(sk.components_.T), torch.from_numpy(sk.noise_variance_), truth)
    err = _rel(fa.cov_factor, fa.cov_diag, truth)
    assert err < 1.5 * err_sk, (err, err_sk)


def test_step_one_of_the_statistics_is_online_em():
    # eta = 1 on the statistics is the PX-EM M-step: the same fit as method="em" with the same steps
    X, _, _ = _fa_stream(30, 3, 400, seed=4)
    nat = _natural(30, 3)
    em = OnlineFactorAnalysis(30, 3, method="em", warmup=20, seed=0, dtype=torch.float64, step_scale=1.0)
    for x in X:
        nat.update(x)
        em.update(x)
    assert torch.allclose(nat.covariance(), em.covariance(), rtol=1e-9, atol=1e-12)


def test_checkpoint_resumes_the_same_fit():
    X, _, _ = _fa_stream(30, 3, 300, seed=5)
    a = _natural(30, 3, step=0.7)
    for x in X[:150]:
        a.update(x)
    b = _natural(30, 3, step=0.7)
    b.load_state_dict(a.state_dict())
    for x in X[150:]:
        a.update(x)
        b.update(x)
    assert torch.equal(a.cov_factor, b.cov_factor) and torch.equal(a.cov_diag, b.cov_diag)


def test_swag_takes_the_natural_step_and_float32():
    X, _, _ = _fa_stream(25, 2, 500, seed=6)
    buf = torch.zeros(25, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swag = SWAG([buf], rank=2, method="sga", optimizer="natural", seed=0)
    with torch.no_grad():
        for x in X:
            buf.copy_(x)
            swag.collect()
    sk = FactorAnalysis(n_components=2).fit(X.numpy())
    S = np.cov(X.numpy(), rowvar=False, bias=True)
    err_sk = np.linalg.norm(sk.get_covariance() - S) / np.linalg.norm(S)
    F, psi = swag.cov_factor.double().numpy(), swag.cov_diag.double().numpy()
    err = np.linalg.norm(F @ F.T + np.diag(psi) - S) / np.linalg.norm(S)
    assert swag.fa._F.dtype == torch.float32 and err < 1.5 * err_sk, (err, err_sk)


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="newton"), r"optimizer must be a torch optimizer class, .* one of \('natural',\) .*got 'newton'"),
    (dict(optimizer="natural", optimizer_kwargs={"step": 0.0}), r"step.*\(0, 1\], got 0.0"),
    (dict(optimizer="natural", optimizer_kwargs={"step": 1.5}), r"\(0, 1\], got 1.5"),
    (dict(optimizer="natural", optimizer_kwargs={"lr": 0.1}), "takes only 'step'"),
    (dict(optimizer="natural", warmup=2), "warmup must be >= rank=3"),
])
def test_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnlineFactorAnalysis(20, 3, method="sga", **kwargs)


def test_a_named_step_is_taken_from_the_table(monkeypatch):
    # optimizer=<name> goes through NAMED_STEPS: a step registered there is the one taken
    from pyro_fa.fa.fitters import sga

    built = []

    def half_step(fitter, owner, *, rank, warmup):
        built.append((owner, rank, warmup))
        return NaturalStep(0.5, step_scale=fitter.step_scale, step_ramp=fitter.step_ramp,
                           m_step_every=fitter.m_step_every)

    monkeypatch.setitem(sga.NAMED_STEPS, "half", half_step)
    X = torch.randn(80, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    by_table = OnlineFactorAnalysis(12, 3, method="sga", optimizer="half", warmup=10, seed=0, dtype=torch.float64,
                                    step_scale=1.0)
    natural = _natural(12, 3, step=0.5, warmup=10)
    for fa in (by_table, natural):
        fa.update(X)
    assert built and built[0] == ("OnlineFactorAnalysis", 3, 10)
    assert torch.equal(by_table.cov_factor, natural.cov_factor) and torch.equal(by_table.cov_diag, natural.cov_diag)


def _ar_stream(D=60, K=4, T=1500, rho=0.99, seed=0):
    # autocorrelated vectors with a slow drift, like the iterates SWAG collects
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(D, K, generator=g, dtype=torch.float64) * torch.tensor([8.0, 4.0, 2.0, 1.0], dtype=torch.float64)
    sd = 0.3 + torch.rand(D, generator=g, dtype=torch.float64)
    x, out = torch.zeros(D, dtype=torch.float64), []
    for t in range(T):
        noise = W @ torch.randn(K, generator=g, dtype=torch.float64) + sd * torch.randn(D, generator=g, dtype=torch.float64)
        x = rho * x + (1 - rho**2) ** 0.5 * noise
        out.append(x + 0.001 * t)
    return torch.stack(out)


@pytest.mark.parametrize("seed, bound", [(0, 1.5), (1, 2.5)])
def test_natural_step_follows_an_autocorrelated_stream(seed, bound):
    # against scikit-learn's batch FA on the stream's own covariance (the SWAG target): the natural step is
    # online EM's (1.29x and 2.39x batch FA's error here: the E-step statistics go stale as the stream drifts),
    # the Adam step on one vector's gradient 107x and 44x
    X = _ar_stream(seed=seed)
    S = np.cov(X.numpy(), rowvar=False, bias=True)
    err_sk = np.linalg.norm(FactorAnalysis(n_components=4).fit(X.numpy()).get_covariance() - S) / np.linalg.norm(S)
    errs = []
    for kw in (dict(optimizer="natural"), dict(lr=1e-2)):
        fa = OnlineFactorAnalysis(60, 4, method="sga", warmup=20, seed=0, dtype=torch.float64, step_scale=1.0, **kw)
        for x in X:
            fa.update(x)
        F, psi = fa.cov_factor.numpy(), fa.cov_diag.numpy()
        errs.append(np.linalg.norm(F @ F.T + np.diag(psi) - S) / np.linalg.norm(S) / err_sk)
    assert errs[0] < bound and errs[1] > 15 * errs[0], errs
