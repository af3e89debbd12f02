"""LowRankAffine and NeuTra HMC with AutoLowRankFactorGuide (Hoffman et al. 2019)."""
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import HMC, MCMC
from pyro.infer.reparam import NeuTraReparam

from pyro_fa import AutoLowRankFactorGuide
from pyro_fa.infer.transforms import LowRankAffine


def _params(D, K, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(D, generator=g, dtype=dtype)
    F = torch.randn(D, K, generator=g, dtype=dtype)
    psi = torch.rand(D, generator=g, dtype=dtype) + 0.05
    return loc, F, psi


def _dense_L(t, D, dtype):
    """The matrix of the linear part, column by column: L e_i = t(e_i) - c."""
    eye = torch.eye(D, dtype=dtype)
    return (t(eye) - t.loc).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("D, K", [(7, 3), (5, 1), (4, 4), (3, 5)])
def test_transform_against_dense_linear_algebra(D, K, dtype):
    loc, F, psi = _params(D, K, dtype)
    t = LowRankAffine(loc, F, psi)
    L = _dense_L(t, D, dtype)
    cov = F @ F.T + torch.diag(psi)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    assert torch.allclose(L @ L.T, cov, **tol)
    z = torch.randn(2, 3, D, dtype=dtype)
    y = t(z)
    assert y.shape == (2, 3, D)
    assert torch.allclose(y, loc + z @ L.T, **tol)
    # inverse: a dense solve
    assert torch.allclose(t.inv(y), torch.linalg.solve(L, (y - loc).unsqueeze(-1)).squeeze(-1), **tol)
    assert torch.allclose(t.inv(y), z, **tol)
    # log|det L| = log|det L| (dense) = log|FF^T + Psi| / 2, one value per point
    ladj = t.log_abs_det_jacobian(z, y)
    assert ladj.shape == (2, 3)
    assert torch.allclose(ladj, torch.linalg.slogdet(L)[1].expand(2, 3), **tol)
    assert torch.allclose(ladj[0, 0], 0.5 * torch.logdet(cov), **tol)


def test_pushforward_of_a_standard_normal_is_the_low_rank_normal():
    D, K = 6, 2
    loc, F, psi = _params(D, K)
    t = LowRankAffine(loc, F, psi)
    q = dist.LowRankMultivariateNormal(loc, F, psi)
    pushed = dist.TransformedDistribution(dist.Normal(torch.zeros(D), 1.0).to_event(1), t)
    x = q.sample((5,))
    assert torch.allclose(pushed.log_prob(x), q.log_prob(x), rtol=1e-10)  # Pyro's own density of FF^T + Psi
    # Monte Carlo: the sample covariance of t(z), z ~ N(0, I), within 4 standard errors of FF^T + Psi
    N = 200_000
    y = t(torch.randn(N, D))
    cov = F @ F.T + torch.diag(psi)
    sample_cov = torch.cov(y.T)
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov ** 2) / N).sqrt()
    assert ((sample_cov - cov).abs() < 4 * se).all()
    assert ((y.mean(0) - loc).abs() < 4 * (cov.diagonal() / N).sqrt()).all()


def test_transform_bad_shapes():
    with pytest.raises(ValueError, match=r"LowRankAffine: loc, cov_factor, cov_diag must have shapes \(D,\), \(D, K\), \(D,\), "
                                         r"got \(3,\), \(4, 2\), \(3,\)\."):
        LowRankAffine(torch.zeros(3), torch.zeros(4, 2), torch.ones(3))


def _gaussian_model(mu, cov):
    def model():
        pyro.sample("x", dist.MultivariateNormal(mu, cov))
    return model


def test_guide_transform_matches_its_posterior():
    mu, F, psi = _params(4, 2)
    model = _gaussian_model(mu, F @ F.T + torch.diag(psi))
    guide = AutoLowRankFactorGuide(model, rank=2)
    guide()
    q = guide.get_posterior()
    t = guide.get_transform()
    L = _dense_L(t, 4, torch.float64).detach()
    assert torch.allclose(L @ L.T, q.covariance_matrix.detach(), atol=1e-12)
    assert torch.allclose(guide.get_base_dist().sample().new_zeros(4), torch.zeros(4))
    assert guide.get_base_dist().event_shape == (4,)


@pytest.mark.slow
def test_neutra_hmc_with_our_guide_gives_the_gaussians_moments():
    """A correlated Gaussian target; the guide is deliberately off (scale x1.5), so HMC must correct it."""
    pyro.set_rng_seed(0)
    D = 4
    mu, F, psi = _params(D, 2)
    cov = F @ F.T + torch.diag(psi)
    model = _gaussian_model(mu, cov)
    guide = AutoLowRankFactorGuide(model, rank=2)
    guide()
    s = psi.sqrt() * 1.5  # a guide with q = N(mu + 0.3, 1.5^2 Sigma): right shape, wrong place and size
    guide.load_state_dict({"loc": mu + 0.3, "factor": F / psi.sqrt().unsqueeze(-1), "scale_unconstrained": s.log()})
    neutra = NeuTraReparam(guide)
    warped = poutine.reparam(model, config=lambda _: neutra)
    # in the warped space the target is close to N(0, I): short fixed trajectories mix well
    # (Pyro's NeuTra costs ~5-10 ms a gradient on this small model, with its own guides too: few draws)
    mcmc = MCMC(HMC(warped, step_size=0.7, num_steps=2), num_samples=250, warmup_steps=50, disable_progbar=True)
    mcmc.run()
    z = mcmc.get_samples()["x_shared_latent"]
    x = neutra.transform_sample(z)["x"].detach()
    assert x.shape == (250, D)
    std = cov.diagonal().sqrt()
    # about 4 standard errors at an effective sample size of ~200
    assert ((x.mean(0) - mu).abs() < 0.3 * std).all()
    assert ((x.std(0) / std - 1).abs() < 0.2).all()
    corr = torch.corrcoef(x.T)
    exact = cov / std[:, None] / std[None, :]
    assert ((corr - exact).abs() < 0.25 * (1 - exact ** 2) + 0.05).all()
    # the guide alone is off by 0.3 in the mean and 1.5x in the spread: HMC corrected it
    assert ((x.mean(0) - mu - 0.3).abs() > 0.1).any() and ((x.std(0) / std - 1.5).abs() > 0.2).all()


def _plated_model(y=None):
    """A global mean, 3 group effects in a plate at dim -2, 40 local latents per group at dim -1."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros(()), 5.0))
    with pyro.plate("groups", 3, dim=-2):
        b = pyro.sample("b", dist.Normal(mu, 1.0))
        with pyro.plate("data", 40, dim=-1):
            z = pyro.sample("z", dist.Normal(b, 1.0))
            pyro.sample("y", dist.Normal(z, 0.5), obs=y)


def test_transform_sample_of_a_flat_stack_of_draws_on_a_plated_model():
    """(S, D) draws, as MCMC returns them, unpack as Pyro's convention (S, 1, 1, D) does, site by site.

    Independent reference: the guide's own affine map applied to each draw by hand and cut at the sites' offsets.
    """
    pyro.set_rng_seed(0)
    y = torch.randn(3, 40) + 2.0
    guide = AutoLowRankFactorGuide(_plated_model, rank=2)
    guide(y)
    neutra = NeuTraReparam(guide)
    poutine.trace(poutine.reparam(_plated_model, config=lambda _: neutra)).get_trace(y)  # sets neutra.transform
    latent = torch.randn(5, 1 + 3 + 120)
    with torch.no_grad():
        flat = neutra.transform_sample(latent)
        aligned = neutra.transform_sample(latent.unsqueeze(-2).unsqueeze(-2))  # Pyro's documented way
        x = guide.get_transform()(latent)
    assert flat["mu"].shape == (5, 1, 1) and flat["b"].shape == (5, 3, 1) and flat["z"].shape == (5, 3, 40)
    for name in ("mu", "b", "z"):
        assert torch.equal(flat[name], aligned[name])
    torch.testing.assert_close(flat["mu"].reshape(5), x[:, 0])
    torch.testing.assert_close(flat["b"].reshape(5, 3), x[:, 1:4])
    torch.testing.assert_close(flat["z"].reshape(5, 120), x[:, 4:])
    # what Pyro's own unpacking does with the same stack
    with pytest.raises(RuntimeError, match="broadcast|view"):
        list(pyro.infer.autoguide.AutoContinuous._unpack_latent(guide, x))
