"""Pathfinder on Pyro models: exact Gaussian posteriors, the factor form, guide initialisation, costs."""
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_fa.infer import AutoLowRankFactorGuide
from pyro_fa.infer.pathfinder import Pathfinder


def _linreg(seed=0, N=50, D=8):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    X[:, 1] = X[:, 0] + 0.1 * X[:, 1]  # near-collinear: condition number ~ 100s
    y = X @ torch.randn(D, generator=g, dtype=torch.float64) + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    sig, tau = 0.5, 1.0

    def model(X, y):
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), tau).to_event(1))
        pyro.sample("y", dist.Normal(X @ w, sig).to_event(1), obs=y)

    P = X.T @ X / sig ** 2 + torch.eye(D, dtype=X.dtype) / tau ** 2
    C = torch.linalg.inv(P)
    return model, X, y, C @ X.T @ y / sig ** 2, C


def test_pathfinder_matches_exact_linear_regression_posterior():
    model, X, y, mean, cov = _linreg()
    pf = Pathfinder(model).fit(X, y, generator=torch.Generator().manual_seed(1))
    q = pf.get_posterior()
    # the ELBO picks one of the last, nearly converged iterates: within a tenth of a posterior s.d. of the mean
    assert ((q.mean - mean).abs() / cov.diagonal().sqrt()).max() < 0.1
    exact_pf = pf.best_.covariance_matrix()  # the paper's Gaussian, exactly
    assert torch.linalg.norm(exact_pf - cov) / torch.linalg.norm(cov) < 0.2
    assert torch.linalg.norm(q.covariance_matrix - cov) / torch.linalg.norm(cov) < 0.2
    assert pf.num_grad_evals_ > 0 and pf.num_density_evals_ > 0
    # the covariance form is exact up to the clipped eigenvalues: equal when none is clipped
    F, psi, clipped = pf.best_.factor_form()
    if clipped.numel() == 0:
        torch.testing.assert_close(q.covariance_matrix, exact_pf)
    else:  # clipping only widens: exact <= covariance form
        assert torch.linalg.eigvalsh(q.covariance_matrix - exact_pf).min() > -1e-10


def test_pathfinder_gaussian_density_and_draws_match_dense_normal():
    model, X, y, _, _ = _linreg(seed=2)
    pf = Pathfinder(model).fit(X, y, generator=torch.Generator().manual_seed(0))
    g = pf.best_
    dense = torch.distributions.MultivariateNormal(g.mu, g.covariance_matrix())
    z = dense.sample((7,))
    torch.testing.assert_close(g.log_prob(z), dense.log_prob(z))
    phi, logq = g.draw(5, torch.Generator().manual_seed(0))
    torch.testing.assert_close(logq, dense.log_prob(phi))
    draws = pf.sample(20000, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(draws.mean(0), g.mu, atol=0.02, rtol=0)
    assert pf.sample(generator=torch.Generator().manual_seed(3)).shape == (8,)


def test_pathfinder_on_a_log_density_and_multi_path():
    D = 4
    A = torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    P = A @ A.T + torch.eye(D, dtype=torch.float64)
    mean = torch.arange(D, dtype=torch.float64)
    target = torch.distributions.MultivariateNormal(mean, precision_matrix=P)
    pf = Pathfinder(log_density=target.log_prob, dim=D, num_paths=3, num_draws_per_path=300)
    pf.fit(generator=torch.Generator().manual_seed(1))
    assert len(pf.paths_) == 3
    z = pf.sample(3000, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(z.mean(0), mean, atol=0.1, rtol=0)
    for path in pf.paths_:  # on a Gaussian target the quasi-Newton step lands on the mode
        torch.testing.assert_close(path.mu, mean, atol=1e-3, rtol=0)
    assert 0 <= pf.khat_ < float("inf")


def test_init_guide_sets_the_factor_guide_to_the_pathfinder_posterior():
    model, X, y, mean, cov = _linreg()
    pf = Pathfinder(model).fit(X, y, generator=torch.Generator().manual_seed(1))
    q = pf.get_posterior()
    pyro.clear_param_store()
    r = q.cov_factor.shape[1]
    guide = AutoLowRankFactorGuide(model, rank=r)
    guide(X, y)
    pf.init_guide(guide)
    torch.testing.assert_close(guide.get_posterior().loc, q.loc)
    torch.testing.assert_close(guide.get_posterior().covariance_matrix, q.covariance_matrix)
    # a smaller rank keeps the marginal variances
    pyro.clear_param_store()
    small = AutoLowRankFactorGuide(model, rank=1)
    small(X, y)
    pf.init_guide(small)
    torch.testing.assert_close(small.get_posterior().variance, q.variance)
    # a guide with a whitened mean measures it in the Pathfinder posterior's marginal s.d.
    pyro.clear_param_store()
    whitened = AutoLowRankFactorGuide(model, rank=r, loc_scale=1.0)
    whitened(X, y)
    pf.init_guide(whitened)
    torch.testing.assert_close(whitened.loc_scale, q.stddev)
    torch.testing.assert_close(whitened.get_posterior().loc, q.loc)
    torch.testing.assert_close(whitened.get_posterior().covariance_matrix, q.covariance_matrix)
    # to_guide: the same in one call, a guide for Predictive
    pyro.clear_param_store()
    built = pf.to_guide(r, X, y)
    torch.testing.assert_close(built.get_posterior().covariance_matrix, q.covariance_matrix)
    draws = pyro.infer.Predictive(model, guide=built, num_samples=4000)(X, y)["w"]
    torch.testing.assert_close(draws.mean(0), q.mean, atol=0.05, rtol=0)


def test_init_guide_gives_an_isotropic_guide_the_mean_noise_and_leaves_a_fixed_one():
    model, X, y, _, _ = _linreg()
    pf = Pathfinder(model).fit(X, y, generator=torch.Generator().manual_seed(1))
    q = pf.get_posterior()
    r = q.cov_factor.shape[1]
    pyro.clear_param_store()
    learned = AutoLowRankFactorGuide(model, rank=r, noise="isotropic")
    learned(X, y)
    pf.init_guide(learned)
    # Psi = sigma^2 I with sigma^2 the mean of the Pathfinder noise variances; the factor F = sigma G is kept
    sigma = q.cov_diag.mean().sqrt()
    assert learned.scale.shape == ()
    torch.testing.assert_close(learned.scale, sigma)
    order = q.cov_factor.pow(2).sum(0).argsort(descending=True)
    torch.testing.assert_close(learned.cov_factor, q.cov_factor[:, order])
    torch.testing.assert_close(learned.get_posterior().loc, q.loc)
    pyro.clear_param_store()
    fixed = AutoLowRankFactorGuide(model, rank=r, noise="isotropic", noise_scale=0.05)
    fixed(X, y)
    pf.init_guide(fixed)
    assert fixed.scale.item() == 0.05  # a fixed noise scale is a hyperparameter: left as built
    torch.testing.assert_close(fixed.factor, q.cov_factor[:, order] / sigma)


def test_pathfinder_refuses_bad_arguments_and_unfitted_use():
    with pytest.raises(ValueError, match="Pathfinder: exactly one of model and log_density must be given"):
        Pathfinder()
    with pytest.raises(ValueError, match="Pathfinder: dim must be an integer >= 1 with log_density, got None"):
        Pathfinder(log_density=lambda z: z.sum())
    with pytest.raises(ValueError, match="Pathfinder: num_paths must be an integer >= 1, got 0"):
        Pathfinder(log_density=lambda z: z.sum(), dim=2, num_paths=0)
    pf = Pathfinder(log_density=lambda z: -z.pow(2).sum(), dim=2)
    with pytest.raises(RuntimeError, match=r"Pathfinder: get_posterior\(\) needs a fitted Pathfinder"):
        pf.get_posterior()
    pf.fit(generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"Pathfinder: to_guide\(\) needs a model"):
        pf.to_guide(1)
    model, X, y, _, _ = _linreg()
    fitted = Pathfinder(model).fit(X, y, generator=torch.Generator().manual_seed(0))
    pyro.clear_param_store()
    other = AutoLowRankFactorGuide(lambda: pyro.sample("v", dist.Normal(torch.zeros(3), 1.0).to_event(1)), rank=1)
    other()
    with pytest.raises(ValueError, match="Pathfinder: the guide's latent dimension must be 8, got 3"):
        fitted.init_guide(other)
    with pytest.raises(ValueError, match="Pathfinder: num_samples must be an integer >= 1, got 0"):
        pf.sample(0)


@pytest.mark.slow
def test_pathfinder_logistic_regression_close_to_nuts():
    from pyro.infer import MCMC, NUTS

    from pyro_fa.metrics.transport import debiased_wasserstein1, wasserstein1_floor

    g = torch.Generator().manual_seed(0)
    N, D = 100, 3
    X = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)), generator=g)

    def model():
        w = pyro.sample("w", dist.Normal(X.new_zeros(D), 1.0).to_event(1))
        pyro.sample("y", dist.Bernoulli(logits=X @ w).to_event(1), obs=y)

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=1000, warmup_steps=300, disable_progbar=True)
    mcmc.run()
    ref = mcmc.get_samples()["w"]
    pf = Pathfinder(model).fit(generator=torch.Generator().manual_seed(1))
    draws = pf.sample(1000, generator=torch.Generator().manual_seed(2))
    w1 = debiased_wasserstein1(draws, ref)["w1_debiased"]
    floor = wasserstein1_floor(ref)
    assert w1 < 0.5 * floor  # within the noise of the reference against itself
    assert pf.num_grad_evals_ < 100


def test_pathfinder_without_a_curvature_step_fails():
    # log p = -|z|: every L-BFGS pair along a ray has s^T y = 0 (no curvature); a path from 0 has no descent at all
    flat = Pathfinder(log_density=lambda z: -(z.pow(2).sum() + 1e-300).sqrt(), dim=2, init=torch.zeros(2))
    with pytest.raises(RuntimeError, match="Pathfinder: L-BFGS made no accepted step with positive curvature"):
        flat.fit()


def test_pathfinder_docstring_example():
    import doctest

    import pyro_fa.infer.pathfinder as module

    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("cls", ["Pathfinder", "BatchAndMatch"])
def test_a_float32_model_is_fitted_in_the_fits_own_dtype(cls):
    # the fit runs in float64 by default; the model's float32 latents get the packed vector in their dtype (this
    # raised "addmv input tensors must have the same dtype" before) and the fit matches the float64 model's
    import pyro
    import pyro.distributions as dist

    from pyro_fa import infer

    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64) + 0.5 * torch.randn(30, generator=g,
                                                                                     dtype=torch.float64)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype), 1.0).to_event(1))
        with pyro.plate("n", X.shape[0]):
            pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    fits = []
    for dtype in (torch.float32, torch.float64):
        kw = {"rank": 2, "num_iters": 40} if cls == "BatchAndMatch" else {}
        fit = getattr(infer, cls)(model, **kw).fit(X.to(dtype), y.to(dtype), generator=torch.Generator().manual_seed(1))
        fits.append(fit.get_posterior())
    assert fits[0].mean.dtype == torch.float64
    # the exact posterior mean, for scale
    prec = X.T @ X / 0.25 + torch.eye(3, dtype=torch.float64)
    exact = torch.linalg.solve(prec, X.T @ y / 0.25)
    assert torch.allclose(fits[0].mean, exact, atol=0.05) and torch.allclose(fits[1].mean, exact, atol=0.05)
    assert torch.allclose(fits[0].mean, fits[1].mean, atol=1e-3)
