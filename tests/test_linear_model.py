"""Standard and generalised linear models: exact Bayesian linear regression, SVI GLMs, scikit-learn estimators."""
import doctest
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from sklearn.linear_model import BayesianRidge
from sklearn.utils.estimator_checks import parametrize_with_checks
from torch.distributions import MultivariateNormal
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_fa import LaplacePrior
from pyro_fa.basis import LinearBasis, RandomFourierBasis
from pyro_fa.linear_model import _sklearn, _sklearn_base, _sklearn_glm, _slm_ops, glm as glm_module, likelihoods
from pyro_fa.linear_model import slm as slm_module
from pyro_fa.linear_model import (
    DegenerateEvidenceWarning,
    GeneralizedLinearModel,
    GLMClassifier,
    GLMRegressor,
    SLMRegressor,
    StandardLinearModel,
)


def _regression(n=80, d=3, noise=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    return X, X @ w + noise * torch.randn(n, generator=g)


# ======================================================================== StandardLinearModel
def test_slm_matches_bayesian_ridge_at_fixed_hyperparameters():
    X, y = _regression()
    br = BayesianRidge(fit_intercept=False, tol=1e-12, max_iter=1000).fit(X.numpy(), y.numpy())
    slm = StandardLinearModel(LinearBasis(3, bias=False), float(br.lambda_), 1 / float(br.alpha_))
    slm.fit(X, y, n_iter=0)
    Xt = torch.randn(10, 3)
    mean, std = slm.predict(Xt, return_std=True)
    br_mean, br_std = br.predict(Xt.numpy(), return_std=True)
    np.testing.assert_allclose(slm.posterior_mean.numpy(), br.coef_, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(slm.posterior_covariance.numpy(), br.sigma_, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(mean.numpy(), br_mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(std.numpy(), br_std, rtol=1e-6)
    post = slm.posterior()
    assert isinstance(post, MultivariateNormal)
    torch.testing.assert_close(post.covariance_matrix, slm.posterior_covariance)


def test_slm_evidence_maximisation_finds_bayesian_ridge_hyperparameters():
    """BayesianRidge's MacKay fixed point (with its 1e-6 Gamma hyperpriors) is the evidence maximum."""
    X, y = _regression(n=120)
    br = BayesianRidge(fit_intercept=False, tol=1e-12, max_iter=3000).fit(X.numpy(), y.numpy())
    slm = StandardLinearModel(LinearBasis(3, bias=False)).fit(X, y)
    np.testing.assert_allclose(float(slm.prior_precision), br.lambda_, rtol=1e-3)
    np.testing.assert_allclose(1 / float(slm.noise_variance), br.alpha_, rtol=1e-3)
    np.testing.assert_allclose(slm.posterior_mean.numpy(), br.coef_, rtol=1e-4)
    assert slm.n_iter_ > 0 and slm.log_evidence_ == pytest.approx(float(slm.log_evidence(X, y).detach()))


@pytest.mark.parametrize("n_components", [3, 100])  # D = 6 < N and D = 200 > N: primal and dual
def test_log_evidence_equals_dense_marginal_likelihood_and_its_gradient(n_components):
    X, y = _regression(n=40)
    slm = StandardLinearModel(RandomFourierBasis(3, n_components, seed=0), prior_precision=2.0, noise_variance=0.3)
    value = slm.log_evidence(X, y)
    value.backward()
    grads = [p.grad.clone() for p in slm.parameters()]
    slm.zero_grad()
    Phi = slm.basis(X)
    cov = Phi @ Phi.T / slm.log_prior_precision.exp() + slm.log_noise_variance.exp() * torch.eye(40)
    dense = MultivariateNormal(torch.zeros(40), cov).log_prob(y)
    dense.backward()
    torch.testing.assert_close(value, dense, rtol=1e-10, atol=1e-10)
    for g, p in zip(grads, slm.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-8, atol=1e-10)


def test_slm_learns_lengthscale_on_random_features_and_predicts_well():
    g = torch.Generator().manual_seed(1)
    X = torch.rand(150, 1, generator=g) * 6 - 3
    y = torch.sin(2 * X[:, 0]) + 0.1 * torch.randn(150, generator=g)
    basis = RandomFourierBasis(1, 100, lengthscale=3.0, seed=0) + LinearBasis(1)
    slm = StandardLinearModel(basis)
    before = float(slm.log_evidence(X, y).detach())
    slm.fit(X, y)
    assert slm.log_evidence_ > before + 50
    assert 0.2 < float(basis.bases[0].lengthscale.detach()) < 1.5
    assert 0.05 < float(slm.noise_variance.sqrt()) < 0.2
    Xt = torch.linspace(-2.5, 2.5, 50).unsqueeze(-1)
    mean, std = slm.predict(Xt, return_std=True)
    assert float((mean - torch.sin(2 * Xt[:, 0])).abs().max()) < 0.15
    assert bool((std > slm.noise_variance.sqrt()).all())


def test_slm_adam_reaches_the_lbfgs_evidence():
    X, y = _regression(n=60)
    lbfgs = StandardLinearModel(LinearBasis(3)).fit(X, y)
    adam = StandardLinearModel(LinearBasis(3)).fit(X, y, n_iter=400, lr=0.05, optimizer="adam")
    assert adam.log_evidence_ == pytest.approx(lbfgs.log_evidence_, abs=1e-3)
    assert adam.n_iter_ == 400


def test_slm_noiseless_data_is_floored_not_crashed():
    X = torch.linspace(-1, 1, 30).unsqueeze(-1)
    slm = StandardLinearModel(LinearBasis(1), min_noise_variance=1e-6).fit(X, 2 * X[:, 0] + 1)
    assert float(slm.noise_variance) == pytest.approx(1e-6, rel=1e-6)
    torch.testing.assert_close(slm.predict(X), 2 * X[:, 0] + 1, atol=1e-4, rtol=0)


def test_slm_follows_dtype_and_accepts_arrays():
    X, y = _regression(n=30)
    slm = StandardLinearModel(RandomFourierBasis(3, 5, seed=0, dtype=torch.float32))
    assert slm.log_noise_variance.dtype == torch.float32
    slm.fit(X.numpy(), y.numpy(), n_iter=5)
    assert slm.predict(X.numpy()).dtype == torch.float32
    slm64 = slm.to(torch.float64)
    assert slm64.predict(X).dtype == torch.float64 and slm64.posterior_mean.dtype == torch.float64


def test_slm_on_device(device):
    X, y = _regression(n=30)
    slm = StandardLinearModel(RandomFourierBasis(3, 5, seed=0, device=device)).fit(X, y, n_iter=5)
    mean, std = slm.predict(X, return_std=True)
    assert mean.device.type == device.type and std.device.type == device.type


def test_slm_refuses_bad_inputs():
    X, y = _regression(n=20)
    with pytest.raises(TypeError, match="StandardLinearModel: basis must be a torch.nn.Module with int attributes"):
        StandardLinearModel(torch.nn.Identity())
    with pytest.raises(ValueError, match="prior_precision must be a positive finite float, got -1.0"):
        StandardLinearModel(LinearBasis(3), prior_precision=-1.0)
    with pytest.raises(TypeError, match="noise_variance must be a positive float, got 'big'"):
        StandardLinearModel(LinearBasis(3), noise_variance="big")
    slm = StandardLinearModel(LinearBasis(3))
    with pytest.raises(RuntimeError, match="call fit"):
        slm.predict(X)
    with pytest.raises(RuntimeError, match="call fit"):
        slm.posterior()
    with pytest.raises(ValueError, match=r"X must have shape \(N, 3\), got \(20, 2\)"):
        slm.fit(X[:, :2], y)
    with pytest.raises(ValueError, match=r"y must have shape \(20,\) to match X, got \(19,\)"):
        slm.fit(X, y[:-1])
    with pytest.raises(ValueError, match="X must be finite"):
        slm.fit(X.masked_fill(X > 1, float("nan")), y)
    with pytest.raises(ValueError, match="y must be finite"):
        slm.log_evidence(X, y.masked_fill(y > 0, float("inf")))
    with pytest.raises(TypeError, match="X must be a tensor or array of numbers"):
        slm.fit("data", y)
    with pytest.raises(ValueError, match="X must have at least one row"):
        slm.log_evidence(X[:0], y[:0])
    with pytest.raises(ValueError, match="n_iter must be >= 0, got -1"):
        slm.fit(X, y, n_iter=-1)
    with pytest.raises(ValueError, match=r"optimizer must be one of \('lbfgs', 'adam'\), got 'sgd'"):
        slm.fit(X, y, optimizer="sgd")
    with pytest.raises(ValueError, match="lr must be a positive finite float, got 0.0"):
        slm.fit(X, y, lr=0.0)
    with pytest.raises(TypeError, match="progress must be a bool"):
        slm.fit(X, y, progress="yes")
    with pytest.raises(TypeError, match="n_iter must be an int, got 1.5"):
        slm.fit(X, y, n_iter=1.5)
    with pytest.raises(TypeError, match="y must be a tensor or array of numbers"):
        slm.fit(X, ["a"] * 20)
    with pytest.raises(TypeError, match="y must be real, got dtype torch.complex128"):
        slm.fit(X, torch.zeros(20, dtype=torch.complex128))


def test_slm_fit_failing_part_way_leaves_the_fitted_model_unchanged(monkeypatch):
    X, y = _regression(n=40)
    slm = StandardLinearModel(RandomFourierBasis(3, 5, seed=0, dtype=torch.float64)).fit(X, y, n_iter=10)
    before = {k: v.clone() for k, v in slm.state_dict().items()}
    pred, n_iter, log_ev = slm.predict(X, return_std=True), slm.n_iter_, slm.log_evidence_

    def fail(*args):
        raise RuntimeError("StandardLinearModel: the posterior precision is not numerically positive definite")

    monkeypatch.setattr(slm, "_set_posterior", fail)
    with pytest.raises(RuntimeError, match="not numerically positive definite"):
        slm.fit(X * 3, -y, n_iter=10)  # the optimiser moves the hyperparameters, then the posterior fails
    for k, v in slm.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert (slm.n_iter_, slm.log_evidence_) == (n_iter, log_ev)
    torch.testing.assert_close(slm.predict(X, return_std=True), pred, rtol=0, atol=0)


def test_slm_optimiser_is_one_table_entry(monkeypatch):
    """A new optimiser is one entry of the table; its default learning rate comes with it."""
    seen = {}

    def gradient_descent(objective, params, n_iter, lr, bar):
        seen["lr"] = lr
        opt = torch.optim.SGD(params, lr=lr)
        for _ in range(n_iter):
            opt.zero_grad()
            objective().backward()
            opt.step()
        return n_iter

    monkeypatch.setitem(_slm_ops.OPTIMIZERS, "gd", _slm_ops.Optimiser(gradient_descent, 0.5))
    X, y = _regression(n=120)
    X, y = X.double(), y.double()
    ref = StandardLinearModel(LinearBasis(3, bias=False)).fit(X, y)
    slm = StandardLinearModel(LinearBasis(3, bias=False)).fit(X, y, n_iter=3000, optimizer="gd")
    assert seen["lr"] == 0.5 and slm.n_iter_ == 3000
    torch.testing.assert_close(slm.prior_precision, ref.prior_precision, rtol=1e-4, atol=0)
    torch.testing.assert_close(slm.noise_variance, ref.noise_variance, rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match=r"optimizer must be one of \('lbfgs', 'adam', 'gd'\), got 'sgd'"):
        slm.fit(X, y, optimizer="sgd")


def test_slm_cholesky_failure_is_explained():
    with pytest.raises(RuntimeError, match="StandardLinearModel: the test matrix is not numerically positive "
                                           "definite, even with jitter"):
        _slm_ops.jittered_cholesky("StandardLinearModel", torch.tensor([[-1.0]]), "test matrix")


# ======================================================================== GeneralizedLinearModel
def test_glm_gaussian_full_batch_reaches_exact_posterior():
    """At full rank, with spherical-radial particles (exact ELBO gradients), q is the exact posterior."""
    X, y = _regression(n=60, d=2)
    glm = GeneralizedLinearModel(LinearBasis(2), rank=3, num_particles=13)
    glm.fit(X, y, n_steps=500, lr=0.05)
    sigma = float(glm.noise_scale)
    slm = StandardLinearModel(LinearBasis(2), prior_precision=1.0, noise_variance=sigma ** 2).fit(X, y, n_iter=0)
    q = glm.posterior()
    std = slm.posterior_covariance.diagonal().sqrt()
    assert float(((q.loc - slm.posterior_mean) / std).abs().max()) < 0.01
    torch.testing.assert_close(q.covariance_matrix, slm.posterior_covariance, rtol=0.02, atol=1e-6)
    # the learned noise maximises the evidence, as the SLM's does
    ml2 = StandardLinearModel(LinearBasis(2))
    ml2.log_prior_precision.requires_grad_(False)
    ml2.fit(X, y)
    assert sigma == pytest.approx(float(ml2.noise_variance.sqrt()), rel=0.01)


def test_glm_gaussian_iid_particles_reach_posterior_mean_within_monte_carlo_tolerance():
    X, y = _regression(n=60, d=2)
    glm = GeneralizedLinearModel(LinearBasis(2), rank=2, noise_scale=0.3, learn_noise=False, init_scale=0.1,
                                 num_particles=4)
    glm.fit(X, y, n_steps=800, lr=0.05, lr_decay=0.01)
    slm = StandardLinearModel(LinearBasis(2), noise_variance=0.09).fit(X, y, n_iter=0)
    std = slm.posterior_covariance.diagonal().sqrt()
    assert float(((glm.posterior().loc - slm.posterior_mean) / std).abs().max()) < 0.3
    assert float(glm.noise_scale) == 0.3


def test_glm_subsampled_likelihood_is_scaled_by_n_over_m():
    """Averaged over the batches of one epoch, the scaled batch log-likelihood is the full one (exactly)."""
    X, y = _regression(n=40, d=2)
    glm = GeneralizedLinearModel(LinearBasis(2), rank=1)
    w = torch.randn(3)
    conditioned = poutine.condition(glm.model, {"w": w})

    def log_lik(subsample):
        tr = poutine.trace(conditioned).get_trace(X, y, subsample)
        site = tr.nodes["y"]
        return site["scale"] * site["fn"].log_prob(site["value"]).sum()

    full = log_lik(None)
    perm = torch.randperm(40)
    batches = torch.stack([log_lik(perm[i:i + 8]) for i in range(0, 40, 8)])
    torch.testing.assert_close(batches.mean(), full)
    assert float(poutine.trace(conditioned).get_trace(X, y, perm[:8]).nodes["y"]["scale"]) == 5.0


@pytest.mark.slow
def test_glm_minibatch_posterior_close_to_full_batch():
    X, y = _regression(n=200, d=2)
    fits = {}
    for batch_size in (None, 20):
        torch.manual_seed(0)
        glm = GeneralizedLinearModel(LinearBasis(2), rank=3, num_particles=13)
        fits[batch_size] = glm.fit(X, y, n_steps=1500, batch_size=batch_size, lr=0.03).posterior()
    std = fits[None].variance.sqrt()
    assert float(((fits[20].loc - fits[None].loc) / std).abs().max()) < 0.5
    ratio = fits[20].variance / fits[None].variance
    assert bool(((ratio > 0.5) & (ratio < 2)).all())


def _separable(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).double()
    return X, y


def test_glm_bernoulli_beats_chance_and_probabilities_sum_to_one():
    X, y = _separable()
    glm = GeneralizedLinearModel(LinearBasis(2), "bernoulli", rank=2).fit(X, y, n_steps=400, lr=0.05)
    Xt, yt = _separable(seed=1)
    proba = glm.predict_proba(Xt, n_samples=200)
    assert proba.shape == (200, 2)
    torch.testing.assert_close(proba.sum(-1), torch.ones(200))
    assert float(((proba[:, 1] > 0.5).double() == yt).double().mean()) > 0.9
    mean, std = glm.predict(Xt, return_std=True, n_samples=200)
    torch.testing.assert_close(std, (mean * (1 - mean)).sqrt())
    torch.manual_seed(5)
    lp = glm.log_predictive(Xt, yt, n_samples=300)
    torch.manual_seed(5)
    p1 = glm.predict_proba(Xt, n_samples=300)[:, 1]
    torch.testing.assert_close(lp, torch.where(yt == 1, p1, 1 - p1).log())  # same draws: same estimate


def test_glm_poisson_recovers_rates():
    g = torch.Generator().manual_seed(0)
    X = torch.rand(400, 1, generator=g) * 2 - 1
    rate = torch.exp(1.0 + 0.8 * X[:, 0])
    y = torch.poisson(rate, generator=g)
    glm = GeneralizedLinearModel(LinearBasis(1), "poisson", rank=2, init_scale=0.1).fit(X, y, n_steps=600, lr=0.03)
    torch.testing.assert_close(glm.posterior().loc, torch.tensor([0.8, 1.0]), atol=0.15, rtol=0)
    Xt = torch.linspace(-1, 1, 11).unsqueeze(-1)
    mean, std = glm.predict(Xt, return_std=True)
    assert float(((mean - torch.exp(1.0 + 0.8 * Xt[:, 0])) / mean).abs().max()) < 0.15
    assert bool((std ** 2 >= mean).all())  # over-dispersed by the weight uncertainty
    # closed-form moments against Monte Carlo over weight draws
    f = glm.predictive_samples(Xt, n_samples=4000)
    rates = f.exp()
    assert float(((rates.mean(0) - mean) / (rates.std(0) / math.sqrt(4000))).abs().max()) < 4.5
    lp = glm.log_predictive(Xt, torch.full((11,), 3.0))
    assert lp.shape == (11,) and bool(torch.isfinite(lp).all())


def test_glm_gaussian_prediction_moments_match_samples():
    X, y = _regression(n=50, d=2)
    glm = GeneralizedLinearModel(RandomFourierBasis(2, 10, seed=0), rank=3, init_scale=0.2).fit(X, y, n_steps=50)
    Xt = torch.randn(7, 2)
    f = glm.predictive_samples(Xt, n_samples=4000)
    assert f.shape == (4000, 7)
    mean, std = glm.predict(Xt, return_std=True)
    se = f.std(0) / math.sqrt(4000)
    assert float(((f.mean(0) - mean) / se).abs().max()) < 4.5
    torch.testing.assert_close(f.var(0) + glm.noise_scale ** 2, std ** 2, rtol=0.1, atol=0)
    torch.testing.assert_close(glm.log_predictive(Xt, mean), dist.Normal(mean, std).log_prob(mean))


def test_glm_custom_likelihood_and_laplace_prior():
    X, y = _regression(n=60, d=2)

    def student(f):
        return dist.StudentT(4.0, f, 0.3)

    glm = GeneralizedLinearModel(LinearBasis(2), student, rank=2, prior=LaplacePrior(1.0), init_scale=0.1)
    glm.fit(X, y, n_steps=400, lr=0.03)
    slm = StandardLinearModel(LinearBasis(2), noise_variance=0.09).fit(X, y, n_iter=0)
    torch.testing.assert_close(glm.posterior().loc, slm.posterior_mean, atol=0.1, rtol=0)
    mean, std = glm.predict(X[:5], return_std=True, n_samples=500)
    assert mean.shape == (5,) and bool((std > 0.3).all())
    assert glm.log_predictive(X[:5], y[:5], n_samples=100).shape == (5,)


class _Exponential(likelihoods.Likelihood):
    """y ~ Exponential with mean exp(f) (log link), with closed-form predictive moments:
    E[y] = E[e^f] = exp(mu + v/2), V[y] = E[e^{2f}] + V[e^f] = 2 exp(2 mu + 2 v) - E[y]^2."""

    def distribution(self, f, noise=None):
        return dist.Exponential(torch.exp(-f))

    def predictive_moments(self, latent, X, n_samples):
        mu, v = latent.moments(X)
        mean = (mu + 0.5 * v).exp()
        return mean, 2 * (2 * mu + 2 * v).exp() - mean.pow(2)


def test_glm_registered_likelihood_is_one_class():
    """A likelihood registered by name fits as the same callable does (same draws: identical posteriors); its
    closed-form moments match the Monte Carlo moments of the callable; the fit recovers the slope."""
    likelihoods.register_likelihood("exponential")(_Exponential)
    try:
        g = torch.Generator().manual_seed(0)
        X = torch.randn(400, 2, generator=g, dtype=torch.float64)
        y = -torch.log1p(-torch.rand(400, generator=g, dtype=torch.float64)) * torch.exp(0.8 * X[:, 0])
        fits = []
        for lik in ("exponential", lambda f: dist.Exponential(torch.exp(-f))):
            torch.manual_seed(0)
            glm = GeneralizedLinearModel(LinearBasis(2, bias=False), lik, rank=2, init_scale=0.1)
            fits.append(glm.fit(X, y, n_steps=300, lr=0.05))
        glm, ref = fits
        assert "likelihood='exponential'" in repr(glm)
        q, q_ref = glm.posterior(), ref.posterior()
        assert torch.equal(q.loc, q_ref.loc) and torch.equal(q.cov_factor, q_ref.cov_factor)
        torch.testing.assert_close(q.loc, q.loc.new_tensor([0.8, 0.0]), atol=0.15, rtol=0)
        Xt = X[:5]
        mean, std = glm.predict(Xt, return_std=True)
        torch.manual_seed(1)
        mc_mean, mc_std = ref.predict(Xt, return_std=True, n_samples=100_000)
        torch.testing.assert_close(mean, mc_mean, rtol=0.01, atol=0)
        torch.testing.assert_close(std, mc_std, rtol=0.02, atol=0)
        torch.manual_seed(2)
        lp = glm.log_predictive(Xt, y[:5], n_samples=50)
        torch.manual_seed(2)
        assert torch.equal(lp, ref.log_predictive(Xt, y[:5], n_samples=50))
    finally:
        likelihoods.LIKELIHOODS.pop("exponential")
    with pytest.raises(ValueError, match="likelihood must be one of .* or a callable, got 'exponential'"):
        GeneralizedLinearModel(LinearBasis(2), "exponential")


def test_register_likelihood_refuses_a_taken_name():
    with pytest.raises(ValueError, match="register_likelihood: name must be new, got 'gaussian'"):
        likelihoods.register_likelihood("gaussian")


def test_glm_leaves_the_global_param_store_alone_and_models_do_not_clash():
    pyro.param("user_param", torch.ones(2))
    X, y = _regression(n=30, d=2)
    a = GeneralizedLinearModel(LinearBasis(2), rank=2).fit(X, y, n_steps=5)
    b = GeneralizedLinearModel(RandomFourierBasis(2, 4, seed=0), rank=3).fit(X, y, n_steps=5)
    assert list(pyro.get_param_store().keys()) == ["user_param"]
    assert a.posterior().loc.shape == (3,) and b.posterior().loc.shape == (8,)
    assert len(a.losses_) == 5 and a.n_steps_ == 5


def test_glm_step_never_builds_a_d_by_d_matrix():
    """O(M D + D K^2) per step: no intermediate tensor has two dimensions of size >= D."""
    D = 300
    X, y = _regression(n=100, d=2)
    glm = GeneralizedLinearModel(RandomFourierBasis(2, D // 2, seed=0), rank=4)
    shapes = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if torch.is_tensor(t):
                    shapes.append(tuple(t.shape))
            return out

    with Record():
        glm.fit(X, y, n_steps=3, batch_size=10)
        glm.predict(X[:5], return_std=True)
    assert shapes and max(sorted(s)[-2] if len(s) > 1 else 0 for s in shapes) < D


def test_progress_bars(capsys):
    X, y = _regression(n=20, d=2)
    StandardLinearModel(LinearBasis(2)).fit(X, y, n_iter=3, progress=True)
    StandardLinearModel(LinearBasis(2)).fit(X, y, n_iter=3, optimizer="adam", progress=True)
    GeneralizedLinearModel(LinearBasis(2), rank=1).fit(X, y, n_steps=3, progress=True)
    err = capsys.readouterr().err
    assert "StandardLinearModel" in err and "GeneralizedLinearModel" in err


def test_glm_float32_model():
    X, y = _separable(n=60)
    glm = GeneralizedLinearModel(RandomFourierBasis(2, 8, seed=0, dtype=torch.float32), "bernoulli", rank=2)
    glm.fit(X.numpy(), y.numpy(), n_steps=10)
    assert glm.predict_proba(X[:3]).dtype == torch.float32
    assert glm.to(torch.float64).predict_proba(X[:3]).dtype == torch.float64


def test_glm_on_device(device):
    X, y = _regression(n=30, d=2)
    glm = GeneralizedLinearModel(RandomFourierBasis(2, 4, seed=0, device=device), rank=2).fit(X, y, n_steps=5)
    mean, std = glm.predict(X, return_std=True)
    assert mean.device.type == device.type and glm.posterior().loc.device.type == device.type


def test_glm_refuses_bad_inputs():
    X, y = _regression(n=20, d=2)
    with pytest.raises(TypeError, match="GeneralizedLinearModel: basis must be a torch.nn.Module"):
        GeneralizedLinearModel("rbf")
    expected = r"likelihood must be one of \('gaussian', 'bernoulli', 'poisson'\) or a callable, got 'gamma'"
    with pytest.raises(ValueError, match=expected):
        GeneralizedLinearModel(LinearBasis(2), "gamma")
    with pytest.raises(TypeError, match="likelihood must be one of .* or a callable f -> distribution, got 3"):
        GeneralizedLinearModel(LinearBasis(2), 3)
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        GeneralizedLinearModel(LinearBasis(2), rank=0)
    expected = r"prior must be a pyro_fa\.infer\.priors\.FactorisedPrior \(GaussianPrior, LaplacePrior or any"
    with pytest.raises(TypeError, match=expected + r" subclass\), got 1\.0\."):
        GeneralizedLinearModel(LinearBasis(2), prior=1.0)
    with pytest.raises(ValueError, match="noise_scale must be a positive finite float, got 0.0"):
        GeneralizedLinearModel(LinearBasis(2), noise_scale=0.0)
    with pytest.raises(TypeError, match="learn_noise must be a bool"):
        GeneralizedLinearModel(LinearBasis(2), learn_noise=1)
    with pytest.raises(ValueError, match="num_particles must be >= 1"):
        GeneralizedLinearModel(LinearBasis(2), num_particles=0)
    with pytest.raises(ValueError, match="init_scale must be a positive finite float"):
        GeneralizedLinearModel(LinearBasis(2), init_scale=-1.0)
    glm = GeneralizedLinearModel(LinearBasis(2), "bernoulli", rank=2)
    with pytest.raises(RuntimeError, match="call fit"):
        glm.predict(X)
    with pytest.raises(ValueError, match=r"y must hold labels in \{0, 1\} for likelihood='bernoulli', got \[2.0\]"):
        glm.fit(X, torch.cat([torch.zeros(19), torch.tensor([2.0])]), n_steps=1)
    with pytest.raises(ValueError, match=r"X must have shape \(N, 2\), got \(20, 3\)"):
        glm.fit(torch.randn(20, 3), torch.zeros(20), n_steps=1)
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        glm.fit(X, torch.zeros(20), n_steps=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        glm.fit(X, torch.zeros(20), batch_size=0)
    with pytest.raises(ValueError, match=r"lr_decay must be in \(0, 1\], got 2.0"):
        glm.fit(X, torch.zeros(20), lr_decay=2.0)
    with pytest.raises(TypeError, match="progress must be a bool"):
        glm.fit(X, torch.zeros(20), progress=1)
    poisson = GeneralizedLinearModel(LinearBasis(2), "poisson", rank=2)
    with pytest.raises(ValueError, match="non-negative integer counts for likelihood='poisson', got \\[-1.0\\]"):
        poisson.fit(X, torch.cat([torch.zeros(19), torch.tensor([-1.0])]), n_steps=1)
    with pytest.raises(ValueError, match="non-negative integer counts for likelihood='poisson', got \\[0.5\\]"):
        poisson.fit(X, torch.cat([torch.zeros(19), torch.tensor([0.5])]), n_steps=1)
    poisson.fit(X, torch.ones(20), n_steps=2)
    with pytest.raises(RuntimeError, match="predict_proba needs likelihood='bernoulli', got 'poisson'"):
        poisson.predict_proba(X)
    with pytest.raises(ValueError, match="n_samples must be >= 1"):
        poisson.predictive_samples(X, n_samples=0)
    with pytest.raises(TypeError, match="must return a pyro.distributions distribution, got Normal"):
        GeneralizedLinearModel(LinearBasis(2), lambda f: torch.distributions.Normal(f, 1.0)).fit(X, y, n_steps=1)
    with pytest.raises(ValueError, match=r"batch shape f.shape = \(20,\) and event shape \(\)"):
        GeneralizedLinearModel(LinearBasis(2), lambda f: dist.Normal(f, 1.0).to_event(1)).fit(X, y, n_steps=1)
    with pytest.raises(ValueError, match="y must lie in the likelihood's support"):
        GeneralizedLinearModel(LinearBasis(2), lambda f: dist.Poisson(f.exp())).fit(X, y, n_steps=1)


# ======================================================================== scikit-learn estimators
def _sine(n=120, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, (n, 1))
    return X, np.sin(X[:, 0]) + 0.1 * rng.normal(size=n)


def test_slm_regressor_fits_and_standardises_equivariantly():
    X, y = _sine()
    reg = SLMRegressor(n_components=50, random_state=0).fit(X, y)
    Xt = np.linspace(-2.5, 2.5, 20)[:, None]
    mean, std = reg.predict(Xt, return_std=True)
    assert np.abs(mean - np.sin(Xt[:, 0])).max() < 0.15 and (std > 0).all()
    scaled = SLMRegressor(n_components=50, random_state=0).fit(X * 10 + 3, y * 1000 - 7)
    mean2, std2 = scaled.predict(Xt * 10 + 3, return_std=True)
    np.testing.assert_allclose(mean2, mean * 1000 - 7, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(std2, std * 1000, rtol=1e-6)
    assert scaled.noise_variance_ == pytest.approx(reg.noise_variance_ * 1e6, rel=1e-6)
    assert reg.lengthscale_.shape == () and reg.n_features_in_ == 1


def test_slm_regressor_without_standardisation_uses_raw_data():
    X, y = _sine()
    reg = SLMRegressor(n_components=20, random_state=0, standardize=False, n_iter=0).fit(X, y + 5)
    assert reg.y_mean_ == 0.0 and reg.y_scale_ == 1.0
    np.testing.assert_array_equal(reg.x_mean_, [0.0])


def test_glm_regressor_gaussian_and_poisson():
    X, y = _sine()
    reg = GLMRegressor(n_components=20, n_steps=300, lr=0.05, random_state=0).fit(X, y)
    mean, std = reg.predict(X, return_std=True)
    assert np.sqrt(np.mean((mean - y) ** 2)) < 0.3 and reg.noise_scale_ > 0
    np.testing.assert_array_equal(reg.predict(X), GLMRegressor(**reg.get_params()).fit(X, y).predict(X))
    counts = np.random.default_rng(0).poisson(np.exp(1 + 0.5 * X[:, 0]))
    pois = GLMRegressor(n_components=10, likelihood="poisson", n_steps=300, lr=0.05, random_state=0).fit(X, counts)
    assert pois.y_scale_ == 1.0 and (pois.predict(X) > 0).all()
    with pytest.raises(ValueError, match="non-negative integer counts"):
        GLMRegressor(likelihood="poisson", n_steps=1).fit(X, counts - 10)


def test_glm_classifier_arbitrary_labels():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(150, 2))
    y = np.where(X[:, 0] - X[:, 1] > 0, "yes", "no")
    clf = GLMClassifier(n_components=20, n_steps=300, lr=0.05, n_samples=200, random_state=0).fit(X, y)
    np.testing.assert_array_equal(clf.classes_, ["no", "yes"])
    proba = clf.predict_proba(X)
    np.testing.assert_allclose(proba.sum(1), 1.0)
    np.testing.assert_array_equal(proba, clf.predict_proba(X))  # seeded Monte Carlo
    assert (clf.predict(X) == y).mean() > 0.9
    np.testing.assert_allclose(clf.predict_log_proba(X[:3]), np.log(proba[:3]))
    with pytest.raises(ValueError, match="Only binary classification is supported: y must hold exactly 2 classes, "
                                         "got 3 classes"):
        GLMClassifier(n_steps=1).fit(X, rng.integers(0, 3, 150))


def test_estimators_refuse_bad_parameters():
    X, y = _sine(n=20)
    with pytest.raises(ValueError, match="'kernel' parameter of SLMRegressor must be a str among"):
        SLMRegressor(kernel="periodic").fit(X, y)
    with pytest.raises(ValueError, match="orthogonal must be False for kernel='laplace'"):
        SLMRegressor(kernel="laplace", orthogonal=True).fit(X, y)
    with pytest.raises(ValueError, match="'n_steps' parameter of GLMRegressor must be an int in the range"):
        GLMRegressor(n_steps=0).fit(X, y)
    with pytest.raises(ValueError, match="'dtype' parameter of GLMClassifier"):
        GLMClassifier(dtype="float16").fit(X, y > 0)
    with pytest.raises(ValueError, match="dtype must be None, 'float32', 'float64'.*got torch.float16"):
        GLMClassifier(dtype=torch.float16).fit(X, y > 0)
    with pytest.raises(ValueError, match="X has 2 features, but SLMRegressor is expecting 1 features"):
        SLMRegressor(n_components=5, n_iter=0).fit(X, y).predict(np.zeros((3, 2)))


def test_slm_regressor_refuses_a_dense_posterior_past_max_dim_before_allocating(monkeypatch):
    X, y = _sine(n=30)

    def never(*args, **kwargs):
        raise AssertionError("the basis or the D x D posterior was being built")

    fitted = SLMRegressor(n_components=5, random_state=0).fit(X, y)
    before = fitted.predict(X, return_std=True)
    monkeypatch.setattr(_sklearn_base, "RandomFourierBasis", never)
    monkeypatch.setattr(_sklearn, "StandardLinearModel", never)
    # D = 2 * 20000 + 1 + 1 = 40002 weights: 40002^2 * 8 bytes = 12.8 GB
    with pytest.raises(ValueError, match=r"SLMRegressor: the posterior over the weights forms a dense D x D matrix "
                                         r"\(12\.8 GB in torch\.float64\) and needs D <= 20000, got 40002\. "
                                         r"n_components=20000 is too many: use fewer, or GLMRegressor .*max_dim=None"):
        fitted.set_params(n_components=20000).fit(X, y)
    with pytest.raises(ValueError, match=r"\(6\.4 GB in torch\.float32\) and needs D <= 20000, got 40003"):
        fitted.set_params(dtype="float32").fit(np.hstack([X, X]), y)  # a refused fit keeps the fitted model
    assert fitted.n_features_in_ == 1 and fitted.n_components == 20000
    fitted.set_params(dtype=None)
    np.testing.assert_array_equal(fitted.predict(X, return_std=True), before)
    with pytest.raises(ValueError, match=r"'max_dim' parameter of SLMRegressor must be None or an int"):
        SLMRegressor(max_dim=0).fit(X, y)


def test_slm_dense_limit_can_be_lifted():
    X, y = _sine(n=30)
    with pytest.raises(ValueError, match=r"needs D <= 20, got 22"):
        SLMRegressor(n_components=10, max_dim=20).fit(X, y)
    lifted = SLMRegressor(n_components=10, max_dim=None, random_state=0, n_iter=0).fit(X, y)
    default = SLMRegressor(n_components=10, random_state=0, n_iter=0).fit(X, y)
    np.testing.assert_array_equal(lifted.predict(X), default.predict(X))
    with pytest.raises(ValueError, match=r"StandardLinearModel: the posterior precision forms a dense "
                                         r"basis.out_features x basis.out_features matrix \(12\.8 GB in "
                                         r"torch\.float64\) and needs basis.out_features <= 20000, got 40000\. "
                                         r"Use GeneralizedLinearModel"):
        StandardLinearModel(RandomFourierBasis(1, 20000, seed=0, dtype=torch.float64))
    assert StandardLinearModel(LinearBasis(3), max_dim=None).max_dim is None
    with pytest.raises(ValueError, match="StandardLinearModel: max_dim must be >= 1, got 0"):
        StandardLinearModel(LinearBasis(3), max_dim=0)


def test_slm_regressor_refuses_one_sample_and_warns_on_too_few():
    X, y = _sine(n=40)
    with pytest.raises(ValueError, match=r"SLMRegressor: fit needs n_samples >= 2 .* got 1 sample"):
        SLMRegressor(n_components=5).fit(X[:1], y[:1])
    with pytest.warns(DegenerateEvidenceWarning, match=r"SLMRegressor: 5 samples are too few to fit 3 hyperparameters "
                                                       r"by evidence maximisation \(needs n_samples > 5, as "
                                                       r"standardize=True"):
        SLMRegressor(n_components=5, random_state=0).fit(X[:5], y[:5])
    with pytest.warns(DegenerateEvidenceWarning, match=r"3 samples are too few to fit 3 hyperparameters .*needs "
                                                       r"n_samples > 3\)"):
        SLMRegressor(n_components=5, random_state=0, standardize=False).fit(X[:3], y[:3])
    with pytest.warns(DegenerateEvidenceWarning, match=r"6 samples are too few to fit 4 hyperparameters"):
        SLMRegressor(n_components=5, random_state=0, ard=True).fit(np.hstack([X, X])[:6], y[:6])  # h = 2 + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SLMRegressor(n_components=5, random_state=0).fit(X[:6], y[:6])  # 6 - 2 > 3
        SLMRegressor(n_components=5, random_state=0, n_iter=0).fit(X[:1], y[:1])  # nothing fitted, nothing to say
        SLMRegressor(n_components=5, random_state=0, learn_lengthscale=False).fit(X[:5], y[:5])  # 5 - 2 > 2


def test_two_standardised_samples_carry_no_information_for_the_evidence():
    """Why the mean and scale of y count: standardised, any two targets become (-1, 1), whatever they were."""
    X, y = _sine(n=2)
    with pytest.warns(DegenerateEvidenceWarning):
        fits = [SLMRegressor(n_components=5, random_state=0).fit(X, t)
                for t in (y, np.array([-3.0, 50.0]) * np.sign(np.diff(y)))]  # same order, other values
    assert fits[0].prior_precision_ == pytest.approx(fits[1].prior_precision_, rel=1e-9)
    np.testing.assert_allclose(fits[0].lengthscale_, fits[1].lengthscale_, rtol=1e-9)


def test_slm_warns_when_n_is_at_most_the_hyperparameters():
    X, y = _regression(n=6, d=1)
    with pytest.warns(DegenerateEvidenceWarning, match=r"StandardLinearModel: the log evidence of N = 2 targets cannot "
                                                       r"determine the 2 hyperparameters"):
        StandardLinearModel(LinearBasis(1)).fit(X[:2], y[:2])
    with pytest.warns(DegenerateEvidenceWarning, match=r"N = 3 targets cannot determine the 3 hyperparameters"):
        StandardLinearModel(RandomFourierBasis(1, 5, seed=0, dtype=torch.float64)).fit(X[:3], y[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StandardLinearModel(LinearBasis(1)).fit(X[:3], y[:3])
        StandardLinearModel(LinearBasis(1)).fit(X[:1], y[:1], n_iter=0)


@pytest.mark.parametrize("cls", [SLMRegressor, GLMRegressor, GLMClassifier])
def test_estimators_refuse_a_meta_device_and_keep_their_fit(cls):
    X, y = _sine(n=30)
    y = y > 0 if cls is GLMClassifier else y
    kw = dict(n_iter=0) if cls is SLMRegressor else dict(n_steps=2, n_samples=5)
    est = cls(n_components=3, random_state=0, **kw).fit(X, y)
    before = est.predict(X)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: device must hold data \('cpu' or 'cuda'\), got 'meta'"):
        est.set_params(device="meta").fit(np.hstack([X, X]), y)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: device must name a torch device .* got 'gpu0'"):
        est.set_params(device="gpu0").fit(X, y)
    est.set_params(device=None)
    assert est.n_features_in_ == 1
    np.testing.assert_array_equal(est.predict(X), before)
    if cls is GLMClassifier:
        with pytest.raises(ValueError, match="exactly 2 classes"):
            est.fit(X, np.arange(30) % 3)
        np.testing.assert_array_equal(est.classes_, [False, True])


@pytest.mark.parametrize("cls", [StandardLinearModel, GeneralizedLinearModel])
def test_models_refuse_a_basis_on_the_meta_device(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: basis must hold data on a device such as 'cpu' or 'cuda', "
                                         r"got tensors on the meta device"):
        cls(RandomFourierBasis(2, 3, seed=0).to("meta"))


@pytest.mark.slow
@parametrize_with_checks(
    [
        SLMRegressor(n_components=10, n_iter=5, random_state=0),
        GLMRegressor(n_components=5, n_steps=100, lr=0.05, n_samples=20, random_state=0),
        GLMClassifier(n_components=5, n_steps=100, lr=0.05, n_samples=20, random_state=0),
    ]
)
def test_estimators_pass_sklearn_checks(estimator, check):
    check(estimator)


@pytest.mark.parametrize("module", [slm_module, glm_module, likelihoods, _sklearn, _sklearn_glm])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
