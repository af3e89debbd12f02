"""Conformance of AutoLowRankFactorGuide and FactorELBO with Pyro's ELBOs, over model shapes.

In the style of Pyro's ``tests/infer/test_autoguide.py``: every behaviour parametrised over
ELBOs x model shapes {global, ``.to_event``, plated local latents, nested plates, subsampled plates,
constrained supports}. Each shape is conjugate in the guide's unconstrained coordinates, so the exact
posterior N(m, S) over the packed latent vector is known and lies in the guide's family (rank = D):

* ``test_loss_agrees_with_trace_elbo``: FactorELBO (default, vectorised, compiled) and Trace_ELBO have the
  same expected loss (large-sample means within 4 standard errors), at a perturbed q;
* ``test_gradient_vanishes_at_exact_posterior``: every ELBO's expected gradient is zero at q = N(m, S) (5 s.e.),
  the first-order condition that makes the exact posterior SVI's fixed point;
* ``test_svi_converges_to_exact_posterior`` (slow): SVI from the default initialisation reaches N(m, S).

The marks on RenyiELBO (plated, nested and subsampled shapes) are Pyro's RenyiELBO, not the guide: their causes
are asserted, for Pyro's own autoguides too, in ``test_renyi_plates.py``.
"""
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from torch.distributions import biject_to
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    RenyiELBO,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from pyro.contrib.autoname import scope
from pyro.optim import ClippedAdam

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, JitFactorELBO

N_DATA = 8


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N_DATA, 2, generator=g)
    y = X @ torch.tensor([1.0, -0.5]) + 0.5 * torch.randn(N_DATA, generator=g)
    return X, y


def _linreg_posterior(X, y, noise=0.5):
    S = torch.linalg.inv(torch.eye(2) + X.T @ X / noise**2)
    return S @ X.T @ y / noise**2, S


def shape_global():
    y = torch.tensor([0.3, 1.2, 0.8, -0.1, 1.5])

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        with pyro.plate("obs", 5):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    prec = 1 / 4 + 5
    return model, (y.sum() / prec).reshape(1), torch.eye(1) / prec


def shape_to_event():
    X, y = _data()

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", N_DATA):
            pyro.sample("y", dist.Normal((w * X).sum(-1), 0.5), obs=y)

    return (model,) + _linreg_posterior(X, y)


def shape_plated():
    y = torch.tensor([0.5, -1.0, 2.0])

    def model():
        with pyro.plate("groups", 3):
            z = pyro.sample("z", dist.Normal(0.0, 1.5))
            pyro.sample("y", dist.Normal(z, 0.7), obs=y)

    prec = 1 / 1.5**2 + 1 / 0.7**2
    return model, y / 0.7**2 / prec, torch.eye(3) / prec


def shape_nested():
    y = torch.tensor([[0.5, -1.0, 2.0], [0.1, 0.9, -0.4]])

    def model():
        with pyro.plate("a", 2, dim=-2), pyro.plate("b", 3, dim=-1):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(z, 0.8), obs=y)

    prec = 1 + 1 / 0.8**2
    return model, y.reshape(-1) / 0.8**2 / prec, torch.eye(6) / prec


def shape_subsampled():
    X, y = _data()

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", N_DATA, subsample_size=4) as idx:
            pyro.sample("y", dist.Normal((w * X[idx]).sum(-1), 0.5), obs=y[idx])

    return (model,) + _linreg_posterior(X, y)  # the subsampled ELBO is unbiased for the full-data one


def shape_constrained():
    y = torch.tensor([0.8, 1.7, 1.1, 2.5])  # log y | s ~ N(log s, 0.5): Gaussian in u = log s
    v = torch.tensor(0.4)

    def model():
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 4):
            pyro.sample("y", dist.LogNormal(s.log(), 0.5), obs=y)
        pyro.sample("v", dist.Normal(w, 1.0), obs=v)

    prec_u = 1 + 4 / 0.25
    m = torch.stack([y.log().sum() / 0.25 / prec_u, v / 2])
    return model, m, torch.diag(torch.stack([1 / torch.tensor(prec_u), torch.tensor(0.5)]))


def shape_subsampled_local():
    """Loss checks only: a local latent with a closed-form prior inside a subsampled plate (scale N / M)."""
    X, y = _data()

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", N_DATA, subsample_size=3) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 0.5))
            pyro.sample("y", dist.Normal((w * X[idx]).sum(-1) + z, 0.5), obs=y[idx])

    return model, None, None


def shape_constrained_mixed():
    """Loss checks only: Beta, HalfCauchy and a plated LogNormal (Monte Carlo + log-Jacobian) beside closed forms."""
    y = torch.tensor([0.3, 1.2, 0.8])

    def model():
        p = pyro.sample("p", dist.Beta(2.0, 3.0))
        sc = pyro.sample("sc", dist.HalfCauchy(1.0))
        w = pyro.sample("w", dist.Laplace(0.0, 1.0))
        with pyro.plate("g", 3):
            t = pyro.sample("t", dist.LogNormal(0.0, 0.5))
            pyro.sample("y", dist.Normal(w + p * t, sc), obs=y)

    return model, None, None


SHAPES = {
    "global": shape_global,
    "to_event": shape_to_event,
    "plated": shape_plated,
    "nested": shape_nested,
    "subsampled": shape_subsampled,
    "constrained": shape_constrained,
}
LOSS_SHAPES = dict(SHAPES, subsampled_local=shape_subsampled_local, constrained_mixed=shape_constrained_mixed)

# name -> (constructor given a particle count, vectorised?)
ELBOS = {
    "Trace_ELBO": lambda n: Trace_ELBO(num_particles=n, vectorize_particles=True),
    "JitTrace_ELBO": lambda n: JitTrace_ELBO(num_particles=n, vectorize_particles=True, ignore_jit_warnings=True),
    "TraceMeanField_ELBO": lambda n: TraceMeanField_ELBO(num_particles=n, vectorize_particles=True),
    "TraceGraph_ELBO": lambda n: TraceGraph_ELBO(num_particles=n, vectorize_particles=True),
    "TraceEnum_ELBO": lambda n: TraceEnum_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=2),
    "RenyiELBO": lambda n: RenyiELBO(alpha=0.5, num_particles=n, vectorize_particles=True),
    "FactorELBO": lambda n: FactorELBO(num_particles=n),  # the default, sequential particles
    "FactorELBO-vectorized": lambda n: FactorELBO(num_particles=n, vectorize_particles=True, sampling="iid"),
    "JitFactorELBO": lambda n: JitFactorELBO(num_particles=n, vectorize_particles=True, ignore_jit_warnings=True),
}
SEQUENTIAL = {"FactorELBO"}  # few particles: each is a Python-level trace


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*max_plate_nesting.*")
        # scope() renames the model's plate subsample sites ("shape_plated/groups"), not the guide's: harmless
        warnings.filterwarnings("ignore", message="Found plate statements in guide but not model")
        yield


def _set_posterior(guide, m, S):
    """Set the guide's q to N(m, S) exactly (rank = D): F F^T + s^2 I = S with s^2 half S's smallest eigenvalue."""
    s2 = 0.5 * torch.linalg.eigvalsh(S).min()
    F = torch.linalg.cholesky(S - s2 * torch.eye(len(m)))
    with torch.no_grad():
        guide.loc.copy_(m)
        guide.factor.copy_(F / s2.sqrt())
        guide.scale_unconstrained.copy_(biject_to(constraints.positive).inv(s2.sqrt().expand(len(m))))
    q = guide.get_posterior()
    assert torch.allclose(q.loc, m) and torch.allclose(q.covariance_matrix, S, atol=1e-10)


def _batches(fn, batches):
    vals = torch.stack([fn() for _ in range(batches)])
    return vals.mean(0), vals.std(0) / math.sqrt(batches)


# ------------------------------------------------------------------ loss in expectation
@pytest.mark.parametrize("shape", list(LOSS_SHAPES))
@pytest.mark.parametrize("elbo_name", ["FactorELBO", "FactorELBO-vectorized", "JitFactorELBO"])
def test_loss_agrees_with_trace_elbo(elbo_name, shape):
    """E[FactorELBO loss] = E[Trace_ELBO loss] at a perturbed q (means of many draws within 4 s.e.)."""
    model = LOSS_SHAPES[shape]()[0]
    guide = AutoLowRankFactorGuide(model, rank=1)
    guide()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    trace = ELBOS["Trace_ELBO"](500)
    m_tr, se_tr = _batches(lambda: torch.tensor(trace.loss(model, guide)), 20)
    n, batches = (8, 10) if elbo_name in SEQUENTIAL else (500, 20)
    elbo = ELBOS[elbo_name](n)
    m_fa, se_fa = _batches(lambda: torch.tensor(elbo.loss(model, guide)), batches)
    assert abs(m_fa - m_tr) < 4 * math.sqrt(se_fa**2 + se_tr**2), (m_fa, m_tr, se_fa, se_tr)


# ------------------------------------------------------------------ the exact posterior is SVI's fixed point
_XFAIL_MEAN_FIELD = pytest.mark.xfail(
    strict=True,
    reason="Pyro 1.9's TraceMeanField_ELBO drops the guide's Delta log-density (the log-Jacobian of "
    "constrained sites), so its optimum is not the posterior",
)


# Pyro's RenyiELBO (pyro 1.9), not the guide: Pyro's AutoLowRankMultivariateNormal and AutoMultivariateNormal do
# the same, asserted in test_renyi_plates.py
_RENYI_PLATES = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="Pyro's RenyiELBO keeps a plate that holds every model site as a batch dimension of the log weights "
    "(renyi_elbo.py sums log_prob only over get_dependent_plate_dims(model_trace), the plates not common to all "
    "model sites): one Renyi bound per plate element, each weighted by the joint guide density q(z) of an "
    "AutoContinuous guide, so the weights are not constant at the exact posterior; same for Pyro's own low-rank and "
    "full-rank guides (test_renyi_plates.py)",
)
_XFAIL_RENYI = {
    "plated": _RENYI_PLATES,
    "nested": _RENYI_PLATES,
    "subsampled": pytest.mark.xfail(
        strict=False, raises=AssertionError,
        reason="the Renyi bound is nonlinear in the log-likelihood, so an N/M-scaled mini-batch biases it: the mean "
        "gradient at the exact posterior is not zero but the closed form's, which RenyiELBO matches over all 70 "
        "mini-batches (test_renyi_plates.py); here it is about 5 s.e., so this test sees it on some seeds only",
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("elbo_name", list(ELBOS))
def test_gradient_vanishes_at_exact_posterior(request, elbo_name, shape):
    """At q = N(m, S), the exact posterior, every ELBO's mean gradient is zero (4 s.e.) in every parameter."""
    if elbo_name == "TraceMeanField_ELBO" and shape == "constrained":
        request.applymarker(_XFAIL_MEAN_FIELD)
    if elbo_name == "RenyiELBO" and shape in _XFAIL_RENYI:
        request.applymarker(_XFAIL_RENYI[shape])
    model, m, S = SHAPES[shape]()
    guide = AutoLowRankFactorGuide(model, rank=len(m))
    guide()
    _set_posterior(guide, m, S)
    n, batches = (4, 20) if elbo_name in SEQUENTIAL else (100, 20)
    elbo = ELBOS[elbo_name](n)

    def grad():
        guide.zero_grad()
        elbo.loss_and_grads(model, guide)  # every Pyro ELBO has it (TraceGraph and Renyi lack differentiable_loss)
        return torch.cat([p.grad.reshape(-1) for p in guide.parameters()])

    mean, se = _batches(grad, batches)
    # 5 s.e. (20 batches): a few hundred coordinates over the suite, each a t-test with 19 d.o.f.
    assert ((mean.abs() < 5 * se + 1e-9) | (se == 0) & (mean.abs() < 1e-9)).all(), (mean, se)


# ------------------------------------------------------------------ SVI reaches the exact posterior
def _all_shapes_model(subsample=True):
    """One model with a global, a .to_event, a plated, a nested-plate and a constrained site, subsampled data.

    With ``subsample=False`` the subsampled regression is the same regression on all its data (same posterior).
    """
    parts = [shape_global(), shape_subsampled() if subsample else shape_to_event(), shape_plated(), shape_nested(),
             shape_constrained()]
    models = [p[0] for p in parts]

    def model():
        for sub in models:  # distinct site and plate names; "data" plates of the same sizes are not shared
            with scope(prefix=sub.__qualname__.split(".")[0]):
                sub()

    return model, torch.cat([p[1] for p in parts]), torch.block_diag(*[p[2] for p in parts])


@pytest.mark.slow
@pytest.mark.parametrize("elbo_name", list(ELBOS))
def test_svi_converges_to_exact_posterior(request, elbo_name):
    """SVI from the default initialisation reaches N(m, S) (means within 0.25 s.d., variances within 30%).

    RenyiELBO (alpha = 0.5) runs on the model without the subsampled plate, for 600 steps, for two verified reasons:
    its optimum under the subsampled plate is not N(m, S) (variances 1.50x and 1.33x the posterior's, in closed
    form: test_renyi_subsampled_objective_is_maximised_by_a_wider_q; SVI for 1500 steps ends at 1.4-1.6x there and
    within 10% elsewhere, 2 seeds); and its objective is flat where q is too wide (one coordinate at twice the
    posterior's s.d.: its gradient in log s.d. is 0.6 against the KL's 3), so 250 steps leave the tightest
    coordinates 1.7-4x too wide even on all data, where 600 steps reach N(m, S) (3 seeds, within 12%).
    """
    if elbo_name == "TraceMeanField_ELBO":
        request.applymarker(_XFAIL_MEAN_FIELD)
    renyi = elbo_name == "RenyiELBO"
    model, m, S = _all_shapes_model(subsample=not renyi)
    pyro.set_rng_seed(0)
    guide = AutoLowRankFactorGuide(model, rank=len(m))
    n = 1 if elbo_name in SEQUENTIAL else 16 if renyi else 4  # Renyi's K-sample bound is noisier
    steps = 600 if renyi else 250
    svi = SVI(model, guide, ClippedAdam({"lr": 0.1, "lrd": 0.985 ** (250 / steps)}), ELBOS[elbo_name](n))
    for _ in range(steps):  # the same learning rate at the end, whatever the number of steps
        svi.step()
    q = guide.get_posterior()
    sd = S.diagonal().sqrt()
    assert ((q.loc - m).abs() < 0.25 * sd).all(), ((q.loc - m) / sd)
    assert torch.allclose(q.covariance_matrix.diagonal(), S.diagonal(), rtol=0.3)
