"""FactorIVON's column of ``pyro-fa uci``: every grid point and split one replica of BatchedFactorIVON; a replica
that diverges scores -inf without changing the others; the column learns yacht."""
import json
import math

import pytest
import torch

from pyro_fa.datasets import load_uci
from pyro_fa.experiments.uci import factor_ivon as fi
from pyro_fa.experiments.uci.protocol import METHODS, Budget, SplitData
from pyro_fa.nn.batched import BatchedMLP


def _replicas(R=3, n=30, p=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, n, p, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(R, n, generator=g, dtype=torch.float64)
    xe = torch.randn(R, 10, p, generator=g, dtype=torch.float64)
    return SplitData(x, y, xe, torch.sin(xe.sum(-1)), torch.ones(R, dtype=torch.float64))


def _setting(lr, hess_init, precision=3e-3, beta2=0.99999):
    """A setting of the column's grid."""
    return {"precision": precision, "lr": lr, "hess_init": hess_init, "beta2": beta2}


def test_a_diverged_replica_scores_minus_inf_and_leaves_the_others_unchanged():
    data, spec = _replicas(), BatchedMLP(2, (8,))
    budget = Budget(steps=40, checkpoints=4, rank=2, eval_samples=4)
    settings = [_setting(0.4, 0.5), _setting(0.8, 0.1), _setting(0.4, 2.0)]
    runs = []
    for lr in (0.8, 1e30):  # replica 1 at a rate that overflows its weights
        settings[1] = _setting(lr, 0.1)
        opt, log_scale, curve = fi._fit(data, spec, settings, [0, 1, 2], budget.steps, budget, seed=0, evaluate=True)
        runs.append((opt, log_scale, torch.stack([ll for _, ll in curve])))
    (plain, scale, lls), (hit, hit_scale, hit_lls) = runs
    assert [s for s, _ in curve] == [10, 20, 30, 40]
    assert not bool(plain.diverged.any()) and bool(torch.isfinite(lls).all())
    assert hit.diverged.tolist() == [False, True, False]
    assert bool(torch.isneginf(hit_lls[:, 1]).all())  # diverged at once: every checkpoint -inf
    for r in (0, 2):  # the others exactly as without the diverged replica
        assert torch.equal(hit_lls[:, r], lls[:, r]) and torch.equal(hit.loc[r], plain.loc[r])
        assert torch.equal(hit_scale[r], scale[r])
    assert bool(torch.isfinite(hit.loc).all()) and bool(torch.isfinite(hit_scale).all())  # frozen, still finite


def test_every_grid_point_and_split_is_one_replica_initialised_by_its_split():
    spec = BatchedMLP(2, (8,))
    like = torch.zeros((), dtype=torch.float64)
    inits = fi._inits(spec, [0, 1, 0, 1], seed=5, like=like)
    assert torch.equal(inits[0], inits[2]) and torch.equal(inits[1], inits[3]) and not torch.equal(inits[0], inits[1])
    # nn.Linear's initialisation, as the column's networks had it: U(-1/sqrt(fan in), 1/sqrt(fan in))
    assert bool((inits[:, :24].abs() <= 1 / math.sqrt(2)).all()) and bool((inits[:, 24:].abs() <= 1 / math.sqrt(8)).all())
    assert float(inits[:, :24].abs().max()) > 0.5 / math.sqrt(2)


def test_the_column_learns_yacht():
    """A quick search on yacht: far better than predicting the training mean (RMSE about 15, LL about -4.1)."""
    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = Budget(steps=300, lrs=(1e-2,), tune_splits=1, checkpoints=3, test_samples=20, rank=4)
    res = fi.run_factor_ivon(METHODS["factor-ivon-1x50"], splits, budget, seed=0)
    assert max(res["rmse"]) < 5 and min(res["ll"]) > -3.2
    assert res["choice"] in [{"precision": a, "lr": 0.4, "hess_init": 10.0, "beta2": fi.BETA2S[0], "steps": s}
                             for a in budget.precisions for s in (100, 200, 300)]
    assert len(res["search"]) == 3 * len(budget.precisions) and res["tune_splits"] == 1 and len(res["ll"]) == 2


def test_the_batched_column_has_its_own_unit_key():
    """Unit files of the one-fit-at-a-time column are not reused: the key carries the column's revision."""
    from pyro_fa.experiments.uci import results

    run_key = results._run_key(Budget(), 3, 0)
    key = results._unit_key(run_key, "yacht", "factor-ivon-1x50", ["factor-ivon-1x50"])
    assert key["revision"] == results.UNIT_REVISIONS["factor-ivon-1x50"]
    assert "revision" not in results._unit_key(run_key, "yacht", "vifa-gaussian-1x50", ["vifa-gaussian-1x50"])
    assert results._unit_path("out", key) != results._unit_path("out", {k: v for k, v in key.items() if k != "revision"})


def test_a_finite_blow_up_is_frozen_as_a_non_finite_one(monkeypatch):
    """A replica whose weights explode without overflowing (rate 20) is frozen once its minibatch loss passes
    EXPLODED_LOSS, its weights still moderate; without the rule it trains on to far larger weights or overflows."""
    data, spec = _replicas(), BatchedMLP(2, (8,))
    budget = Budget(steps=40, checkpoints=4, rank=2, eval_samples=4)
    settings = [_setting(0.4, 0.5), _setting(20.0, 0.1), _setting(0.4, 2.0)]
    opt, _, curve = fi._fit(data, spec, settings, [0, 1, 2], budget.steps, budget, seed=0, evaluate=True)
    assert opt.diverged.tolist() == [False, True, False]
    assert bool(torch.isfinite(opt.loc).all()) and float(opt.loc[1].abs().max()) < 1e3
    assert all(bool(torch.isneginf(ll[1])) and bool(torch.isfinite(ll[[0, 2]]).all()) for _, ll in curve)
    assert opt.diag_floor == fi.DIAG_FLOOR == 0.25
    monkeypatch.setattr(fi, "EXPLODED_LOSS", math.inf)
    free, _, _ = fi._fit(data, spec, settings, [0, 1, 2], budget.steps, budget, seed=0, evaluate=True)
    assert not bool(torch.isfinite(free.loc[1]).all() and free.loc[1].abs().max() < 1e3)
    assert torch.equal(free.loc[[0, 2]], opt.loc[[0, 2]])


def test_a_final_fit_that_diverges_is_recorded_as_diverged_not_scored(monkeypatch):
    """The final fits' frozen weights are not a fit: a split whose final fit diverged scores test LL -inf (RMSE inf,
    calibration error NaN) and is listed under "diverged"; the report says so instead of a mean."""
    from pyro_fa.experiments.uci.report import results_table

    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = Budget(steps=30, lrs=(1e-2,), precisions=(1.0,), tune_splits=1, checkpoints=3, test_samples=5, rank=2)
    monkeypatch.setattr(fi, "QUICK_GRID", ((50.0, 0.1),))
    res = fi.run_factor_ivon(METHODS["factor-ivon-1x50"], splits, budget, seed=0)
    assert res["diverged"] == [0, 1] and res["ll"] == [-math.inf] * 2 and res["rmse"] == [math.inf] * 2
    assert all(math.isnan(v) for v in res["calibration_error"])
    table = results_table({"yacht": {"factor-ivon-1x50": {**res, "seconds": 1.0}}}, {})
    assert "diverged on 2 of 2 splits" in table


def test_a_diverged_final_fit_is_trained_again_at_half_the_rate_the_others_kept(monkeypatch):
    """Split 0's final fit marked diverged once: trained again alone, from its start, at half the chosen rate; split
    1's scores are those of the run without the divergence; the record lists the lowered rate."""
    from pyro_fa.experiments.uci.report import results_table

    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = Budget(steps=30, lrs=(1e-2,), precisions=(1.0,), tune_splits=1, checkpoints=3, test_samples=5, rank=2)
    monkeypatch.setattr(fi, "QUICK_GRID", ((0.4, 10.0),))
    plain = fi.run_factor_ivon(METHODS["factor-ivon-1x50"], splits, budget, seed=0)
    fit, calls = fi._fit, []

    def first_final_diverges(data, spec, settings, split_of, steps, budget, seed, evaluate=False, **kw):
        opt, scale, curve = fit(data, spec, settings, split_of, steps, budget, seed, evaluate=evaluate, **kw)
        if not evaluate:
            calls.append(([c["lr"] for c in settings], list(split_of)))
            if len(calls) == 1:
                opt.diverged[0] = True
        return opt, scale, curve

    monkeypatch.setattr(fi, "_fit", first_final_diverges)
    res = fi.run_factor_ivon(METHODS["factor-ivon-1x50"], splits, budget, seed=0)
    assert calls == [([0.4, 0.4], [0, 1]), ([0.2], [0])]
    assert "diverged" not in res and res["lowered_lr"] == {"0": 0.2}
    assert json.loads(json.dumps(res["lowered_lr"])) == res["lowered_lr"]  # the record as its unit file holds it
    assert res["ll"][1] == plain["ll"][1] and res["rmse"][1] == plain["rmse"][1]
    assert math.isfinite(res["ll"][0]) and res["ll"][0] != plain["ll"][0]
    table = results_table({"yacht": {"factor-ivon-1x50": {**res, "seconds": 1.0}}}, {})
    assert "(rate lowered on 1 of 2 splits)" in table


def test_final_record_scores_the_splits_that_did_not_diverge_as_evaluate_does():
    from pyro_fa.experiments.uci.protocol import evaluate, final_record

    data = _replicas(R=3)
    g = torch.Generator().manual_seed(1)
    means = data.y_eval.unsqueeze(0) + 0.3 * torch.randn(7, 3, 10, generator=g, dtype=torch.float64)
    noise_var = torch.full((3, 1), 0.2, dtype=torch.float64)
    search = ({"lr": 0.1}, 0.0, [], 1)
    rec = final_record(METHODS["factor-ivon-1x50"], means, noise_var, data, None, search, 5, 1.0,
                       torch.ones(3, dtype=torch.float64), 1.0, 0, diverged=torch.tensor([False, True, False]))
    alone = evaluate(means[:, [0, 2]], noise_var[[0, 2]], data.take(torch.tensor([0, 2])))
    assert rec["diverged"] == [1] and rec["ll"][1] == -math.inf and rec["rmse"][1] == math.inf
    for k in ("ll", "rmse", "calibration_error"):
        assert [rec[k][0], rec[k][2]] == pytest.approx(alone[k].tolist(), rel=1e-12)
    none = final_record(METHODS["factor-ivon-1x50"], means, noise_var, data, None, search, 5, 1.0,
                        torch.ones(3, dtype=torch.float64), 1.0, 0, diverged=torch.zeros(3, dtype=torch.bool))
    assert "diverged" not in none and none["ll"] == pytest.approx(evaluate(means, noise_var, data)["ll"].tolist())


def test_the_ivon_column_is_the_factor_ivon_column_at_rank_0(monkeypatch):
    """ivon-1x50: every fit's optimizer at rank 0 (IVON's update), the record the FactorIVON column's with the
    budget's rank 0; the command runs it by its own runner."""
    import dataclasses

    from pyro_fa.experiments.uci.command import RUNNERS

    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = Budget(steps=30, lrs=(1e-2,), precisions=(1.0,), tune_splits=1, checkpoints=3, test_samples=5, rank=2)
    ranks, cls = [], fi.BatchedFactorIVON

    def spy(*args, **kwargs):
        ranks.append(kwargs["rank"])
        return cls(*args, **kwargs)

    monkeypatch.setattr(fi, "BatchedFactorIVON", spy)
    ours = fi.run_ivon(METHODS["ivon-1x50"], splits, budget, seed=0)
    assert ranks == [0, 0]  # the search and the final fits
    want = fi.run_factor_ivon(METHODS["ivon-1x50"], splits, dataclasses.replace(budget, rank=0), seed=0)
    assert ours == want
    other = fi.run_factor_ivon(METHODS["factor-ivon-1x50"], splits, budget, seed=0)
    assert ours["ll"] != other["ll"] and ranks[-1] == 2
    assert RUNNERS[METHODS["ivon-1x50"].family] is fi.run_ivon


def test_halving_keeps_the_better_half_of_the_settings_still_training():
    """_halve: 4 settings x 2 splits, setting 1 already dropped; by their best mean so far settings 3 > 0 > 2:
    3 and 0 go on (ceil(3 / 2) = 2), at their positions in the batch of the replicas still trained."""
    inf = math.inf
    curve = [(1, torch.tensor([0.0, 0.0, 5.0, 5.0, -1.0, -1.0, 1.0, 1.0])),
             (2, torch.tensor([0.5, 0.5, -inf, -inf, -3.0, -3.0, 2.0, 2.0]))]
    alive = torch.tensor([0, 1, 4, 5, 6, 7])  # setting 1 (replicas 2, 3) stopped before
    assert fi._halve(curve, alive, 4).tolist() == [0, 1, 4, 5]


def test_the_search_halves_its_settings_and_scores_the_dropped_ones_minus_inf(monkeypatch):
    data, spec = _replicas(R=8), BatchedMLP(2, (8,))
    budget = Budget(steps=40, checkpoints=8, rank=2, eval_samples=4)
    settings = [_setting(lr, 0.5) for lr in (0.05, 0.1, 0.2, 0.4) for _ in range(2)]  # 4 settings x 2 splits
    monkeypatch.setattr(fi, "HALVE_AT", (1 / 8, 1 / 4, 1 / 2))
    opt, log_scale, curve = fi._fit(data, spec, settings, [0, 1] * 4, budget.steps, budget, seed=0, evaluate=True,
                                    n_configs=4, halving=True)
    # cuts at the checkpoints at steps 5 (1/8), 10 (1/4), 20 (1/2): 4 -> 2 -> 1 -> 1 settings
    alive = [torch.isfinite(ll).reshape(4, 2).all(1).sum().item() for _, ll in curve]
    assert alive == [4, 2, 1, 1, 1, 1, 1, 1]
    assert opt.replicas == 2 and log_scale.shape == (2,) and opt.loc.shape == (2, spec.dim)
    winner = torch.isfinite(curve[-1][1]).reshape(4, 2).all(1).nonzero().item()
    best = torch.stack([ll for _, ll in curve[:2]]).reshape(2, 4, 2).mean(-1).amax(0)
    assert winner in best.topk(2).indices.tolist()  # among the better half at the first cut
    assert torch.allclose(opt.lr / opt.lr.max(), torch.ones(2)) and float(opt.diverged.sum()) == 0
