"""The posterior scale of SWAG / MultiSWAG, chosen on validation data, and the prediction helpers."""
import math

import pytest
import torch
from torch import nn

from pyro_fa import SWAG, MultiSWAG, metrics
from pyro_fa.predictive.scale import DEFAULT_SCALES, bma_log_likelihood, select_scale, tune_scale


def _gaussian_swag(v=0.01, T=4000, seed=0):
    """SWAG-EM of Linear(1, 1) fed iterates w ~ N(1, v), b ~ N(0, 1e-6 v): the fitted weight variance is ~v."""
    torch.manual_seed(seed)
    net = nn.Linear(1, 1)
    swag = SWAG(net, rank=1, method="em", warmup=20, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(T):
        with torch.no_grad():
            net.weight.fill_(1.0 + math.sqrt(v) * float(torch.randn((), generator=g)))
            net.bias.fill_(math.sqrt(1e-6 * v) * float(torch.randn((), generator=g)))
        swag.collect()
    return net, swag


def test_scale_multiplies_the_covariance_of_samples_and_distribution():
    net, swag = _gaussian_swag(T=500)
    base = swag.get_posterior().covariance_matrix
    swag.scale = 9.0
    torch.testing.assert_close(swag.get_posterior().covariance_matrix, 9.0 * base)
    draws = swag.sample(20000, generator=torch.Generator().manual_seed(1))
    emp = torch.cov(draws.T)
    assert float((emp - 9.0 * base).norm() / (9.0 * base).norm()) < 0.05
    torch.testing.assert_close(draws.mean(0), swag.loc, atol=4 * math.sqrt(9 * float(base[0, 0]) / 20000), rtol=0)


def test_tune_scale_finds_the_known_right_scale_gaussian():
    # the BMA predictive at x is about N(c x, sigma^2 + s v x^2) (200 draws of width sigma = 0.5 make
    # a smooth mixture): validation data whose weight
    # varies with variance tau^2 = 100 v per point is fitted best at s = 100
    v = 0.01
    net, swag = _gaussian_swag(v=v)
    v_fit = float(swag.get_posterior().covariance_matrix[0, 0])
    assert v_fit == pytest.approx(v, rel=0.1)
    g = torch.Generator().manual_seed(5)
    N = 4000
    x = 1.0 + torch.rand(N, 1, generator=g)
    tau2 = 100.0 * v_fit
    y = (1.0 + math.sqrt(tau2) * torch.randn(N, 1, generator=g)) * x + 0.5 * torch.randn(N, 1, generator=g)
    found = swag.tune_scale(x, y[:, 0], "gaussian", noise_std=0.5, num_samples=200, rule="argmax")
    assert found.scale == 100.0 and swag.scale == 100.0
    assert found.scales == [0.0] + list(DEFAULT_SCALES)  # the mean first; no widening (the best is inside)
    i = found.scales.index(100.0)
    assert found.log_likelihoods[i] > max(found.log_likelihoods[i - 1], found.log_likelihoods[i + 1]) + 0.01
    # the score is the BMA log-likelihood of the Gaussian mixture, computed here by hand
    dev = swag._deviations(200, torch.Generator().manual_seed(0))
    theta = swag.loc + 10.0 * dev  # sqrt(100)
    mean = theta[:, :1] * x[:, 0] + theta[:, 1:]  # (S, N)
    ll = torch.distributions.Normal(mean, 0.5).log_prob(y[:, 0])
    by_hand = float((torch.logsumexp(ll, 0) - math.log(200)).mean())
    assert found.log_likelihoods[i] == pytest.approx(by_hand, rel=1e-10)
    # scale 0 is the mean's own prediction, one Gaussian per point
    at_mean = torch.distributions.Normal(swag.loc[0] * x[:, 0] + swag.loc[1], 0.5).log_prob(y[:, 0])
    assert found.log_likelihoods[0] == pytest.approx(float(at_mean.mean()), rel=1e-10)
    # the default rule: the smallest scale within one paired standard error of the best, read off the per-point curve
    j, _ = select_scale(found.scales, found.point_log_likelihoods)  # the default rule on the same curve
    default = found._replace(scale=found.scales[j], gain=found.log_likelihoods[j] - found.log_likelihoods[0])
    L = found.point_log_likelihoods.numpy()
    d = L[i] - L  # the best (scale 100) minus each candidate, point by point
    within = d.mean(1) <= d.std(1, ddof=1) / math.sqrt(N)
    expected = found.scales[int(within.argmax())]
    assert default.scale == expected and 0 < expected <= 100.0
    assert default.gain == pytest.approx(float((L[found.scales.index(expected)] - L[0]).mean()), rel=1e-12)


def _classifier_swag(method="em"):
    torch.manual_seed(0)
    X = torch.randn(300, 4)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).long() + (X[:, 2] > 1).long()
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swag = SWAG(net, rank=3, method=method, warmup=30, start_after=100, seed=0)
    swag.attach(opt)
    for _ in range(300):
        idx = torch.randint(0, 300, (32,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(X[idx]), y[idx]).backward()
        opt.step()
    return net, swag, X, y


@pytest.mark.parametrize("method", ["em", "swag"])
def test_categorical_score_equals_the_metrics_of_predictive_samples(method):
    net, swag, X, y = _classifier_swag(method)
    swag.scale = 30.0
    ll = swag.log_likelihood(X, y, num_samples=25, seed=3)
    samples = swag.predictive_samples(X, num_samples=25, fn=lambda z: z.softmax(-1),
                                      generator=torch.Generator().manual_seed(3))
    assert samples.shape == (25, 300, 3)
    assert ll == pytest.approx(-float(metrics.negative_log_likelihood(samples, y)), rel=1e-9)
    torch.testing.assert_close(swag.predict_proba(X, num_samples=25, generator=torch.Generator().manual_seed(3)),
                               samples.mean(0))
    found = swag.tune_scale(X, y, scales=[1.0, 30.0, 1e3], num_samples=25, seed=3, rule="argmax", widen=0)
    assert found.scales == [0.0, 1.0, 30.0, 1e3]
    assert found.log_likelihoods[2] == pytest.approx(ll, rel=1e-12)
    assert found.scale == found.scales[max(range(4), key=found.log_likelihoods.__getitem__)]


def test_multiswag_shares_one_scale_and_eval_works():
    def train(net, swag):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        swag.attach(opt)
        for _ in range(60):
            opt.zero_grad()
            net(torch.randn(16, 2)).pow(2).mean().backward()
            opt.step()

    ms = MultiSWAG.from_training(lambda: nn.Linear(2, 3), train, num_models=3, rank=2, method="swag")
    assert ms.eval() is ms and ms.train() is ms  # nn.Module's own train()/eval()
    X = torch.randn(40, 2)
    y = torch.randint(0, 3, (40,))
    found = ms.tune_scale(X, y, scales=[0.5, 2.0], num_samples=6)
    assert all(m.scale == found.scale for m in ms.members) and ms.scale == found.scale
    assert ms.predictive_samples(X, num_samples=2).shape == (6, 40, 3)
    assert ms.predict_proba(X, num_samples=2).sum(-1).sub(1).abs().max() < 1e-6
    assert isinstance(ms.log_likelihood(X, y, num_samples=6), float)
    ms.members[0].scale = 3.0
    with pytest.raises(RuntimeError, match=r"MultiSWAG: scale is per member here"):
        ms.scale


def test_scale_and_tuning_errors():
    net, swag, X, y = _classifier_swag()
    with pytest.raises(ValueError, match=r"SWAG: scale must be a finite number >= 0, got -1.0"):
        swag.scale = -1.0
    with pytest.raises(ValueError, match=r"SWAG: scale must be a finite number >= 0, got inf"):
        swag.scale = math.inf
    with pytest.raises(ValueError, match=r"tune_scale: scales must hold at least one positive candidate \(0, the "
                                         r"mean, is always added\), got \[\]"):
        swag.tune_scale(X, y, scales=[])
    with pytest.raises(ValueError, match=r"tune_scale: scales must hold at least one positive candidate .*got \[0.0\]"):
        swag.tune_scale(X, y, scales=[0.0])
    with pytest.raises(ValueError, match=r"tune_scale: scales must be finite numbers >= 0, got -1.0"):
        swag.tune_scale(X, y, scales=[1.0, -1.0])
    with pytest.raises(ValueError, match=r"tune_scale: rule must be one of \('gated', 'one_se', 'fraction', "
                                         r"'argmax', 'significant'\), got 'best'"):
        swag.tune_scale(X, y, rule="best")
    with pytest.raises(ValueError, match=r"tune_scale: fraction must be a number in \(0, 1\], got 1.5"):
        swag.tune_scale(X, y, fraction=1.5)
    with pytest.raises(ValueError, match=r"tune_scale: widen must be an integer >= 0, got -1"):
        swag.tune_scale(X, y, widen=-1)
    with pytest.raises(ValueError, match=r"tune_scale: pred_type must be one of \('nn', 'glm'\), got 'lin'"):
        swag.tune_scale(X, y, pred_type="lin")
    with pytest.raises(ValueError, match=r"tune_scale: targets must have shape \(N,\) with N >= 1, got \(0,\)"):
        swag.tune_scale(X[:0], y[:0])
    with pytest.raises(ValueError, match=r"targets must have shape \(N,\).*got \(300, 1\). Flatten it"):
        swag.tune_scale(X, y[:, None])
    with pytest.raises(ValueError, match=r"tune_scale: likelihood must be one of \('categorical', 'gaussian'\)"):
        swag.tune_scale(X, y, "poisson")
    with pytest.raises(ValueError, match=r"tune_scale: noise_std must be given for likelihood='gaussian'"):
        swag.tune_scale(X, y.double(), "gaussian")
    with pytest.raises(TypeError, match=r"tune_scale: posterior must have a scale and a predictive\(\) returning a "
                                        r"SampledPredictive \(a SWAG\), or hold such posteriors as members \(a "
                                        r"MultiSWAG\), got Sequential\."):
        tune_scale(net, X, y)
    with pytest.raises(ValueError, match=r"bma_log_likelihood: the model's output must be means of shape"):
        bma_log_likelihood(swag, X, y.double(), "gaussian", noise_std=1.0)
    assert swag.scale == 1.0  # every refusal left it alone
    state = swag.state_dict()
    swag.scale = 4.0
    swag.load_state_dict(state)
    assert swag.scale == 1.0
