import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_fa import GaussianPrior, LaplacePrior
from pyro_fa.infer.priors import expected_abs, laplace_expected_log_prob, normal_expected_log_prob


def _quadrature(f, loc, variance, n=20001, width=12.0):
    """E f(X), X ~ N(loc, variance), by the trapezoid rule on a wide grid (elementwise)."""
    std = variance.sqrt()
    z = torch.linspace(-width, width, n, dtype=loc.dtype)
    x = loc.unsqueeze(-1) + std.unsqueeze(-1) * z
    w = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return torch.trapezoid(f(x) * w, z, dim=-1)


def test_expected_abs_matches_quadrature():
    loc = torch.tensor([-3.0, -0.4, 0.0, 0.2, 1.5, 7.0])
    var = torch.tensor([0.5, 2.0, 1.0, 0.01, 3.0, 0.2])
    assert torch.allclose(expected_abs(loc, var), _quadrature(torch.abs, loc, var), atol=1e-8)


def test_expected_abs_stable_limits():
    # tiny variance: |mu|; huge |mu| / sigma: |mu|; zero variance and zero mean: 0
    loc = torch.tensor([2.0, -5.0, 0.0, 1e3])
    var = torch.tensor([1e-300, 1e-30, 0.0, 1e-4])
    out = expected_abs(loc, var)
    assert torch.allclose(out, loc.abs())
    assert torch.isfinite(out).all()


def test_expected_abs_gradients_match_seed_formulas():
    # Jiang (2023) eqs. (1)-(2): d/dmu = 2 Phi(mu / sigma) - 1, d/dv = exp(-mu^2 / 2v) / sqrt(2 pi v)
    loc = torch.tensor([-1.3, -0.1, 0.0, 0.7, 4.0], requires_grad=True)
    var = torch.tensor([0.3, 1.2, 0.5, 2.0, 1e-3], requires_grad=True)
    expected_abs(loc, var).sum().backward()
    mu, v = loc.detach(), var.detach()
    assert torch.allclose(loc.grad, torch.erf(mu / (2 * v).sqrt()))
    assert torch.allclose(var.grad, torch.exp(-mu * mu / (2 * v)) / (2 * math.pi * v).sqrt())


def test_expected_abs_gradients_finite_at_tiny_variance():
    loc = torch.tensor([1.0, -2.0], requires_grad=True)
    var = torch.tensor([0.0, 1e-300], requires_grad=True)
    expected_abs(loc, var).sum().backward()
    assert torch.isfinite(loc.grad).all() and torch.isfinite(var.grad).all()
    assert torch.allclose(loc.grad, torch.tensor([1.0, -1.0]))


def test_gaussian_expected_log_prob_matches_quadrature_and_grad():
    prior = GaussianPrior(precision=2.5)
    loc = torch.tensor([-1.0, 0.0, 0.3, 2.0], requires_grad=True)
    var = torch.tensor([0.2, 1.0, 0.05, 3.0], requires_grad=True)
    out = prior.expected_log_prob(loc, var)
    ref = _quadrature(prior.log_prob, loc.detach(), var.detach())
    assert torch.allclose(out, ref, atol=1e-8)
    out.sum().backward()
    # Brownlie (2021) eqs. 4.48 and 4.55: d/dc = -alpha c, d/dpsi = -alpha / 2
    assert torch.allclose(loc.grad, -2.5 * loc.detach())
    assert torch.allclose(var.grad, torch.full_like(var, -1.25))


def test_laplace_expected_log_prob_matches_monte_carlo():
    prior = LaplacePrior(scale=0.7)
    loc = torch.tensor([-1.0, 0.0, 0.4])
    var = torch.tensor([0.5, 0.1, 2.0])
    draws = loc + var.sqrt() * torch.randn(400_000, 3)
    lp = prior.log_prob(draws)
    mc, se = lp.mean(0), lp.std(0) / math.sqrt(len(draws))
    out = prior.expected_log_prob(loc, var)
    assert ((out - mc).abs() < 4 * se).all()
    assert torch.allclose(out, _quadrature(prior.log_prob, loc, var), atol=1e-8)


def test_expected_log_prob_with_prior_location():
    loc, var = torch.tensor([0.3, -1.0]), torch.tensor([0.4, 0.9])
    pl, ps = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 2.0])
    ref_n = _quadrature(lambda x: dist.Normal(pl.unsqueeze(-1), ps.unsqueeze(-1)).log_prob(x), loc, var)
    ref_l = _quadrature(lambda x: dist.Laplace(pl.unsqueeze(-1), ps.unsqueeze(-1)).log_prob(x), loc, var)
    assert torch.allclose(normal_expected_log_prob(loc, var, pl, ps), ref_n, atol=1e-8)
    assert torch.allclose(laplace_expected_log_prob(loc, var, pl, ps), ref_l, atol=1e-7)


@pytest.mark.parametrize("prior, variance", [(GaussianPrior(4.0), 0.25), (LaplacePrior(0.5), 0.5)])
def test_distribution_shape_dtype_device(prior, variance, device):
    like = torch.zeros(3, 2, dtype=torch.float32, device=device)
    d = prior.distribution(like)
    assert d.event_shape == (3, 2) and d.batch_shape == ()
    x = d.sample()
    assert x.dtype == torch.float32 and x.device.type == device.type
    assert torch.allclose(d.log_prob(x), prior.log_prob(x).sum())
    assert math.isclose(float(d.base_dist.variance.flatten()[0]), variance, rel_tol=1e-6)


def test_laplace_matches_seed_rate():
    # Jiang (2023): rate alpha = 1 / b, variance 2 b^2
    prior = LaplacePrior(scale=0.5)
    assert torch.allclose(prior.log_prob(torch.tensor([0.3])), torch.log(torch.tensor(1.0)) - 0.3 / 0.5)


@pytest.mark.parametrize(
    "cls, arg, value, exc, match",
    [
        (GaussianPrior, "precision", 0.0, ValueError, r"GaussianPrior: precision must be a positive finite number, got 0\.0\."),
        (GaussianPrior, "precision", -1, ValueError, r"GaussianPrior: precision must be a positive finite number, got -1\.0\."),
        (GaussianPrior, "precision", float("inf"), ValueError, r"GaussianPrior: precision must be a positive finite number"),
        (GaussianPrior, "precision", "1", TypeError, r"GaussianPrior: precision must be a real number, got '1'\."),
        (LaplacePrior, "scale", -0.5, ValueError, r"LaplacePrior: scale must be a positive finite number, got -0\.5\."),
        (LaplacePrior, "scale", None, TypeError, r"LaplacePrior: scale must be a real number, got None\."),
    ],
)
def test_prior_bad_arguments(cls, arg, value, exc, match):
    with pytest.raises(exc, match=match):
        cls(**{arg: value})


@pytest.mark.parametrize("prior", [GaussianPrior(1.0), LaplacePrior(1.0)])
def test_bayesianize(prior):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    bnn = prior.bayesianize(net)
    assert len(list(net.parameters())) == 4  # original untouched
    assert list(bnn.parameters()) == []
    trace = pyro.poutine.trace(bnn).get_trace(torch.randn(5, 3))
    sites = {n: s for n, s in trace.nodes.items() if s["type"] == "sample"}
    assert set(sites) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sites["0.weight"]["fn"].event_shape == (4, 3)
    assert torch.equal(bnn.initial_values["0.weight"], net[0].weight.detach())
    assert isinstance(sites["2.bias"]["fn"].base_dist, type(prior.distribution(torch.zeros(1)).base_dist))


def test_bayesianize_errors():
    with pytest.raises(TypeError, match=r"GaussianPrior\.bayesianize: module must be a torch\.nn\.Module, got 3\."):
        GaussianPrior().bayesianize(3)
    with pytest.raises(ValueError, match=r"LaplacePrior\.bayesianize: module must have at least one parameter"):
        LaplacePrior().bayesianize(torch.nn.Tanh())


def test_laplace_expected_log_prob_gradient_matches_monte_carlo_autograd():
    """d/dmu and d/dv of the closed form agree with autograd of a reparameterised Monte Carlo estimate (4 s.e.)."""
    prior = LaplacePrior(scale=0.7)
    loc = torch.tensor([-1.0, 0.05, 0.4, 2.5])
    var = torch.tensor([0.5, 0.1, 2.0, 0.3])
    loc_, var_ = loc.clone().requires_grad_(), var.clone().requires_grad_()
    prior.expected_log_prob(loc_, var_).sum().backward()
    grads_loc, grads_var = [], []
    for _ in range(50):
        m, v = loc.clone().requires_grad_(), var.clone().requires_grad_()
        draws = m + v.sqrt() * torch.randn(20_000, 4)
        prior.log_prob(draws).mean(0).sum().backward()
        grads_loc.append(m.grad)
        grads_var.append(v.grad)
    for closed, mc in ((loc_.grad, torch.stack(grads_loc)), (var_.grad, torch.stack(grads_var))):
        se = mc.std(0) / math.sqrt(len(mc))
        assert ((closed - mc.mean(0)).abs() < 4 * se).all(), (closed, mc.mean(0), se)
