"""One contract for every posterior: get_posterior() is a member of the family (pyro_fa.distributions) and sample()
draws from it; each checked against a dense torch MultivariateNormal built from covariance_matrix, or large Monte
Carlo, in float64 and float32, on the CPU and (where there is one) the GPU."""
import functools
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn
from torch.distributions import MultivariateNormal

from pyro_fa import SWAG, AutoLowRankFactorGuide, FactorELBO, MultiSWAG
from pyro_fa.distributions import (BlockLowRankPrecisionNormal, FactorNormal, FactorNormalMixture,
                                   LowRankPrecisionNormal, PointMassNormal, StableLowRankMultivariateNormal)
from pyro_fa.laplace import FactorLaplace, PyroFactorLaplace

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float64, torch.float32]


# ----------------------------------------------------------------------------- the posteriors, small and quick
def _swag(method, dtype, device, seed=0, scale=1.0):
    torch.manual_seed(seed)
    net = nn.Linear(3, 2).to(dtype=dtype, device=device)
    swag = SWAG(net, rank=2, method=method, warmup=5, seed=seed, max_deviation=None)
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=dtype))
        swag.collect()
    swag.scale = scale
    return swag


def _fresh_swag(post):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGA's advice to prefer EM on few iterates
        return SWAG(nn.Linear(3, 2).to(dtype=post.loc.dtype, device=post.loc.device), rank=2, method=post.method,
                    warmup=5, max_deviation=None)


def _linear_model(X, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=X.dtype, device=X.device), 1.0).to_event(1))
    with pyro.plate("n", X.shape[0]):
        pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def _linear_data(dtype, device):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 3, generator=g, dtype=dtype)
    y = X @ torch.tensor([1.0, -1.0, 0.5], dtype=dtype) + 0.5 * torch.randn(20, generator=g, dtype=dtype)
    return X.to(device), y.to(device)


def _guide(dtype, device):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _linear_data(dtype, device)
    guide = AutoLowRankFactorGuide(_linear_model, rank=2)
    svi = pyro.infer.SVI(_linear_model, guide, pyro.optim.Adam({"lr": 0.05}), FactorELBO())
    for _ in range(10):
        svi.step(X, y)
    return guide


def _fresh_guide(post):
    X, y = _linear_data(post.loc.dtype, post.loc.device)
    fresh = AutoLowRankFactorGuide(_linear_model, rank=2)
    fresh(X, y)
    return fresh


def _mlp_data(dtype, device):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=g, dtype=dtype)
    y = torch.randint(3, (30,), generator=g)
    return X.to(device), y.to(device)


def _mlp(dtype, device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype=dtype, device=device)


def _laplace(rank, dtype, device):
    X, y = _mlp_data(dtype, device)
    return FactorLaplace(_mlp(dtype, device), "classification", rank=rank, curvature_fit="scatter",
                         seed=0).fit([(X[:15], y[:15]), (X[15:], y[15:])])


def _fresh_laplace(rank, post):
    return FactorLaplace(_mlp(post.loc.dtype, post.loc.device), "classification", rank=rank)


def _pyro_laplace(dtype, device):
    from pyro.infer.autoguide import AutoDelta

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    X, y = _linear_data(dtype, device)
    svi = pyro.infer.SVI(_linear_model, AutoDelta(_linear_model), pyro.optim.Adam({"lr": 0.1}), pyro.infer.Trace_ELBO())
    for _ in range(30):
        svi.step(X, y)
    return PyroFactorLaplace(_linear_model, rank=2, num_samples=20, seed=0).fit(X, y)


def _multiswag(dtype, device, scale=1.0):
    ms = MultiSWAG([_swag("em", dtype, device, seed=0), _swag("em", dtype, device, seed=1)])
    ms.scale = scale
    return ms


def _fresh_multiswag(post):
    return MultiSWAG([_fresh_swag(m) for m in post.members])


def _online_fa(dtype, device):
    from pyro_fa import OnlineFactorAnalysis

    X = torch.randn(200, 5, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
    fa = OnlineFactorAnalysis(5, 2, seed=0, dtype=dtype, device=device)
    fa.update(X)
    return fa


def _fresh_online_fa(post):
    from pyro_fa import OnlineFactorAnalysis

    return OnlineFactorAnalysis(5, 2, seed=1, dtype=post.loc.dtype, device=post.loc.device)


def _batch_fa(dtype, device):
    from pyro_fa import BatchFactorAnalysis

    X = torch.randn(200, 5, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
    return BatchFactorAnalysis(5, 2, seed=0, dtype=dtype, device=device).fit(X)


def _fresh_batch_fa(post):
    from pyro_fa import BatchFactorAnalysis

    return BatchFactorAnalysis(5, 2, seed=1, dtype=post.loc.dtype, device=post.loc.device)


def _pathfinder(dtype, device):
    from pyro_fa.infer import Pathfinder

    pyro.set_rng_seed(0)
    X, y = _linear_data(dtype, device)
    return Pathfinder(_linear_model, dtype=dtype).fit(X, y, generator=torch.Generator(device=device).manual_seed(0))


def _batch_and_match(dtype, device):
    from pyro_fa.infer import BatchAndMatch

    pyro.set_rng_seed(0)
    X, y = _linear_data(dtype, device)
    return BatchAndMatch(_linear_model, rank=2, num_iters=30, dtype=dtype).fit(
        X, y, generator=torch.Generator(device=device).manual_seed(0))


def _factor_ivon(dtype, device):
    from pyro_fa.optim import FactorIVON

    X, y = _mlp_data(dtype, device)
    net = _mlp(dtype, device)
    opt = FactorIVON(net.parameters(), lr=0.05, ess=30.0, beta2=0.99, rank=2)
    for _ in range(10):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return opt.posterior(net.eval())


#: name -> (build(dtype, device), fresh(post) for the state_dict round trip or None, the form get_posterior returns)
CASES = {
    "swag-em": (functools.partial(_swag, "em"), _fresh_swag, StableLowRankMultivariateNormal),
    "swag-sga": (functools.partial(_swag, "sga"), _fresh_swag, StableLowRankMultivariateNormal),
    "swag-sketch": (functools.partial(_swag, "sketch"), _fresh_swag, StableLowRankMultivariateNormal),
    "swag-classic": (functools.partial(_swag, "swag"), _fresh_swag, StableLowRankMultivariateNormal),
    "swag-em-scale-2.5": (functools.partial(_swag, "em", scale=2.5), _fresh_swag, StableLowRankMultivariateNormal),
    "swag-em-scale-0": (functools.partial(_swag, "em", scale=0.0), _fresh_swag, PointMassNormal),
    "multiswag": (_multiswag, _fresh_multiswag, FactorNormalMixture),
    "multiswag-scale-0": (functools.partial(_multiswag, scale=0.0), _fresh_multiswag, FactorNormalMixture),
    "guide": (_guide, _fresh_guide, StableLowRankMultivariateNormal),
    "laplace-dense": (functools.partial(_laplace, 3), functools.partial(_fresh_laplace, 3), LowRankPrecisionNormal),
    "laplace-blocks": (functools.partial(_laplace, [2, 3]), functools.partial(_fresh_laplace, [2, 3]),
                       BlockLowRankPrecisionNormal),
    "pyro-laplace": (_pyro_laplace, None, LowRankPrecisionNormal),
    "online-fa": (_online_fa, _fresh_online_fa, StableLowRankMultivariateNormal),
    "batch-fa": (_batch_fa, _fresh_batch_fa, StableLowRankMultivariateNormal),
    "pathfinder": (_pathfinder, None, StableLowRankMultivariateNormal),
    "batch-and-match": (_batch_and_match, None, StableLowRankMultivariateNormal),
    "factor-ivon": (_factor_ivon, None, LowRankPrecisionNormal),  # state: FactorIVON.state_dict()
}


@functools.lru_cache(maxsize=None)
def _built(name, dtype, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGA's advice to prefer EM on few iterates
        return CASES[name][0](dtype, torch.device(device))


def _gaussian(q):
    return not isinstance(q, (PointMassNormal, FactorNormalMixture))


def _dense_log_prob(q, x):
    """log q(x) from dense float64 covariance matrices (a log-sum-exp over the components for a mixture)."""
    if isinstance(q, FactorNormalMixture):
        comp = q.component_distribution
        locs, covs = comp.mean.double(), comp.covariance_matrix.double()
        if isinstance(comp, PointMassNormal):
            return torch.stack([(x.double() == m).all(-1).double().log() for m in locs], -1).add(
                q.mixture_distribution.logits.double().log_softmax(-1)).logsumexp(-1)
        lps = torch.stack([MultivariateNormal(m, c).log_prob(x.double()) for m, c in zip(locs, covs)], -1)
        return (lps + q.mixture_distribution.logits.double().log_softmax(-1)).logsumexp(-1)
    if isinstance(q, PointMassNormal):  # the log of the mass, as pyro's Delta
        return (x == q.mean).all(-1).double().log()
    return MultivariateNormal(q.mean.double(), q.covariance_matrix.double()).log_prob(x.double())


def _tol(dtype):
    return dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)


names = pytest.mark.parametrize("name", list(CASES))
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
devices = pytest.mark.parametrize("device", DEVICES)


# ----------------------------------------------------------------------------- the contract
@names
@dtypes
@devices
def test_get_posterior_is_a_member_of_the_family_with_the_posteriors_shapes_dtype_and_device(name, dtype, device):
    post = _built(name, dtype, device)
    q = post.get_posterior()
    assert isinstance(q, CASES[name][2])
    assert isinstance(q, FactorNormal) or isinstance(q, FactorNormalMixture)
    D = post.sample().shape[-1]
    assert q.event_shape == (D,) and q.batch_shape == ()
    for t in (q.mean, q.variance, q.stddev, post.sample(), q.sample()):
        assert t.shape == (D,) and t.dtype == dtype and t.device.type == device
    for t in (post.sample(5), q.sample((5,)), q.log_prob(q.sample((5,)))[:, None].expand(5, D)):
        assert t.shape == (5, D) and t.dtype == dtype and t.device.type == device
    torch.testing.assert_close(q.stddev, q.variance.sqrt())
    if isinstance(q, FactorNormal):
        K = q.cov_factor.shape[-1]
        assert q.cov_factor.shape == (D, K) and q.cov_diag.shape == (D,) and q.factor_sign in (1.0, -1.0)
        assert q.cov_factor.dtype == dtype and q.cov_diag.device.type == device


@names
@dtypes
def test_log_prob_entropy_and_covariance_matvec_against_a_dense_multivariate_normal(name, dtype):
    post = _built(name, dtype, "cpu")
    q = post.get_posterior()
    x = torch.cat([q.sample((3,), generator=torch.Generator().manual_seed(1)), q.mean[None] + 0.01])
    torch.testing.assert_close(q.log_prob(x).double(), _dense_log_prob(q, x), **_tol(dtype))
    Sigma = q.covariance_matrix
    if isinstance(q, FactorNormal):
        if not isinstance(q, PointMassNormal):
            B = q.cov_factor.double()  # the factor form: Sigma = diag(cov_diag) + sign B B^T
            torch.testing.assert_close(Sigma.double(), torch.diag(q.cov_diag.double()) + q.factor_sign * B @ B.T,
                                       **_tol(dtype))
            dense = MultivariateNormal(q.mean.double(), Sigma.double())
            torch.testing.assert_close(q.entropy().double(), dense.entropy(), **_tol(dtype))
        else:
            assert q.entropy() == -math.inf
    V = torch.randn(4, Sigma.shape[-1], generator=torch.Generator().manual_seed(2), dtype=dtype)
    torch.testing.assert_close(q.covariance_matvec(V), V @ Sigma, **_tol(dtype))
    torch.testing.assert_close(q.variance, Sigma.diagonal(), **_tol(dtype))


def test_the_point_mass_member_is_the_mean_alone():
    loc = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    q = PointMassNormal(loc)
    assert torch.equal(q.mean, loc) and torch.equal(q.variance, torch.zeros(3, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert torch.equal(q.sample((2,), generator=g), loc.expand(2, 3)) and torch.equal(g.get_state(), state)
    assert torch.equal(q.log_prob(torch.stack([loc, loc + 1e-12])), torch.tensor([0.0, -math.inf], dtype=loc.dtype))
    assert q.entropy() == -math.inf
    assert torch.equal(q.covariance_matvec(torch.ones(2, 3, dtype=loc.dtype)), torch.zeros(2, 3, dtype=loc.dtype))
    assert torch.equal(q.covariance_matrix, torch.zeros(3, 3, dtype=loc.dtype))
    assert q.expand((2,)).sample().shape == (2, 3)
    with pytest.raises(ValueError, match=r"PointMassNormal: loc must be a tensor of shape \(..., D\), got \(\)"):
        PointMassNormal(torch.tensor(1.0))


def test_the_mixture_refuses_components_outside_the_family():
    from torch.distributions import Categorical, Independent, Normal

    with pytest.raises(TypeError, match=r"FactorNormalMixture: component_distribution must be a FactorNormal, got "
                                        r"Independent"):
        FactorNormalMixture(Categorical(logits=torch.zeros(2)), Independent(Normal(torch.zeros(2, 3), 1.0), 1))
    with pytest.raises(ValueError, match=r"FactorNormalMixture: component_distribution must have batch shape \(M,\), "
                                         r"got \(2, 2\)"):
        FactorNormalMixture(Categorical(logits=torch.zeros(2)), PointMassNormal(torch.zeros(2, 2, 3)))


@names
def test_sample_with_a_seeded_generator_is_reproducible_and_leaves_the_global_generator(name):
    post = _built(name, torch.float64, "cpu")
    q = post.get_posterior()
    torch.manual_seed(5)
    after = torch.rand(())
    torch.manual_seed(5)
    a = post.sample(4, generator=torch.Generator().manual_seed(3))
    b = post.sample(4, generator=torch.Generator().manual_seed(3))
    c = q.sample((4,), generator=torch.Generator().manual_seed(3))
    d = q.sample((4,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.rand(()), after)  # the global generator untouched
    assert torch.equal(a, b) and torch.equal(c, d)
    if _gaussian(q):
        assert not torch.equal(a, post.sample(4, generator=torch.Generator().manual_seed(4)))
    if not isinstance(post, MultiSWAG) and not isinstance(q, FactorNormalMixture):
        # one generator, one draw: the posterior's sample() is its distribution's (up to rounding)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


@names
def test_sample_moments_match_mean_and_variance_within_five_standard_errors(name):
    post = _built(name, torch.float64, "cpu")
    q = post.get_posterior()
    N = 40_000
    for x in (post.sample(N, generator=torch.Generator().manual_seed(0)),
              q.sample((N,), generator=torch.Generator().manual_seed(1))):
        assert x.shape == (N, q.event_shape[0])
        if isinstance(q, PointMassNormal):
            assert torch.equal(x, q.mean.expand_as(x))
            continue
        mean, var = x.mean(0), x.var(0)
        assert ((mean - q.mean).abs() <= 5 * (var / N).sqrt() + 1e-12).all()
        sq = (x - mean).square()
        assert ((var - q.variance).abs() <= 5 * sq.std(0) / math.sqrt(N) + 1e-12).all()
        # a direction off the axes: the covariance, not only its diagonal
        v = torch.linspace(-1.0, 1.0, x.shape[1], dtype=x.dtype)
        proj = x @ v
        want = (v @ q.covariance_matvec(v)).detach()
        se = ((proj - proj.mean()).square().std() / math.sqrt(N))
        assert abs(float(proj.var() - want)) <= 5 * float(se)


@names
def test_a_state_dict_round_trip_gives_the_same_posterior(name):
    fresh = CASES[name][1]
    if fresh is None:
        pytest.skip("holds no state_dict (PyroFactorLaplace, Pathfinder, BatchAndMatch: refit from the model)")
    post = _built(name, torch.float64, "cpu")
    other = fresh(post)
    other.load_state_dict(post.state_dict())
    if isinstance(post, (SWAG, MultiSWAG)):
        assert other.scale == post.scale
    a, b = post.get_posterior(), other.get_posterior()
    assert type(a) is type(b)
    for attr in ("mean", "variance"):
        assert torch.equal(getattr(a, attr), getattr(b, attr))
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert torch.equal(a.sample((3,), generator=g()), b.sample((3,), generator=g()))
    assert torch.equal(post.sample(3, generator=g()), other.sample(3, generator=g()))


@pytest.mark.parametrize("num_samples", [0, -1, 1.5, True])
@pytest.mark.parametrize("name", ["swag-em", "multiswag", "guide", "laplace-dense", "pyro-laplace", "online-fa",
                                  "batch-fa", "pathfinder", "batch-and-match"])
def test_sample_refuses_a_bad_number_of_samples(name, num_samples):
    post = _built(name, torch.float64, "cpu")
    with pytest.raises(ValueError, match=r"num_samples must be an integer >= 1(?: or None)?, got "):
        post.sample(num_samples)


@pytest.mark.parametrize("name", ["swag-em", "guide", "laplace-dense", "pyro-laplace"])
def test_get_posterior_before_fit_says_what_to_do(name):
    unfitted = {
        "swag-em": lambda: SWAG(nn.Linear(3, 2), rank=2),
        "guide": lambda: AutoLowRankFactorGuide(_linear_model, rank=2),
        "laplace-dense": lambda: FactorLaplace(_mlp(torch.float32, "cpu"), "classification", rank=2),
        "pyro-laplace": lambda: PyroFactorLaplace(_linear_model, rank=2),
    }[name]()
    with pytest.raises(RuntimeError, match=r"get_posterior\(\) needs"):
        unfitted.get_posterior()


def test_multiswag_refuses_members_at_scale_0_beside_members_above_it():
    ms = MultiSWAG([_swag("em", torch.float64, "cpu", seed=0), _swag("em", torch.float64, "cpu", seed=1)])
    ms.members[0].scale = 0.0
    with pytest.raises(ValueError, match=r"MultiSWAG: the members' scales must be all 0 or all > 0 for "
                                         r"get_posterior\(\), got \[0.0, 1.0\]"):
        ms.get_posterior()


# ----------------------------------------------------------------------------- scale 0 (what tune_scale may choose)
def test_swag_at_scale_0_answers_every_verb_with_its_mean():
    swag = _swag("em", torch.float64, "cpu", scale=0.0)
    net = swag._source.module
    q = swag.get_posterior()
    assert isinstance(q, PointMassNormal) and torch.equal(q.mean, swag.loc)
    assert torch.equal(q.variance, torch.zeros_like(swag.loc))
    assert torch.equal(swag.sample(3), swag.loc.expand(3, -1)) and torch.equal(swag.sample(), swag.loc)
    x = torch.randn(6, 3, dtype=torch.float64)
    with swag.sampled_weights(swag.loc):
        at_mean = net(x).detach()
    torch.testing.assert_close(swag.predict(x, num_samples=4), at_mean, rtol=1e-12, atol=1e-12)
    y = torch.randint(2, (6,))
    want = float(torch.log_softmax(at_mean, -1).gather(1, y[:, None]).mean())
    assert swag.log_likelihood(x, y, num_samples=4) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("module", ["numerics", "covariance", "precision", "point_mass", "mixture"])
def test_the_familys_doctests(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"pyro_fa.distributions.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0
