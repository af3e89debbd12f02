"""The online fits on the streams users give them: float32 iterates with a tiny spread,
vectors whose update would overflow, diverging training runs, and states that do not fit."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from pyro_fa import SWAG, OnlineFactorAnalysis
from pyro_fa.fa.batch import ScatterStatistics
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.sklearn import FactorAnalysis


def _late_sgd_like(T, D=20, K=2, offset=1e3, seed=0):
    """Vectors with variance ~1e-8 around entries of ~1e3 (late SGD iterates), rounded to float32."""
    g = torch.Generator().manual_seed(seed)
    F = torch.randn(D, K, generator=g, dtype=torch.float64) * 1e-4
    psi = torch.rand(D, generator=g, dtype=torch.float64) * 1e-8 + 1e-9
    mu = offset + torch.randn(D, generator=g, dtype=torch.float64)
    X = mu + torch.randn(T, K, generator=g, dtype=torch.float64) @ F.T
    X = X + torch.randn(T, D, generator=g, dtype=torch.float64) * psi.sqrt()
    return X.float()  # the data as a float32 user has it


def _state(module):
    return {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in module.state_dict().items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        elif k.endswith("_optimizer_state"):
            for pid, st in a[k]["state"].items():
                for name, v in st.items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[k]["state"][pid][name])), (k, name)
        else:
            assert a[k] == b[k], k


def test_running_moments_float32_stream_exact_at_any_offset():
    X = _late_sgd_like(3000)
    m = RunningMoments(X.shape[1])
    n = 0
    for i in range(0, 3000, 7):  # uneven batches, merged exactly
        mean, sq_dev, _ = m.propose(X[i:i + 7], n)
        m.commit(mean, sq_dev)
        n += X[i:i + 7].shape[0]
    ref = X.double()
    torch.testing.assert_close(m.mean, ref.mean(0), rtol=1e-15, atol=0)
    torch.testing.assert_close(m.variance(n), ref.var(0, correction=0), rtol=1e-9, atol=0)
    assert m.mean.dtype == torch.float64
    m.float()  # the owner's dtype changes; the accumulators keep their width and bits
    assert m.mean.dtype == torch.float64
    torch.testing.assert_close(m.mean, ref.mean(0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("method", ["em", "sga"])
def test_float32_fit_matches_float64_on_late_iterates(method):
    # 3000 single updates: float32 state used to freeze its mean 1 ulp from the truth and
    # to bias every variance by the stale mean's squared error
    X = _late_sgd_like(3000)
    fits = {}
    for dtype in (torch.float32, torch.float64):
        fa = OnlineFactorAnalysis(20, 2, method=method, warmup=100, seed=0, dtype=dtype)
        for x in X.to(dtype):
            fa.update(x)
        fits[dtype] = fa
    f32, f64 = fits[torch.float32], fits[torch.float64]
    mean = X.double().mean(0)
    assert torch.equal(f32.loc, mean.float())  # the exact mean, rounded once
    torch.testing.assert_close(f32.variance.double(), X.double().var(0, correction=0), rtol=1e-5, atol=0)
    S = torch.cov(X.double().T, correction=0)
    err = {dt: float((fa.covariance().double() - S).norm() / S.norm()) for dt, fa in fits.items()}
    assert err[torch.float32] <= 1.05 * err[torch.float64] + 1e-3, err
    if method == "em":
        assert err[torch.float64] < 0.1


def test_classic_swag_float32_moments_exact():
    X = _late_sgd_like(500)
    p = torch.zeros(20, dtype=torch.float32)
    swag = SWAG([p], rank=3, method="swag")
    for x in X:
        p.data.copy_(x)
        swag.collect()
    ref = X.double()
    assert torch.equal(swag.loc, ref.mean(0).float())
    torch.testing.assert_close(swag.cov_diag.double(), 0.5 * ref.var(0, correction=0), rtol=1e-5, atol=0)
    # the last deviations, from the running mean after each vector, rounded once
    devs = torch.stack([X[i].double() - ref[: i + 1].mean(0) for i in range(497, 500)]).float()
    kept = swag._dev[torch.tensor([497 % 3, 498 % 3, 499 % 3])]
    torch.testing.assert_close(kept, devs, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("method", ["em", "sga"])
@pytest.mark.parametrize("dtype, big", [(torch.float32, 1e20), (torch.float64, 1e200)])
def test_vector_whose_update_would_overflow_is_refused(method, dtype, big):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 8, generator=g, dtype=dtype)
    fa = OnlineFactorAnalysis(8, 2, method=method, warmup=50, seed=0, dtype=dtype)
    fa.update(X[:200])
    before = _state(fa)
    bad = X[200:203].clone()
    bad[1] = big  # finite, but its square overflows the dtype
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: x must stay within the range whose update fits"):
        fa.update(bad)
    with pytest.raises(ValueError, match="The update was refused and the model is unchanged"):
        fa.update(bad[1])
    _same_state(before, _state(fa))
    for x in X[200:]:  # the model goes on as if the bad vectors had never come
        fa.update(x)
    assert fa.n_updates == 300
    assert torch.isfinite(fa.cov_factor).all() and torch.isfinite(fa.cov_diag).all()
    assert torch.isfinite(fa.sample(4)).all()


def test_first_vector_huge_then_normal_refused():
    fa = OnlineFactorAnalysis(4, 1, warmup=5, seed=0, dtype=torch.float32)
    fa.update(torch.full((4,), 1e20, dtype=torch.float32))  # alone it is a mean, nothing overflows
    with pytest.raises(ValueError, match="would overflow"):
        fa.update(torch.zeros(4, dtype=torch.float32))  # its variance with the first would be 2.5e39
    assert fa.n_updates == 1


def _diverging_run(method, on_nonfinite, dtype=torch.float32):
    torch.manual_seed(0)
    X = torch.randn(256, 5, dtype=dtype)
    y = X @ torch.randn(5, 1, dtype=dtype) + 0.1 * torch.randn(256, 1, dtype=dtype)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    swag = SWAG(net, rank=4, method=method, warmup=50, seed=0, on_nonfinite=on_nonfinite)
    swag.attach(opt)

    def steps(n):
        for _ in range(n):
            idx = torch.randint(0, 256, (32,))
            opt.zero_grad()
            nn.functional.mse_loss(net(X[idx]), y[idx]).backward()
            opt.step()

    return net, opt, swag, steps


@pytest.mark.parametrize("method", ["em", "sga", "swag"])
def test_diverging_run_keeps_the_posterior_collected_before(method):
    net, opt, swag, steps = _diverging_run(method, "skip")
    steps(200)
    before = _state(swag)
    cov_diag = swag.cov_diag.clone()
    assert float(cov_diag.max()) < 1.0
    for group in opt.param_groups:
        group["lr"] = 50.0
    with pytest.warns(RuntimeWarning, match=r"SWAG: the parameter vector must (lie within max_deviation|be finite)"):
        steps(40)
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert not torch.isfinite(params).all() or float(params.abs().max()) > 1e3  # the run did diverge
    assert swag.n_collected == 200 and swag.n_refused == 40
    after = _state(swag)
    for k in before:
        if torch.is_tensor(before[k]):
            assert torch.equal(before[k], after[k]), k
    torch.testing.assert_close(swag.cov_diag, cov_diag, rtol=0, atol=0)
    assert torch.isfinite(swag.sample(8)).all()


def test_diverging_run_raise_mode_guard_warns_then_nonfinite_raises():
    # the guard never stops training (it skips with a warning); the non-finite vectors of the
    # diverged run then raise, with a message that is true: the posterior is the one before
    net, opt, swag, steps = _diverging_run("em", "raise")
    steps(100)
    before = _state(swag)
    for group in opt.param_groups:
        group["lr"] = 50.0
    with pytest.warns(RuntimeWarning, match=r"the run looks diverged; .*\). It was not collected and the posterior "
                                            r"is unchanged \(100 vectors collected\)"):
        with pytest.raises(ValueError, match=r"SWAG: the parameter vector must be finite, got NaN or inf .* It was "
                                             r"not collected and the posterior is unchanged \(100 vectors collected\)"):
            steps(200)
    after = _state(swag)
    for k in before:
        if torch.is_tensor(before[k]):
            assert torch.equal(before[k], after[k]), k
    assert torch.isfinite(swag.cov_diag).all()


def test_guard_does_not_judge_without_spread():
    p = torch.zeros(5)
    swag = SWAG([p], rank=2, method="swag")
    for _ in range(15):  # identical vectors (a schedule that ended at rate 0): no spread yet
        swag.collect()
    p.data.fill_(0.01)
    assert swag.collect() is True and swag.n_refused == 0

def test_divergence_guard_leaves_ordinary_runs_alone():
    # a random walk and a Gaussian stream: every vector is collected
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(30)
    swag = SWAG([p], rank=3, method="swag")
    walk = torch.randn(2000, 30, generator=g).cumsum(0)
    for x in walk:
        p.data.copy_(x)
        swag.collect()
    assert swag.n_refused == 0 and swag.n_collected == 2000
    with pytest.raises(ValueError, match=r"SWAG: max_deviation must be a finite number > 1 or None, got 0.5"):
        SWAG([p], rank=3, max_deviation=0.5)


@pytest.mark.parametrize("method", ["em", "sga"])
def test_failed_load_state_dict_changes_nothing(method):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 10, generator=g)
    fa = OnlineFactorAnalysis(10, 3, method=method, warmup=50, seed=0)
    fa.update(X)
    other = OnlineFactorAnalysis(10, 2, method=method, warmup=50, seed=1)
    other.update(X[:100] * 5)
    before = _state(fa)
    with pytest.raises(ValueError, match=r"OnlineFactorAnalysis: state_dict\['_F'\] must have shape \(10, 3\)"):
        fa.load_state_dict(other.state_dict())
    _same_state(before, _state(fa))
    bad = _state(fa)
    bad["loc"][0] = float("nan")
    with pytest.raises(ValueError, match=r"state_dict\['loc'\] must be finite"):
        fa.load_state_dict(bad)
    bad = _state(fa)
    bad["_extra_state"]["n_updates"] = -3
    with pytest.raises(ValueError, match=r"'n_updates' must be a non-negative integer, got -3"):
        fa.load_state_dict(bad)
    bad = _state(fa)
    del bad["_moments.mean"]
    with pytest.raises(ValueError, match=r"missing keys \['_moments.mean'\]"):
        fa.load_state_dict(bad)
    _same_state(before, _state(fa))
    fa.update(X[:5])  # and it goes on
    assert fa.n_updates == 305


def test_failed_swag_load_changes_nothing():
    net = nn.Linear(4, 2)
    swag = SWAG(net, rank=3, method="em", warmup=10)
    for _ in range(30):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * torch.randn_like(p))
        swag.collect()
    before = _state(swag)
    other = SWAG(net, rank=2, method="em", warmup=10)
    other.collect()
    with pytest.raises(ValueError, match=r"SWAG: state_dict\['fa._F'\] must have shape \(10, 3\)"):
        swag.load_state_dict(other.state_dict())
    after = _state(swag)
    for k in before:
        if torch.is_tensor(before[k]):
            assert torch.equal(before[k], after[k]), k
    assert swag.n_collected == 30


@pytest.mark.parametrize("algorithm", ["online_em", "sga", "em", "svd"])
def test_sklearn_partial_fit_refuses_overflowing_rows(algorithm):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 6))
    fa = FactorAnalysis(n_components=2, algorithm=algorithm, warmup=50, random_state=0)
    fa.partial_fit(X[:200])
    attrs = {k: copy.deepcopy(v) for k, v in vars(fa).items() if k != "_model"}
    model_state = _state(fa._model)
    bad = X[200:300].copy()
    bad[40] = 1e200
    with pytest.raises(ValueError, match=r"(overflow|fit the model's dtype)"):
        fa.partial_fit(bad)
    _same_state(model_state, _state(fa._model))
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, getattr(fa, k))
    fa.partial_fit(X[200:])
    assert np.isfinite(fa.components_).all() and np.isfinite(fa.score(X))


def test_scatter_statistics_refuse_overflow():
    stats = ScatterStatistics(3)
    stats.update(torch.randn(10, 3))
    before = _state(stats)
    with pytest.raises(ValueError, match=r"ScatterStatistics: x must have squared deviations that fit"):
        stats.update(torch.tensor([[1e200, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    _same_state(before, _state(stats))


def test_once_per_epoch_run_shorter_than_the_warmup_ends_it():
    # 40 epochs, one collection per epoch, with warmup=100 (the old default): distribution() used to refuse
    torch.manual_seed(0)
    X = torch.randn(64, 3)
    y = X.sum(-1, keepdim=True) + 0.1 * torch.randn(64, 1)
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swag = SWAG(net, rank=2, method="em", collect_every=8, warmup=100, seed=0)
    swag.attach(opt)
    record = []
    for epoch in range(40):
        for i in range(8):
            opt.zero_grad()
            nn.functional.mse_loss(net(X[8 * i:8 * i + 8]), y[8 * i:8 * i + 8]).backward()
            opt.step()
        record.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone())
    assert swag.n_collected == 40
    with pytest.warns(UserWarning, match=r"SWAG: 40 vectors collected, not more than warmup=100: the warm-up ends"):
        q = swag.get_posterior()
    # the same as a fit whose warm-up was planned to end there
    ref = OnlineFactorAnalysis(4, 2, warmup=39, seed=0, step_scale=1.0)
    for v in record:
        ref.update(v)
    torch.testing.assert_close(q.cov_factor, ref.cov_factor)
    torch.testing.assert_close(q.cov_diag, ref.cov_diag)
    assert swag.warmup == 39
    swag.sample(3)  # no second warning: the warm-up is over
    state = swag.state_dict()
    again = SWAG(net, rank=2, method="em", collect_every=8, warmup=100, seed=0)
    again.load_state_dict(state)
    again.sample(2)
    assert again.warmup == 39
    short = SWAG(net, rank=2, method="em", warmup=100, seed=0)
    short.collect()
    with torch.no_grad():  # two different vectors (identical ones would extend the warm-up: no spread yet)
        net.bias.add_(0.1)
    short.collect()
    with pytest.raises(RuntimeError, match=r"needs more than warmup=100 collected vectors for method='em', got 2 "
                                           r"\(more than rank=2 to end the warm-up early\)"):
        short.get_posterior()


def test_divergence_guard_lets_a_run_that_changed_regime_back_in():
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(50)
    swag = SWAG([p], rank=3, method="em", warmup=10, seed=0, on_nonfinite="skip")
    x = torch.zeros(50)
    for _ in range(60):  # a slow random walk
        x = x + 0.01 * torch.randn(50, generator=g)
        p.data.copy_(x)
        swag.collect()
    direction = torch.randn(50, generator=g)
    refused = 0
    with pytest.warns(RuntimeWarning) as record:
        for _ in range(60):  # a new regime: a steady drift 40x faster, which leaves the spread
            x = x + 3.0 * direction / direction.norm() + 0.01 * torch.randn(50, generator=g)
            p.data.copy_(x)
            refused += not swag.collect()
    assert 1 <= refused <= 20 and swag.n_collected == 120 - refused
    assert any("collecting again" in str(w.message) for w in record)
    # an exploding run is never let back in
    swag2 = SWAG([p], rank=3, method="em", warmup=10, seed=0, on_nonfinite="skip")
    x = torch.zeros(50)
    for _ in range(60):
        x = x + 0.01 * torch.randn(50, generator=g)
        p.data.copy_(x)
        swag2.collect()
    first_refusal = None
    with pytest.warns(RuntimeWarning, match="looks diverged"):
        for k in range(60):
            p.data.copy_(x + 0.1 * 1.5 ** k * direction)
            if not swag2.collect() and first_refusal is None:
                first_refusal = swag2.n_collected
    assert first_refusal is not None and swag2.n_collected == first_refusal
    assert torch.isfinite(swag2.cov_diag).all()


def test_attach_twice_and_half_precision_refused():
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swag = SWAG(net, rank=1, method="swag")
    handle = swag.attach(opt)
    with pytest.raises(ValueError, match=r"SWAG: optimizer must not be attached twice"):
        swag.attach(opt)
    for _ in range(5):
        opt.zero_grad()
        net(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert swag.n_collected == 5
    handle.remove()
    swag.attach(opt)  # after remove() it may be attached again
    opt.step()
    assert swag.n_collected == 6
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(TypeError, match=r"OnlineFactorAnalysis: dtype must be torch.float32 or torch.float64"):
            OnlineFactorAnalysis(4, 1, dtype=dtype)
        with pytest.raises(TypeError, match=r"SWAG: parameters must be float32 or float64, got '0' of dtype"):
            SWAG([torch.zeros(4, dtype=dtype)], rank=1)
