import io
import math
import pickle
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, init_to_value
from pyro.optim import Adam, ClippedAdam

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, GaussianPrior, LaplacePrior

GUIDES = [AutoLowRankFactorGuide, AutoLowRankMultivariateNormal]
ELBOS = [Trace_ELBO, TraceMeanField_ELBO, FactorELBO]


def _model(X, y=None, subsample_size=None):
    """Global latents (one constrained), a local plate with subsampling; batch agnostic."""
    D = X.shape[-1]
    w = pyro.sample("w", dist.Normal(torch.zeros(D, dtype=X.dtype, device=X.device), 1.0).to_event(1))
    with pyro.plate("groups", 2, dim=-2):
        b = pyro.sample("b", dist.Normal(torch.zeros((), dtype=X.dtype, device=X.device), 1.0))
    s = pyro.sample("s", dist.LogNormal(torch.zeros((), dtype=X.dtype, device=X.device), 1.0))
    with pyro.plate("data", X.shape[0], subsample_size=subsample_size, dim=-1) as idx:
        mean = (w * X[idx]).sum(-1) + b.sum(-2, keepdim=True)
        obs = None if y is None else y[idx]
        return pyro.sample("y", dist.Normal(mean, s), obs=obs)


def _data(device="cpu", N=20):
    X = torch.randn(N, 3, device=device)
    y = X @ torch.tensor([1.0, -0.5, 2.0], device=device) + 0.3 * torch.randn(N, device=device)
    return X, y


@pytest.mark.parametrize("Elbo", ELBOS)
@pytest.mark.parametrize("guide_cls", GUIDES)
def test_svi_shapes(guide_cls, Elbo, device):
    X, y = _data(device)
    guide = guide_cls(_model, rank=2)
    svi = SVI(_model, guide, Adam({"lr": 0.01}), Elbo(max_plate_nesting=2))
    for _ in range(3):
        loss = svi.step(X, y, subsample_size=5)
    assert math.isfinite(loss)
    sample = guide(X, y)
    assert sample["w"].shape == (3,) and sample["b"].shape == (2, 1) and sample["s"].shape == ()
    assert sample["s"] > 0 and sample["w"].device.type == device.type
    assert guide.latent_dim == 6
    post = guide.get_posterior()
    assert isinstance(post, torch.distributions.LowRankMultivariateNormal)
    assert post.loc.shape == (6,) and post.cov_factor.shape == (6, 2) and post.cov_diag.shape == (6,)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_vectorized_particles(guide_cls):
    X, y = _data()
    guide = guide_cls(_model, rank=2)
    for Elbo in ELBOS:
        elbo = Elbo(num_particles=7, vectorize_particles=True, max_plate_nesting=2)
        svi = SVI(_model, guide, Adam({"lr": 0.01}), elbo)
        assert math.isfinite(svi.step(X, y, subsample_size=5))
    with pyro.plate("particles", 7, dim=-3):
        latent = guide.sample_latent(X, y)
        sample = guide(X, y)
    assert latent.shape == (7, 1, 1, 6)
    assert sample["w"].shape == (7, 1, 1, 3) and sample["b"].shape == (7, 2, 1)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_median_and_quantiles(guide_cls):
    X, y = _data()
    guide = guide_cls(_model, rank=2)
    guide(X, y)
    median = guide.median(X, y)
    q = guide.quantiles([0.1, 0.5, 0.9], X, y)
    assert set(median) == set(q) == {"w", "b", "s"}
    for name in median:
        assert q[name].shape == (3,) + median[name].shape
        assert torch.allclose(q[name][1], median[name])
        assert (q[name][0] < q[name][2]).all()
    assert (q["s"] > 0).all()
    # the quantiles are those of the unconstrained marginals N(loc, diag(cov)), pushed through the transform
    post = guide.get_posterior()
    std = post.variance.sqrt()
    w90 = post.loc[:3] + std[:3] * dist.Normal(0.0, 1.0).icdf(torch.tensor(0.9))
    assert torch.allclose(q["w"][2], w90)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_serialization(guide_cls):
    X, y = _data()
    guide = guide_cls(_model, rank=2)
    svi = SVI(_model, guide, Adam({"lr": 0.05}), FactorELBO(max_plate_nesting=2))
    for _ in range(5):
        svi.step(X, y)
    # state_dict round trip into a fresh guide
    state = guide.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = guide_cls(_model, rank=2)
    fresh(X, y)
    fresh.load_state_dict(torch.load(buf))
    a, b = guide.get_posterior(), fresh.get_posterior()
    for attr in ("loc", "cov_factor", "cov_diag"):
        assert torch.equal(getattr(a, attr), getattr(b, attr))
    # pickling the whole guide
    clone = pickle.loads(pickle.dumps(guide))
    assert torch.equal(clone.get_posterior().covariance_matrix, a.covariance_matrix)
    # the param store holds the guide's parameters under its name
    names = set(pyro.get_param_store().keys())
    assert any(name.startswith(f"{guide_cls.__name__}.") for name in names)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_init_loc_fn(guide_cls):
    X, y = _data()
    values = {"w": torch.tensor([0.5, -1.0, 2.0]), "b": torch.tensor([[0.1], [0.2]]), "s": torch.tensor(0.7)}
    guide = guide_cls(_model, rank=2, init_loc_fn=init_to_value(values=values))
    guide(X, y)
    median = guide.median()
    for name, value in values.items():
        assert torch.allclose(median[name], value)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_predictive(guide_cls):
    X, y = _data()
    guide = guide_cls(_model, rank=2)
    svi = SVI(_model, guide, Adam({"lr": 0.05}), FactorELBO(max_plate_nesting=2))
    for _ in range(5):
        svi.step(X, y)
    pred = Predictive(_model, guide=guide, num_samples=11, return_sites=["w", "s", "y", "_RETURN"])
    out = pred(X)
    # sequential Predictive keeps the max_plate_nesting batch dims of each draw, as for every Pyro autoguide
    assert out["w"].reshape(11, 3).shape == (11, 3) and out["s"].numel() == 11
    assert out["y"].reshape(11, 20).shape == (11, 20) and out["_RETURN"].shape[-1] == 20
    assert out["w"].reshape(11, 3).std(0).gt(0).all()
    out_par = Predictive(_model, guide=guide, num_samples=11, parallel=True, return_sites=["y"])(X)
    assert out_par["y"].shape == (11, 1, 20)


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_discrete_site_helpful_error(guide_cls):
    def model():
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        pyro.sample("x", dist.Bernoulli(p))

    guide = guide_cls(model, rank=1)
    with pytest.raises(ValueError, match="Continuous inference cannot handle discrete sample site 'x'"):
        guide()


@pytest.mark.parametrize("guide_cls", GUIDES)
def test_empty_model_error(guide_cls):
    def model():
        pyro.sample("y", dist.Normal(0.0, 1.0), obs=torch.tensor(0.5))

    with pytest.raises(RuntimeError, match="found no latent variables"):
        guide_cls(model)()


def _fit_linreg(linreg, guide, steps, lr, particles, Elbo=FactorELBO):
    optim = ClippedAdam({"lr": lr, "lrd": 0.001 ** (1 / steps), "betas": (0.9, 0.999)})
    svi = SVI(linreg.model, guide, optim, Elbo(num_particles=particles, vectorize_particles=True))
    for _ in range(steps):
        svi.step(linreg.X, linreg.y)
    return guide.get_posterior()


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", GUIDES)
def test_exact_posterior_at_full_rank(linreg, guide_cls):
    """Full rank: the guide's covariance matches S = (alpha I + beta X^T X)^-1 within 1%, mean m too."""
    guide = guide_cls(linreg.model, rank=3, init_scale=0.1)
    q = _fit_linreg(linreg, guide, steps=800, lr=0.1, particles=256)
    cov = q.covariance_matrix.detach()
    assert torch.linalg.norm(cov - linreg.S) / torch.linalg.norm(linreg.S) < 0.01
    assert torch.linalg.norm(q.loc.detach() - linreg.m) / torch.linalg.norm(linreg.m) < 0.01
    elbo = linreg.analytic_elbo(q.loc.detach(), cov)
    # at the exact posterior the bound is tight: ELBO = log evidence up to float64 rounding
    # (the fit reaches S to ~1e-14, and the sign of the last digits depends on the BLAS)
    assert elbo <= linreg.log_evidence + 1e-9
    assert linreg.log_evidence - elbo < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["diagonal", "isotropic"])
def test_elbo_below_log_evidence_at_rank_one(linreg, noise):
    guide = AutoLowRankFactorGuide(linreg.model, rank=1, noise=noise, init_scale=0.1)
    q = _fit_linreg(linreg, guide, steps=600, lr=0.05, particles=16)
    elbo = linreg.analytic_elbo(q.loc.detach(), q.covariance_matrix.detach())
    assert elbo < linreg.log_evidence
    assert linreg.log_evidence - elbo < 2.0  # and not absurdly far: D = 3, rank 1


def test_orthogonal_initialisation_scale():
    def model():
        pyro.sample("w", dist.Normal(torch.zeros(50), 1.0).to_event(1))

    guide = AutoLowRankFactorGuide(model, rank=5, init_scale=0.02)
    guide()
    G = guide.factor.detach()
    assert torch.allclose(G.T @ G, 10.0 * torch.eye(5), atol=1e-10)  # orthogonal columns, norm^2 = D / K
    assert math.isclose(float(guide.get_posterior().variance.mean().detach()), 0.02**2, rel_tol=1e-10)
    assert torch.allclose(guide.cov_diag, torch.full((50,), 0.02**2 / 2))
    assert torch.allclose(guide.get_posterior().cov_factor, guide.cov_factor)


def test_isotropic_noise_learned_and_fixed(linreg):
    guide = AutoLowRankFactorGuide(linreg.model, rank=1, noise="isotropic")
    q = _fit_linreg(linreg, guide, steps=50, lr=0.05, particles=2)
    assert torch.allclose(q.cov_diag, q.cov_diag[0].expand(3))
    assert guide.scale.shape == ()
    fixed = AutoLowRankFactorGuide(linreg.model, rank=1, noise="isotropic", noise_scale=0.05)
    q = _fit_linreg(linreg, fixed, steps=50, lr=0.05, particles=2)
    assert torch.allclose(q.cov_diag, torch.full((3,), 0.05**2))
    assert "scale" in fixed.state_dict() and all(p is not fixed.scale for p in fixed.parameters())


def test_default_init_from_bayesianized_module():
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    bnn = GaussianPrior(1.0).bayesianize(net)
    guide = AutoLowRankFactorGuide(bnn, rank=2)
    guide(torch.randn(4, 3))
    median = guide.median()
    for name, value in bnn.initial_values.items():
        assert torch.allclose(median[name], value)


@pytest.mark.slow
def test_stable_training_at_large_dimension():
    """D = 22 000, rank 100, float32 (the size of pyro-ppl/pyro#2127): finite and decreasing loss."""
    torch.set_default_dtype(torch.float32)
    D = 22_000
    target = torch.randn(D)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(w, 0.1).to_event(1), obs=target)

    guide = AutoLowRankFactorGuide(model, rank=100)
    svi = SVI(model, guide, Adam({"lr": 0.05}), FactorELBO())
    losses = [svi.step() for _ in range(60)]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert torch.isfinite(guide.get_posterior().variance).all()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"rank": 0}, ValueError, r"AutoLowRankFactorGuide: rank must be >= 1, got 0\."),
        ({"rank": 2.0}, TypeError, r"AutoLowRankFactorGuide: rank must be an int or None, got 2\.0\."),
        ({"noise": "full"}, ValueError, r"AutoLowRankFactorGuide: noise must be one of \('diagonal', 'isotropic'\), got 'full'\."),
        ({"init_scale": 0.0}, ValueError, r"AutoLowRankFactorGuide: init_scale must be a positive finite float, got 0\.0\."),
        ({"init_scale": "0.1"}, TypeError, r"AutoLowRankFactorGuide: init_scale must be a positive float, got '0\.1'\."),
        ({"noise_scale": 0.1}, ValueError, r"AutoLowRankFactorGuide: noise_scale must be None when noise='diagonal', got 0\.1\. Pass noise='isotropic'"),
        ({"noise": "isotropic", "noise_scale": -1.0}, ValueError, r"AutoLowRankFactorGuide: noise_scale must be a positive finite float, got -1\.0\."),
        ({"init_loc_fn": 2}, TypeError, r"AutoLowRankFactorGuide: init_loc_fn must be a callable or None, got 2\. "
                                        r"The positional order is Pyro's \(model, init_loc_fn, init_scale, rank\): pass rank=2\."),
        ({"init_loc_fn": "median"}, TypeError, r"AutoLowRankFactorGuide: init_loc_fn must be a callable or None, got 'median'\.$"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        AutoLowRankFactorGuide(_model, **kwargs)


def test_rank_larger_than_latent_dimension_is_clipped_with_a_warning():
    """Pyro's low-rank guide accepts rank > D; ours clips it to D and says so."""
    X, y = _data()
    guide = AutoLowRankFactorGuide(_model, rank=7)
    with pytest.warns(UserWarning, match=r"AutoLowRankFactorGuide: rank 7 exceeds the latent dimension D=6; using rank=6\."):
        guide(X, y)
    assert guide.rank == 6 and guide.factor.shape == (6, 6)
    q = guide.get_posterior()
    assert q.cov_factor.shape == (6, 6) and torch.isfinite(q.log_prob(q.loc))
    pyro_guide = AutoLowRankMultivariateNormal(_model, rank=7)
    pyro_guide(X, y)
    assert pyro_guide.cov_factor.shape == (6, 7)  # what Pyro does with the same argument



def test_a_guide_built_over_an_older_guides_params_of_another_shape_warns():
    """Pyro's param store keeps a name's first value: a rank-2 guide after a rank-1 one keeps the rank-1 factor."""
    X, y = _data()
    AutoLowRankFactorGuide(_model, rank=1)(X, y)
    stored = pyro.get_param_store()["AutoLowRankFactorGuide.factor"].detach().clone()
    guide = AutoLowRankFactorGuide(_model, rank=2)
    with pytest.warns(UserWarning, match=r"AutoLowRankFactorGuide: param 'AutoLowRankFactorGuide\.factor' must have "
                                         r"shape \(6, 2\) .*got \(6, 1\).*pyro\.clear_param_store\(\)"):
        guide(X, y)
    assert torch.equal(guide.factor.detach(), stored)  # what the warning says: the stored value is kept
    pyro.clear_param_store()  # the fix it names
    guide = AutoLowRankFactorGuide(_model, rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide(X, y)
    assert guide.factor.shape == (6, 2)


def test_an_isotropic_guide_over_a_diagonal_guides_scale_warns():
    X, y = _data()
    AutoLowRankFactorGuide(_model, rank=1)(X, y)
    with pytest.warns(UserWarning, match=r"param 'AutoLowRankFactorGuide\.scale' must have shape \(\) .*got \(6,\)"):
        AutoLowRankFactorGuide(_model, rank=1, noise="isotropic")(X, y)


def test_a_second_guide_of_the_same_shape_shares_the_store_without_a_warning():
    X, y = _data()
    AutoLowRankFactorGuide(_model, rank=2)(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AutoLowRankFactorGuide(_model, rank=2)(X, y)  # Pyro's sharing by name, as intended

def test_latent_sites_on_two_devices():
    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("b", dist.Normal(torch.zeros(2, device="meta"), 1.0, validate_args=False).to_event(1))

    guide = AutoLowRankFactorGuide(model, rank=1, init_loc_fn=lambda site: torch.zeros_like(site["fn"].mean))
    with pytest.raises(ValueError, match=r"AutoLowRankFactorGuide: latent sites must all be on one device, got \['cpu', 'meta'\]\."):
        guide()


# ------------------------------------------------------------------ loc_scale (whitened mean)
def test_loc_scale_prior_is_the_prior_standard_deviation():
    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2), 10.0).to_event(1))
        pyro.sample("b", LaplacePrior(scale=3.0).distribution(torch.zeros(3)))
        pyro.sample("s", dist.LogNormal(0.0, 5.0))  # constrained: unit scale
        pyro.sample("c", dist.Cauchy(0.0, 1.0))  # infinite variance: unit scale

    guide = AutoLowRankFactorGuide(model, rank=1, loc_scale="prior")
    guide()
    expected = torch.tensor([10.0, 10.0] + [3.0 * math.sqrt(2)] * 3 + [1.0, 1.0])
    assert torch.allclose(guide.loc_scale, expected)
    assert torch.allclose(guide.loc, guide.whitened_loc * expected)
    assert torch.allclose(guide.get_posterior().loc, guide.loc)
    assert "whitened_loc" in dict(guide.named_parameters()) and "loc" not in dict(guide.named_parameters())
    fixed = AutoLowRankFactorGuide(model, rank=1, loc_scale=2.0)
    fixed()
    assert torch.allclose(fixed.loc_scale, torch.full((7,), 2.0))


@pytest.mark.slow
def test_loc_scale_reaches_a_distant_posterior_mean():
    """Regression test for vifa-synthetic's mean error: Adam moves c by about lr per step.

    Prior N(0, 10^2 I), exact posterior mean about 25 prior-free units away
    (seed 4 of vifa-synthetic): with c itself as the parameter, 1000 steps of lr
    0.02 cannot get there; whitened by the prior scale they do, and the fit
    matches the closed-form posterior N(m, S).
    """
    from pyro_fa.experiments.vifa_synthetic import ALPHA, _model as synthetic_model, make_data

    X, y, m, S = make_data(4)
    model = synthetic_model(GaussianPrior(ALPHA))

    def fit(**kw):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoLowRankFactorGuide(model, rank=1, **kw)
        svi = SVI(model, guide, Adam({"lr": 0.02}), FactorELBO(num_particles=8, vectorize_particles=True))
        for _ in range(1000):
            svi.step(X, y)
        return guide.get_posterior()

    q = fit(loc_scale="prior")
    assert torch.linalg.norm(q.loc.detach() - m) / torch.linalg.norm(m) < 1e-6
    assert torch.linalg.norm(q.covariance_matrix.detach() - S) / torch.linalg.norm(S) < 1e-4
    q = fit()
    assert torch.linalg.norm(q.loc.detach() - m) / torch.linalg.norm(m) > 0.05


def test_loc_scale_serialization():
    X, y = _data()
    guide = AutoLowRankFactorGuide(_model, rank=2, loc_scale="prior")
    svi = SVI(_model, guide, Adam({"lr": 0.05}), FactorELBO())
    for _ in range(3):
        svi.step(X, y)
    state = guide.state_dict()
    assert set(state) >= {"whitened_loc", "loc_scale"}
    other = AutoLowRankFactorGuide(_model, rank=2, loc_scale="prior")
    other(X, y)
    other.load_state_dict(state)
    assert torch.allclose(other.loc, guide.loc) and torch.allclose(other.median(X, y)["w"], guide.median(X, y)["w"])


@pytest.mark.parametrize(
    "value, exc, match",
    [
        ("data", ValueError, r"AutoLowRankFactorGuide: loc_scale must be None, 'prior' or a positive float, got 'data'\."),
        (0.0, ValueError, r"AutoLowRankFactorGuide: loc_scale must be a positive finite float, got 0\.0\."),
        ([1.0], TypeError, r"AutoLowRankFactorGuide: loc_scale must be a positive float, got \[1\.0\]\."),
    ],
)
def test_loc_scale_bad_arguments(value, exc, match):
    with pytest.raises(exc, match=match):
        AutoLowRankFactorGuide(_model, loc_scale=value)


@pytest.mark.parametrize("store_restored", [False, True], ids=["same-store", "store-restored"])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_keeps_param_store_in_step(assign, store_restored):
    """After load_state_dict, SVI starts from the loaded values and moves the guide's own parameters,
    also when the param store holds other tensor objects than the guide (e.g. after ``set_state``)."""
    from pyro.optim import SGD

    def model():
        pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    pyro.clear_param_store()
    guide = AutoLowRankFactorGuide(model, rank=1)
    svi = SVI(model, guide, SGD({"lr": 0.01}), Trace_ELBO())
    for _ in range(5):
        svi.step()
    if store_restored:  # the store now holds copies, not the guide's Parameter objects
        import copy

        pyro.get_param_store().set_state(copy.deepcopy(pyro.get_param_store().get_state()))
    loaded = {k: v.detach().clone() + 2.0 for k, v in guide.state_dict().items()}
    guide.load_state_dict({k: v.clone() for k, v in loaded.items()}, assign=assign)
    assert torch.equal(guide.loc.detach(), loaded["loc"])
    pyro.set_rng_seed(0)
    svi.step()
    moved = guide.loc.detach().clone()
    assert not torch.equal(moved, loaded["loc"])  # SVI moved the guide's own loc ...
    assert (moved - loaded["loc"]).abs().max() < 0.2  # ... by one small step from the loaded value
    store = dict(pyro.get_param_store().named_parameters())
    assert torch.equal(store["AutoLowRankFactorGuide.loc"].detach(), moved)


# ------------------------------------------------------------------ use before the first call, load transactions
@pytest.mark.parametrize("call", ["get_posterior", "get_transform", "get_base_dist", "cov_factor", "cov_diag", "median"])
def test_use_before_the_guide_has_run(call):
    guide = AutoLowRankFactorGuide(_model, rank=2)
    with pytest.raises(RuntimeError, match=r"AutoLowRankFactorGuide: .* needs the guide's parameters, which are created "
                                           r"from a first trace of the model; call the guide once .* or run one SVI step first\."):
        attr = getattr(guide, call)
        attr() if callable(attr) else None


def _fitted(rank=2, **kwargs):
    pyro.clear_param_store()  # guides of one class share the store's names
    X, y = _data()
    guide = AutoLowRankFactorGuide(_model, rank=rank, **kwargs)
    svi = SVI(_model, guide, Adam({"lr": 0.05}), Trace_ELBO(max_plate_nesting=2))
    for _ in range(3):
        svi.step(X, y)
    return guide, X, y


def _snapshot(guide):
    return {k: v.detach().clone() for k, v in guide.state_dict().items()}


def _assert_unchanged(guide, before):
    after = guide.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k


@pytest.mark.parametrize(
    "other, match",
    [
        (dict(rank=3), r"saved with rank=3, D=6, noise='diagonal', loc_scale=None .* but this guide has rank=2, D=6, "
                       r"noise='diagonal', loc_scale=None"),
        (dict(rank=2, noise="isotropic"), r"saved with rank=2, D=6, noise='isotropic'"),
        (dict(rank=2, noise="isotropic", noise_scale=0.3), r"saved with rank=2, D=6, noise='isotropic', noise_scale fixed"),
        (dict(rank=2, loc_scale=2.0), r"saved with rank=2, D=6, noise='diagonal', loc_scale set"),
    ],
    ids=["rank", "noise", "fixed-noise", "loc_scale"],
)
def test_load_state_dict_with_other_settings_refused_before_any_write(other, match):
    guide, X, y = _fitted()
    before = _snapshot(guide)
    source, _, _ = _fitted(**other)
    state = {k: v.detach() + 1.0 for k, v in source.state_dict().items()}
    with pytest.raises(RuntimeError, match=match + r".*Build the guide with the settings the state was saved with\."):
        guide.load_state_dict(state)
    _assert_unchanged(guide, before)
    # nested in a parent module: the same check, the same transaction
    parent = torch.nn.Module()
    parent.guide = guide
    with pytest.raises(RuntimeError, match=match):
        parent.load_state_dict({f"guide.{k}": v for k, v in state.items()})
    _assert_unchanged(guide, before)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("loc", float("nan"), r"'loc' must be finite"),
        ("factor", float("inf"), r"'factor' must be finite"),
        ("scale_unconstrained", float("nan"), r"'scale_unconstrained' must be finite"),
        ("scale_unconstrained", -1e4, r"the noise scale must be positive and finite"),  # exp underflows to 0
    ],
)
def test_load_state_dict_non_finite_or_non_positive_refused(key, value, match):
    guide, X, y = _fitted()
    before = _snapshot(guide)
    state = _snapshot(guide)
    state["loc"] = state["loc"] + 1.0  # a change that must not be written
    state[key] = state[key].clone()
    state[key].view(-1)[0] = value
    with pytest.raises(ValueError, match=r"AutoLowRankFactorGuide: load_state_dict: " + match):
        guide.load_state_dict(state)
    _assert_unchanged(guide, before)


def test_load_state_dict_non_positive_fixed_noise_refused():
    guide, X, y = _fitted(noise="isotropic", noise_scale=0.3)
    before = _snapshot(guide)
    state = _snapshot(guide)
    state["scale"] = torch.tensor(-0.3)
    with pytest.raises(ValueError, match=r"AutoLowRankFactorGuide: load_state_dict: 'scale' must be positive, got tensor\(-0\.3"):
        guide.load_state_dict(state)
    _assert_unchanged(guide, before)


def test_load_state_dict_before_the_guide_has_run():
    guide, X, y = _fitted()
    fresh = AutoLowRankFactorGuide(_model, rank=2)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) needs the guide's parameters"):
        fresh.load_state_dict(guide.state_dict())


def test_unpack_latent_matches_pyros_for_every_batch_shape():
    """The guide caches where each site sits in the packed latent; the pieces are Pyro's, for any batch shape."""
    from pyro.infer.autoguide import AutoContinuous

    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("p", 3):
            pyro.sample("b", dist.LogNormal(torch.zeros((), dtype=torch.float64), 1.0))
        pyro.sample("c", dist.Dirichlet(torch.ones(4, dtype=torch.float64)))

    pyro.clear_param_store()
    guide = AutoLowRankFactorGuide(model, rank=2)
    guide()
    D = guide.latent_dim
    for shape in [(D,), (5, 1, D), (2, 5, 1, D), (D,)]:  # the last one again: from the cache
        latent = torch.randn(shape, dtype=torch.float64)
        ours = list(guide._unpack_latent(latent))
        pyros = list(AutoContinuous._unpack_latent(guide, latent))
        assert [s["name"] for s, _ in ours] == [s["name"] for s, _ in pyros] == ["a", "b", "c"]
        for (_, x), (_, y) in zip(ours, pyros):
            assert x.shape == y.shape and torch.equal(x, y)
    with pytest.raises(AssertionError):
        list(guide._unpack_latent(torch.randn(D + 1, dtype=torch.float64)))
