"""FactorIVON(process_group=... / sync=True) in 2 gloo processes on the CPU, each on half of every minibatch, against
one process on the whole minibatch, and rank 0 against ivon-opt's own ``sync=True`` (the pattern of
tests/test_distributed.py: spawned ranks save what the checks need, the tests compare it here)."""
import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pyro_fa.distributed import Sharding
from pyro_fa.optim import FactorIVON

from _ranks import run_ranks

WORLD_SIZE = 2
TIMEOUT = 120  # seconds for a whole scenario (spawn, import, run)
STEPS = 10
#: (name, FactorIVON keywords, two param groups): K > 0 with refreshes every 2 and 3 steps, 2 draws and 1 a step
CONFIGS = [("K3-T2-M2", dict(rank=3, update_every=2, mc_samples=2), False),
           ("K2-T3-M1-groups", dict(rank=2, update_every=3, mc_samples=1), True),
           ("K0-T1-M1", dict(rank=0, update_every=1, mc_samples=1), False)]
KW = dict(lr=0.05, ess=200.0, hess_init=0.5, beta2=0.99, weight_decay=1e-2)


# ----------------------------------------------------------------------------- harness
def _entry(rank, world_size, init_file, scenario, out_dir):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.save(globals()[scenario](rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        import gc

        gc.collect()  # cyclic garbage holding gloo work: freed now (at exit, after the group is gone, it aborts)
        dist.destroy_process_group()


def _spawn(tmp_path, scenario):
    """Run ``scenario(rank)`` in 2 processes; their results in rank order."""
    return run_ranks(_entry, (WORLD_SIZE, str(tmp_path / "store"), scenario, str(tmp_path)), WORLD_SIZE, tmp_path,
                     TIMEOUT, scenario)


def _net(seed=0):
    torch.manual_seed(seed)
    f32 = dict(dtype=torch.float32)  # the same weights whatever the default dtype
    return nn.Sequential(nn.Linear(4, 5, **f32), nn.Tanh(), nn.Linear(5, 3, **f32)).double()  # D = 43


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, 24, 4, generator=g, dtype=torch.float64), torch.randint(3, (STEPS, 24), generator=g)


def _share(rank):
    """Rank ``rank``'s half of every minibatch (None: the whole minibatch)."""
    return slice(None) if rank is None else slice(12 * rank, 12 * (rank + 1))


def _params(net, groups):
    return [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.02}] if groups else \
        net.parameters()


def _train(opt, net, rank, steps=STEPS):
    X, Y = _data()
    rows = _share(rank)
    for t in range(steps):
        def closure():
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(net(X[t, rows]), Y[t, rows])
                loss.backward()
            return loss

        opt.step(closure)


def _state(opt):
    q = opt.get_posterior()
    return dict(mean=q.loc, prec=q.precision_matrix, cov=q.covariance_matrix, hess=opt.state["hess"].clone(),
                momentum=opt.state["momentum"].clone(), basis=opt.state["basis"].clone(),
                eigvals=opt.state["eigvals"].clone(), step=opt.state["step"])


def _factor_ivon(rank, config, **kw):
    _, options, groups = config
    net = _net()
    opt = FactorIVON(_params(net, groups), **KW, **options, **kw)
    _train(opt, net, rank)
    return opt


# ----------------------------------------------------------------------------- scenarios (in the ranks)
def runs(rank):
    out = {}
    for config in CONFIGS:
        opt = _factor_ivon(rank, config, process_group=dist.group.WORLD)
        out[config[0]] = dict(_state(opt), collectives=opt._averager.n_collectives, bytes=opt._averager.bytes_reduced)
    # rank 0 with sync=True against ivon-opt's sync=True: the same draws (the same seed), each rank on its half
    try:
        import ivon  # ivon-opt, the reference implementation (the "peers" extra)
    except ImportError:
        return out
    net = _net(1)
    reference = ivon.IVON(net.parameters(), **KW, sync=True)
    _train(reference, net, rank)
    out["ivon"] = dict(params=torch.cat([p.detach().flatten() for p in net.parameters()]),
                       hess=reference.param_groups[0]["hess"], momentum=reference.param_groups[0]["momentum"])
    net = _net(1)
    opt = FactorIVON(net.parameters(), **KW, rank=0, sync=True)
    _train(opt, net, rank)
    out["sync"] = dict(params=torch.cat([p.detach().flatten() for p in net.parameters()]),
                       hess=opt.state["hess"], momentum=opt.state["momentum"])
    return out


def bad_inputs(rank):
    group = dist.group.WORLD
    X, Y = _data()
    rows = _share(rank)

    def draw(opt, net, times=1, nan=False):
        for _ in range(times):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(net(X[0, rows]), Y[0, rows])
                (loss * (float("nan") if nan else 1.0)).backward()

    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        FactorIVON(_net().parameters(), **KW, process_group="WORLD")
    with pytest.raises(ValueError, match="every rank must pass the same rank"):
        FactorIVON(_net().parameters(), **KW, rank=2 + rank, process_group=group)
    # one rank's bad argument stops both: its own error there, "rank 1 refused" on the other
    with pytest.raises(ValueError, match="lr must be a finite number" if rank else "rank 1 refused its input"):
        FactorIVON(_net().parameters(), **dict(KW, lr=-1.0 if rank else 0.05), rank=2, process_group=group)
    # ranks whose global generators differ draw unlike: refused at step() on both, the state unchanged
    net = _net()
    opt = FactorIVON(net.parameters(), **KW, rank=2, process_group=group)
    torch.manual_seed(10 + rank)
    draw(opt, net)
    with pytest.raises(ValueError, match="every rank must draw the same weights"):
        opt.step()
    assert opt.state["step"] == 0 and not opt.state["momentum"].any()
    # a different number of draws per rank
    torch.manual_seed(0)
    draw(opt, net, times=1 + rank)
    with pytest.raises(ValueError, match="every rank must draw the same number of times per step, got 1 on rank 0, "
                                         "2 on rank 1"):
        opt.step()
    # a NaN gradient on rank 1: dropped on leaving the block there, refused at step() on both
    torch.manual_seed(0)
    draw(opt, net, nan=rank == 1)
    with pytest.raises(ValueError, match=r"the gradients must be finite, got NaN or inf on rank\(s\) 1"):
        opt.step()
    with pytest.raises(RuntimeError, match="step\\(\\) needs the gradient of at least one draw"):
        opt.step()
    assert opt.state["step"] == 0 and opt.state["count"] == 0
    # and the ranks go on together afterwards
    torch.manual_seed(0)
    draw(opt, net)
    opt.step()
    return dict(step=opt.state["step"], mean=opt.get_posterior().loc)


def runs_then_bad_inputs(rank):
    """Both in one pair of processes (a spawn costs seconds); a failed check in ``bad_inputs`` is reported."""
    out = runs(rank)
    try:
        out["bad"] = bad_inputs(rank)
    except BaseException as exc:  # noqa: B902 (pytest's failure is a BaseException): reported by the test
        out["bad"] = {"failed": f"{type(exc).__name__}: {exc}"}
    return out


# ----------------------------------------------------------------------------- the checks
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("factor_ivon_runs"), "runs_then_bad_inputs")


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_two_ranks_on_half_the_batch_equal_one_process_on_all_of_it(results, config):
    one = _state(_factor_ivon(None, config))
    two = results[0][config[0]]
    assert two["step"] == one["step"] == STEPS
    for name in ("mean", "hess", "momentum", "eigvals", "prec", "cov"):
        torch.testing.assert_close(two[name], one[name], rtol=1e-10, atol=1e-12, msg=name)
    # the basis up to each row's sign (eigenvectors)
    signs = torch.sign((two["basis"] * one["basis"]).sum(1, keepdim=True))
    torch.testing.assert_close(two["basis"] * signs, one["basis"], rtol=1e-8, atol=1e-10)
    assert config[1]["rank"] == 0 or float(one["eigvals"].abs().min()) > 0  # the low-rank part was learnt


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_every_rank_holds_the_same_state(results, config):
    r0, r1 = (r[config[0]] for r in results)
    for name in ("mean", "hess", "momentum", "basis", "eigvals", "prec", "cov"):
        assert torch.equal(r0[name], r1[name]), name


def test_communication_is_a_few_vectors_per_step(results):
    D, W = 43, WORLD_SIZE
    # K3-T2-M2: a table of 4W numbers a step; 2 D-vectors on the 5 plain steps, M = 2 on the 5 refreshes; the
    # first broadcast of the weights (D numbers)
    r = results[0]["K3-T2-M2"]
    assert r["collectives"] == 1 + STEPS + 5 * 2 + 5 * 2
    assert r["bytes"] == 8 * (D + STEPS * 4 * W + 5 * 2 * D + 5 * 2 * D)
    r = results[0]["K2-T3-M1-groups"]  # refreshes at steps 3, 6, 9: one D-vector each
    assert r["bytes"] == 8 * (D + STEPS * 4 * W + 7 * 2 * D + 3 * D)


def test_rank_0_with_sync_equals_ivon_opts_sync_to_the_bit(results):
    pytest.importorskip("ivon")
    assert "ivon" in results[0]
    for r in results:
        for name in ("params", "hess", "momentum"):
            assert torch.equal(r["sync"][name], r["ivon"][name]), name
    start = torch.cat([p.detach().flatten() for p in _net(1).parameters()])
    assert float((results[0]["sync"]["params"] - start).abs().max()) > 1e-3  # it trained


def test_bad_input_raises_on_every_rank_without_hanging(results):
    r0, r1 = (r["bad"] for r in results)  # the pytest.raises checks ran in the ranks (bad_inputs)
    assert "failed" not in r0 and "failed" not in r1, (r0, r1)
    assert r0["step"] == r1["step"] == 1 and torch.equal(r0["mean"], r1["mean"])


def test_sync_and_process_group_refused_without_torch_distributed():
    assert not dist.is_initialized()
    net = _net()
    with pytest.raises(TypeError, match="sync must be True or False, got 1"):
        FactorIVON(net.parameters(), **KW, sync=1)
    with pytest.raises(RuntimeError, match="sync=True needs an initialised torch.distributed, got none"):
        FactorIVON(net.parameters(), **KW, sync=True)
    with pytest.raises(RuntimeError, match="process_group needs an initialised torch.distributed"):
        FactorIVON(net.parameters(), **KW, process_group=object())
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup, got a Sharding"):
        FactorIVON(net.parameters(), **KW, process_group=Sharding.__new__(Sharding))


def test_without_a_group_nothing_is_averaged():
    from pyro_fa.optim._distributed import NO_AVERAGE

    opt = FactorIVON(_net().parameters(), **KW, rank=2)
    assert opt._averager is NO_AVERAGE
