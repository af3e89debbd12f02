"""Priors plug in by registration: the registry's contract, every registered prior against Monte Carlo,
and a prior defined outside the library (docs/architecture.md, "Add a prior") picked up by FactorELBO,
BayesianNetwork and the batched trainer."""
import math
import re
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, GaussianPrior, LaplacePrior
from pyro_fa.infer.priors import (
    PRIORS,
    FactorisedPrior,
    closed_form,
    expected_log_prob,
    get_prior,
    register_expected_log_prob,
    register_prior,
)
from pyro_fa.infer.priors import closed_forms as _closed_forms
from pyro_fa.infer.priors import registry as _registry
from pyro_fa.nn import BatchedMLP, BatchedVI, BayesianNetwork, fit_batched

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BUILT_IN = sorted(PRIORS)  # collected before any test registers more


@pytest.fixture(scope="module")
def user():
    """Run the docs' "Add a prior" block; unregister what it added afterwards (the registry is global)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Add a prior"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace = {"__name__": "user_prior"}
    exec(compile(block, "docs/architecture.md[Add a prior]", "exec"), namespace)
    yield namespace
    _registry._PRIORS.pop("student_t", None)
    _closed_forms._CLOSED_FORMS.pop(namespace["StudentTWeight"], None)


def _prior(name, user):
    return get_prior(name)()


def _monte_carlo(prior, loc, variance, n=400_000):
    """Mean and standard error of log p(θ), θ ~ N(loc, variance), elementwise."""
    g = torch.Generator().manual_seed(0)
    theta = loc + variance.sqrt() * torch.randn((n,) + loc.shape, generator=g, dtype=loc.dtype)
    lp = prior.log_prob(theta.reshape(n, -1)).reshape(theta.shape)
    return lp.mean(0), lp.std(0) / math.sqrt(n)


LOC = torch.tensor([0.0, 0.3, -1.5, 4.0], dtype=torch.float64)
VAR = torch.tensor([1.0, 0.05, 2.0, 0.5], dtype=torch.float64)


# --------------------------------------------------------------- conformance over the registry
@pytest.mark.parametrize("name", BUILT_IN + ["student_t"])
def test_expected_log_prob_matches_monte_carlo(name, user):
    prior = _prior(name, user)
    exact = prior.expected_log_prob(LOC, VAR)
    mean, se = _monte_carlo(prior, LOC, VAR)
    assert exact.shape == LOC.shape and exact.dtype == LOC.dtype
    assert ((exact - mean).abs() <= 4 * se).all(), (exact, mean, se)


@pytest.mark.parametrize("name", BUILT_IN + ["student_t"])
def test_site_distribution_dispatches_to_the_same_closed_form(name, user):
    """FactorELBO's route (a site's `.to_event` distribution through the registry) equals the prior's own."""
    prior = _prior(name, user)
    site = prior.distribution(torch.zeros(2, 2, dtype=torch.float64))
    assert site.event_shape == (2, 2) and closed_form(site.base_dist) is not None
    m, v = LOC.reshape(2, 2), VAR.reshape(2, 2)
    torch.testing.assert_close(expected_log_prob(site, m, v), prior.expected_log_prob(m, v), rtol=0, atol=0)


@pytest.mark.parametrize("name", BUILT_IN + ["student_t"])
def test_batched_form_has_variance_one_over_precision_and_its_closed_form(name, user):
    cls = get_prior(name)
    precision = torch.tensor([[0.5], [4.0]], dtype=torch.float64)
    p = cls.batched(precision)
    assert p.batch_shape == (2, 1)
    torch.testing.assert_close(p.variance, 1 / precision)
    assert cls().precision == pytest.approx(1 / float(cls().base_distribution(LOC).variance))
    loc, var = LOC.expand(2, 4), VAR.expand(2, 4)
    g = torch.Generator().manual_seed(1)
    theta = loc + var.sqrt() * torch.randn((200_000, 2, 4), generator=g, dtype=loc.dtype)
    lp = p.log_prob(theta)
    mean, se = lp.mean(0), lp.std(0) / math.sqrt(lp.shape[0])
    assert ((closed_form(p)(p, loc, var) - mean).abs() <= 4 * se).all()


@pytest.mark.parametrize("name", BUILT_IN + ["student_t"])
def test_factor_elbo_equals_monte_carlo_elbo(name, user):
    """A prior-only model: FactorELBO's loss is closed form (the same at every seed) and equals -E_q[log p - log q]."""
    prior = _prior(name, user)

    def model():
        pyro.sample("w", prior.distribution(torch.zeros(3, dtype=torch.float64)))

    pyro.clear_param_store()
    guide = AutoLowRankFactorGuide(model, rank=2, init_scale=0.7)
    elbo = FactorELBO()
    pyro.set_rng_seed(0)
    first = elbo.loss(model, guide)
    pyro.set_rng_seed(1)
    assert elbo.loss(model, guide) == first  # no Monte Carlo left
    q = guide.get_posterior()
    theta = q.rsample((200_000,)).detach()
    terms = prior.log_prob(theta).sum(-1) - q.log_prob(theta).detach()
    se = float(terms.std()) / math.sqrt(terms.shape[0])
    assert abs(-first - float(terms.mean())) <= 4 * se


# --------------------------------------------------------------- a user's prior in every consumer
def test_user_prior_trains_in_bayesian_network_with_its_closed_form(user):
    pyro.clear_param_store()
    prior = user["StudentTPrior"](scale=0.5)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()
    bnn = BayesianNetwork(net, prior, noise_scale=0.3, rank=2, name="student_t_bnn")
    x = torch.randn(20, 2, dtype=torch.float64)
    y = x.sum(-1)
    elbo = FactorELBO()
    elbo.loss(bnn.model, bnn.guide, x, y)  # sets the guide up
    model_trace, guide_trace = elbo._get_trace(bnn.model, bnn.guide, (x, y), {})
    _, _, closed = elbo._analytic_terms(model_trace, guide_trace, bnn.guide)
    assert closed == {"0.weight", "0.bias", "2.weight", "2.bias"}
    svi = pyro.infer.SVI(bnn.model, bnn.guide, pyro.optim.Adam({"lr": 1e-2}), elbo)
    losses = [svi.step(x, y) for _ in range(5)]
    assert all(math.isfinite(v) for v in losses)


def test_user_prior_in_the_batched_trainer_uses_its_closed_form(user):
    """Same parameters and draws: the loss moves from the Gaussian's by exactly the difference of the priors'
    expectations, computed here by an independent quadrature over q's marginals."""
    mlp = BatchedMLP(2, (4,))
    x, y = torch.randn(16, 2, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    precision = torch.tensor([0.5, 3.0], dtype=torch.float64)
    kw = dict(precision=precision, rank=2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vi_t, vi_g = BatchedVI(mlp, "fa", "student_t", **kw), BatchedVI(mlp, "fa", "gaussian", **dict(
        kw, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(2)
    loss_t = vi_t.loss(x, y, 16)
    torch.manual_seed(2)
    loss_g = vi_g.loss(x, y, 16)
    q = vi_t.distribution()
    m, v = q.mean.detach(), q.variance.detach()
    nodes, weights = (torch.as_tensor(a) for a in np.polynomial.hermite.hermgauss(80))
    theta = m.unsqueeze(-1) + (2 * v).sqrt().unsqueeze(-1) * nodes
    df = user["StudentTPrior"].df
    scale = ((df - 2) / (df * precision)).sqrt().reshape(2, 1, 1)
    log_t = dist.StudentT(df, 0.0, scale).log_prob(theta)
    log_g = dist.Normal(0.0, precision.rsqrt().reshape(2, 1, 1)).log_prob(theta)
    diff = ((log_t - log_g) * weights).sum(-1).sum(-1) / math.sqrt(math.pi)
    torch.testing.assert_close((loss_g - loss_t).detach(), diff, rtol=1e-9, atol=1e-9)
    losses = fit_batched(vi_t, x, y, steps=5, progress=False)
    assert losses.shape == (5, 2) and torch.isfinite(losses).all()


def test_user_prior_in_fit_many(user):
    pyro.clear_param_store()
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()
    x = torch.randn(20, 2, dtype=torch.float64)
    priors = [user["StudentTPrior"](s) for s in (0.3, 1.0)]
    bnns = BayesianNetwork.fit_many(net, priors, x, x.sum(-1), steps=3, rank=2, progress=False,
                                    generator=torch.Generator().manual_seed(0))
    assert [b.prior for b in bnns] == priors


# --------------------------------------------------------------- the registry's rules and refusals
def test_lookup_follows_the_mro_but_not_past_a_new_density():
    assert closed_form(dist.Normal(0.0, 1.0)) is closed_form(torch.distributions.Normal(0.0, 1.0)) is not None
    assert closed_form(dist.Laplace(0.0, 1.0)) is not None
    assert closed_form(dist.SoftLaplace(0.0, 1.0)) is None  # its own log_prob
    assert closed_form(dist.StudentT(3.0)) is None

    class Tilted(dist.Normal):
        def log_prob(self, value):
            return super().log_prob(value) + value

    assert closed_form(Tilted(0.0, 1.0)) is None


def test_expected_log_prob_without_a_closed_form_raises():
    with pytest.raises(NotImplementedError, match=r"no closed form registered for StudentT; register one with"):
        expected_log_prob(dist.StudentT(3.0), LOC, VAR)


def test_builtin_names_and_classes():
    assert PRIORS["gaussian"] is GaussianPrior and PRIORS["laplace"] is LaplacePrior
    assert GaussianPrior.name == "gaussian" and LaplacePrior.name == "laplace"
    assert LaplacePrior(0.5).precision == 1.0 / (2.0 * 0.5 ** 2)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: register_prior(""), ValueError, r"register_prior: name must be a non-empty str, got ''\."),
    (lambda: register_prior("x")(int), TypeError, r"register_prior: the decorated class must subclass "
                                                  r"FactorisedPrior, got <class 'int'>\."),
    (lambda: register_prior("gaussian")(type("Other", (FactorisedPrior,), {})), ValueError,
     r"register_prior: name must be new, got 'gaussian', which names GaussianPrior\."),
    (lambda: register_expected_log_prob(int), TypeError,
     r"register_expected_log_prob: type_ must be a torch Distribution subclass, got <class 'int'>\."),
    (lambda: get_prior("horseshoe"), ValueError, r"get_prior: prior must be one of \('gaussian', 'laplace'"),
    (lambda: FactorisedPrior().base_distribution(LOC), NotImplementedError,
     r"FactorisedPrior must implement base_distribution\(like\)\."),
])
def test_registry_refusals(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_batched_trainer_refuses_a_prior_without_a_batched_form():
    @register_prior("no_batched_form")
    class NoBatched(FactorisedPrior):
        def base_distribution(self, like):
            return dist.Normal(torch.zeros((), dtype=like.dtype), 1.0)

    try:
        with pytest.raises(ValueError, match=r"BatchedVI: prior must name a prior with a batched form, got "
                                             r"'no_batched_form': NoBatched has no batched form"):
            BatchedVI(BatchedMLP(2, (4,)), "fa", "no_batched_form", rank=2)
        pyro.clear_param_store()
        net = torch.nn.Sequential(torch.nn.Linear(2, 1)).double()
        bnn = BayesianNetwork(net, NoBatched(), noise_scale=1.0, rank=1, name="no_batched_bnn")  # any prior
        assert bnn.prior.name == "no_batched_form"
        with pytest.raises(ValueError, match=r"fit_many: priors must be of a class registered with register_prior "
                                             r"and with a precision, got NoBatched"):
            BayesianNetwork.fit_many(torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                                                         torch.nn.Linear(4, 1)).double(),
                                     [NoBatched()], torch.zeros(3, 2, dtype=torch.float64),
                                     torch.zeros(3, dtype=torch.float64), steps=1, progress=False)
    finally:
        _registry._PRIORS.pop("no_batched_form")


def test_unregistered_prior_in_bayesian_network_falls_back_to_monte_carlo():
    class Unregistered(FactorisedPrior):
        def base_distribution(self, like):
            return dist.SoftLaplace(torch.zeros((), dtype=like.dtype), 1.0)

    pyro.clear_param_store()
    bnn = BayesianNetwork(torch.nn.Sequential(torch.nn.Linear(2, 1)).double(), Unregistered(), noise_scale=1.0,
                          rank=1, guide_builder=lambda model, init: AutoNormal(model, init_loc_fn=init),
                          name="unregistered_bnn")
    x = torch.randn(4, 2, dtype=torch.float64)
    assert math.isfinite(FactorELBO().loss(bnn.model, bnn.guide, x, x.sum(-1)))
    with pytest.raises(NotImplementedError, match=r"no closed form registered for SoftLaplace"):
        Unregistered().expected_log_prob(LOC, VAR)
