"""The prediction protocol (pyro_fa.predictive.Posterior): one set of verbs and one likelihood vocabulary on SWAG,
MultiSWAG and FactorLaplace, checked against dense and brute-force computations."""
import inspect
import math

import pytest
import torch
from torch import nn

import pyro_fa
from pyro_fa.laplace import FactorLaplace
from pyro_fa.predictive import (LIKELIHOODS, Posterior, TemperatureScaling, fit_temperature, normalize_likelihood,
                                resolve_link_approx)
from pyro_fa.swag import SWAG, MultiSWAG


VERBS = ("predictive", "predict", "predict_proba", "predict_log_proba", "predictive_samples", "log_likelihood",
         "tune_scale")


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _blobs(N, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (N,), generator=g)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    return centres[y] + 1.2 * torch.randn(N, 2, generator=g), y


def _trained_mlp(X, y, seed=0, steps=300):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net.eval()


def _swag(seed=0):
    torch.manual_seed(seed)
    net = nn.Linear(2, 3)
    swag = SWAG(net, rank=2, warmup=5, max_deviation=None, seed=seed)
    for _ in range(30):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.05 * torch.randn_like(p))
        swag.collect()
    return swag


def _split(net, theta):
    out, i = {}, 0
    for name, p in net.named_parameters():
        out[name] = theta[i:i + p.numel()].view_as(p)
        i += p.numel()
    return out


# ------------------------------------------------------------------ one protocol, written once
def test_every_posterior_answers_the_verbs_with_one_signature():
    X, y = _blobs(60, 0)
    la = FactorLaplace(_trained_mlp(X, y, steps=20), "classification", rank=3).fit([(X, y)])
    ms = MultiSWAG([_swag(0), _swag(1)])
    for posterior in (_swag(), ms, la):
        assert isinstance(posterior, Posterior)
        for verb in VERBS[1:]:  # written once: the very function of the protocol
            assert getattr(type(posterior), verb) is getattr(Posterior, verb), (type(posterior).__name__, verb)
        assert inspect.signature(type(posterior).predictive).parameters.keys() == {"self", "pred_type", "loader"}
    params = inspect.signature(Posterior.predict).parameters
    assert list(params)[:7] == ["self", "x", "pred_type", "link_approx", "num_samples", "generator", "return_var"]
    assert params["pred_type"].default == "nn" and params["link_approx"].default is None
    assert params["num_samples"].default == 30
    assert pyro_fa.FactorLaplace is FactorLaplace and pyro_fa.predictive.Posterior is Posterior
    assert pyro_fa.PyroFactorLaplace is pyro_fa.laplace.PyroFactorLaplace


def test_the_likelihood_vocabulary_is_normalised_once():
    assert LIKELIHOODS == ("classification", "regression")
    assert normalize_likelihood("SWAG", "categorical") == "classification"
    assert normalize_likelihood("SWAG", "gaussian") == "regression"
    assert normalize_likelihood("SWAG", "regression") == "regression"
    with pytest.raises(ValueError, match=r"^SWAG: likelihood must be one of 'classification', 'regression', got "
                                         r"'foo'\.$"):
        normalize_likelihood("SWAG", "foo")
    with pytest.raises(ValueError, match=r"^SWAG: likelihood must be one of 'classification', 'regression', got "
                                         r"'foo'\. \(A callable"):
        _swag().log_likelihood(torch.randn(5, 2), torch.zeros(5, dtype=torch.long), "foo")
    with pytest.raises(ValueError, match=r"FactorLaplace: likelihood must be one of 'classification', 'regression', "
                                         r"got 'Gaussian'\."):
        FactorLaplace(nn.Linear(2, 1), "Gaussian")
    assert FactorLaplace(nn.Linear(2, 1), "gaussian").likelihood == "regression"
    # the alias and the name score alike
    swag = _swag()
    X, y = _blobs(20, 1)
    assert swag.log_likelihood(X, y, "categorical") == swag.log_likelihood(X, y, "classification")
    assert resolve_link_approx("SWAG", "nn") == "mc" and resolve_link_approx("SWAG", "glm") == "probit"
    with pytest.raises(ValueError, match=r"SWAG: link_approx='probit' needs pred_type='glm'"):
        resolve_link_approx("SWAG", "nn", "probit")


# ------------------------------------------------------------------ FactorLaplace through the protocol
def test_factor_laplace_tune_scale_matches_a_brute_force_validation_curve():
    """tune_scale on a FactorLaplace scores every candidate scale by the validation log-likelihood of the model
    average, on common draws: recomputed here by hand (the draws from sample(), scaled about the MAP, each run
    through torch.func.functional_call), and the chosen scale is the brute-force curve's best (rule="argmax")."""
    X, y = _blobs(300, 0)
    X_val, y_val = _blobs(200, 1)
    net = _trained_mlp(X, y)
    la = FactorLaplace(net, "classification", rank=10, prior_precision=1.0).fit([(X, y)])
    scales = [0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
    S = 40
    search = la.tune_scale(X_val, y_val, scales=scales, num_samples=S, rule="argmax", widen=0, seed=3)
    assert search.scales == [0.0] + scales
    thetas = la.sample(S, generator=torch.Generator().manual_seed(3))  # the scorer's draws: a CPU generator, seed 3
    brute = []
    for s in search.scales:
        logp = torch.stack([torch.func.functional_call(net, _split(net, la.loc + math.sqrt(s) * (t - la.loc)),
                                                       (X_val,)).log_softmax(-1)[torch.arange(200), y_val]
                            for t in thetas])
        brute.append(float((torch.logsumexp(logp, 0) - math.log(S)).mean()))
    assert search.log_likelihoods == pytest.approx(brute, rel=1e-10, abs=1e-12)
    best = search.scales[max(range(len(brute)), key=brute.__getitem__)]
    assert search.scale == best == la.scale
    # a sensible choice here: the curve rises from the MAP and falls past the best (an interior maximum)
    assert 0.0 < best < scales[-1] and brute[-1] < max(brute)
    # the chosen scale is the one predictions use: log_likelihood at it equals the curve's value
    assert la.log_likelihood(X_val, y_val, num_samples=S, seed=3) == pytest.approx(max(brute), rel=1e-10)
    # and the gated default never does worse than the MAP on validation
    gated = la.tune_scale(X_val, y_val, scales=scales, num_samples=S, seed=3)
    assert gated.log_likelihoods[gated.scales.index(gated.scale)] >= gated.log_likelihoods[0]


def test_factor_laplace_scale_zero_is_the_map_network_and_temperature_takes_its_predictive():
    X, y = _blobs(120, 2)
    net = _trained_mlp(X, y, steps=100)
    la = FactorLaplace(net, "classification", rank=5).fit([(X, y)])
    la.scale = 0.0
    with torch.no_grad():
        torch.testing.assert_close(la.predict_proba(X[:7]), net(X[:7]).softmax(-1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(la.predict_proba(X[:7], pred_type="glm"), net(X[:7]).softmax(-1))
    la.scale = 1.0
    scaled = TemperatureScaling(lambda x: la.predict_log_proba(x, generator=torch.Generator().manual_seed(0)))
    scaled.fit(X, y)
    assert scaled.temperature == pytest.approx(fit_temperature(
        la.predict_log_proba(X, generator=torch.Generator().manual_seed(0)), y))
    with pytest.raises(ValueError, match=r"FactorLaplace: num_samples must be an integer >= 1, got 0"):
        la.predict_proba(X, num_samples=0)


def test_factor_laplace_regression_predict_against_the_dense_posterior():
    """Bayesian linear regression (exact at rank >= D): predict's closed-form GLM mean and variance against
    the dense posterior, x^T P^{-1} x s + sigma^2; the sampled predictive's mean and variance against them."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 3, generator=g)
    y = X @ torch.tensor([1.0, -1.0, 0.5]) + 0.3 * torch.randn(50, generator=g)
    net = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0))  # outputs of shape (N,)
    Z = torch.cat([X, torch.ones(50, 1)], 1)
    P = 2.0 * torch.eye(4) + Z.T @ Z / 0.09
    with torch.no_grad():
        m = torch.linalg.solve(P, Z.T @ y / 0.09)
        net[0].weight.copy_(m[:3][None])
        net[0].bias.copy_(m[3:])
    la = FactorLaplace(net, "regression", rank=4, prior_precision=2.0, sigma_noise=0.3).fit([(X, y)])
    la.scale = 2.0
    x = torch.randn(6, 3, generator=g)
    x1 = torch.cat([x, torch.ones(6, 1)], 1)
    var = 2.0 * torch.einsum("nd,de,ne->n", x1, torch.linalg.inv(P), x1) + 0.09
    mean, v = la.predict(x, pred_type="glm", return_var=True)
    assert mean.shape == v.shape == (6,)
    torch.testing.assert_close(mean, x1 @ m)
    torch.testing.assert_close(v, var)
    torch.testing.assert_close(la.predict(x, pred_type="glm"), x1 @ m)
    torch.testing.assert_close(la(x, pred_type="glm")[1], var)  # laplace-torch's la(x): (mean, variance)
    S = 20_000
    mean_nn, v_nn = la.predict(x, return_var=True, num_samples=S, generator=torch.Generator().manual_seed(1))
    sd = (var - 0.09).sqrt()
    assert bool(((mean_nn - x1 @ m).abs() < 5 * sd / math.sqrt(S)).all())
    assert bool(((v_nn - var).abs() < 5 * (var - 0.09) * math.sqrt(2 / S)).all())
    with pytest.raises(ValueError, match=r"FactorLaplace: noise_std must be positive and finite, got -1"):
        la.predict(x, return_var=True, noise_std=-1)


def test_one_bernoulli_logit_gives_two_class_probabilities_on_every_path():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(80, 2, generator=g)
    y = (X[:, 0] > 0).long()
    net = nn.Linear(2, 1)
    la = FactorLaplace(net, "classification", rank=3).fit([(X, y)])
    mean, var = la._linearized_marginals((X[:5],), None)[0]
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var.reshape(-1))
    p1 = torch.sigmoid(kappa * mean.reshape(-1))
    torch.testing.assert_close(la.predict_proba(X[:5], pred_type="glm"), torch.stack([1 - p1, p1], -1))
    draws = la.sample(9, generator=torch.Generator().manual_seed(2))
    by_hand = torch.stack([torch.sigmoid(torch.func.functional_call(net, _split(net, t), (X[:5],))).reshape(-1)
                           for t in draws]).mean(0)
    p = la.predict_proba(X[:5], num_samples=9, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(p, torch.stack([1 - by_hand, by_hand], -1))
    torch.testing.assert_close(la.predict_log_proba(X[:5], num_samples=9, generator=torch.Generator().manual_seed(2)),
                               p.log())


def test_multiswag_predicts_with_num_samples_in_all_split_over_its_members():
    a, b = _swag(0), _swag(1)
    ms = MultiSWAG([a, b])
    x = torch.randn(4, 2)
    p = ms.predict_proba(x, num_samples=5, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    draws = [(a, t) for t in a.sample(3, generator=g)] + [(b, t) for t in b.sample(2, generator=g)]
    by_hand = sum(torch.func.functional_call(m._source.module, _split(m._source.module, t), (x,)).softmax(-1)
                  for m, t in draws) / 5
    torch.testing.assert_close(p, by_hand)
    with pytest.raises(RuntimeError, match=r"SWAG: predictions need a posterior built from an nn.Module"):
        params_only = SWAG([torch.zeros(3, requires_grad=True)], rank=1, method="swag")
        params_only.collect()
        params_only.predict(x)
