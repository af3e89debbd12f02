"""The contract every registered fitter of OnlineFactorAnalysis keeps (pyro_fa.fa.fitters).

One suite, parametrised over the fitters in ``FITTERS`` (online EM, online SGA) and the toy fitter
of docs/architecture.md ("Add a fitter"): state round trip, dtype and device, refusal of bad input
with the state unchanged, and agreement of the fitted distribution with an independent computation
(dense algebra; batch factor analysis on the same stream).
"""
import re
from pathlib import Path

import pytest
import torch

from pyro_fa import OnlineFactorAnalysis
from pyro_fa.fa.batch import BatchFactorAnalysis
from pyro_fa.fa.fitters import FITTERS, Fitter, fitter_class, register_fitter

BUILTIN = ["em", "sga", "sketch"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _doc_example() -> str:
    text = DOC.read_text()
    section = text[text.index("## Add a fitter"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def toy_fitter():
    """Runs the documented example (it registers "diagonal"), then removes it from the registry."""
    namespace = {}
    try:
        exec(compile(_doc_example(), str(DOC), "exec"), namespace)
        yield namespace
    finally:
        FITTERS.pop("diagonal", None)


def _stream(D=8, K=2, T=600, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=torch.float64)
    psi = 0.1 + torch.rand(D, generator=g, dtype=torch.float64)
    X = 3.0 + torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T + psi.sqrt() * torch.randn(
        T, D, generator=g, dtype=torch.float64)
    return X.to(dtype=dtype, device=device), F @ F.T + torch.diag(psi)


def _fit(method, X, seed=0, **kw):
    kw = dict(dict(warmup=20, seed=seed, dtype=X.dtype, device=X.device), **kw)
    if method == "sga" and kw.get("optimizer") is None:
        kw.setdefault("lr", 1e-2)
    fa = OnlineFactorAnalysis(X.shape[-1], 2, method=method, **kw)
    for chunk in X.split(3):
        fa.update(chunk)
    return fa


def _state(fa):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in fa.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("method", BUILTIN)
def test_registry_holds_the_builtin_fitters(method):
    cls = fitter_class(method, "OnlineFactorAnalysis")
    assert issubclass(cls, Fitter) and cls.name == method and FITTERS[method] is cls
    assert isinstance(OnlineFactorAnalysis(5, 2, method=method, warmup=2).fitter, cls)


def test_unknown_method_is_refused_at_the_boundary():
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: method must be one of \('em', 'sga', 'sketch'\), got 'pca'"):
        OnlineFactorAnalysis(5, 2, method="pca")


def test_register_fitter_refuses_a_taken_name_and_a_non_fitter():
    with pytest.raises(ValueError, match=r"register_fitter: name must be new, got 'em', which names OnlineEM"):
        register_fitter("em")(type("Other", (Fitter,), {}))
    with pytest.raises(TypeError, match=r"register_fitter: the decorated class must subclass Fitter"):
        register_fitter("plain")(object)
    with pytest.raises(ValueError, match=r"register_fitter: name must be a non-empty str, got ''"):
        register_fitter("")
    assert "plain" not in FITTERS


@pytest.mark.parametrize("method", BUILTIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_state_round_trip_gives_identical_draws_and_updates(method, dtype, device):
    X, _ = _stream(dtype=dtype, device=device)
    src = _fit(method, X[:300], seed=0)
    dst = _fit(method, X[:50], seed=1)  # another seed, another count: everything must come from the state
    dst.load_state_dict(src.state_dict())
    for name in ("loc", "cov_factor", "cov_diag"):
        assert torch.equal(getattr(dst, name), getattr(src, name)), name
    torch.manual_seed(0)
    a = src.sample(4)
    torch.manual_seed(0)
    b = dst.sample(4)
    assert torch.equal(a, b)
    for chunk in X[300:].split(3):  # and the two fits go on alike
        src.update(chunk)
        dst.update(chunk)
    assert torch.equal(dst.cov_factor, src.cov_factor) and torch.equal(dst.cov_diag, src.cov_diag)


def test_sga_continues_alike_after_a_load():
    # the optimizer state is copied on load (it was shared with the source's: each one's steps moved the other)
    X, _ = _stream()
    src, dst = _fit("sga", X[:300], seed=0), _fit("sga", X[:50], seed=1)
    dst.load_state_dict(src.state_dict())
    for chunk in X[300:].split(3):
        src.update(chunk)
        dst.update(chunk)
    assert torch.equal(dst.cov_factor, src.cov_factor) and torch.equal(dst.cov_diag, src.cov_diag)


@pytest.mark.parametrize("method", BUILTIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_factors_and_draws_have_the_state_dtype_and_device(method, dtype, device):
    X, _ = _stream(T=100, dtype=dtype, device=device)
    fa = _fit(method, X)
    for t in (fa.loc, fa.cov_factor, fa.cov_diag, fa.sample(2), fa.log_prob(X[:2])):
        assert t.dtype == dtype and t.device.type == device
    assert fa.cov_factor.shape == (8, 2) and fa.cov_diag.shape == (8,)
    moved = _fit(method, X.double().cpu()).to(dtype=dtype, device=device)  # and .to() moves the whole state
    moved.update(X[:3])
    assert moved.cov_factor.dtype == dtype and moved.cov_factor.device.type == device


@pytest.mark.parametrize("method", BUILTIN)
@pytest.mark.parametrize("bad, error, match", [
    (lambda X: X[:2].clone().index_fill_(1, torch.tensor([3]), float("nan")), ValueError, r"x must be finite"),
    (lambda X: X[:2, :5], ValueError, r"x must have shape \(D,\) or \(B, D\) with D=8, got shape \(2, 5\)"),
    (lambda X: X[:2].float(), TypeError, r"x must have dtype torch.float64 like the model state, got torch.float32"),
    (lambda X: X[:2] * 1e300, ValueError, r"x must stay within the range whose update fits torch.float64"),
])
def test_bad_input_is_refused_with_the_state_unchanged(method, bad, error, match):
    X, _ = _stream(T=200)
    fa = _fit(method, X)
    before = _state(fa)
    with pytest.raises(error, match="OnlineFactorAnalysis: " + match):
        fa.update(bad(X))
    _same(before, _state(fa))


@pytest.mark.parametrize("method", BUILTIN)
def test_distribution_is_the_dense_gaussian_of_the_factors(method):
    X, _ = _stream(T=200)
    fa = _fit(method, X)
    F, psi = fa.cov_factor, fa.cov_diag
    dense = torch.distributions.MultivariateNormal(X.mean(0), F @ F.T + torch.diag(psi))
    assert torch.allclose(fa.loc, X.mean(0), rtol=0, atol=1e-12)  # the running mean is exact
    assert torch.allclose(fa.variance, X.var(0, correction=0), rtol=1e-12, atol=0)
    assert torch.allclose(fa.log_prob(X[:5]), dense.log_prob(X[:5]), rtol=1e-10, atol=1e-10)
    assert torch.allclose(fa.covariance(), dense.covariance_matrix, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method, T, tol", [("em", 3000, 0.05), ("sga", 20000, 0.2)])
def test_fitted_covariance_agrees_with_batch_fa_on_the_same_stream(method, T, tol):
    X, _ = _stream(T=T, seed=3)
    fa = _fit(method, X, warmup=50)
    batch = BatchFactorAnalysis(8, 2, dtype=torch.float64).fit(X)
    ours = fa.covariance()
    ref = batch.cov_factor @ batch.cov_factor.T + torch.diag(batch.cov_diag)
    assert float(torch.linalg.norm(ours - ref) / torch.linalg.norm(ref)) < tol


def test_documented_toy_fitter_is_used_by_online_factor_analysis(toy_fitter):
    # the example of docs/architecture.md ran (its own asserts included) and registered "diagonal"
    assert FITTERS["diagonal"] is toy_fitter["DiagonalFitter"]
    X, _ = _stream(T=100)
    fa = OnlineFactorAnalysis(8, 2, method="diagonal", warmup=1, seed=0, dtype=torch.float64)
    fa.update(X)
    assert torch.equal(fa.cov_factor, torch.zeros(8, 2, dtype=torch.float64))
    assert torch.allclose(fa.cov_diag, X.var(0, correction=0), rtol=1e-12, atol=0)
    # the shared contract holds for it too: refusal with the state unchanged, state round trip
    before = _state(fa)
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: x must be finite"):
        fa.update(torch.full((1, 8), float("nan"), dtype=torch.float64))
    _same(before, _state(fa))
    other = OnlineFactorAnalysis(8, 2, method="diagonal", warmup=1, seed=5, dtype=torch.float64)
    other.load_state_dict(fa.state_dict())
    torch.manual_seed(0)
    a = fa.sample(3)
    torch.manual_seed(0)
    assert torch.equal(other.sample(3), a)
    short = OnlineFactorAnalysis(8, 2, method="diagonal", warmup=50, seed=0, dtype=torch.float64)
    short.update(X[:10])
    with pytest.raises(RuntimeError, match=r"OnlineFactorAnalysis: finish_warmup\(\) needs a method that can end "
                                           r"its warm-up early, got 'diagonal'"):
        short.finish_warmup()


def test_one_registry_serves_swag_and_factor_laplace(toy_fitter):
    # a fitter registered in its one file is SWAG's method (supports_iterates) by name and as an object, and
    # FactorLaplace's curvature_fit when it names one, with no list elsewhere to edit
    from torch import nn

    from pyro_fa import SWAG
    from pyro_fa.fa.fitters import curvature_fitters, iterate_fitters
    from pyro_fa.laplace import FactorLaplace
    from pyro_fa.laplace.moment import fit_second_moment, moment_fits

    Diagonal = toy_fitter["DiagonalFitter"]
    assert "diagonal" in iterate_fitters() and "diagonal" not in curvature_fitters()
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()
    for method in ("diagonal", Diagonal(shrink=0.5)):
        swag = SWAG(net, rank=1, method=method, warmup=1, seed=0)
        thetas = []
        for _ in range(6):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p))
            swag.collect()
            thetas.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        shrink = 1.0 if method == "diagonal" else 0.5
        var = torch.stack(thetas).var(0, correction=0)  # the dense reference of the running variances
        assert swag.method == "diagonal"
        assert torch.allclose(swag.fa.cov_diag, shrink * var, rtol=1e-10)
    with pytest.raises(ValueError, match=r"FactorLaplace: curvature_fit must be one of \('auto', 'scatter', 'online', "
                                         r"'sketch', 'randomized', 'exact'\), got 'diagonal'"):
        FactorLaplace(net, "regression", rank=1, curvature_fit="diagonal")
    Diagonal.curvature_fit = "diagonal"  # now FactorLaplace offers it: the second moment of +-v is diag(E v^2)
    try:
        assert moment_fits() == ("auto", "scatter", "online", "sketch", "diagonal", "randomized", "exact")
        V = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        F, psi, info = fit_second_moment(lambda: iter([V]), 5, 1, method="diagonal", dtype=torch.float64)
        assert info["method"] == "diagonal" and torch.equal(F, torch.zeros(5, 1, dtype=torch.float64))
        assert torch.allclose(psi, V.pow(2).mean(0), rtol=1e-10)
    finally:
        del Diagonal.curvature_fit


def test_a_fitter_object_carries_its_options():
    from pyro_fa.fa.fitters.em import OnlineEM
    from pyro_fa.fa.fitters.sga import OnlineSGA

    X, _ = _stream(T=200)
    by_name = _fit("sga", X, lr=3e-3, optimizer="natural", optimizer_kwargs={"step": 0.5}, m_step_every=2)
    by_object = _fit(OnlineSGA(lr=3e-3, optimizer="natural", optimizer_kwargs={"step": 0.5}, m_step_every=2), X)
    _same(_state(by_name), _state(by_object))
    assert by_object.method == "sga" and by_object.fitter.natural
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: expand, step_scale must be given to the fitter "
                                         r"object with method=OnlineEM\(\.\.\.\), got them beside it"):
        OnlineFactorAnalysis(8, 2, method=OnlineEM(), step_scale=3.0, expand=False)
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: step_scale must be a finite number >= 1, got 0.5"):
        OnlineFactorAnalysis(8, 2, method=OnlineEM(step_scale=0.5))
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: lr must be a positive finite number, got -1"):
        OnlineFactorAnalysis(8, 2, method=OnlineSGA(lr=-1))


def test_factor_laplace_fits_the_curvature_with_a_fitter_object():
    # curvature_fit="online" is online EM with its defaults; an OnlineEM object with other options fits with them
    from pyro_fa.fa.fitters import OnlineEM
    from pyro_fa.laplace.moment import fit_second_moment

    V = torch.randn(60, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    kw = dict(dtype=torch.float64, num_passes=2, seed=0)
    F, psi, info = fit_second_moment(lambda: iter([V]), 6, 2, method="online", **kw)
    F1, psi1, info1 = fit_second_moment(lambda: iter([V]), 6, 2, method=OnlineEM(), **kw)
    assert torch.equal(F, F1) and torch.equal(psi, psi1) and info1["method"] == "online"
    F2, psi2, _ = fit_second_moment(lambda: iter([V]), 6, 2, method=OnlineEM(step_scale=1.0, expand=False), **kw)
    fa = OnlineFactorAnalysis(6, 2, method=OnlineEM(step_scale=1.0, expand=False), seed=0, dtype=torch.float64)
    for _ in range(2):
        fa.update(torch.cat([V, -V]))  # the stream +-v, as the curvature fit feeds it
    assert torch.equal(F2, fa.cov_factor) and torch.equal(psi2, fa.cov_diag) and not torch.equal(psi2, psi)


# ---------------------------------------------------------------- SWAG over its three fits
# SWAG holds one fit per method (pyro_fa.swag._fits: em and sga through OnlineFactorAnalysis, classic SWAG's
# deviations in pyro_fa.swag._classic); the same contract, seen from the iterates of an optimizer.
SWAG_METHODS = ["em", "sga", "swag"]


def _swag(method, X, seed=0, **kw):
    from pyro_fa import SWAG

    p = torch.zeros(X.shape[-1], dtype=X.dtype, device=X.device, requires_grad=True)
    with pytest.warns(UserWarning, match="method 'sga'") if method == "sga" else _nothing():
        swag = SWAG([p], rank=2, method=method, warmup=10, seed=seed, **kw)
    for x in X:
        with torch.no_grad():
            p.copy_(x)
        swag.collect()
    return swag, p


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("method", SWAG_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swag_state_round_trip_gives_identical_draws(method, dtype):
    X, _ = _stream(T=80, dtype=dtype)
    src, _ = _swag(method, X[:60], seed=0)
    dst, _ = _swag(method, X[:20], seed=1)
    dst.load_state_dict(src.state_dict())
    assert dst.n_collected == src.n_collected == 60
    for name in ("loc", "cov_factor", "cov_diag"):
        assert torch.equal(getattr(dst, name), getattr(src, name)), name
    a = src.sample(5, generator=torch.Generator().manual_seed(0))
    b = dst.sample(5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    for swag in (src, dst):
        p = swag._source.named[0][1]
        for x in X[60:]:
            with torch.no_grad():
                p.copy_(x)
            swag.collect()
    assert torch.equal(dst.cov_factor, src.cov_factor) and torch.equal(dst.cov_diag, src.cov_diag)


@pytest.mark.parametrize("method", SWAG_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swag_factors_and_draws_have_the_weights_dtype(method, dtype):
    X, _ = _stream(T=40, dtype=dtype)
    swag, _ = _swag(method, X)
    d = swag.get_posterior()
    for t in (swag.loc, swag.cov_factor, swag.cov_diag, swag.sample(3), d.log_prob(X[:2])):
        assert t.dtype == dtype
    assert swag.cov_factor.shape == (8, 2) and swag.cov_diag.shape == (8,) and swag.sample(3).shape == (3, 8)


@pytest.mark.parametrize("method", SWAG_METHODS)
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_swag_bad_vector_is_refused_with_the_state_unchanged(method, on_nonfinite):
    X, _ = _stream(T=40)
    swag, p = _swag(method, X, on_nonfinite=on_nonfinite)
    posterior = lambda: {k: v for k, v in _state(swag).items() if torch.is_tensor(v)}  # noqa: E731  (not n_refused)
    before = posterior()
    with torch.no_grad():
        p.copy_(X[0]).index_fill_(0, torch.tensor([3]), float("nan"))
    match = r"SWAG: the parameter vector must be finite, got NaN or inf in 1 entries"
    if on_nonfinite == "raise":
        with pytest.raises(ValueError, match=match):
            swag.collect()
    else:
        with pytest.warns(RuntimeWarning, match=match):
            assert swag.collect() is False
    _same(before, posterior())
    with torch.no_grad():  # the divergence guard skips (whatever on_nonfinite says), state unchanged
        p.copy_(X[0] + 1e6)
    with pytest.warns(RuntimeWarning, match=r"SWAG: the parameter vector must lie within max_deviation=10"):
        assert swag.collect() is False
    _same(before, posterior())
    assert swag.n_refused == 2 and swag.n_collected == 40


@pytest.mark.parametrize("method", SWAG_METHODS)
def test_swag_distribution_is_the_dense_gaussian_of_its_factors(method):
    X, _ = _stream(T=40)
    swag, _ = _swag(method, X)
    F, psi = swag.cov_factor, swag.cov_diag
    dense = torch.distributions.MultivariateNormal(X.mean(0), F @ F.T + torch.diag(psi))
    assert torch.allclose(swag.loc, X.mean(0), rtol=0, atol=1e-12)  # the running mean is exact
    assert torch.allclose(swag.get_posterior().log_prob(X[:5]), dense.log_prob(X[:5]), rtol=1e-10, atol=1e-10)
    # draws: mean and covariance of many agree with the dense ones
    draws = swag.sample(40000, generator=torch.Generator().manual_seed(0))
    cov = dense.covariance_matrix
    assert float(torch.linalg.norm(torch.cov(draws.T) - cov) / torch.linalg.norm(cov)) < 0.05


def test_classic_swag_factors_are_maddox_et_al_from_the_iterates():
    # Maddox et al. (2019), eq. 3 / Alg. 1, computed densely from the stored iterates
    X, _ = _stream(T=40)
    swag, _ = _swag("swag", X)
    K, T = 2, X.shape[0]
    means = X.cumsum(0) / torch.arange(1, T + 1, dtype=X.dtype).unsqueeze(-1)  # the mean after each iterate
    dev = (X - means)[-K:]  # the last K deviations theta_i - mean_i
    assert torch.allclose(swag.cov_factor @ swag.cov_factor.T, dev.T @ dev / (2 * (K - 1)), rtol=1e-10, atol=1e-12)
    var = X.var(0, correction=0)
    assert torch.allclose(swag.cov_diag, 0.5 * var.clamp_min(1e-4 * var.mean()), rtol=1e-10, atol=0)
