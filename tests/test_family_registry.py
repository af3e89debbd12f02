"""Guide families plug in by registration: the registry's contract, one conformance suite over every
registered family, and a family defined outside the library (docs/architecture.md, "Add a guide family")
trained by BatchedVI and checked against a hand-written ELBO."""
import math
import re
from pathlib import Path

import pytest
import torch
from torch.distributions import Normal

from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched
from pyro_fa.nn.batched import vi as vi_module
from pyro_fa.nn.batched.families import (
    FAMILIES,
    GuideFamily,
    WhitenedLowRankFamily,
    get_family,
    register_family,
)
from pyro_fa.nn.batched.families import registry as _registry

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BUILT_IN = ["fa", "ppca", "lowrank", "normal", "delta"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def user():
    """Run the docs' "Add a guide family" block; unregister what it added afterwards (the registry is global)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Add a guide family"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace = {"__name__": "user_family"}
    exec(compile(block, "docs/architecture.md[Add a guide family]", "exec"), namespace)
    yield namespace
    _registry._FAMILIES.pop("isotropic", None)


def _toy(N=24, p=3, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, p, generator=g, dtype=dtype)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(N, generator=g, dtype=dtype)
    return x.to(device), y.to(device)


def _vi(family, dtype=torch.float64, device="cpu", estimator=None, R=3):
    sigma = torch.tensor([math.nan, 0.05, math.nan][:R]) if family == "ppca" else None
    return BatchedVI(BatchedMLP(3, (5,)), family, "laplace", torch.tensor([0.5, 1.0, 2.0][:R]), 1e-2, rank=2,
                     estimator=estimator, guide_noise_scale=sigma, generator=torch.Generator().manual_seed(1),
                     dtype=dtype, device=device)


def _perturb(vi):
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for v in vi.params().values():
            v.add_(0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype).to(v.device))


# --------------------------------------------------------------------------- the registry
def test_builtin_families_in_order_and_read_only():
    assert list(FAMILIES)[:5] == BUILT_IN and vi_module.FAMILIES is FAMILIES
    assert [get_family(n).name for n in BUILT_IN] == BUILT_IN
    assert issubclass(get_family("fa"), WhitenedLowRankFamily) and issubclass(get_family("ppca"), get_family("fa"))
    with pytest.raises(TypeError):
        FAMILIES["flow"] = GuideFamily  # a view: register_family is the only way in
    assert "flow" not in FAMILIES and "fa" in FAMILIES


@pytest.mark.parametrize("call,exc,match", [
    (lambda: register_family(""), ValueError, r"register_family: name must be a non-empty str, got ''\."),
    (lambda: register_family("x")(int), TypeError, r"register_family: the decorated class must subclass GuideFamily"),
    (lambda: register_family("fa")(type("Other", (GuideFamily,), {})), ValueError,
     r"register_family: name must be new, got 'fa', which names FactorFamily\."),
    (lambda: get_family("flow", "Who"), ValueError, r"Who: family must be one of \('fa', .*\), got 'flow'\."),
    (lambda: get_family(["fa"]), ValueError, r"get_family: family must be one of .*, got \['fa'\]\."),
])
def test_registry_refusals(call, exc, match):
    before = dict(FAMILIES)
    with pytest.raises(exc, match=match):
        call()
    assert dict(FAMILIES) == before


def test_a_family_must_implement_init_and_distribution():
    class Bare(GuideFamily):
        pass

    class BareLowRank(WhitenedLowRankFamily):
        pass

    loc = torch.zeros(2, 3)
    with pytest.raises(NotImplementedError, match=r"Bare must implement init\(vi, loc, init_scale, generator\)\."):
        Bare().init(None, loc, 0.1, None)
    with pytest.raises(NotImplementedError, match=r"Bare must implement distribution\(vi, p\)\."):
        Bare().distribution(None, {"loc": loc})
    with pytest.raises(NotImplementedError, match=r"BareLowRank must implement whitened\(vi, p\)\."):
        BareLowRank().distribution(None, {"loc": loc})


def test_batched_vi_refuses_what_the_family_does_not_accept():
    with pytest.raises(ValueError, match=r"BatchedVI: family must be one of \('fa', .*\), got 'flow'\."):
        _vi("flow")
    with pytest.raises(ValueError, match=r"BatchedVI: estimator must be one of \('factor', 'trace'\), got 'map'\."):
        _vi("normal", estimator="map")
    with pytest.raises(ValueError, match=r"BatchedVI: guide_noise_scale must be None for family='lowrank', got "
                                         r"0\.1; it fixes the isotropic noise of family='ppca'\."):
        BatchedVI(BatchedMLP(3, (5,)), "lowrank", guide_noise_scale=0.1)
    assert _vi("delta", estimator="trace").estimator == "map"  # one estimator: always that one
    assert _vi("normal").rank == 2 and BatchedVI(BatchedMLP(3, (5,)), "normal", rank=10 ** 6).rank == 10 ** 6


# --------------------------------------------------------- conformance over every family
def _families():
    return BUILT_IN + ["isotropic"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", _families())
def test_family_contract(family, dtype, device, user):
    """Shapes, dtype and device of parameters, q, draws; finite loss and gradients per estimator."""
    fam_cls = get_family(family)
    R, D = 3, BatchedMLP(3, (5,)).dim
    x, y = _toy(dtype=dtype, device=device)
    for estimator in fam_cls.estimators:
        vi = _vi(family, dtype, device, estimator)
        assert vi.estimator == estimator and isinstance(vi._family, fam_cls)
        p = vi.params()
        assert p["loc"].shape == (R, D) and all(v.shape[0] == R for v in p.values())
        assert all(v.dtype == dtype and v.device.type == device for v in p.values())
        q = vi.distribution()
        if q is not None:
            assert q.batch_shape == (R,) and q.event_shape == (D,) and q.mean.dtype == dtype
            assert q.variance.shape == (R, D) and bool((q.variance > 0).all())
        S = 1 if q is None else 4
        a = vi.predict(x, 4, generator=torch.Generator().manual_seed(3))[0]
        b = vi.predict(x, 4, generator=torch.Generator().manual_seed(3))[0]
        assert a.shape == (S, R, x.shape[0]) and a.dtype == dtype and torch.equal(a, b)
        loss = vi.loss(x, y, 100, particles=2)
        assert loss.shape == (R,) and loss.dtype == dtype and bool(torch.isfinite(loss).all())
        loss.sum().backward()
        assert all(v.grad is None or bool(torch.isfinite(v.grad).all()) for v in vi.params().values())


@pytest.mark.parametrize("family", _families())
def test_replicas_are_independent(family, user):
    """The loss of replica r has no gradient in the other replicas' parameters."""
    vi = _vi(family)
    x, y = _toy()
    vi.loss(x, y, 50)[1].backward()
    for name, leaf in vi.params().items():  # one learning rate: the leaves themselves
        if leaf.grad is not None:
            assert leaf.grad[[0, 2]].abs().sum() == 0, name


@pytest.mark.parametrize("estimator", ["factor", "trace"])
@pytest.mark.parametrize("family", ["fa", "ppca", "lowrank", "normal", "isotropic"])
def test_loss_equals_the_default_loss_built_from_the_distribution(family, estimator, user):
    """A family's own loss (the O(DK²) whitened one for the low-rank families) equals GuideFamily.loss, which
    takes everything from ``distribution``, at the same draws: loss and gradients."""
    vi = _vi(family, estimator=estimator)
    _perturb(vi)
    x, y = _toy()
    p = vi.params()
    torch.manual_seed(4)
    ours = vi.loss(x, y, 60, particles=2)
    torch.manual_seed(4)
    ref = GuideFamily.loss(vi._family, vi, p, x, y, 60, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-9)
    leaves = list(p.values())
    for a, b in zip(torch.autograd.grad(ours.sum(), leaves, retain_graph=True, allow_unused=True),
                    torch.autograd.grad(ref.sum(), leaves, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the user's family
def test_user_family_trains_without_a_library_edit(user):
    assert FAMILIES["isotropic"] is user["IsotropicFamily"] and user["vi"].family == "isotropic"
    assert set(user["vi"].params()) == {"loc", "log_scale", "log_noise"}
    assert user["vi"].estimator == "factor"


def test_user_family_loss_equals_a_hand_written_elbo(user):
    """-ELBO = -(N/B) E log N(y; f_θ(x), σ²) - E log p(θ) - H[q], written out with torch.nn modules,
    the Laplace prior's E|θ| of a Gaussian, and the entropy of N(c, s² I)."""
    vi = user["vi"]
    x, y = _toy(p=2, N=20)
    vi = BatchedVI(vi.mlp, "isotropic", "laplace", torch.tensor([0.5, 2.0]), 1e-2,
                   generator=torch.Generator().manual_seed(0))
    _perturb(vi)
    torch.manual_seed(5)
    ours = vi.loss(x, y, 50, particles=3)
    p = {k: v.detach() for k, v in vi.params().items()}
    torch.manual_seed(5)
    R, D = p["loc"].shape
    s = p["log_scale"].exp()  # (R, 1)
    theta = p["loc"] + s * torch.randn(3, R, D, dtype=x.dtype)  # the draws Normal.rsample makes
    for r in range(R):
        loglik = torch.stack([
            Normal(vi.mlp.to_module(theta[k, r])(x).squeeze(-1), p["log_noise"][r].exp()).log_prob(y).sum() * 50 / 20
            for k in range(3)]).mean()
        b = 1 / math.sqrt(2 * vi.precision[r].item())  # the Laplace prior of variance 1 / precision
        m, v = p["loc"][r], s[r].pow(2)
        sd = v.sqrt()
        e_abs = sd * math.sqrt(2 / math.pi) * torch.exp(-m ** 2 / (2 * v)) + m * torch.erf(m / (sd * math.sqrt(2)))
        e_prior = (-math.log(2 * b) - e_abs / b).sum()
        entropy = D * (0.5 * (1 + math.log(2 * math.pi)) + s[r].log().squeeze())
        torch.testing.assert_close(ours[r].detach(), -(loglik + e_prior + entropy), rtol=1e-10, atol=1e-9)


def test_user_family_equals_normal_with_the_same_scales(user):
    """The isotropic family is AutoNormal with every scale equal: the same trace loss at the same draws."""
    x, y = _toy()
    iso = _vi("isotropic", estimator="trace")
    normal = _vi("normal", estimator="trace")
    _perturb(iso)
    with torch.no_grad():
        for k in ("loc", "log_noise"):
            normal.params()[k].copy_(iso.params()[k])
        s = iso.params()["log_scale"].exp().expand_as(iso.params()["loc"])
        normal.params()["scale_u"].copy_(s + torch.log(-torch.expm1(-s)))  # inverse softplus
    torch.manual_seed(6)
    a = iso.loss(x, y, 40, particles=2)
    torch.manual_seed(6)
    b = normal.loss(x, y, 40, particles=2)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
