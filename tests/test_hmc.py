"""Full-batch HMC (pyro_fa.infer.hmc) against targets with known moments: an anisotropic Gaussian and the exact
posterior of a Bayesian linear regression; its warm-up schedule, determinism, progress reports and gradient
count, diagnostics (against ArviZ called directly) and input checks."""
import math

import numpy as np
import pytest
import torch

from pyro_fa.infer.hmc import MASS_MATRICES, chain_diagnostics, hmc, warmup_windows


def _gaussian(sd):
    return lambda x: -0.5 * (x / sd).pow(2).sum(-1)


@pytest.mark.slow
def test_anisotropic_gaussian_moments():
    # D = 20, standard deviations from 0.1 to 10: the mass matrix must learn a 100-fold range of scales
    sd = torch.logspace(-1, 1, 20, dtype=torch.float64)
    mu = torch.linspace(-3, 3, 20, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    init = 5 * torch.randn(4, 20, generator=g, dtype=torch.float64)
    res = hmc(lambda x: _gaussian(sd)(x - mu), init, num_samples=1000, num_warmup=500, num_steps=10, generator=g)
    draws = res.draws.reshape(-1, 20)
    diag = chain_diagnostics(res.draws)
    assert diag["rhat_max"] < 1.05 and diag["ess_min"] > 300
    # within 5 Monte Carlo standard errors of the known moments (the standard error from the smallest ESS)
    z = ((draws.mean(0) - mu) / sd).abs() * math.sqrt(diag["ess_min"])
    assert bool((z < 5).all()), z
    ratio = draws.std(0) / sd  # a variance estimate's relative s.e. is about sqrt(2 / ESS)
    assert bool(((ratio - 1).abs() < 5 * math.sqrt(0.5 / diag["ess_min"])).all()), ratio
    assert torch.allclose(res.inv_mass.sqrt().mean(0), sd, rtol=0.3)  # the warm-up learned the scales
    assert bool((res.divergences == 0).all())
    assert bool(((res.accept_rate > 0.6) & (res.accept_rate < 0.99)).all())


def _linear_regression(seed=0, n=50, d=5, alpha=2.0, beta=25.0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    y = X @ w + torch.randn(n, generator=g, dtype=torch.float64) / math.sqrt(beta)
    S = torch.linalg.inv(alpha * torch.eye(d, dtype=torch.float64) + beta * X.T @ X)  # exact posterior
    m = beta * S @ X.T @ y

    def log_prob(theta):  # (C, d) -> (C,)
        return -0.5 * alpha * theta.pow(2).sum(-1) - 0.5 * beta * (y - theta @ X.T).pow(2).sum(-1)
    return log_prob, m, S


@pytest.mark.slow
def test_bayesian_linear_regression_exact_posterior():
    log_prob, m, S = _linear_regression()
    g = torch.Generator().manual_seed(1)
    res = hmc(log_prob, torch.randn(4, 5, generator=g, dtype=torch.float64), num_samples=1500, num_warmup=500,
              num_steps=8, generator=g)
    diag = chain_diagnostics(res.draws)
    assert diag["rhat_max"] < 1.05
    draws = res.draws.reshape(-1, 5)
    sd = S.diagonal().sqrt()
    z = ((draws.mean(0) - m) / sd).abs() * math.sqrt(diag["ess_min"])
    assert bool((z < 5).all()), z
    cov = torch.cov(draws.T)
    # every covariance entry, in units of the posterior standard deviations (correlations to within ~0.1)
    err = (cov - S) / torch.outer(sd, sd)
    assert float(err.abs().max()) < 5 * math.sqrt(2 / diag["ess_min"]), err


def test_runs_are_deterministic_with_a_generator_and_shaped_as_documented():
    log_prob, _, _ = _linear_regression(n=20, d=3)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return hmc(log_prob, torch.zeros(3, 3, dtype=torch.float64), num_samples=15, num_warmup=30, num_steps=3,
                   thin=2, collect=lambda t: t.sum(-1, keepdim=True), generator=g)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.draws, b.draws) and torch.equal(a.step_size, b.step_size)
    assert not torch.equal(a.draws, c.draws)
    assert a.draws.shape == (3, 15, 1) and a.log_prob.shape == (3, 15) and a.inv_mass.shape == (3, 3)
    assert a.accept_rate.shape == (3,) and a.last.shape == (3, 3)
    assert torch.allclose(a.log_prob[:, -1], log_prob(a.last))


def test_chains_are_independent_of_each_other():
    # a chain whose density is not finite in one place does not disturb the others: NaN is a rejected proposal
    def log_prob(x):
        lp = -0.5 * x.pow(2).sum(-1)
        return torch.where(x[:, 0] > 3, torch.full_like(lp, float("nan")), lp)

    g = torch.Generator().manual_seed(0)
    res = hmc(log_prob, torch.zeros(2, 2, dtype=torch.float64), num_samples=200, num_warmup=100, num_steps=5,
              generator=g)
    assert bool(torch.isfinite(res.log_prob).all()) and bool((res.draws[..., 0] <= 3).all())


def test_progress_sees_every_iteration_and_gradients_are_counted():
    calls = []

    def log_prob(x):  # counts its own (batched) calls, independently of the sampler's count
        calls.append(1)
        return -0.5 * (x / 0.1).pow(2).sum(-1)

    x0 = torch.zeros(3, 2, dtype=torch.float64)
    seen = []
    # a fixed step of 5 standard deviations, no warm-up: every iteration diverges, and the count is closed-form
    res = hmc(log_prob, x0, num_samples=4, num_warmup=0, num_steps=3, thin=2, step_size=0.5, jitter=0.0,
              generator=torch.Generator().manual_seed(0), progress=lambda it, st: seen.append((it, st)))
    assert res.grad_evals == len(calls) == 1 + 4 * 2 * 3
    assert [it for it, _ in seen] == list(range(1, 9)) and not any(st["warmup"] for _, st in seen)
    assert [st["grad_evals"] for _, st in seen] == [1 + 3 * k for k in range(1, 9)]
    assert torch.equal(res.divergences, torch.full((3,), 8.0, dtype=torch.float64))
    assert torch.equal(seen[-1][1]["divergences"], res.divergences)
    assert all(bool((st["accept"] < 1e-100).all()) for _, st in seen)  # every proposal is far off: rejected
    assert all(st["seconds"] <= st2["seconds"] for (_, st), (_, st2) in zip(seen, seen[1:]))

    def run(progress):
        g = torch.Generator().manual_seed(1)
        return hmc(lambda x: -0.5 * x.pow(2).sum(-1), x0, num_samples=10, num_warmup=40, num_steps=3, generator=g,
                   progress=progress)

    seen.clear()
    a, b = run(lambda it, st: seen.append((it, st))), run(None)
    assert torch.equal(a.draws, b.draws) and a.grad_evals == b.grad_evals  # the callback draws no random numbers
    assert [it for it, _ in seen] == list(range(1, 51)) and [st["warmup"] for _, st in seen] == [True] * 40 + [False] * 10
    assert torch.equal(seen[-1][1]["step_size"], a.step_size) and torch.equal(seen[39][1]["step_size"], a.step_size)
    assert a.grad_evals == seen[-1][1]["grad_evals"] > 1 + 50 * 3  # plus the step-size searches


def test_warmup_windows_follow_stans_schedule():
    # Stan's defaults for 1000 warm-up iterations: 75 fast, windows 25, 50, 100, 200, 500, 50 fast
    assert warmup_windows(1000) == [(75, 99), (100, 149), (150, 249), (250, 449), (450, 949)]
    assert warmup_windows(100) == [(15, 89)]  # too short for the buffers: 15 % / 75 % / 10 %
    assert warmup_windows(10) == []


def test_chain_diagnostics_see_chains_that_disagree():
    g = torch.Generator().manual_seed(0)
    same = torch.randn(4, 500, 3, generator=g, dtype=torch.float64)
    ok = chain_diagnostics(same)
    assert ok["rhat_max"] < 1.02 and ok["ess_min"] > 1000  # independent draws: ESS near 4 x 500
    shifted = same + torch.arange(4, dtype=torch.float64).reshape(4, 1, 1)
    assert chain_diagnostics(shifted)["rhat_max"] > 1.5
    import arviz as az
    ref = az.rhat(az.convert_to_dataset({"q": shifted.numpy()}), method="rank")["q"].values
    assert chain_diagnostics(shifted)["rhat_max"] == pytest.approx(float(np.max(ref)))
    data = az.convert_to_dataset({"q": same.numpy()})
    assert ok["ess_median"] == pytest.approx(float(np.median(az.ess(data, method="bulk")["q"].values)))
    assert ok["ess_tail_min"] == pytest.approx(float(np.min(az.ess(data, method="tail")["q"].values)))
    stuck = same.clone()
    stuck[:, :, 0] = same[:, :, 0].cumsum(1)  # one entry a random walk: its tails are seldom visited
    assert chain_diagnostics(stuck)["ess_tail_min"] < 50 < ok["ess_tail_min"]


def test_input_checks():
    lp = _gaussian(torch.ones(2, dtype=torch.float64))
    x = torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"hmc: init must be a Tensor of shape \(C, D\)"):
        hmc(lp, x[0], num_samples=1, num_warmup=0)
    with pytest.raises(ValueError, match=r"hmc: init must be a finite floating-point Tensor"):
        hmc(lp, x * float("nan"), num_samples=1, num_warmup=0)
    with pytest.raises(ValueError, match=r"hmc: num_samples must be an integer >= 1"):
        hmc(lp, x, num_samples=0, num_warmup=0)
    with pytest.raises(ValueError, match=r"hmc: num_warmup must be an integer >= 0"):
        hmc(lp, x, num_samples=1, num_warmup=-1)
    with pytest.raises(ValueError, match=r"hmc: num_steps must be an integer >= 1"):
        hmc(lp, x, num_samples=1, num_warmup=0, num_steps=1.5)
    with pytest.raises(ValueError, match=r"hmc: target_accept must be a number in \(0, 1\)"):
        hmc(lp, x, num_samples=1, num_warmup=0, target_accept=1.0)
    with pytest.raises(ValueError, match=r"hmc: step_size must be a positive finite number"):
        hmc(lp, x, num_samples=1, num_warmup=0, step_size=0.0)
    with pytest.raises(ValueError, match=r"hmc: jitter must be a number in \[0, 1\)"):
        hmc(lp, x, num_samples=1, num_warmup=0, jitter=1.0)
    with pytest.raises(ValueError, match=r"hmc: mass must be one of \['dense', 'diag'\], got 'full'"):
        hmc(lp, x, num_samples=1, num_warmup=0, mass="full")
    with pytest.raises(ValueError, match=r"hmc: mass must be one of \['dense', 'diag'\], got None"):
        hmc(lp, x, num_samples=1, num_warmup=0, mass=None)
    with pytest.raises(ValueError, match=r"hmc: progress must be a callable or None, got 'yes'"):
        hmc(lp, x, num_samples=1, num_warmup=0, progress="yes")
    with pytest.raises(ValueError, match=r"hmc: log_prob must return shape \(2,\)"):
        hmc(lambda t: t.sum(), x, num_samples=1, num_warmup=0)
    with pytest.raises(ValueError, match=r"hmc: log_prob must be finite with a finite gradient at init"):
        hmc(lambda t: t.sum(-1) * float("nan"), x, num_samples=1, num_warmup=0)
    with pytest.raises(ValueError, match=r"chain_diagnostics: draws must have shape \(C, S, ...\) with C >= 2"):
        chain_diagnostics(torch.zeros(1, 10))


def _correlated(d, rho=0.99):
    sd = torch.logspace(-0.5, 0.5, d, dtype=torch.float64)
    corr = (1 - rho) * torch.eye(d, dtype=torch.float64) + rho * torch.ones(d, d, dtype=torch.float64)
    cov = corr * torch.outer(sd, sd)
    prec = torch.linalg.inv(cov)
    mu = torch.linspace(-1, 1, d, dtype=torch.float64)
    return (lambda x: -0.5 * (((x - mu) @ prec) * (x - mu)).sum(-1)), mu, cov


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, 20])
def test_dense_mass_samples_a_strongly_correlated_gaussian(d):
    # correlation 0.99 between every pair (and a 10-fold range of scales): the narrow direction (1 - rho) sets a
    # diagonal mass matrix's step size; the dense one whitens it. Same iterations and leapfrog steps for both.
    log_prob, mu, cov = _correlated(d)
    runs = {}
    for mass in ("diag", "dense"):
        g = torch.Generator().manual_seed(0)
        init = mu + torch.randn(4, d, generator=g, dtype=torch.float64)
        runs[mass] = hmc(log_prob, init, num_samples=600, num_warmup=400, num_steps=10, generator=g, mass=mass)
    diag, dense = runs["diag"], runs["dense"]
    assert abs(dense.grad_evals - diag.grad_evals) < 0.01 * diag.grad_evals  # the same gradient budget
    stats = {m: chain_diagnostics(r.draws) for m, r in runs.items()}
    assert stats["dense"]["ess_min"] > 5 * stats["diag"]["ess_min"], stats
    assert stats["dense"]["rhat_max"] < 1.05 and stats["dense"]["ess_min"] > 300, stats["dense"]
    ess = stats["dense"]["ess_min"]
    draws = dense.draws.reshape(-1, d)
    sd = cov.diagonal().sqrt()
    z = ((draws.mean(0) - mu) / sd).abs() * math.sqrt(ess)
    assert bool((z < 5).all()), z  # within 5 Monte Carlo standard errors
    err = (torch.cov(draws.T) - cov) / torch.outer(sd, sd)  # entries in units of the standard deviations
    assert float(err.abs().max()) < 5 * math.sqrt(2 / ess), err
    assert dense.inv_mass.shape == (4, d, d)  # the warm-up learned the covariance
    assert float(((dense.inv_mass - cov) / torch.outer(sd, sd)).abs().max()) < 0.5
    assert bool((dense.divergences == 0).all())


def test_dense_mass_momenta_kinetic_energy_and_covariance_estimate():
    g = torch.Generator().manual_seed(0)
    c, d = 3, 4
    a = torch.randn(c, d, d, generator=g, dtype=torch.float64)
    theta = torch.zeros(c, d, dtype=torch.float64)
    metric = MASS_MATRICES["dense"](theta)
    xs = (a @ torch.randn(50, c, d, 1, generator=g, dtype=torch.float64)).squeeze(-1)  # N(0, a a^T) per chain
    for x in xs:
        metric.observe(x)
    metric.adapt(theta)
    n = 50
    cov = torch.stack([torch.cov(xs[:, i].T) for i in range(c)])  # numpy-style covariance, independently
    expected = n / (n + 5) * cov + 1e-3 * 5 / (n + 5) * torch.eye(d, dtype=torch.float64)
    assert torch.allclose(metric.inv_mass, expected, atol=1e-12)
    assert metric.count == 0 and not bool(metric.m2.any())  # the next window starts afresh
    mass = torch.linalg.inv(expected)
    p = metric.momentum(torch.randn(c, d, generator=g, dtype=torch.float64))
    kinetic = 0.5 * torch.einsum("ci,cij,cj->c", p, expected, p)
    assert torch.allclose(metric.kinetic(p), kinetic)
    assert torch.allclose(metric.move(torch.full((c, 1), 0.5, dtype=torch.float64), p),
                          0.5 * torch.linalg.solve(mass, p.unsqueeze(-1)).squeeze(-1))
    z = torch.randn(200_000, c, d, generator=g, dtype=torch.float64)
    big = metric.momentum(z)  # 200 000 momenta per chain at once (broadcast over the leading dimension)
    emp = torch.einsum("nci,ncj->cij", big, big) / z.shape[0]
    scale = torch.sqrt(torch.einsum("cii,cjj->cij", mass, mass))
    assert float(((emp - mass) / scale).abs().max()) < 0.02


def test_dense_and_diagonal_mass_agree_at_the_identity():
    # without adaptation both mass matrices are the identity: the same random numbers give the same chain
    log_prob, _, _ = _linear_regression(n=20, d=3)
    runs = [hmc(log_prob, torch.zeros(2, 3, dtype=torch.float64), num_samples=20, num_warmup=30, num_steps=4,
                adapt_mass=False, mass=mass, generator=torch.Generator().manual_seed(0)) for mass in ("diag", "dense")]
    assert torch.allclose(runs[0].draws, runs[1].draws, atol=1e-10)
    assert torch.allclose(runs[0].step_size, runs[1].step_size)
    assert runs[1].inv_mass.shape == (2, 3, 3) and runs[0].inv_mass.shape == (2, 3)
    adapted = hmc(log_prob, torch.zeros(2, 3, dtype=torch.float64), num_samples=5, num_warmup=120, num_steps=4,
                  mass="dense", generator=torch.Generator().manual_seed(0)).inv_mass
    assert torch.allclose(adapted, adapted.transpose(-1, -2)) and bool((torch.linalg.eigvalsh(adapted) > 0).all())
