"""FactorLaplace(process_group=...) in 2 gloo processes on the CPU, each holding half the data, against one
process holding all of it (the pattern of tests/test_distributed.py)."""
import datetime
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pyro_fa.laplace import FactorLaplace

WORLD_SIZE = 2
TIMEOUT = 120


def _net():
    torch.manual_seed(0)
    f32 = dict(dtype=torch.float32)  # the same draws whatever the default dtype
    return nn.Sequential(nn.Linear(3, 6, **f32), nn.Tanh(), nn.Linear(6, 3, **f32)).double()


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(80, 3, generator=g, dtype=torch.float64), torch.randint(3, (80,), generator=g)


def _batches(x, y, size=20):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _entry(rank, world_size, init_file, out_dir):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        X, y = _data()
        mine = _batches(X[rank * 40:(rank + 1) * 40], y[rank * 40:(rank + 1) * 40])
        out = {}
        for fit in ("scatter", "online"):
            la = FactorLaplace(_net(), "classification", rank=3, curvature_fit=fit, chunk_size=1000,
                               process_group=dist.group.WORLD).fit(mine)
            out[fit] = {k: v.clone() for k, v in la.state_dict().items()}
            out[fit]["lml"] = la.log_marginal_likelihood().detach()
        bad = FactorLaplace(_net(), "classification", rank=3, process_group=dist.group.WORLD)
        try:  # rank 1's labels are out of range: both ranks raise, neither hangs
            bad.fit([(X[:10], y[:10] + (5 if rank == 1 else 0))])
        except ValueError as exc:
            out["refused"] = str(exc)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("laplace_dist")
    ctx = mp.start_processes(_entry, args=(WORLD_SIZE, str(tmp / "store"), str(tmp)), nprocs=WORLD_SIZE, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the ranks did not finish within {TIMEOUT} s (a hang)")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("fit", ["scatter", "online"])
def test_two_ranks_equal_one_process_on_all_the_data(results, fit):
    X, y = _data()
    # one process fed the blocks in the order the ranks gather them: rank 0's batch i, then rank 1's
    r0, r1 = _batches(X[:40], y[:40]), _batches(X[40:], y[40:])
    joined = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(r0, r1)]
    single = FactorLaplace(_net(), "classification", rank=3, curvature_fit=fit, chunk_size=1000).fit(joined)
    for rank_state in results:
        state = rank_state[fit]
        assert int(state["n_data"]) == 80
        for key in ("loc", "loss"):
            torch.testing.assert_close(state[key], single.state_dict()[key])
        # the fitted curvature (F is identified up to rotation; summation order moves the EM's last digits)
        ours = state["cov_factor"] @ state["cov_factor"].T + torch.diag(state["cov_diag"])
        ref = single.cov_factor @ single.cov_factor.T + torch.diag(single.cov_diag)
        assert float((ours - ref).norm() / ref.norm()) < 1e-5
        torch.testing.assert_close(state["lml"], single.log_marginal_likelihood().detach(), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_refused_input_raises_on_every_rank(results):
    assert "classification targets must be labels in [0, 3)" in results[1]["refused"]
    assert "another rank" in results[0]["refused"]
