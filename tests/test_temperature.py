"""Temperature scaling (Guo et al. 2017) of logits and of model averages' log class probabilities."""
import math

import pytest
import torch
from torch import nn

from pyro_fa import SWAG, MultiSWAG
from pyro_fa.predictive.temperature import TemperatureScaling, fit_temperature


def _nll(z, y, T):
    return float(nn.functional.cross_entropy(z.double() / T, y))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fit_temperature_matches_a_dense_grid_search(dtype, device):
    g = torch.Generator().manual_seed(0)
    z = (3.0 * torch.randn(300, 5, generator=g)).to(dtype)
    y = torch.randint(5, (300,), generator=g)
    T_dev = fit_temperature(z.to(device), y.to(device))
    scaled = TemperatureScaling(lambda x: x).fit(z.to(device), y.to(device))
    out = scaled.log_proba(z.to(device))
    assert out.device.type == device and out.dtype == dtype and scaled.temperature == T_dev
    T = fit_temperature(z, y)
    grid = torch.logspace(-2, 2, 40001, dtype=torch.float64)
    nlls = torch.tensor([_nll(z, y, float(t)) for t in grid[::40]])  # coarse pass, then a fine one around it
    i = int(nlls.argmin()) * 40
    fine = grid[max(i - 40, 0):i + 41]
    fine_nll = torch.tensor([_nll(z, y, float(t)) for t in fine])
    t_grid = float(fine[fine_nll.argmin()])
    assert T == pytest.approx(t_grid, rel=5e-4)  # the grid's spacing is 2.3e-4 in log T
    assert T_dev == pytest.approx(T, rel=1e-6)
    assert _nll(z, y, T) <= float(fine_nll.min()) + 1e-12


def test_fit_temperature_recovers_the_overconfidence_factor():
    # labels drawn from softmax(z): the calibrated temperature of 3 z is 3 (within Monte Carlo error)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(20000, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]
    assert fit_temperature(3.0 * z, y) == pytest.approx(3.0, rel=0.05)
    assert fit_temperature(z / 2, y) == pytest.approx(0.5, rel=0.05)


def test_fit_temperature_two_point_closed_form_and_ruled_out_classes():
    # one error in four at margin 4: the NLL is minimised where sigmoid(4 / T) = 3/4, T = 4 / log 3
    z = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0], [4.0, 0.0]])
    y = torch.tensor([0, 1, 1, 0])
    assert fit_temperature(z, y) == pytest.approx(4 / math.log(3), rel=1e-8)
    # a log-probability of -inf for a non-target class stays ruled out; the others decide
    lp = torch.tensor([[0.0, -4.0, -math.inf], [-4.0, 0.0, -math.inf], [-4.0, 0.0, -math.inf], [0.0, -4.0, -math.inf]])
    assert fit_temperature(lp, torch.tensor([0, 1, 0, 0])) == pytest.approx(4 / math.log(3), rel=1e-8)
    # separable data: the smallest temperature allowed; all wrong: the largest
    assert fit_temperature(z[:2], y[:2]) == 1e-2
    assert fit_temperature(z[:2], 1 - y[:2], max_temperature=50.0) == 50.0


def test_fit_temperature_refusals():
    z, y = torch.randn(6, 3), torch.randint(3, (6,))
    with pytest.raises(TypeError, match=r"fit_temperature: log_probs_or_logits must be a torch.Tensor of shape \(N, C\), got list"):
        fit_temperature([[0.0, 1.0]], y)
    with pytest.raises(ValueError, match=r"fit_temperature: log_probs_or_logits must have shape \(N, C\) with C >= 2, got \(6,\)"):
        fit_temperature(z[:, 0], y)
    with pytest.raises(ValueError, match=r"fit_temperature: log_probs_or_logits must not hold NaN or \+inf .*got 1 such"):
        fit_temperature(z.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.nan)), y)
    with pytest.raises(TypeError, match=r"fit_temperature: targets must hold integer class labels"):
        fit_temperature(z, y.float())
    with pytest.raises(ValueError, match=r"fit_temperature: targets must have one label per row .*\(6\), got 5"):
        fit_temperature(z, y[:5])
    with pytest.raises(ValueError, match=r"fit_temperature: targets must be class labels in \[0, 3\), got 1 outside, e.g. \[7\]"):
        fit_temperature(z, torch.tensor([0, 1, 2, 0, 1, 7]))
    with pytest.raises(ValueError, match=r"fit_temperature: every target's class must have a finite log-probability"):
        fit_temperature(torch.tensor([[0.0, -math.inf]]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"fit_temperature: min_temperature must be a positive finite number, got 0"):
        fit_temperature(z, y, min_temperature=0)
    with pytest.raises(ValueError, match=r"fit_temperature: min_temperature must be below max_temperature, got 5.0 and 2.0"):
        fit_temperature(z, y, min_temperature=5.0, max_temperature=2.0)
    with pytest.raises(TypeError, match=r"TemperatureScaling: predict must be callable .*got int"):
        TemperatureScaling(3)
    scaled = TemperatureScaling(lambda x: x)
    with pytest.raises(ValueError, match=r"fit_temperature: targets must be class labels"):
        scaled.fit(z, torch.full((6,), 9))
    assert scaled.temperature == 1.0  # a refusal leaves it alone


def _trained(seed):
    torch.manual_seed(seed)
    X = torch.randn(400, 4, dtype=torch.float64)
    y = (X[:, 0] + 0.7 * X[:, 1] + 0.8 * torch.randn(400, dtype=torch.float64) > 0).long() \
        + (X[:, 2] > 0.8).long()
    net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    swag = SWAG(net, rank=3, warmup=10, start_after=150, collect_every=10, seed=seed)
    swag.attach(opt)
    for _ in range(300):  # trained to overconfidence on 200 points
        opt.zero_grad()
        nn.functional.cross_entropy(net(X[:200]), y[:200]).backward()
        opt.step()
    return net, swag, X, y


def test_temperature_scaling_wraps_a_map_net_swag_and_multiswag():
    net, swag, X, y = _trained(0)
    _, other, _, _ = _trained(1)
    ms = MultiSWAG([swag, other])
    val, test = slice(200, 300), slice(300, 400)
    def swag_avg(x):  # a new seeded generator per call: the same draws for validation and test
        return swag.predict_log_proba(x, num_samples=10, generator=torch.Generator().manual_seed(0))

    for predict in (net, swag_avg):
        scaled = TemperatureScaling(predict).fit(X[val], y[val])
        with torch.no_grad():
            z = predict(X[val])
        assert scaled.temperature == fit_temperature(z, y[val])
        torch.testing.assert_close(scaled.log_proba(X[val]), (z / scaled.temperature).log_softmax(-1))
        # the fitted temperature minimises the validation NLL: no worse than T = 1
        assert _nll(z, y[val], scaled.temperature) <= _nll(z, y[val], 1.0)
        torch.testing.assert_close(scaled.proba(X[test]).sum(-1), torch.ones(100, dtype=torch.float64))
    # a mixture's model average: its log class probabilities as the logits
    def avg(x):  # MultiSWAG draws from the global generator: seed it for the same draws on every call
        torch.manual_seed(0)
        return ms.predict_log_proba(x, num_samples=10)

    scaled = TemperatureScaling(avg).fit((X[val],), y[val])
    assert scaled.temperature == fit_temperature(avg(X[val]), y[val])
    assert _nll(avg(X[val]), y[val], scaled.temperature) <= _nll(avg(X[val]), y[val], 1.0)
    assert "TemperatureScaling(temperature=" in repr(scaled)
