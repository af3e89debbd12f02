"""tune_scale(..., temperature=True): every candidate scored after a temperature fitted at it (Guo et al. 2017)."""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from torch import nn

from pyro_fa import SWAG, MultiSWAG
from pyro_fa.predictive import tune_scale

pytestmark = pytest.mark.filterwarnings("ignore::pyro_fa.predictive.ScaleSelectionWarning")


def _blobs(N, seed):
    """Three overlapping Gaussian classes in 2-D: about 80 % accuracy at best."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (N,), generator=g)
    centres = torch.tensor([[0.0, 0.0], [1.5, 0.0], [0.0, 1.5]], dtype=torch.float64)
    return centres[y] + torch.randn(N, 2, generator=g, dtype=torch.float64), y


def _overconfident_swag(noise=0.6, boost=8.0, T=200, seed=0):
    """SWAG-EM of a softmax regression whose iterates scatter isotropically around a good but overconfident
    classifier (its weights ``boost`` times the maximum-likelihood ones)."""
    torch.manual_seed(seed)
    x, y = _blobs(3000, seed + 100)
    net = nn.Linear(2, 3).double()
    opt = torch.optim.LBFGS(net.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        centre = [p.detach().clone() * boost for p in net.parameters()]
    swag = SWAG(net, rank=2, method="em", warmup=10, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(T):
        with torch.no_grad():
            for p, c in zip(net.parameters(), centre):
                p.copy_(c + noise * torch.randn(c.shape, generator=g, dtype=c.dtype))
        swag.collect()
    return net, swag


def _tempered_by_hand(net, loc, dev, s, x, y):
    """The tempered model average's per-point log-likelihood and its temperature, by scipy on the NLL in log T."""
    probe = nn.Linear(2, 3).double()
    probs = []
    for d in dev:
        torch.nn.utils.vector_to_parameters(loc + math.sqrt(s) * d, probe.parameters())
        with torch.no_grad():
            probs.append(probe(x).softmax(-1))
    z = torch.stack(probs).mean(0).log().numpy()
    yy = y.numpy()

    def nll(log_t):
        zt = z / math.exp(log_t)
        zt = zt - zt.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(zt).sum(1)) - zt[np.arange(len(yy)), yy]))

    log_t = minimize_scalar(nll, bounds=(math.log(1e-2), math.log(1e2)), method="bounded",
                            options={"xatol": 1e-10}).x
    zt = z / math.exp(log_t)
    zt = zt - zt.max(1, keepdims=True)
    return zt[np.arange(len(yy)), yy] - np.log(np.exp(zt).sum(1)), math.exp(log_t)


def test_tempered_scores_equal_a_hand_computation_on_the_same_draws():
    net, swag = _overconfident_swag()
    x, y = _blobs(400, 7)
    S, seed = 12, 3
    search = tune_scale(swag, x, y, scales=[0.1, 1.0], num_samples=S, seed=seed, widen=0, temperature=True)
    pred = swag.predictive()
    dev = pred.deviations(S, torch.Generator().manual_seed(seed))  # the draws tune_scale makes with this seed
    assert search.scales == [0.0, 0.1, 1.0] and len(search.temperatures) == 3
    for i, s in enumerate(search.scales):
        ll, t = _tempered_by_hand(net, pred.loc, dev, s, x, y)
        assert search.temperatures[i] == pytest.approx(t, rel=1e-5)
        np.testing.assert_allclose(search.point_log_likelihoods[i].numpy(), ll, rtol=1e-6, atol=1e-8)
    assert search.temperature == search.temperatures[search.scales.index(search.scale)]
    assert swag.scale == search.scale
    # the overconfident mean wants a temperature well above 1; without a temperature the search reports none
    assert search.temperatures[0] > 3.0
    raw = tune_scale(swag, x, y, scales=[0.1, 1.0], num_samples=S, seed=seed, widen=0)
    assert raw.temperatures is None and raw.temperature == 1.0


def test_the_tempered_choice_keeps_the_spread_from_curing_overconfidence():
    # the iterates' scatter carries no information: a temperature calibrates the mean at no cost in accuracy,
    # while the raw rule uses the spread to soften it, losing accuracy and the tempered NLL
    net, swag = _overconfident_swag(noise=1.5)
    x_val, y_val = _blobs(600, 11)
    x_test, y_test = _blobs(4000, 12)
    scales = [0.01, 0.1, 1.0, 10.0]
    raw = tune_scale(swag, x_val, y_val, scales=scales, num_samples=30, widen=0)
    tempered = tune_scale(swag, x_val, y_val, scales=scales, num_samples=30, widen=0, temperature=True)
    assert raw.scale >= 1.0 and tempered.scale < raw.scale
    # on test points, each choice tempered with its own validation temperature (the "+T" predictive)
    pred = swag.predictive()
    dev = pred.deviations(30, torch.Generator().manual_seed(0))

    def tempered_test_nll(search):
        probe = nn.Linear(2, 3).double()
        probs = []
        for d in dev:
            torch.nn.utils.vector_to_parameters(pred.loc + math.sqrt(search.scale) * d, probe.parameters())
            with torch.no_grad():
                probs.append(probe(x_test).softmax(-1))
        z = torch.stack(probs).mean(0).log() / search.temperature
        return float(nn.functional.cross_entropy(z, y_test))

    t_raw = tune_scale(swag, x_val, y_val, scales=[raw.scale], num_samples=30, widen=0, temperature=True)
    t_raw = t_raw._replace(scale=raw.scale)  # the raw choice, tempered at its own scale
    assert tempered_test_nll(tempered) < tempered_test_nll(t_raw) - 0.01


def test_multiswag_tempered_scale_zero_is_the_tempered_ensemble_of_the_members_means():
    nets, members = zip(*(_overconfident_swag(seed=s) for s in range(2)))
    ms = MultiSWAG(members)
    x, y = _blobs(300, 5)
    search = ms.tune_scale(x, y, scales=[1.0], num_samples=4, widen=0, temperature=True)
    with torch.no_grad():
        probs = []
        for m, net in zip(members, nets):
            probe = nn.Linear(2, 3).double()
            torch.nn.utils.vector_to_parameters(m.loc, probe.parameters())
            probs.append(probe(x).softmax(-1))
    z = torch.stack(probs).mean(0).log() / search.temperatures[0]
    expected = z.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)
    torch.testing.assert_close(search.point_log_likelihoods[0], expected, rtol=1e-9, atol=1e-10)


def test_temperature_refusals_leave_the_posterior_alone():
    net, swag = _overconfident_swag(T=40)
    swag.scale = 2.0
    x, y = _blobs(100, 1)
    with pytest.raises(ValueError, match=r"tune_scale: temperature=True needs likelihood='classification' \(a "
                                         r"temperature on class probabilities\), got likelihood='regression'"):
        tune_scale(swag, x, y.double(), "gaussian", noise_std=1.0, temperature=True)
    with pytest.raises(ValueError, match=r"tune_scale: temperature must be True or False, got 'yes'"):
        swag.tune_scale(x, y, temperature="yes")
    assert swag.scale == 2.0
