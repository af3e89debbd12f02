"""AutoLowRankFactorGuide as a drop-in for Pyro's AutoLowRankMultivariateNormal: signature, defaults, checkpoints."""
import inspect
import io
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, init_to_median, init_to_sample
from pyro.optim import Adam

from pyro_fa import AutoLowRankFactorGuide


def _model(X, y=None):
    """Global, plated and constrained latents (D = 3 + 2 + 1 = 6)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("groups", 2, dim=-2):
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
    s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", X.shape[0], dim=-1):
        return pyro.sample("y", dist.Normal((w * X).sum(-1) + b.sum(-2, keepdim=True), s), obs=y)


def _data():
    X = torch.randn(20, 3)
    return X, X @ torch.tensor([1.0, -0.5, 2.0]) + 0.3 * torch.randn(20)


def _fit(guide, steps=20):
    X, y = _data()
    svi = SVI(_model, guide, Adam({"lr": 0.05}), Trace_ELBO(max_plate_nesting=2))
    for _ in range(steps):
        svi.step(X, y)
    return X, y


def _assert_same_q(a, b, tol=1e-6):
    qa, qb = a.get_posterior(), b.get_posterior()
    assert torch.allclose(qa.loc, qb.loc, atol=tol, rtol=0)
    assert torch.allclose(qa.covariance_matrix, qb.covariance_matrix, atol=tol, rtol=0)
    assert torch.allclose(qa.cov_factor, qb.cov_factor, atol=tol, rtol=0)
    assert torch.allclose(qa.cov_diag, qb.cov_diag, atol=tol, rtol=0)


def test_signature_and_defaults_are_pyros():
    ours = list(inspect.signature(AutoLowRankFactorGuide).parameters.values())[:4]
    theirs = list(inspect.signature(AutoLowRankMultivariateNormal).parameters.values())
    assert [p.name for p in ours] == [p.name for p in theirs] == ["model", "init_loc_fn", "init_scale", "rank"]
    assert ours[2].default == theirs[2].default == 0.1 and ours[3].default is theirs[3].default is None
    X, y = _data()
    guide = AutoLowRankFactorGuide(_model, init_to_sample)  # TypeError before: rank was second
    guide(X, y)
    assert guide.rank == round(math.sqrt(6))
    # default init_scale 0.1: each unconstrained coordinate starts with variance 0.1^2 on average
    assert math.isclose(float(guide.get_posterior().variance.mean().detach()), 0.1 ** 2, rel_tol=1e-10)
    pyro.clear_param_store()  # guides of one class share the store's names
    positional = AutoLowRankFactorGuide(_model, init_to_median, 0.02, 3)
    positional(X, y)
    assert positional.rank == 3
    assert math.isclose(float(positional.get_posterior().variance.mean().detach()), 0.02 ** 2, rel_tol=1e-10)


def test_from_pyro_gives_the_same_q():
    pyro_guide = AutoLowRankMultivariateNormal(_model, rank=2)
    X, y = _fit(pyro_guide)
    ours = AutoLowRankFactorGuide.from_pyro(pyro_guide)
    assert ours.rank == 2 and ours.noise == "diagonal" and ours.latent_dim == 6
    _assert_same_q(ours, pyro_guide)
    # usable at once (it shares the model trace) and trainable
    assert set(ours(X, y)) == {"w", "b", "s"}
    assert torch.allclose(ours.median()["s"], pyro_guide.median()["s"], atol=1e-6)
    pyro.clear_param_store()
    _fit(ours, steps=2)
    assert not torch.allclose(ours.get_posterior().loc, pyro_guide.get_posterior().loc)


@pytest.mark.parametrize("noise", ["diagonal", "isotropic"])
def test_to_pyro_gives_the_same_q_and_a_native_state(noise):
    ours = AutoLowRankFactorGuide(_model, rank=2, noise=noise)
    X, y = _fit(ours)
    pyro_guide = ours.to_pyro()
    assert isinstance(pyro_guide, AutoLowRankMultivariateNormal)
    _assert_same_q(ours, pyro_guide)
    back = AutoLowRankFactorGuide.from_pyro(pyro_guide)
    _assert_same_q(back, ours)
    _fit(pyro_guide, steps=2)  # Pyro's own SVI trains the converted guide
    assert not torch.allclose(pyro_guide.get_posterior().loc, ours.get_posterior().loc)
    pyro.clear_param_store()
    native = AutoLowRankMultivariateNormal(_model, rank=2)
    native(X, y)
    assert {k: v.shape for k, v in pyro_guide.state_dict().items()} == {k: v.shape for k, v in native.state_dict().items()}


def test_to_pyro_values_win_over_a_same_named_guide_in_the_store():
    X, y = _data()
    other = AutoLowRankMultivariateNormal(_model, rank=2)
    other(X, y)  # its parameters are in the store under "AutoLowRankMultivariateNormal.*"
    ours = AutoLowRankFactorGuide(_model, rank=2)
    _fit(ours)
    pyro_guide = ours.to_pyro()
    pyro_guide(X, y)  # inside its context: reads the store
    _assert_same_q(ours, pyro_guide)


def test_load_a_pyro_state_dict_checkpoint():
    """A Pyro user's ``torch.save(guide.state_dict())`` loads into our guide and gives the same q."""
    pyro_guide = AutoLowRankMultivariateNormal(_model, rank=2)
    X, y = _fit(pyro_guide)
    buf = io.BytesIO()
    torch.save(pyro_guide.state_dict(), buf)
    buf.seek(0)
    for kwargs in ({}, {"loc_scale": 2.0}):
        pyro.clear_param_store()
        ours = AutoLowRankFactorGuide(_model, rank=2, **kwargs)
        ours(X, y)
        buf.seek(0)
        ours.load_state_dict(torch.load(buf))
        _assert_same_q(ours, pyro_guide)


def test_pyro_param_store_checkpoint_through_from_pyro(tmp_path):
    """The other kind of Pyro checkpoint: the param store saved to a file, restored into Pyro's guide, converted."""
    pyro_guide = AutoLowRankMultivariateNormal(_model, rank=2)
    X, y = _fit(pyro_guide)
    expected = pyro_guide.get_posterior()
    path = tmp_path / "params.pt"
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    pyro.get_param_store().load(path)
    restored = AutoLowRankMultivariateNormal(_model, rank=2)
    restored(X, y)  # Pyro's guide takes the stored values at its first call
    ours = AutoLowRankFactorGuide.from_pyro(restored)
    q = ours.get_posterior()
    assert torch.allclose(q.loc, expected.loc, atol=1e-6) and torch.allclose(q.covariance_matrix, expected.covariance_matrix, atol=1e-6)


def test_pyro_state_refused_by_an_isotropic_guide_and_when_non_finite():
    pyro_guide = AutoLowRankMultivariateNormal(_model, rank=2)
    X, y = _fit(pyro_guide)
    state = {k: v.detach().clone() for k, v in pyro_guide.state_dict().items()}
    pyro.clear_param_store()
    iso = AutoLowRankFactorGuide(_model, rank=2, noise="isotropic")
    iso(X, y)
    before = {k: v.clone() for k, v in iso.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"AutoLowRankFactorGuide: load_state_dict got an AutoLowRankMultivariateNormal "
                                           r"state, whose noise is per coordinate, but this guide has noise='isotropic'"):
        iso.load_state_dict(state)
    pyro.clear_param_store()
    ours = AutoLowRankFactorGuide(_model, rank=2)
    ours(X, y)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    state["scale_unconstrained"][0] = float("nan")
    with pytest.raises(ValueError, match=r"AutoLowRankFactorGuide: load_state_dict: 'scale_unconstrained' must be finite"):
        ours.load_state_dict(state)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())


def test_from_pyro_bad_input():
    with pytest.raises(TypeError, match=r"AutoLowRankFactorGuide.from_pyro: guide must be an AutoLowRankMultivariateNormal, got AutoNormal\."):
        AutoLowRankFactorGuide.from_pyro(pyro.infer.autoguide.AutoNormal(_model))
    with pytest.raises(RuntimeError, match=r"AutoLowRankFactorGuide.from_pyro: guide has not run yet"):
        AutoLowRankFactorGuide.from_pyro(AutoLowRankMultivariateNormal(_model))
    with pytest.raises(RuntimeError, match=r"to_pyro\(\) needs the guide's parameters"):
        AutoLowRankFactorGuide(_model).to_pyro()
