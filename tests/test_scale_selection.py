"""Choosing the scale: the mean (scale 0) as a candidate, the selection rules, widening, warnings, the plot."""
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from pyro_fa import SWAG, MultiSWAG
from pyro_fa.distributions import PointMassNormal
from pyro_fa.predictive import ScaleSelectionWarning, bma_log_likelihood, select_scale, tune_scale


def _curve(seed=0, N=200):
    """Per-point log-likelihoods at scales 0, 0.1, 1, 10, 100: a gain rising to scale 10, then a heavy-tailed cliff."""
    g = torch.Generator().manual_seed(seed)
    base = -1.0 + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    rows = [base]
    for mean, sd in ((0.02, 0.02), (0.07, 0.03), (0.08, 0.05)):
        rows.append(base + mean + sd * torch.randn(N, generator=g, dtype=torch.float64))
    cliff = torch.full((N,), 0.28, dtype=torch.float64)
    cliff[torch.randperm(N, generator=g)[:N // 10]] = -1.5  # a tenth of the points lose much: mean gain 0.102
    rows.append(base + cliff + 0.01 * torch.randn(N, generator=g, dtype=torch.float64))
    return [0.0, 0.1, 1.0, 10.0, 100.0], torch.stack(rows)


def _by_numpy(scales, L, rule, fraction=0.7, num_se=1.5):
    """The rules of select_scale's docstring, written again in numpy."""
    L = np.asarray(L)
    N = L.shape[1]
    d = L - L[0]
    g, se = d.mean(1), d.std(1, ddof=1) / np.sqrt(N)
    if rule == "argmax":
        return int(L.mean(1).argmax())
    if rule == "gated":
        best = int(L.mean(1).argmax())
        if best == 0 or not g[best] > 2 * se[best]:
            return 0
        rule = "one_se"
    if rule == "one_se":
        best = int(L.mean(1).argmax())
        se_best = (L[best] - L).std(1, ddof=1) / np.sqrt(N)
        return min(j for j in range(len(scales)) if L[best].mean() - L[j].mean() <= se_best[j])
    if rule == "significant":
        b = 1 + int(g[1:].argmax())
        return b if g[b] > 2 * se[b] else 0
    b = 1 + int((g - num_se * se)[1:].argmax())
    if g[b] <= se[b]:
        return 0
    return min(j for j in range(1, len(scales)) if g[j] >= fraction * g[b])


@pytest.mark.parametrize("rule", ["fraction", "argmax", "one_se", "significant", "gated"])
@pytest.mark.parametrize("seed", range(4))
def test_select_scale_matches_the_rules_written_in_numpy(rule, seed):
    scales, L = _curve(seed, N=60 + 50 * seed)
    i, reason = select_scale(scales, L, rule)
    assert i == _by_numpy(scales, L.numpy(), rule) and isinstance(reason, str) and reason
    if rule == "fraction":
        assert select_scale(scales, L, rule, fraction=0.9, num_se=0.5)[0] == _by_numpy(scales, L.numpy(), rule, 0.9, 0.5)
    if rule != "argmax":  # never worse than the mean on validation
        assert float(L[i].mean()) >= float(L[0].mean())


def test_fraction_rule_steps_back_from_a_noisy_optimum_and_falls_back_to_the_mean():
    scales, L = _curve(0, N=200)
    assert select_scale(scales, L, "argmax")[0] == 4  # the noisy cliff has the highest mean
    # the lower bound prefers 10 (0.08 +- 0.004); 70 % of its gain: scale 1
    i, reason = select_scale(scales, L, "fraction")
    assert scales[i] == 1.0 and "at scale 10" in reason and "the best lower bound" in reason
    assert select_scale(scales, L, "fraction", fraction=1.0)[0] == 3
    assert select_scale(scales, L, "fraction", fraction=0.2)[0] == 1
    # one paired standard error below the noisy best (100): scales 1 (0.07) and 10 (0.08) are within it
    i, reason = select_scale(scales, L)
    assert scales[i] == 1.0 and "within one paired standard error" in reason
    # every scale a little worse than the mean, with noise: the mean is chosen
    g = torch.Generator().manual_seed(3)
    noise = L[0] - 0.01 + 0.05 * torch.randn(5, L.shape[1], generator=g, dtype=torch.float64)
    noise[0] = L[0]
    for rule in ("one_se", "fraction"):
        i, reason = select_scale(scales, noise, rule)
        assert i == 0 and "no scale beats the mean by more than its paired standard error" in reason
    i, reason = select_scale(scales, noise)  # the default, "gated"
    assert i == 0 and "no scale beats the mean by more than twice its paired standard error" in reason


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_select_scale_reads_a_curve_on_any_device(device):
    scales, L = _curve(1)
    for rule in ("one_se", "fraction", "argmax", "significant"):
        assert select_scale(scales, L.to(device), rule) == select_scale(scales, L, rule)


def test_select_scale_refusals():
    scales, L = _curve()
    with pytest.raises(ValueError, match=r"select_scale: rule must be one of .*got 'max'"):
        select_scale(scales, L, "max")
    with pytest.raises(ValueError, match=r"select_scale: fraction must be a number in \(0, 1\], got 0"):
        select_scale(scales, L, fraction=0)
    with pytest.raises(ValueError, match=r"select_scale: num_se must be a finite number >= 0, got -1"):
        select_scale(scales, L, num_se=-1)
    with pytest.raises(ValueError, match=r"select_scale: scales must increase from 0 \(the mean\), got \[0.1, 1.0\]"):
        select_scale([0.1, 1.0], L[:2])
    with pytest.raises(ValueError, match=r"select_scale: point_log_likelihoods must have shape \(5, N\) with N >= 1, "
                                         r"got \(4, 200\)"):
        select_scale(scales, L[:4])
    bad = L.clone()
    bad[0, 3] = -math.inf
    with pytest.raises(ValueError, match=r"select_scale: the mean \(scale 0\) must have a finite log-likelihood"):
        select_scale(scales, bad)
    bad = L.clone()
    bad[4, 3] = -math.inf  # a candidate that rules a point out is never chosen
    assert select_scale(scales, bad, "argmax")[0] != 4


def _gaussian_swag(v=0.01, T=300, seed=0):
    """SWAG-EM of Linear(1, 1) fed iterates w ~ N(1, v): the fitted weight variance is about v."""
    torch.manual_seed(seed)
    net = nn.Linear(1, 1).double()
    swag = SWAG(net, rank=1, method="em", warmup=20, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(T):
        with torch.no_grad():
            net.weight.fill_(1.0 + math.sqrt(v) * float(torch.randn((), generator=g)))
            net.bias.fill_(math.sqrt(1e-6 * v) * float(torch.randn((), generator=g)))
        swag.collect()
    return net, swag


def _data(swag, tau2_over_v=100.0, N=2000, seed=5):
    v_fit = float(swag.get_posterior().covariance_matrix[0, 0])
    g = torch.Generator().manual_seed(seed)
    x = 1.0 + torch.rand(N, 1, generator=g, dtype=torch.float64)
    w = 1.0 + math.sqrt(tau2_over_v * v_fit) * torch.randn(N, 1, generator=g, dtype=torch.float64)
    y = w * x + 0.5 * torch.randn(N, 1, generator=g, dtype=torch.float64)
    return x, y[:, 0]


def test_scale_zero_is_the_mean_and_costs_one_forward_pass():
    net, swag = _gaussian_swag()
    x, y = _data(swag)
    calls = []
    handle = net.register_forward_hook(lambda *a: calls.append(1))
    try:
        search = tune_scale(swag, x, y, "gaussian", scales=[1.0], num_samples=7, noise_std=0.5, widen=0)
    finally:
        handle.remove()
    assert len(calls) == 7 + 1  # seven draws at scale 1, one pass at the mean
    at_mean = torch.distributions.Normal(swag.loc[0] * x[:, 0] + swag.loc[1], 0.5).log_prob(y)
    torch.testing.assert_close(search.point_log_likelihoods[0], at_mean, rtol=1e-12, atol=1e-12)
    assert bma_log_likelihood(swag, x, y, "gaussian", scale=0.0, noise_std=0.5) == pytest.approx(
        float(at_mean.mean()), rel=1e-12)
    # standard errors over the points, of the curve and of the paired gain
    L = search.point_log_likelihoods.numpy()
    np.testing.assert_allclose(search.standard_errors, L.std(1, ddof=1) / np.sqrt(L.shape[1]), rtol=1e-10)
    np.testing.assert_allclose(search.gain_standard_errors, (L - L[0]).std(1, ddof=1) / np.sqrt(L.shape[1]),
                               rtol=1e-10, atol=1e-15)
    # the posterior at scale 0: draws are the mean, and get_posterior() the point mass there
    swag.scale = 0
    assert swag.scale == 0.0
    torch.testing.assert_close(swag.sample(3), swag.loc.expand(3, -1), rtol=0, atol=0)
    q = swag.get_posterior()
    assert isinstance(q, PointMassNormal)
    assert torch.equal(q.mean, swag.loc) and torch.equal(q.variance, torch.zeros_like(swag.loc))


def test_multiswag_scale_zero_is_the_ensemble_of_the_members_means():
    nets, members = zip(*(_gaussian_swag(seed=s) for s in range(2)))
    ms = MultiSWAG(members)
    x, y = _data(members[0], N=300)
    ll = torch.stack([torch.distributions.Normal(m.loc[0] * x[:, 0] + m.loc[1], 0.5).log_prob(y) for m in members])
    ensemble = float((torch.logsumexp(ll, 0) - math.log(2)).mean())
    assert bma_log_likelihood(ms, x, y, "gaussian", scale=0.0, num_samples=4, noise_std=0.5) == pytest.approx(
        ensemble, rel=1e-12)
    search = ms.tune_scale(x, y, "gaussian", scales=[1.0, 10.0], num_samples=4, noise_std=0.5, widen=0)
    assert search.log_likelihoods[0] == pytest.approx(ensemble, rel=1e-12)


def test_the_grid_is_widened_where_the_best_sits_at_its_edge():
    # the model average is best near s = 100 (validation weights vary with variance 100 v)
    net, swag = _gaussian_swag()
    x, y = _data(swag)
    full = tune_scale(swag, x, y, "gaussian", scales=[1.0, 10.0, 100.0, 1000.0, 1e4], num_samples=50,
                      noise_std=0.5, rule="argmax")
    assert full.scale == 100.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # widening finds the optimum: no warning
        short = tune_scale(swag, x, y, "gaussian", scales=[0.1, 1.0, 10.0], num_samples=50, noise_std=0.5,
                           rule="argmax")
    assert short.scales == [0.0, 0.1, 1.0, 10.0, 100.0, 1000.0] and short.scale == 100.0
    assert short.log_likelihoods[-2] == pytest.approx(full.log_likelihoods[3], rel=1e-12)  # the same draws
    with pytest.warns(ScaleSelectionWarning, match=r"the best scale is still the largest tried \(10\) after "
                                                   r"widening the grid by 0"):
        tune_scale(swag, x, y, "gaussian", scales=[0.1, 1.0, 10.0], num_samples=50, noise_std=0.5, widen=0)


def test_warnings_for_a_flat_curve_and_a_small_validation_set():
    net, swag = _gaussian_swag()
    x, y = _data(swag, tau2_over_v=0.0)  # the data's weight does not vary: sampling does not help
    with pytest.warns(ScaleSelectionWarning, match=r"tune_scale: the validation curve is flat: no scale beats the "
                                                   r"mean by more than twice its paired standard error"):
        search = tune_scale(swag, x, y, "gaussian", scales=[1.0, 10.0, 100.0], num_samples=20, noise_std=0.5)
    assert search.scale == 0.0 and swag.scale == 0.0 and search.gain == 0.0 and search.rule == "gated"
    with pytest.warns(ScaleSelectionWarning, match=r"tune_scale: 30 validation points are too few") as record:
        small = swag.tune_scale(x[:30], y[:30], "gaussian", scales=[1.0, 10.0], num_samples=5, noise_std=0.5)
    assert small.rule == "gated" and swag.scale == small.scale  # SWAG.tune_scale's default rule
    assert record[0].filename == __file__  # the warning names the caller's line, not the library's


def test_plot_draws_the_curve_with_error_bars():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    net, swag = _gaussian_swag()
    x, y = _data(swag, N=300)
    search = tune_scale(swag, x, y, "gaussian", scales=[1.0, 10.0, 100.0], num_samples=10, noise_std=0.5)
    ax = search.plot()
    line = ax.lines[0]
    np.testing.assert_allclose(np.asarray(line.get_xdata(), dtype=float), search.scales[1:])
    np.testing.assert_allclose(np.asarray(line.get_ydata(), dtype=float), search.log_likelihoods[1:])
    assert ax.get_xscale() == "log" and len(ax.collections) >= 1  # the error bars
    plt.close(ax.figure)


def test_pred_type_glm_agrees_with_sampled_networks_for_a_linear_model_and_is_refused_without_support():
    net, swag = _gaussian_swag()
    x, y = _data(swag, N=300)
    nn_search = tune_scale(swag, x, y, "gaussian", scales=[1.0, 100.0], num_samples=10, noise_std=0.5, widen=0)
    try:
        glm_search = tune_scale(swag, x, y, "gaussian", scales=[1.0, 100.0], num_samples=10, noise_std=0.5,
                                widen=0, pred_type="glm")
    except TypeError as exc:  # SWAG.predictive without pred_type: the clear refusal
        assert "predictive() without it" in str(exc)
    else:  # a network linear in its weights: the linearised network is the network
        torch.testing.assert_close(glm_search.point_log_likelihoods, nn_search.point_log_likelihoods,
                                   rtol=1e-10, atol=1e-10)

    point = swag.predictive()

    class OnlySampled:
        scale = 1.0

        def predictive(self):
            return point

    with pytest.raises(TypeError, match=r"tune_scale: pred_type='glm' needs a posterior whose predictive\(\) takes "
                                        r"pred_type, got OnlySampled.predictive\(\) without it; use pred_type='nn'"):
        tune_scale(OnlySampled(), x, y, "gaussian", noise_std=0.5, pred_type="glm")
    with pytest.raises(ValueError, match=r"bma_log_likelihood: scale must be a finite number >= 0, got -1"):
        bma_log_likelihood(swag, x, y, "gaussian", scale=-1, noise_std=0.5)
    swag.scale = 3.0
    with pytest.raises(RuntimeError, match=r"tune_scale: the mean \(scale 0\) gives a non-finite log-likelihood"):
        tune_scale(swag, x, y, lambda out, t: torch.full_like(t, -math.inf), scales=[1.0], num_samples=2)
    assert swag.scale == 3.0  # left alone


def test_gated_rule_keeps_the_mean_on_a_gain_below_two_standard_errors():
    # the MNIST-1D CNN's seed: a gain of 1.7 paired standard errors on 400 validation points
    g = torch.Generator().manual_seed(0)
    base = -0.2 + 0.1 * torch.randn(400, generator=g, dtype=torch.float64)
    z = torch.randn(400, generator=g, dtype=torch.float64)
    z = (z - z.mean()) / z.std()
    for gain, expect in ((0.07, 0), (0.09, 1)):  # 1.7 and 2.2 standard errors (se = 0.82 / 20 = 0.041)
        L = torch.stack([base, base + gain + 0.82 * z])
        assert select_scale([0.0, 31.6], L, "one_se")[0] == 1
        i, reason = select_scale([0.0, 31.6], L, "gated")
        assert i == expect, (gain, reason)
        if expect == 0:
            assert "no scale beats the mean by more than twice its paired standard error" in reason
