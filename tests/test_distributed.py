"""pyro_fa under torch.distributed: 2 gloo processes on the CPU (spawned), compared with one process.

Each scenario runs once in two spawned ranks (a module-scoped fixture) and saves what the
checks need; the tests compare it with single-process fits computed here. A scenario that
hangs fails its tests after a timeout instead of stalling CI (the process group's own
timeout is shorter, so a stuck collective raises first).
"""
import datetime
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from pyro_fa import OnlineFactorAnalysis, SWAG
from pyro_fa.distributed import ShardedOnlineFactorAnalysis, shard_bounds
from pyro_fa.distributions import FactorNormal

from _ranks import run_ranks

WORLD_SIZE = 2
TIMEOUT = 120  # seconds for a whole scenario (spawn, import, run)
D, K, T = 37, 3, 240


# ----------------------------------------------------------------------------- harness
def _entry(rank, world_size, init_file, scenario, out_dir, backend):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    warnings.simplefilter("ignore")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    before = {}
    if scenario == "bad_inputs":  # a process group that is not initialised: every rank raises, nothing collective
        try:
            OnlineFactorAnalysis(12, 2, process_group=dist.group.WORLD or object())
        except RuntimeError as exc:
            before["uninitialised"] = ("RuntimeError", str(exc))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        result = dict(globals()[scenario](rank, world_size, out_dir), **before)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        import gc

        gc.collect()  # cyclic garbage holding gloo work: freed now (at exit, after the group is gone, it aborts)
        dist.destroy_process_group()


def _spawn(tmp_path, scenario, backend="gloo", world_size=WORLD_SIZE):
    """Run ``scenario(rank, world_size)`` in ``world_size`` processes; their results in rank order."""
    return run_ranks(_entry, (world_size, str(tmp_path / "store"), scenario, str(tmp_path), backend), world_size,
                     tmp_path, TIMEOUT, scenario)


def _data(n=T, dim=D, rank=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(dim, rank, generator=g)
    noise = 0.3 + torch.rand(dim, generator=g)
    return torch.randn(n, rank, generator=g) @ W.T + noise.sqrt() * torch.randn(n, dim, generator=g) + 2.0


FA_KW = dict(warmup=20, seed=0, lr=1e-2)


# ----------------------------------------------------------------------------- scenarios (run in each rank)
def fits(rank, world_size, out_dir):
    """Sharded OnlineFactorAnalysis (EM, SGA) and SWAG (EM, SGA, classic) on the same stream; samples; state."""
    group = dist.group.WORLD
    X = _data()
    out = {}
    for method in ("em", "sga"):
        fa = OnlineFactorAnalysis(D, K, method, process_group=group, **FA_KW)
        lo, hi = fa._sharding.lo, fa._sharding.hi
        for t in range(T - 10):
            fa.update(X[t, lo:hi])
        fa.update(X[T - 10:, lo:hi])  # a batch
        out[f"{method}_F"], out[f"{method}_psi"], out[f"{method}_loc"] = (
            fa.cov_factor.clone(), fa.cov_diag.clone(), fa.loc.clone())
        out[f"{method}_collectives"] = fa._sharding.n_collectives
        out[f"{method}_log_prob"] = fa.log_prob(X[:5, lo:hi])
        out[f"{method}_entropy"] = fa.get_posterior().entropy()
        out[f"{method}_types"] = (type(fa).__name__, type(fa.get_posterior()).__name__,
                                  isinstance(fa.get_posterior(), FactorNormal))
        out[f"{method}_matvec"] = fa.get_posterior().covariance_matvec(X[:2, lo:hi] - X[2:4, lo:hi])
        if method == "em":
            out["samples"] = fa.sample(8000)
            # state_dict round trip per rank: save, load into a new sharded model, go on alike
            path = os.path.join(out_dir, f"fa_state_rank{rank}.pt")
            torch.save(fa.state_dict(), path)
            fa2 = OnlineFactorAnalysis(D, K, method, process_group=group, **FA_KW)
            fa2.load_state_dict(torch.load(path, weights_only=False))
            for t in range(10):
                fa.update(X[t, lo:hi])
                fa2.update(X[t, lo:hi])
            out["resumed_equal"] = bool(torch.equal(fa.cov_factor, fa2.cov_factor)
                                        and torch.equal(fa.cov_diag, fa2.cov_diag) and torch.equal(fa.loc, fa2.loc))
            out["state_keys"] = sorted(fa.state_dict())
            out["state_F_rows"] = fa.state_dict()["_F"].shape[0]
            os.remove(path)
    out["lo"], out["hi"] = lo, hi
    # SWAG over a replicated parameter vector: each rank collects its rows
    for method in ("em", "sga", "swag"):
        p = torch.zeros(D, requires_grad=True)
        swag = SWAG([p], rank=K, method=method, warmup=20, seed=0, lr=1e-2, process_group=group)
        for t in range(T):
            with torch.no_grad():
                p.copy_(X[t])
            swag.collect()
        out[f"swag_{method}_F"], out[f"swag_{method}_psi"] = swag.cov_factor, swag.cov_diag
        out[f"swag_{method}_loc"] = swag.loc
        g = torch.Generator().manual_seed(rank)  # different generators: rank 0's decides
        out[f"swag_{method}_draws"] = swag.sample(3, generator=g)
    return out


def ddp(rank, world_size, out_dir):
    """A DDP-wrapped MLP trained by SGD with sharded SWAG attached; the trajectory and the predictions."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = DDP(net)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 3, generator=g)
    y = torch.sin(x.sum(-1, keepdim=True)) + 0.1 * torch.randn(64, 1, generator=g)
    lo, hi = shard_bounds(64, world_size, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"thetas": []}
    swags = {m: SWAG(model, rank=3, method=m, warmup=5, seed=0) for m in ("em", "swag")}
    for s in swags.values():
        s.attach(opt)
    for step in range(40):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        out["thetas"].append(torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone())
    for m, s in swags.items():
        out[f"{m}_F"], out[f"{m}_psi"], out[f"{m}_loc"] = s.cov_factor, s.cov_diag, s.loc
        out[f"{m}_n"] = s.n_collected
        out[f"{m}_predict"] = s.predict(x[:5], num_samples=6)
        with s.sampled_weights(s.loc) as theta:  # the SWA mean, gathered from the ranks' rows
            out[f"{m}_swa"] = theta
            out[f"{m}_swa_out"] = net(x[:5]).detach()
    out["D"] = swags["em"].dim
    # tune_scale runs the sampled networks on every rank alike and picks one scale
    out["scale"] = swags["em"].tune_scale(x[:16], y[:16, 0], "gaussian", noise_std=0.1, num_samples=4,
                                          scales=[0.1, 1.0, 10.0]).scale
    # SWAG's state_dict per rank: a new SWAG on the same model loads it and predicts alike
    again = SWAG(model, rank=3, method="em", warmup=5, seed=1)
    again.load_state_dict(swags["em"].state_dict())
    g = torch.Generator().manual_seed(0)
    out["reloaded_predict_equal"] = bool(torch.equal(
        again.predict(x[:5], num_samples=3, generator=torch.Generator().manual_seed(0)),
        swags["em"].predict(x[:5], num_samples=3, generator=g)))
    out["weights_after"] = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    from pyro_fa.distributed import ShardedParameters

    sp = ShardedParameters(model)
    out["sp_bounds"], out["sp_full"] = sp.bounds, sp.gather(sp.local())
    sp.assign(out["sp_full"])
    try:
        sp.assign(torch.zeros(3))
    except ValueError as exc:
        out["sp_error"] = str(exc)
    return out


def svi(rank, world_size, out_dir):
    """Bayesian linear regression by SVI with AutoLowRankFactorGuide + FactorELBO, data split over the ranks."""
    from pyro_fa.distributed import AllReduceOptim, local_indices

    X, y = _linreg()
    idx = local_indices(X.shape[0])
    out = {}
    for name, seed, steps in (("same_seed", 0, 100), ("own_seed", 10 + rank, 300)):
        loc, cov, opt = _fit_svi(X[idx], y[idx], idx, X.shape[0], seed, wrap=lambda o: AllReduceOptim(o),
                                 steps=steps)
        out[name] = (loc, cov)
        out[name + "_collectives"] = opt.n_collectives
    return out


def bad_inputs(rank, world_size, out_dir):
    """Each mistake must raise on every rank, and no rank may wait forever; the ranks go on afterwards."""
    group = dist.group.WORLD
    cases = {}

    def case(name, fn):
        try:
            fn()
            cases[name] = None
        except Exception as exc:  # recorded, checked by the parent
            cases[name] = (type(exc).__name__, str(exc))

    case("rank", lambda: OnlineFactorAnalysis(12, 2 + rank, process_group=group))
    case("method", lambda: OnlineFactorAnalysis(12, 2, ("em", "sga")[rank], process_group=group))
    case("dtype", lambda: OnlineFactorAnalysis(12, 2, dtype=(torch.float32, torch.float64)[rank], process_group=group))
    case("dim", lambda: OnlineFactorAnalysis(12 + rank, 2, process_group=group))
    case("shard", lambda: OnlineFactorAnalysis(12, 2, process_group=group, shard=((0, 6), (5, 12))[rank]))
    case("invalid_on_one_rank", lambda: OnlineFactorAnalysis(12, (2, 0)[rank], process_group=group))
    case("swag_models", lambda: SWAG(torch.nn.Linear(3 + rank, 2), rank=2, process_group=group))
    case("swag_method", lambda: SWAG(torch.nn.Linear(3, 2), rank=2, method=("em", "swag")[rank],
                                     process_group=group))
    fa = OnlineFactorAnalysis(12, 2, warmup=3, process_group=group, seed=0)
    lo, hi = fa._sharding.lo, fa._sharding.hi
    x = torch.randn(12)
    case("x_shape_on_one_rank", lambda: fa.update(x[lo:hi] if rank == 0 else x))
    case("x_batch_sizes", lambda: fa.update(torch.randn(1 + rank, 12)[:, lo:hi]))
    case("x_nan_on_one_rank", lambda: fa.update(x[lo:hi] * (math.nan if rank == 1 else 1.0)))
    case("x_dtype_on_one_rank", lambda: fa.update(x[lo:hi].to((torch.float64, torch.float32)[rank])))
    for _ in range(6):  # the refusals left every rank unchanged and in step
        fa.update(torch.randn(12)[lo:hi])
    cases["n_updates_after"] = fa.n_updates
    other = fa.state_dict()
    other["_extra_state"] = dict(other["_extra_state"], shard=dict(other["_extra_state"]["shard"], rank=1 - rank))
    case("load_other_ranks_state", lambda: fa.load_state_dict(other))
    case("load_other_point", lambda: fa.load_state_dict(
        dict(fa.state_dict(), _extra_state=dict(fa.state_dict()["_extra_state"], n_updates=6 + rank))))
    from pyro_fa.distributed import AllReduceOptim
    import pyro

    pyro.clear_param_store()
    p = pyro.param(f"p{rank}", torch.zeros(2))
    p.unconstrained().grad = torch.ones(2)
    optim = AllReduceOptim(pyro.optim.SGD({"lr": 0.1}))
    case("svi_params", lambda: optim([pyro.param(f"p{rank}").unconstrained()]))
    # one rank refuses a state it loads, the other does not: both stop
    good = fa.state_dict()
    bad = dict(good, _psi=good["_psi"] * math.nan)
    case("load_refused_on_one_rank", lambda: fa.load_state_dict(bad if rank == 0 else good))
    case("different_objects", lambda: OnlineFactorAnalysis(12, 2, process_group=group) if rank == 0
         else SWAG(torch.nn.Linear(3, 2), rank=2, process_group=group))
    case("shard_on_one_rank", lambda: OnlineFactorAnalysis(12, 2, process_group=group,
                                                           shard=(0, 6) if rank == 0 else None))
    case("not_a_group", lambda: OnlineFactorAnalysis(12, 2, process_group="world"))
    case("draws", lambda: fa.sample(2 + rank))
    case("gather_shape", lambda: fa._sharding.all_gather(torch.zeros(3)))
    case("log_prob_shape", lambda: fa.log_prob(torch.zeros(12)))
    case("covariance", lambda: fa.covariance())
    swag = SWAG(torch.nn.Linear(3, 2), rank=2, method="swag", process_group=group)
    from pyro_fa import MultiSWAG

    case("multiswag", lambda: MultiSWAG([swag]))
    return cases


def nccl(rank, world_size, out_dir):
    X = _data().cuda()
    fa = OnlineFactorAnalysis(D, K, process_group=dist.group.WORLD, device="cuda", **FA_KW)
    lo, hi = fa._sharding.lo, fa._sharding.hi
    for t in range(T):
        fa.update(X[t, lo:hi])
    return {"F": fa.cov_factor.cpu(), "psi": fa.cov_diag.cpu()}


# ----------------------------------------------------------------------------- SVI helpers (both sides)
def _linreg(N=64, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, dim, generator=g)
    y = X @ torch.randn(dim, generator=g) + 0.5 * torch.randn(N, generator=g)
    return X, y


ALPHA, BETA = 0.5, 4.0


def _linreg_model(X, y, idx, N):
    import pyro
    import pyro.distributions as pdist

    w = pyro.sample("w", pdist.Normal(torch.zeros(X.shape[-1]), ALPHA ** -0.5).to_event(1))
    with pyro.plate("data", N, subsample=idx):  # this rank's points, scaled by N / len(idx)
        pyro.sample("y", pdist.Normal((w * X).sum(-1), BETA ** -0.5), obs=y)


def _fit_svi(X, y, idx, N, seed, wrap=lambda o: o, steps=300):
    import pyro
    from pyro_fa import AutoLowRankFactorGuide, FactorELBO

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoLowRankFactorGuide(_linreg_model, rank=3, init_scale=0.01)
    optim = wrap(pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.995}))
    svi_ = pyro.infer.SVI(_linreg_model, guide, optim, FactorELBO(num_particles=4))
    for _ in range(steps):
        svi_.step(X, y, idx, N)
    q = guide.get_posterior()
    return q.loc.detach(), q.covariance_matrix.detach(), optim


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def fit_results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("fits"), "fits")


def _single(method, X):
    fa = OnlineFactorAnalysis(D, K, method, **FA_KW)
    for t in range(T - 10):
        fa.update(X[t])
    fa.update(X[T - 10:])
    return fa


@pytest.mark.parametrize("method", ["em", "sga"])
def test_sharded_online_fa_equals_single_process(fit_results, method):
    X = _data()
    fa = _single(method, X)
    F = torch.cat([r[f"{method}_F"] for r in fit_results])
    assert [r[f"{method}_F"].shape[0] for r in fit_results] == [19, 18]  # memory per rank: its rows only
    torch.testing.assert_close(F, fa.cov_factor, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([r[f"{method}_psi"] for r in fit_results]), fa.cov_diag, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.cat([r[f"{method}_loc"] for r in fit_results]), fa.loc, rtol=1e-12, atol=1e-12)
    # log_prob and entropy of whole vectors, from the rows: the same on every rank, and the single-process value
    for r in fit_results:
        torch.testing.assert_close(r[f"{method}_log_prob"], fa.log_prob(X[:5]), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(r[f"{method}_entropy"], fa.get_posterior().entropy(), rtol=1e-9, atol=1e-9)
    # process_group= built the sharded subclass, whose posterior is a member of the family; Sigma v of whole
    # vectors against the dense covariance F F^T + diag(psi)
    assert all(r[f"{method}_types"] == ("ShardedOnlineFactorAnalysis", "ShardedLowRankNormal", True)
               for r in fit_results)
    dense = fa.cov_factor @ fa.cov_factor.T + torch.diag(fa.cov_diag)
    torch.testing.assert_close(torch.cat([r[f"{method}_matvec"] for r in fit_results], -1),
                               (X[:2] - X[2:4]) @ dense, rtol=1e-9, atol=1e-9)


def test_sharded_em_needs_one_all_reduce_per_update(fit_results):
    # T - 10 single updates and a batch; warm-up rescalings (n = 2, 4, 8, 16) and the batch add one each,
    # the initial factor one (Cholesky QR); SGA needs two per step past the warm-up
    n = fit_results[0]["em_collectives"]
    assert n <= (T - 10) + 1 + 4 + 2 + 2, n
    assert fit_results[0]["sga_collectives"] >= 2 * (T - 10 - 20)


@pytest.mark.parametrize("method", ["em", "sga", "swag"])
def test_sharded_swag_equals_single_process(fit_results, method):
    X = _data()
    p = torch.zeros(D, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swag = SWAG([p], rank=K, method=method, warmup=20, seed=0, lr=1e-2)
    for t in range(T):
        with torch.no_grad():
            p.copy_(X[t])
        swag.collect()
    for key, ref in (("F", swag.cov_factor), ("psi", swag.cov_diag), ("loc", swag.loc)):
        got = torch.cat([r[f"swag_{method}_{key}"] for r in fit_results])
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
    # sampled whole vectors: gathered, identical on every rank (rank 0's generator decides)
    draws = [r[f"swag_{method}_draws"] for r in fit_results]
    assert draws[0].shape == (3, D)
    assert torch.equal(draws[0], draws[1])


def test_sampling_is_coherent_across_ranks(fit_results):
    # one latent draw per sample shared by the ranks: the cross-rank block of the samples' covariance is F0 F1^T
    S = torch.cat([r["samples"] for r in fit_results], dim=-1)
    F = torch.cat([r["em_F"] for r in fit_results])
    psi = torch.cat([r["em_psi"] for r in fit_results])
    emp = torch.cov(S.T)
    lo, hi = fit_results[1]["lo"], fit_results[1]["hi"]
    cross, ref = emp[:lo, lo:hi], (F @ F.T)[:lo, lo:hi]
    assert float((cross - ref).norm() / ref.norm()) < 0.1
    full = F @ F.T + torch.diag(psi)
    assert float((emp - full).norm() / full.norm()) < 0.1
    se = (full.diagonal() / S.shape[0]).sqrt()
    assert float(((S.mean(0) - torch.cat([r["em_loc"] for r in fit_results])) / se).abs().max()) < 5


def test_state_dict_is_per_rank_and_round_trips(fit_results):
    for r in fit_results:
        assert r["resumed_equal"]
        assert r["state_F_rows"] == r["hi"] - r["lo"]
        assert "_extra_state" in r["state_keys"]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ddp"), "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "swag"])
def test_ddp_swag_collects_once_and_predicts_alike(ddp_results, method):
    r0, r1 = ddp_results
    Dm = r0["D"]
    assert torch.equal(torch.stack(r0["thetas"]), torch.stack(r1["thetas"]))  # DDP kept the replicas equal
    # each rank collected its rows once per step: together exactly one posterior
    assert r0[f"{method}_n"] == r1[f"{method}_n"] == 40
    assert r0[f"{method}_loc"].shape[0] + r1[f"{method}_loc"].shape[0] == Dm
    assert r0[f"{method}_F"].shape[0] == shard_bounds(Dm, 2, 0)[1]
    # the same posterior as one process collecting the same trajectory
    p = torch.zeros(Dm, requires_grad=True)
    swag = SWAG([p], rank=3, method=method, warmup=5, seed=0)
    for theta in r0["thetas"]:
        with torch.no_grad():
            p.copy_(theta)
        swag.collect()
    for key, ref in (("F", swag.cov_factor), ("psi", swag.cov_diag), ("loc", swag.loc)):
        torch.testing.assert_close(torch.cat([r0[f"{method}_{key}"], r1[f"{method}_{key}"]]), ref,
                                   rtol=1e-9, atol=1e-10)
    # predictions and loaded weights agree on every rank
    assert torch.equal(r0[f"{method}_predict"], r1[f"{method}_predict"])
    torch.testing.assert_close(r0[f"{method}_swa"], swag.loc)
    assert torch.equal(r0[f"{method}_swa_out"], r1[f"{method}_swa_out"])
    assert torch.equal(r0["weights_after"], r0["thetas"][-1])  # sampled_weights restored the trained weights
    assert r0["scale"] == r1["scale"]
    # ShardedParameters: this rank's slice of the flattened weights, gathered back whole
    assert r0["sp_bounds"] == shard_bounds(Dm, 2, 0) and r1["sp_bounds"] == shard_bounds(Dm, 2, 1)
    assert torch.equal(r0["sp_full"], r0["weights_after"]) and torch.equal(r1["sp_full"], r0["weights_after"])
    assert "theta must have shape" in r0["sp_error"]
    assert r0["reloaded_predict_equal"] and r1["reloaded_predict_equal"]


@pytest.mark.slow
def test_svi_under_ddp_matches_single_process(tmp_path):
    r0, r1 = _spawn(tmp_path, "svi")
    X, y = _linreg()
    N = X.shape[0]
    loc, cov, _ = _fit_svi(X, y, torch.arange(N), N, seed=0, steps=100)
    # the same seed on every rank: the ranks draw the same theta, and the averaged gradient is the full-data one
    for r in (r0, r1):
        torch.testing.assert_close(r["same_seed"][0], loc, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(r["same_seed"][1], cov, rtol=1e-5, atol=1e-8)
        assert r["same_seed_collectives"] == 100 + 1  # one all-reduce per step, one broadcast
    # own seeds: the replicas stay equal and the fit is the exact posterior within Monte Carlo error
    assert torch.equal(r0["own_seed"][0], r1["own_seed"][0])
    A = ALPHA * torch.eye(3) + BETA * X.T @ X
    S = torch.linalg.inv(A)
    m = BETA * S @ X.T @ y
    sd = S.diagonal().sqrt()
    assert float(((r0["own_seed"][0] - m) / sd).abs().max()) < 0.5
    assert float(((r0["own_seed"][1].diagonal() - S.diagonal()) / S.diagonal()).abs().max()) < 0.5


def test_bad_input_raises_on_every_rank_without_hanging(tmp_path):
    r0, r1 = _spawn(tmp_path, "bad_inputs")
    expected = {
        "rank": ("ValueError", "every rank must pass the same rank"),
        "method": ("ValueError", "every rank must pass the same method"),
        "dtype": ("ValueError", "every rank must pass the same dtype"),
        "dim": ("ValueError", "every rank must pass the same dim"),
        "shard": ("ValueError", "tile"),
        "invalid_on_one_rank": ("ValueError", "every rank must pass the same rank"),
        "swag_models": ("ValueError", "every rank must pass the same params"),
        "swag_method": ("ValueError", "every rank must pass the same method"),
        "x_batch_sizes": ("ValueError", "same number of observations"),
        "x_nan_on_one_rank": ("ValueError", "must be finite"),
        "load_other_ranks_state": ("ValueError", "must come from rank"),
        "load_other_point": ("ValueError", "same point of the same run"),
        "svi_params": ("ValueError", "every rank must pass the same parameters"),
        "uninitialised": ("RuntimeError", "uninitialised"),
        "different_objects": ("ValueError", "same kind of object"),
        "shard_on_one_rank": ("ValueError", "tile"),
        "not_a_group": ("TypeError", "must be a torch.distributed.ProcessGroup"),
        "draws": ("ValueError", "same number of draws"),
        "gather_shape": ("ValueError", "last dimension 6"),
        "log_prob_shape": ("ValueError", "last dimension 6"),
        "covariance": ("RuntimeError", "sharded over a process group"),
        "multiswag": ("ValueError", "must not be sharded"),
    }
    for name, (kind, text) in expected.items():
        for rank, r in enumerate((r0, r1)):
            assert r[name] is not None, f"{name}: rank {rank} did not raise"
            assert r[name][0] == kind and text in r[name][1], (name, rank, r[name])
    # a bad x on one rank: that rank says why, the other that it stopped with it
    assert r0["x_shape_on_one_rank"][0] == "ValueError" and "rank 1 refused" in r0["x_shape_on_one_rank"][1]
    assert r1["x_shape_on_one_rank"][0] == "ValueError" and "shape" in r1["x_shape_on_one_rank"][1]
    assert r1["x_dtype_on_one_rank"][0] == "TypeError" and r0["x_dtype_on_one_rank"][0] == "TypeError"
    assert r0["n_updates_after"] == r1["n_updates_after"] == 6
    assert r0["load_refused_on_one_rank"][0] == "ValueError" and "finite" in r0["load_refused_on_one_rank"][1]
    assert r1["load_refused_on_one_rank"][0] == "ValueError" and "rank 0 refused" in r1["load_refused_on_one_rank"][1]


def test_the_core_alone_refuses_a_process_group(monkeypatch):
    # the core is single-process: process_group= builds pyro_fa.distributed's subclass, registered on import
    assert OnlineFactorAnalysis.sharded_class is ShardedOnlineFactorAnalysis
    assert type(OnlineFactorAnalysis(10, 2)) is OnlineFactorAnalysis
    monkeypatch.setattr(OnlineFactorAnalysis, "sharded_class", None)
    with pytest.raises(ValueError, match="process_group and shard need pyro_fa.distributed's ShardedOnlineFactor"):
        OnlineFactorAnalysis(10, 2, process_group=object())


def test_process_group_checks_without_distributed():
    import pyro
    from pyro_fa.distributed import AllReduceOptim, ShardedParameters, check_agreement, local_indices

    with pytest.raises(RuntimeError, match="uninitialised"):
        OnlineFactorAnalysis(10, 2, process_group=object())
    with pytest.raises(RuntimeError, match="uninitialised"):
        SWAG(torch.nn.Linear(3, 2), rank=2, process_group=object())
    with pytest.raises(ValueError, match="shard needs a process_group"):
        OnlineFactorAnalysis(10, 2, shard=(0, 5))
    with pytest.raises(ValueError, match="every rank holds a row"):
        shard_bounds(1, 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        shard_bounds(10, 2, 2)
    with pytest.raises(ValueError, match="dim must be an integer"):
        shard_bounds(0, 2, 0)
    assert [shard_bounds(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(TypeError, match="must be a pyro.optim optimizer"):
        AllReduceOptim(torch.optim.SGD)
    with pytest.raises(TypeError, match="broadcast must be True or False"):
        AllReduceOptim(pyro.optim.Adam({}), broadcast=1)
    for fn in (lambda: AllReduceOptim(pyro.optim.Adam({})), lambda: local_indices(10),
               lambda: ShardedParameters(torch.nn.Linear(3, 2)), lambda: check_agreement({"a": 1})):
        with pytest.raises(RuntimeError, match="initialised torch.distributed"):
            fn()
    # a shard's state does not load into a model that is not sharded
    fa = OnlineFactorAnalysis(10, 2, warmup=2)
    fa.update(torch.randn(4, 10))
    state = fa.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], shard={"dim": 20, "world_size": 2, "rank": 0, "lo": 0, "hi": 10})
    with pytest.raises(ValueError, match="must come from a model that is not sharded"):
        fa.load_state_dict(state)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices")
def test_nccl_sharded_em_equals_single_process(tmp_path):
    r0, r1 = _spawn(tmp_path, "nccl", backend="nccl")
    fa = OnlineFactorAnalysis(D, K, **FA_KW)
    for x in _data():
        fa.update(x)
    torch.testing.assert_close(torch.cat([r0["F"], r1["F"]]), fa.cov_factor, rtol=1e-9, atol=1e-10)
