"""FactorLaplace's predictive scale (tune_scale's choice) is part of its saved state: a tuned posterior reloads
with it and predicts bit for bit as before; a state saved without it loads as before (the scale left alone)."""
import pytest
import torch
from torch import nn

from pyro_fa.laplace import FactorLaplace


def _data(seed, N=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64).to(dtype)
    return X, torch.randint(3, (N,), generator=g)


def _fitted(dtype=torch.float64):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    return net, FactorLaplace(net, "classification", rank=3).fit([_data(0, dtype=dtype)])


def _predictions(la, X):
    return [la.predict_proba(X, generator=torch.Generator().manual_seed(1)),
            la.predict_proba(X, pred_type="glm"),
            la.sample(4, generator=torch.Generator().manual_seed(2)),
            la.get_posterior().variance]


def _assert_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tuned_scale_round_trips_bit_for_bit(dtype):
    net, la = _fitted(dtype)
    X_val, y_val = _data(1, dtype=dtype)
    search = la.tune_scale(X_val, y_val, scales=[0.013, 0.3, 3.7], num_samples=5, rule="argmax", widen=0)
    assert la.scale == torch.tensor(search.scale, dtype=dtype).item()  # held in the approximation's dtype
    la.scale = 0.3 if la.scale != 0.3 else 3.7  # a scale away from the default 1, whichever was chosen
    X_test, _ = _data(2, N=6, dtype=dtype)
    before = _predictions(la, X_test)
    fresh = FactorLaplace(net, "classification", rank=3)
    fresh.load_state_dict(la.state_dict())
    assert fresh.scale == la.scale
    _assert_equal(_predictions(fresh, X_test), before)
    # and the scale predicts: at scale 1 the sampled predictive is another one
    fresh.scale = 1.0
    assert not torch.equal(_predictions(fresh, X_test)[0], before[0])


def test_scale_zero_round_trips_to_the_point_mass():
    net, la = _fitted()
    la.scale = 0.0
    fresh = FactorLaplace(net, "classification", rank=3)
    fresh.load_state_dict(la.state_dict())
    assert fresh.scale == 0.0
    assert torch.equal(fresh.get_posterior().variance, torch.zeros_like(la.loc))


def test_state_saved_without_the_scale_loads_as_before():
    net, la = _fitted()
    old = {k: v for k, v in la.state_dict().items() if k != "predictive_scale"}
    X_test, _ = _data(2, N=6)
    fresh = FactorLaplace(net, "classification", rank=3)
    fresh.load_state_dict(old)  # strict: the missing scale is not a missing key
    assert fresh.scale == 1.0
    _assert_equal(_predictions(fresh, X_test), _predictions(la, X_test))
    fresh.scale = 0.5
    fresh.load_state_dict(old)  # the scale, not in the state, is left as it was
    assert fresh.scale == 0.5


@pytest.mark.parametrize("value, match", [
    (-0.5, r"state_dict\['predictive_scale'\] must be non-negative, got \[-0.5\]; nothing was loaded"),
    (float("inf"), r"state_dict\['predictive_scale'\] must be finite, got NaN or inf; nothing was loaded"),
])
def test_a_bad_saved_scale_is_refused_and_nothing_loaded(value, match):
    net, la = _fitted()
    state = {**la.state_dict(), "predictive_scale": torch.tensor(value, dtype=torch.float64)}
    fresh = FactorLaplace(net, "classification", rank=3)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    assert fresh.scale == 1.0 and int(fresh.n_data) == 0


def test_scale_and_temperature_are_held_in_the_approximations_dtype():
    net, la = _fitted()
    la.scale, la.temperature = 0.1, 0.7  # not rounded through float32 on the way to a float64 buffer
    assert (la.scale, la.temperature) == (0.1, 0.7)
    fresh = FactorLaplace(net, "classification", rank=3)
    fresh.load_state_dict(la.state_dict())
    assert (fresh.scale, fresh.temperature) == (0.1, 0.7)
    with pytest.raises(ValueError, match=r"FactorLaplace: scale must be a finite number >= 0, got -1"):
        la.scale = -1
    assert la.scale == 0.1
