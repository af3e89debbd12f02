"""Loading saved posteriors: one transaction, checked whole, also when nested in a parent module.

A refused state raises a clear error and leaves every tensor (of every member) bit-identical.
"""
import math
import warnings

import pytest
import torch
from torch import nn

from pyro_fa import MultiSWAG, OnlineFactorAnalysis, SWAG

pytestmark = pytest.mark.filterwarnings("ignore:SWAG. method 'sga'")


def _trained_swag(method="em", seed=0, n=12, rank=2):
    torch.manual_seed(seed)
    net = nn.Linear(3, 2).double()
    swag = SWAG(net, rank=rank, method=method, warmup=rank + 1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(n):
            for p in net.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            swag.collect()
    return swag


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}


def _assert_unchanged(module, before):
    now = {k: v for k, v in module.state_dict().items() if torch.is_tensor(v)}
    assert now.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(now[k], v), k


class Holder(nn.Module):
    """A user's model holding a SWAG posterior beside its own layers."""

    def __init__(self, swag):
        super().__init__()
        self.head = nn.Linear(2, 2).double()
        self.swag = swag


# ---------------------------------------------------------------- nested loads (item 2)
@pytest.mark.parametrize("method", ["em", "sga", "swag"])
def test_parent_module_load_refuses_nan_and_leaves_swag_unchanged(method):
    src, dst = Holder(_trained_swag(method, seed=1)), Holder(_trained_swag(method, seed=2))
    sd = src.state_dict()
    key = "swag.fa.loc" if method != "swag" else "swag._mean"
    sd[key] = sd[key].clone()
    sd[key][3] = float("nan")
    before = _snapshot(dst.swag)
    with pytest.raises(ValueError, match=r"must be finite.*swag\."):
        dst.load_state_dict(sd)
    _assert_unchanged(dst.swag, before)
    # a good state loads through the parent and reproduces the source's posterior
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.swag.cov_diag, src.swag.cov_diag)
    assert torch.equal(dst.swag.loc, src.swag.loc)


def test_parent_module_load_refuses_nonpositive_psi():
    src, dst = Holder(_trained_swag(seed=1)), Holder(_trained_swag(seed=2))
    sd = src.state_dict()
    sd["swag.fa._psi"] = sd["swag.fa._psi"].clone()
    sd["swag.fa._psi"][0] = -1e-3
    before = _snapshot(dst.swag)
    with pytest.raises(ValueError, match=r"_psi'\] must be positive .*got 1 entries <= 0"):
        dst.load_state_dict(sd)
    _assert_unchanged(dst.swag, before)


def test_multiswag_nan_in_second_member_leaves_every_member_unchanged():
    src = MultiSWAG([_trained_swag(seed=s) for s in (1, 2)])
    dst = MultiSWAG([_trained_swag(seed=s) for s in (3, 4)])
    sd = src.state_dict()
    sd["members.1.fa.loc"] = sd["members.1.fa.loc"].clone()
    sd["members.1.fa.loc"][0] = float("nan")
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=r"member 1 .*must be finite"):
        dst.load_state_dict(sd)
    _assert_unchanged(dst, before)
    # the same through a parent module holding the mixture
    parent = nn.ModuleDict({"ms": dst})
    with pytest.raises(ValueError, match=r"member 1 .*must be finite"):
        parent.load_state_dict({"ms." + k: v for k, v in sd.items()})
    _assert_unchanged(dst, before)
    dst.load_state_dict(src.state_dict())
    draws = dst.sample(5, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(draws).all()
    assert torch.equal(dst.members[1].cov_factor, src.members[1].cov_factor)


@pytest.mark.parametrize("saved, target", [(2, 3), (3, 2)])
def test_multiswag_member_count_mismatch_refused_before_any_write(saved, target):
    src = MultiSWAG([_trained_swag(seed=s) for s in range(saved)])
    dst = MultiSWAG([_trained_swag(seed=10 + s) for s in range(target)])
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=rf"this mixture's {target} members, got entries for members"):
        dst.load_state_dict(src.state_dict())
    _assert_unchanged(dst, before)


def test_multiswag_sga_round_trip_through_parent():
    # SGA's optimizer state is saved under the fit; a parent's load must not call it unexpected
    src = MultiSWAG([_trained_swag("sga", seed=s, n=15) for s in (1, 2)])
    dst = MultiSWAG([_trained_swag("sga", seed=s, n=15) for s in (3, 4)])
    nn.ModuleList([dst]).load_state_dict({"0." + k: v for k, v in src.state_dict().items()})
    for a, b in zip(src.members, dst.members):
        assert torch.equal(a.cov_factor, b.cov_factor) and torch.equal(a.cov_diag, b.cov_diag)
        sa, sb = a.fa.fit_state.optimizer.state_dict()["state"], b.fa.fit_state.optimizer.state_dict()["state"]
        assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def test_nested_load_checks_counts_agree():
    src, dst = Holder(_trained_swag(seed=1)), Holder(_trained_swag(seed=2))
    sd = src.state_dict()
    sd["swag._extra_state"] = dict(sd["swag._extra_state"], n=3)
    before = _snapshot(dst.swag)
    with pytest.raises(ValueError, match=r"n=3 against the fit's n_updates=12"):
        dst.load_state_dict(sd)
    _assert_unchanged(dst.swag, before)


# ---------------------------------------------------------------- states that must be refused (item 5)
@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_swag_direct_load_refuses_nonpositive_psi(bad):
    src, dst = _trained_swag(seed=1), _trained_swag(seed=2)
    sd = src.state_dict()
    sd["fa._psi"] = sd["fa._psi"].clone()
    sd["fa._psi"][2] = bad
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=r"SWAG: state_dict\['fa._psi'\] must be positive"):
        dst.load_state_dict(sd)
    _assert_unchanged(dst, before)
    dst.get_posterior()  # still usable


@pytest.mark.parametrize("key, value, match", [
    ("_psi", -1.0, r"_psi'\] must be positive"),
    ("_psi", 0.0, r"_psi'\] must be positive"),
    ("loc", float("nan"), r"loc'\] must be finite"),
    ("_F", float("inf"), r"_F'\] must be finite"),
    ("_moments.sq_dev", -1.0, r"_moments.sq_dev'\] must be >= 0"),
])
def test_online_fa_load_refuses_bad_values(key, value, match):
    g = torch.Generator().manual_seed(0)
    src = OnlineFactorAnalysis(6, 2, warmup=3, seed=0, dtype=torch.float64)
    dst = OnlineFactorAnalysis(6, 2, warmup=3, seed=1, dtype=torch.float64)
    src.update(torch.randn(20, 6, generator=g, dtype=torch.float64))
    dst.update(torch.randn(20, 6, generator=g, dtype=torch.float64))
    sd = src.state_dict()
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = value
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=match):
        dst.load_state_dict(sd)
    _assert_unchanged(dst, before)
    # nested in a parent module: the same refusal
    parent = nn.ModuleDict({"fa": dst})
    with pytest.raises(ValueError, match=match):
        parent.load_state_dict({"fa." + k: v for k, v in sd.items()})
    _assert_unchanged(dst, before)


def test_online_fa_load_refuses_capacitance_not_positive_definite():
    src = OnlineFactorAnalysis(6, 2, warmup=3, seed=0, dtype=torch.float64)
    src.update(torch.randn(20, 6, dtype=torch.float64))
    dst = OnlineFactorAnalysis(6, 2, warmup=3, seed=1, dtype=torch.float64)
    sd = src.state_dict()
    sd["_cap"] = -torch.eye(2, dtype=torch.float64)
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=r"'_cap'\] must be positive definite"):
        dst.load_state_dict(sd)
    _assert_unchanged(dst, before)


@pytest.mark.parametrize("method", ["em", "swag"])
def test_swag_wrong_shape_refused_nested(method):
    src = Holder(_trained_swag(method, seed=1, rank=3))
    dst = Holder(_trained_swag(method, seed=2, rank=2))
    before = _snapshot(dst.swag)
    with pytest.raises(ValueError, match=r"must have shape"):
        dst.load_state_dict(src.state_dict())
    _assert_unchanged(dst.swag, before)


def test_non_strict_parent_load_without_swag_entries_leaves_it():
    dst = Holder(_trained_swag(seed=2))
    before = _snapshot(dst.swag)
    out = dst.load_state_dict({"head.weight": torch.zeros(2, 2, dtype=torch.float64)}, strict=False)
    assert "swag.fa.loc" in out.missing_keys
    _assert_unchanged(dst.swag, before)


# ---------------------------------------------------------------- unclear errors (item 10)
def test_online_fa_refuses_warmup_below_rank_like_swag():
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: warmup must be >= rank=3 for method 'em', got 2"):
        OnlineFactorAnalysis(10, 3, warmup=2)
    with pytest.raises(ValueError, match=r"SWAG: warmup must be >= rank=3 for method 'em', got 2"):
        SWAG(nn.Linear(4, 2), rank=3, warmup=2)
    OnlineFactorAnalysis(10, 3, method="sga", warmup=2)  # SGA has no M-step to degenerate, as in SWAG
    assert OnlineFactorAnalysis(300, 150).warmup == 150  # the default fits a large rank
    assert OnlineFactorAnalysis(300, 5).warmup == 100


def test_swag_refuses_the_same_parameter_twice():
    w = nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"SWAG: module_or_params must hold each tensor once, got tensor 1"):
        SWAG([w, w], rank=2)
    with pytest.raises(ValueError, match=r"each tensor once"):
        SWAG([w, w.view(5, 1)], rank=2, method="swag")
    assert SWAG([w, nn.Parameter(torch.randn(3))], rank=2, method="swag").dim == 8


def test_multiswag_refuses_the_same_member_twice():
    s = _trained_swag(seed=0)
    with pytest.raises(ValueError, match=r"MultiSWAG: members must be distinct posteriors, got the same SWAG as "
                                         r"members 0 and 1"):
        MultiSWAG([s, s])


def test_log_prob_of_another_dtype_names_both():
    fa = OnlineFactorAnalysis(5, 2, warmup=2, seed=0, dtype=torch.float32)
    fa.update(torch.randn(10, 5, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"x must have dtype torch.float32 like the model state, got torch.float64"):
        fa.log_prob(torch.randn(5, dtype=torch.float64))
    x = torch.randn(3, 5, dtype=torch.float32)
    torch.testing.assert_close(fa.log_prob(x), fa.get_posterior().log_prob(x))


def test_meta_device_refused():
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: device must hold data"):
        OnlineFactorAnalysis(5, 2, device="meta")
    fa = OnlineFactorAnalysis(5, 2, warmup=2)
    with pytest.raises(ValueError, match=r"x must be on a device that holds data .* got a tensor on meta"):
        fa.update(torch.randn(5, device="meta"))
    assert fa.n_updates == 0
    with torch.device("meta"):
        net = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"SWAG: parameters must hold data, got 'weight' on the meta device"):
        SWAG(net, rank=2)


def test_tune_scale_label_out_of_range_names_targets():
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    swag = SWAG(net, rank=2, method="swag")
    with torch.no_grad():
        for _ in range(5):
            net.weight.add_(0.1 * torch.randn_like(net.weight))
            swag.collect()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 5, 1, 0])
    with pytest.raises(ValueError, match=r"tune_scale: targets must be class labels in \[0, 3\) for the model's 3 "
                                         r"logits, got 1 outside, e.g. \[5\]"):
        swag.tune_scale(x, y, num_samples=2)
    assert swag.scale == 1.0


def _extreme_posterior(members=1):
    # logits of scale 1e4: a class that every draw rules out has probability exp(-1e4), 0 in float64
    swags = []
    for seed in range(members):
        torch.manual_seed(seed)
        net = nn.Linear(2, 3).double()
        with torch.no_grad():
            net.weight.copy_(torch.tensor([[1e4, 0.0], [0.0, 1e4], [-1e4, -1e4]], dtype=torch.float64))
            net.bias.zero_()
        swag = SWAG(net, rank=2, method="swag")
        with torch.no_grad():
            for _ in range(6):
                net.weight.add_(50 * torch.randn_like(net.weight))
                swag.collect()
        swags.append(swag)
    return swags


@pytest.mark.parametrize("members", [1, 2])
def test_predict_log_proba_is_finite_and_matches_float64_reference(members):
    swags = _extreme_posterior(members)
    post = swags[0] if members == 1 else MultiSWAG(swags)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.3, -0.2]], dtype=torch.float64)
    S = 7
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero warning
        out = post.predict_log_proba(x, num_samples=S, generator=gen())
    assert out.shape == (3, 3) and torch.isfinite(out).all()
    # the reference: the same draws' logits (S in all, split over the members), a float64 log-sum-exp written out
    logits = post.predictive_samples(x, num_samples=S, generator=gen())
    lp = logits - logits.max(-1, keepdim=True).values
    lp = lp - lp.exp().sum(-1, keepdim=True).log()
    m = lp.max(0).values
    ref = m + (lp - m).exp().sum(0).log() - math.log(S)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-9)
    assert float(out.min()) < -100  # a class every draw rules out, still finite
    # the log of the averaged probabilities loses it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        naive = post.predict_proba(x, num_samples=S, generator=gen()).log()
    assert not torch.isfinite(naive).all()
    torch.testing.assert_close(out.exp(), post.predict_proba(x, num_samples=S, generator=gen()))


def test_glm_classifier_predict_log_proba_is_stable():
    # scikit-learn's predict_log_proba on a Monte Carlo classifier: log E sigmoid(f) over the same draws,
    # finite far from the data, where 1 - E sigmoid(f) of the ruled-out class rounds to 0 in float64
    import numpy as np

    from pyro_fa.linear_model import GLMClassifier

    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 2))
    y = (X[:, 0] - X[:, 1] > 0).astype(int)
    clf = GLMClassifier(n_components=10, n_steps=150, lr=0.05, n_samples=50, random_state=0).fit(X, y)
    far = np.array([[200.0, -200.0], [-200.0, 200.0], [0.3, -0.1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "divide by zero encountered in log"
        out = clf.predict_log_proba(far)
    assert out.shape == (3, 2) and np.isfinite(out).all()
    # float64 reference over the same seeded draws of the linear predictor
    with clf._seeded():
        f = clf.model_.predictive_samples(clf._scale_x(far), n_samples=clf.n_samples).double()
    ref = torch.stack([torch.logsumexp(-torch.nn.functional.softplus(f), 0),
                       torch.logsumexp(-torch.nn.functional.softplus(-f), 0)], -1) - math.log(clf.n_samples)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-10, atol=1e-12)
    assert out.min() < -100
    with np.errstate(divide="ignore"):  # 1 - p rounds to 0 there: the log of predict_proba is -inf
        assert not np.isfinite(np.log(clf.predict_proba(far))).all()
    np.testing.assert_allclose(np.exp(out[2]), clf.predict_proba(far)[2], rtol=1e-10)
