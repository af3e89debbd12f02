"""Online SGA's natural step sharded over 2 gloo processes (spawned on the CPU), against one process."""
import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from pyro_fa import OnlineFactorAnalysis, SWAG

from _ranks import run_ranks

D, K, T = 37, 3, 200
TIMEOUT = 120
KW = dict(method="sga", optimizer="natural", warmup=20, seed=0)


def _data():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(D, K, generator=g, dtype=torch.float64)
    noise = 0.3 + torch.rand(D, generator=g, dtype=torch.float64)
    X = torch.randn(T, K, generator=g, dtype=torch.float64) @ W.T
    return X + noise.sqrt() * torch.randn(T, D, generator=g, dtype=torch.float64) + 2.0


def _fit(fa, X, lo=0, hi=D):
    for t in range(T - 10):
        fa.update(X[t, lo:hi])
    fa.update(X[T - 10:, lo:hi])  # a batch
    return fa


def _entry(rank, world_size, init_file, out_dir, step):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        X = _data()
        fa = OnlineFactorAnalysis(D, K, process_group=dist.group.WORLD, optimizer_kwargs={"step": step}, **KW)
        lo, hi = fa._sharding.lo, fa._sharding.hi
        _fit(fa, X, lo, hi)
        p = torch.zeros(D)
        swag = SWAG([p], rank=K, process_group=dist.group.WORLD, optimizer_kwargs={"step": step}, **KW)
        for x in X:
            p.copy_(x)
            swag.collect()
        out = dict(F=fa.cov_factor, psi=fa.cov_diag, swag_F=swag.cov_factor, swag_psi=swag.cov_diag,
                   rows=hi - lo, collectives=fa._sharding.n_collectives)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_sharded_natural_step_equals_single_process(tmp_path, step):
    res = run_ranks(_entry, (2, str(tmp_path / "store"), str(tmp_path), step), 2, tmp_path, TIMEOUT)
    X = _data()
    single = _fit(OnlineFactorAnalysis(D, K, dtype=torch.float64, optimizer_kwargs={"step": step}, **KW), X)
    assert [r["rows"] for r in res] == [19, 18]  # each rank holds its rows only
    torch.testing.assert_close(torch.cat([r["F"] for r in res]), single.cov_factor, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["psi"] for r in res]), single.cov_diag, rtol=1e-9, atol=1e-12)
    # one all-reduce per update, as online EM (the warm-up's rescalings and the batch add a few)
    assert res[0]["collectives"] <= (T - 10) + 1 + 4 + 2 + 2, res[0]["collectives"]
    p = torch.zeros(D, dtype=torch.float64)
    swag = SWAG([p], rank=K, optimizer_kwargs={"step": step}, **KW)
    for x in X:
        p.copy_(x)
        swag.collect()
    torch.testing.assert_close(torch.cat([r["swag_F"] for r in res]), swag.cov_factor, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["swag_psi"] for r in res]), swag.cov_diag, rtol=1e-9, atol=1e-12)
