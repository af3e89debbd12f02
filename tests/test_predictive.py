"""The shared predictive (pyro_fa.predictive): model averages against loops over the draws written by hand.

One contract, run over every posterior that predicts through it (SWAG-EM, SWAG-SGA, classic SWAG, a
MultiSWAG member, BayesianNetwork, the docs' own diagonal posterior): the predictive's draws, run in
the network one at a time by hand, give its outputs, its model average and its log-probabilities.
"""
import contextlib
import copy
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from pyro_fa import SWAG, GaussianPrior, MultiSWAG
from pyro_fa.nn import BayesianNetwork
from pyro_fa.predictive import SampledPredictive, bma_log_likelihood, log_mean_exp, tune_scale

ROOT = Path(__file__).resolve().parents[1]


def _trained_swag(method, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    swag = SWAG(net, rank=2, method=method, warmup=4, seed=seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    swag.attach(opt)
    g = torch.Generator().manual_seed(seed)
    for _ in range(30):
        x, y = torch.randn(16, 3, generator=g, dtype=dtype), torch.randint(3, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net, swag


def _swag_case(method):
    def build(dtype):
        net, swag = _trained_swag(method, dtype=dtype)
        predictive = swag.predictive()

        def by_hand(theta, x):  # a copy of the network with the draw's weights, nothing shared
            copy_ = copy.deepcopy(net)
            vector_to_parameters(theta, copy_.parameters())
            return copy_(x)

        return predictive, by_hand, lambda: [p.detach().clone() for p in net.parameters()]
    return build


def _multiswag_member_case(dtype):
    ms = MultiSWAG([_trained_swag("em", seed=s, dtype=dtype)[1] for s in range(2)])
    member = ms.members[1]
    net = member.predictive().module

    def by_hand(theta, x):
        copy_ = copy.deepcopy(net)
        vector_to_parameters(theta, copy_.parameters())
        return copy_(x)

    return member.predictive(), by_hand, lambda: [p.detach().clone() for p in net.parameters()]


def _bayesian_network_case(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    bnn = BayesianNetwork(net, GaussianPrior(1.0), likelihood="categorical", rank=2)
    x, y = torch.randn(32, 3, dtype=dtype), torch.randint(3, (32,))
    import pyro

    bnn.fit([(x, y)], pyro.optim.Adam({"lr": 0.01}), epochs=2, progress=False)
    predictive = bnn.predictive()

    def by_hand(draw, x):  # the network's functional form with the draw's site values
        w0, b0, w1, b1 = (draw[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
        return torch.tanh(x @ w0.T + b0) @ w1.T + b1

    return predictive, by_hand, lambda: []


def _docs_case(dtype):
    namespace = _run_docs_example()
    posterior = namespace["DiagonalPosterior"](nn.Linear(3, 3).to(dtype), variance=0.04)
    net = posterior.module

    def by_hand(theta, x):
        return x @ theta[:9].reshape(3, 3).T + theta[9:]

    return posterior.predictive(), by_hand, lambda: [p.detach().clone() for p in net.parameters()]


CASES = {"swag-em": _swag_case("em"), "swag-sga": _swag_case("sga"), "swag-classic": _swag_case("swag"),
         "multiswag-member": _multiswag_member_case, "bayesian-network": _bayesian_network_case,
         "docs-example": _docs_case}


@pytest.mark.filterwarnings("ignore:SWAG. method 'sga'")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_model_average_equals_a_loop_over_the_draws_by_hand(case, dtype):
    predictive, by_hand, weights = CASES[case](dtype)
    before = weights()
    x = torch.randn(7, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    draws = predictive.sample(5, torch.Generator().manual_seed(2))
    assert len(draws) == 5
    with torch.no_grad():
        logits = torch.stack([by_hand(d, x) for d in draws])  # (S, N, C)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    outputs = predictive.outputs(draws, x)
    assert outputs.shape == (5, 7, 3) and outputs.dtype == dtype
    torch.testing.assert_close(outputs, logits, **tol)
    probs = logits.softmax(-1)
    torch.testing.assert_close(predictive.average(draws, x, fn=lambda z: z.softmax(-1)),
                               sum(probs[s] for s in range(5)) / 5, **tol)
    torch.testing.assert_close(predictive.average(draws, x), logits.mean(0), **tol)
    torch.testing.assert_close(predictive.log_average_proba(draws, x), probs.mean(0).log(), **tol)
    for p, q in zip(weights(), before):  # the network's own weights are back after every draw
        assert torch.equal(p, q)


@pytest.mark.parametrize("method", ["em", "swag"])
def test_swag_predict_is_the_predictives_average_of_its_draws(method):
    net, swag = _trained_swag(method)
    x = torch.randn(9, 3)
    thetas = swag.sample(6, generator=torch.Generator().manual_seed(3))
    predictive = swag.predictive()
    assert torch.equal(swag.predict_proba(x, num_samples=6, generator=torch.Generator().manual_seed(3)),
                       predictive.average(thetas, x, fn=lambda z: z.softmax(-1)))
    assert torch.equal(swag.predict_log_proba(x, num_samples=6, generator=torch.Generator().manual_seed(3)),
                       predictive.log_average_proba(thetas, x))
    assert torch.equal(predictive.loc, swag.loc)


def test_log_mean_exp_against_the_direct_formula_and_where_the_mean_underflows():
    v = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(log_mean_exp(v), v.exp().mean(0).log(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(log_mean_exp(v, dim=1), v.exp().mean(1).log(), rtol=1e-14, atol=1e-14)
    far = torch.full((3,), -1e4, dtype=torch.float64)
    assert far.exp().mean().log() == -math.inf and log_mean_exp(far) == -1e4


def test_tune_scale_takes_any_posterior_with_a_scale_and_a_predictive():
    namespace = _run_docs_example()
    posterior = namespace["posterior"]
    x, y = namespace["x"], namespace["y"]
    assert posterior.scale == namespace["search"].scale
    # the scores are the model average's log-likelihood on common draws, computed here by hand
    dev = posterior.predictive().deviations(20, torch.Generator().manual_seed(0))
    assert namespace["search"].scales == [0.0, 0.1, 1.0, 10.0]  # the mean (scale 0) is always a candidate
    for s, score in zip([0.0, 0.1, 1.0, 10.0], namespace["search"].log_likelihoods):
        theta = posterior.loc + math.sqrt(s) * dev
        w, b = theta[:, :6].reshape(20, 2, 3), theta[:, 6:]
        logits = torch.einsum("nd,scd->snc", x, w) + b[:, None, :]
        ll = logits.log_softmax(-1).gather(-1, y.expand(20, -1)[..., None])[..., 0]
        assert score == pytest.approx(float((torch.logsumexp(ll, 0) - math.log(20)).mean()), rel=1e-10)
    assert bma_log_likelihood(posterior, x, y, scale=1.0, num_samples=20) == pytest.approx(
        namespace["search"].log_likelihoods[2], rel=1e-12)


def test_sampled_predictive_refusals():
    net = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"SampledPredictive: sample must be callable, got int"):
        SampledPredictive(3, lambda d: contextlib.nullcontext(net))
    with pytest.raises(TypeError, match=r"SampledPredictive: network must be callable, got NoneType"):
        SampledPredictive(lambda S, g: [None] * S, None)
    with pytest.raises(ValueError, match=r"SampledPredictive: loc and deviations must be given together .* "
                                         r"got loc=a Tensor and deviations=None"):
        SampledPredictive(lambda S, g: [None] * S, lambda d: contextlib.nullcontext(net), loc=torch.zeros(6))
    point = SampledPredictive(lambda S, g: [None] * S, lambda d: contextlib.nullcontext(net), module=net)
    with pytest.raises(ValueError, match=r"SampledPredictive: draws must hold at least one draw, got none"):
        point.average([], torch.randn(3, 2))
    x, y = torch.randn(4, 2), torch.randint(2, (4,))

    class NoDeviations:
        scale = 1.0

        def predictive(self):
            return point

    with pytest.raises(TypeError, match=r"tune_scale: the posterior's predictive must give loc and deviations"):
        tune_scale(NoDeviations(), x, y)
    with pytest.raises(TypeError, match=r"tune_scale: posterior must have a scale and a predictive\(\) .*got "
                                        r"Linear\."):
        tune_scale(net, x, y)

    class Mixture:
        members = [NoDeviations(), net]

    with pytest.raises(TypeError, match=r"bma_log_likelihood: posterior must have .*got Mixture with a member of "
                                        r"type Linear\."):
        bma_log_likelihood(Mixture(), x, y)
    with pytest.raises(RuntimeError, match=r"SWAG: predictive\(\) needs at least one collected parameter vector"):
        SWAG(nn.Linear(2, 2), rank=1).predictive()


def _run_docs_example():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Add a predictive", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/architecture.md (Add a predictive)", "exec"), namespace)
    return namespace


def test_docs_example_runs():
    namespace = _run_docs_example()
    assert namespace["probs"].shape == (50, 2)
    torch.testing.assert_close(namespace["probs"].sum(-1), torch.ones(50, dtype=namespace["probs"].dtype))
