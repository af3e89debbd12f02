"""Numerics of the online fits: identical first iterates, the floor on psi, the float32 capacitance at
large D, and reproducibility under ``torch.manual_seed``."""
import math
import warnings

import pytest
import torch
from torch import nn

from pyro_fa import OnlineFactorAnalysis, SWAG
from pyro_fa.fa import linalg


@pytest.fixture
def flush_denormal():
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _fa_stream(n, dim=4, rank=2, scale=0.1, seed=0, dtype=torch.float32):
    """n draws of a known FA model around a centre v (scale: the size of the spread)."""
    g = torch.Generator().manual_seed(seed)
    F = scale * torch.randn(dim, rank, generator=g, dtype=torch.float64)
    psi = scale ** 2 * (0.2 + torch.rand(dim, generator=g, dtype=torch.float64))
    v = torch.randn(dim, generator=g, dtype=torch.float64)
    h = torch.randn(n, rank, generator=g, dtype=torch.float64)
    eps = torch.randn(n, dim, generator=g, dtype=torch.float64)
    x = v + h @ F.T + eps * psi.sqrt()
    return v.to(dtype), x.to(dtype), F, psi


# ------------------------------------------------------------------ identical first iterates (issue 25 item 1)
@pytest.mark.parametrize("method, repeats", [("em", 2), ("em", 5), ("sga", 5)])
def test_identical_first_vectors_do_not_brick_the_fit(method, repeats):
    # OnlineFactorAnalysis(4, 2, warmup=3) fed identical vectors, then noisy ones: every update is accepted,
    # n_updates counts them, the warm-up waits for the spread and the fit describes the noisy ones
    v, x, F, psi = _fa_stream(400, seed=1)
    fa = OnlineFactorAnalysis(4, 2, method=method, warmup=3, seed=0, dtype=torch.float32)
    for _ in range(repeats):
        fa.update(v.clone())
    accepted = 0
    for row in x:
        try:
            fa.update(row)
            accepted += 1
        except (ValueError, RuntimeError):
            pass
    assert accepted == len(x)
    assert fa.n_updates == repeats + accepted  # refused updates (if any) would not count
    assert fa.warmup == 3 + repeats - 1  # the repeats count as one vector for the warm-up
    # the covariance is that of the stream (the repeats pull it in a little): against the sample covariance
    xs = torch.cat([v.expand(repeats, 4), x]).double()
    sample = torch.cov(xs.T, correction=0)
    fitted = linalg.dense_covariance(fa.cov_factor.double(), fa.cov_diag.double())
    rel = float(torch.linalg.norm(fitted - sample) / torch.linalg.norm(sample))
    assert rel < (0.15 if method == "em" else 0.5), rel
    assert bool(torch.isfinite(fa.log_prob(x[:5])).all())


@pytest.mark.parametrize("method", ["em", "sga"])
def test_identical_first_vectors_in_a_batch_and_one_by_one_agree(method):
    # the same stream as one batch of repeats or one at a time gives the same warm-up
    v, x, _, _ = _fa_stream(50, seed=2, dtype=torch.float64)
    a = OnlineFactorAnalysis(4, 2, method=method, warmup=3, seed=0, dtype=torch.float64)
    b = OnlineFactorAnalysis(4, 2, method=method, warmup=3, seed=0, dtype=torch.float64)
    a.update(v.expand(3, 4).clone())
    for _ in range(3):
        b.update(v.clone())
    assert a.warmup == b.warmup == 5
    for row in x:
        a.update(row)
        b.update(row)
    torch.testing.assert_close(a.cov_diag, b.cov_diag)


def test_psi_floor_is_relative_and_never_denormal(flush_denormal):
    # a coordinate that never moves gets a floor relative to the data's scale (not 1.4e-45 or, flushed, 0)
    v, x, _, _ = _fa_stream(200, seed=3, scale=1e-3)
    x[:, 2] = v[2]
    fa = OnlineFactorAnalysis(4, 2, warmup=3, seed=0, dtype=torch.float32)
    fa.update(v.clone())
    fa.update(v.clone())
    for row in x:
        fa.update(row)
    psi = fa.cov_diag
    var = torch.cat([v.expand(2, 4), x]).double().var(0, unbiased=False)  # independent of the fit's moments
    assert float(psi.min()) >= torch.finfo(torch.float32).tiny
    expected = torch.finfo(torch.float32).eps * float(fa.variance.double().mean())
    assert float(psi[2]) == pytest.approx(expected, rel=1e-3)
    assert bool((psi[[0, 1, 3]] >= 1e-4 * var[[0, 1, 3]] * (1 - 1e-3)).all())
    assert bool(torch.isfinite(fa.log_prob(x[:3])).all())


@pytest.mark.parametrize("method", ["em", "sga"])
def test_identical_vectors_under_flush_denormal(method, flush_denormal):
    v, x, _, _ = _fa_stream(100, seed=4)
    fa = OnlineFactorAnalysis(4, 2, method=method, warmup=3, seed=0, dtype=torch.float32)
    for _ in range(4):
        fa.update(v.clone())
    for row in x:
        fa.update(row)
    assert fa.n_updates == 104
    assert float(fa.cov_diag.min()) >= torch.finfo(torch.float32).tiny
    assert bool(torch.isfinite(fa.sample(3)).all())


def test_a_refused_update_while_waiting_changes_nothing():
    v, x, _, _ = _fa_stream(10, seed=5)
    fa = OnlineFactorAnalysis(4, 2, warmup=3, seed=0, dtype=torch.float32)
    fa.update(v.clone())
    fa.update(v.clone())
    before = {k: t.clone() for k, t in fa.state_dict().items() if torch.is_tensor(t)}
    bad = v.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        fa.update(bad)
    assert fa.n_updates == 2 and fa.warmup == 4
    for k, t in fa.state_dict().items():
        if torch.is_tensor(t):
            torch.testing.assert_close(t, before[k], equal_nan=True)


def test_finish_warmup_refuses_identical_vectors():
    fa = OnlineFactorAnalysis(4, 2, warmup=10, seed=0, dtype=torch.float32)
    for _ in range(4):
        fa.update(torch.ones(4, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="finish_warmup\\(\\) needs observations that differ, got 4 identical"):
        fa.finish_warmup()


def _warmup_training(method, steps=120, frozen=12, seed=0):
    """A small MLP trained by SGD whose LambdaLR warm-up holds the rate at 0 for the first steps."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).float()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < frozen else 1.0)
    swag = SWAG(net, rank=2, method=method, warmup=10, seed=0)
    swag.attach(opt)
    x = torch.randn(64, 3, dtype=torch.float32)
    y = x.sum(-1, keepdim=True)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        idx = torch.randint(0, 64, (8,))
        nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
        seen.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return swag, torch.stack(seen)


@pytest.mark.parametrize("method", ["em", "sga"])
def test_swag_with_a_warmup_schedule_at_rate_zero_collects_everything(method):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no vector skipped
        warnings.filterwarnings("ignore", "SWAG: method 'sga'", UserWarning)
        swag, seen = _warmup_training(method)
    assert bool((seen[0] == seen[11]).all())  # the schedule did hand identical vectors first (past warmup=10)
    assert swag.n_collected == 120 and swag.n_refused == 0
    # the fitted marginal variances follow those of the iterates collected
    var = seen.double().var(0, unbiased=False)
    fitted = (swag.cov_factor.double().pow(2).sum(-1) + swag.cov_diag.double())
    ratio = float(fitted.sum() / var.sum())
    assert 0.5 < ratio < 1.5, ratio
    assert float(swag.cov_factor.abs().max()) > 0
    assert math.isfinite(float(swag.get_posterior().log_prob(swag.loc)))


# ------------------------------------------------------------------ reproducibility (issue 25 item 9)
def _seeded_script(seed, method="em"):
    """A whole run without seed arguments: train with SWAG attached, then tune its scale on validation data."""
    torch.manual_seed(seed)
    x = torch.randn(96, 3)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swag = SWAG(net, rank=3, method=method, warmup=20, start_after=30)
    swag.attach(opt)
    for _ in range(90):
        idx = torch.randint(0, 64, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    search = swag.tune_scale(x[64:], y[64:], num_samples=8)
    return swag, search.scale, swag.sample(2, generator=None)


@pytest.mark.parametrize("method", ["em", "sga"])
def test_torch_manual_seed_makes_a_run_repeatable(method):
    a, scale_a, draw_a = _seeded_script(0, method)
    b, scale_b, draw_b = _seeded_script(0, method)
    assert torch.equal(a.cov_factor, b.cov_factor) and torch.equal(a.cov_diag, b.cov_diag)
    assert scale_a == scale_b
    assert torch.equal(draw_a, draw_b)  # sampling without a generator: the global one, seeded by the script
    c, _, _ = _seeded_script(1, method)
    assert not torch.equal(a.cov_factor, c.cov_factor)


def test_seedless_fits_draw_their_seed_from_the_global_generator():
    # the initial factor follows torch.manual_seed, and the global stream moves by one number only
    torch.manual_seed(3)
    f1 = OnlineFactorAnalysis(50, 3, warmup=5).cov_factor.clone()
    after1 = torch.rand(1)
    torch.manual_seed(3)
    f2 = OnlineFactorAnalysis(50, 3, warmup=5).cov_factor.clone()
    torch.manual_seed(3)
    torch.empty((), dtype=torch.int64).random_(0, 2 ** 62)
    assert torch.equal(f1, f2) and torch.equal(torch.rand(1), after1)
    torch.manual_seed(4)
    assert not torch.equal(OnlineFactorAnalysis(50, 3, warmup=5).cov_factor, f1)


# ------------------------------------------------------------------ the float32 capacitance at large D (item 4)
def _ill_conditioned(D=20000, K=6, seed=0):
    """float32 F, psi whose F^T Psi^-1 F has eigenvalues near 1e9 beside near-zero ones (rank-deficient F)."""
    g = torch.Generator().manual_seed(seed)
    F = (torch.randn(D, 2, generator=g, dtype=torch.float64) @ torch.randn(2, K, generator=g, dtype=torch.float64)
         * 1e-3 + 1e-9 * torch.randn(D, K, generator=g, dtype=torch.float64))
    psi = 10 ** (-15 + 6 * torch.rand(D, generator=g, dtype=torch.float64))
    loc = torch.randn(D, generator=g, dtype=torch.float64)
    return loc.float(), F.float(), psi.float()


def test_stable_normal_matches_a_float64_computation_where_torch_fails():
    from torch.distributions import LowRankMultivariateNormal

    from pyro_fa.distributions import StableLowRankMultivariateNormal

    loc, F, psi = _ill_conditioned()
    with pytest.raises(RuntimeError, match="positive-definite"):
        LowRankMultivariateNormal(loc, F, psi)  # torch's float32 capacitance
    q = StableLowRankMultivariateNormal(loc, F, psi)
    assert isinstance(q, LowRankMultivariateNormal)
    # float64 reference: torch's own class on float64 copies of the same numbers
    ref = LowRankMultivariateNormal(loc.double(), F.double(), psi.double())
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, F.shape[1], generator=g, dtype=torch.float64)
    eps = torch.randn(3, loc.shape[0], generator=g, dtype=torch.float64)
    x = (loc.double() + h @ F.double().T + psi.double().sqrt() * eps).float()
    torch.testing.assert_close(q.log_prob(x).double(), ref.log_prob(x.double()), rtol=1e-6, atol=0)
    torch.testing.assert_close(q.entropy().double(), ref.entropy(), rtol=1e-6, atol=0)
    assert q.log_prob(x).dtype == torch.float32
    # the capacitance's factor against a dense float64 capacitance
    cap = torch.eye(F.shape[1], dtype=torch.float64) + F.double().T @ (F.double() / psi.double().unsqueeze(-1))
    L = linalg.capacitance_cholesky(F, psi).double()
    torch.testing.assert_close(L @ L.T, cap, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(q.rsample((2,))).all()


@pytest.mark.slow
def test_swag_of_a_large_linear_layer_gives_a_usable_distribution():
    # SWAG(nn.Linear(1000, 200), rank=10) after 14 full-batch steps: torch's float32 capacitance was not
    # positive definite (eigenvalues down to -10); the posterior's log_prob agrees with a float64 one
    from torch.distributions import LowRankMultivariateNormal

    torch.manual_seed(0)
    net = nn.Linear(1000, 200).float()
    x = torch.randn(256, 1000, dtype=torch.float32)
    y = torch.randn(256, 200, dtype=torch.float32)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    swag = SWAG(net, rank=10, warmup=10, seed=0)
    swag.attach(opt)
    for _ in range(14):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    q = swag.get_posterior()
    F, psi = swag.cov_factor.double(), swag.cov_diag.double()
    ref = LowRankMultivariateNormal(swag.loc.double(), F, psi)
    theta = swag.sample(2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(q.log_prob(theta).double(), ref.log_prob(theta.double()), rtol=1e-5, atol=0)
    torch.testing.assert_close(q.entropy().double(), ref.entropy(), rtol=1e-6, atol=0)
