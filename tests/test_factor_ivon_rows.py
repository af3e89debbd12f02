"""FactorIVON's rows of ``pyro-fa classify`` and its column of ``pyro-fa uci``.

The classification problem: three Gaussian blobs in 2-D (300 training points) and a 2-32-3 tanh MLP, as the IVON
row's tests; the commands' own data for the end-to-end runs.
"""
import json
import math

import pytest
import torch
from torch import nn

from pyro_fa import cli
from pyro_fa.experiments.classify import baselines as peers
from pyro_fa.experiments.classify.factor_ivon_rows import FACTOR_IVON_ROWS, factor_ivon_probs
from pyro_fa.experiments.classify.command import QUICK_METHODS
from pyro_fa.experiments.classify.methods import METHODS, Budget, epochs_of, run_methods


def _blobs(n, generator):
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    y = torch.randint(0, 3, (n,), generator=generator)
    return centers[y] + 1.2 * torch.randn(n, 2, generator=generator), y


def _make_net():
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3))


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    return {"train": _blobs(300, g), "val": _blobs(100, g), "test": _blobs(200, g), "far": 6.0 * torch.randn(50, 2, generator=g)}


GRID = dict(lr_grid=(0.1, 0.4), hess_init_grid=(0.1, 0.5))


def test_rank_zero_row_is_the_ivon_row(problem):
    """FactorIVON at rank 0 is ivon-opt's IVON bit for bit, so the factor-ivon row at rank 0 must give the IVON
    row's very predictions: same grid scores, same choice, same draws."""
    reason = peers.unavailable_reasons()["ivon"]
    if reason is not None:
        pytest.skip(f"ivon-opt does not import ({reason})")
    torch.set_num_threads(1)
    args = (_make_net, problem["train"], problem["val"], [problem["test"][0], problem["far"]])
    info_ivon, info_ours = {}, {}
    want = peers.ivon_probs(*args, epochs=6, batch_size=32, num_samples=5, info=info_ivon, **GRID)
    (got,) = factor_ivon_probs(*args, epochs=6, batch_size=32, num_samples=5, rank=0, update_every=1,
                               info=info_ours, **GRID)
    assert len(info_ivon["val_nll"]) == 4
    assert info_ours["val_nll"] == info_ivon["val_nll"]
    assert (info_ours["lr"], info_ours["hess_init"]) == (info_ivon["lr"], info_ivon["hess_init"])
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_choice_is_made_on_validation_only(problem):
    """Other test inputs change neither the grid's scores nor the choice nor the predictions of the inputs shared;
    other validation labels change the scores. The choice is the grid point of least validation NLL."""
    torch.set_num_threads(1)
    x_te = problem["test"][0]
    common = dict(epochs=4, batch_size=32, num_samples=4, rank=3, update_every=2, **GRID)
    info_a, info_b, info_c = {}, {}, {}
    (a,) = factor_ivon_probs(_make_net, problem["train"], problem["val"], [x_te, problem["far"]], info=info_a,
                             **common)
    (b,) = factor_ivon_probs(_make_net, problem["train"], problem["val"], [x_te, -problem["far"][:7]], info=info_b,
                             **common)
    assert info_a == {**info_b, "seconds_grid": info_a["seconds_grid"], "seconds_members": info_a["seconds_members"]}
    assert torch.equal(a[0], b[0]) and a[1].shape == (4, 50, 3) and b[1].shape == (4, 7, 3)
    best = min(info_a["val_nll"], key=info_a["val_nll"].get)
    assert best == repr((info_a["lr"], info_a["hess_init"]))
    x_va, y_va = problem["val"]
    factor_ivon_probs(_make_net, problem["train"], (x_va, (y_va + 1) % 3), [x_te], info=info_c, **common)
    assert set(info_c["val_nll"]) == set(info_a["val_nll"])
    assert all(info_c["val_nll"][k] > info_a["val_nll"][k] for k in info_a["val_nll"])  # wrong labels cost


def test_ensemble_members_start_from_the_chosen_network(problem):
    torch.set_num_threads(1)
    args = (_make_net, problem["train"], problem["val"], [problem["test"][0]])
    common = dict(epochs=3, batch_size=64, num_samples=3, rank=2, **GRID)
    info = {}
    one = factor_ivon_probs(*args, **common)
    three = factor_ivon_probs(*args, members=3, info=info, **common)
    assert len(one) == 1 and len(three) == 3
    assert torch.equal(one[0][0], three[0][0])  # the first member is the row's network, its draws the row's
    assert not torch.equal(three[0][0], three[1][0])  # another seed, another network
    x_te, y_te = problem["test"]
    pooled = torch.cat([m[0] for m in three]).mean(0)
    assert torch.allclose(pooled.sum(-1), torch.ones(len(x_te)), atol=1e-5)
    assert info["seconds_members"] > 0


def test_diag_floor_reaches_the_optimizer(problem):
    """The row's ``diag_floor`` is FactorIVON's: the row at one grid point predicts as the IVON recipe's own
    training loop run with ``FactorIVON(..., diag_floor=...)`` by hand, and another floor changes the draws."""
    import functools
    import types

    from pyro_fa.optim import FactorIVON

    torch.set_num_threads(1)
    x_te = problem["test"][0]
    common = dict(epochs=3, batch_size=32, num_samples=3, rank=3, update_every=1, lr_grid=(0.4,),
                  hess_init_grid=(0.5,))
    (low,) = factor_ivon_probs(_make_net, problem["train"], None, [x_te], diag_floor=0.05, **common)
    (no_low_rank,) = factor_ivon_probs(_make_net, problem["train"], None, [x_te], diag_floor=1.0, **common)
    optimizer = types.SimpleNamespace(IVON=functools.partial(FactorIVON, rank=3, update_every=1, diag_floor=0.05))
    with torch.random.fork_rng():
        net, opt = peers._ivon_train(optimizer, _make_net, *problem["train"], 3, 32, lr=0.4, seed=0, hess_init=0.5,
                                     beta2=0.99999, weight_decay=1e-4)
        torch.manual_seed(1)
        (by_hand,) = peers._ivon_predict(net, opt, [x_te], 3)
    assert torch.equal(low[0], by_hand)
    assert not torch.allclose(low[0], no_low_rank[0])  # a floor of 1 leaves the low-rank part no room


def test_a_diverging_grid_point_is_never_chosen(problem):
    """A rate at which FactorIVON meets a non-finite gradient scores an infinite validation NLL and the search goes
    on; a grid where every point diverges is refused, naming them."""
    torch.set_num_threads(1)
    common = dict(epochs=2, batch_size=32, num_samples=3, rank=2, hess_init_grid=(0.5,))
    info = {}
    (got,) = factor_ivon_probs(_make_net, problem["train"], problem["val"], [problem["test"][0]],
                               lr_grid=(0.4, 1e30), info=info, **common)
    assert info["val_nll"][repr((1e30, 0.5))] == math.inf and math.isfinite(info["val_nll"][repr((0.4, 0.5))])
    assert info["lr"] == 0.4 and bool(torch.isfinite(got[0]).all())
    with pytest.raises(ValueError, match=r"factor_ivon_probs: training diverged .* at every grid point "
                                         r"\(1e\+30, 0.5\)"):
        factor_ivon_probs(_make_net, problem["train"], problem["val"], [problem["test"][0]], lr_grid=(1e30,),
                          hess_init_grid=(0.5, 0.6), epochs=2, batch_size=32, num_samples=3, rank=2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"rank": -1}, ValueError, "rank must be a non-negative integer, got -1"),
    ({"members": 0}, ValueError, "members must be a positive integer, got 0"),
    ({"update_every": 0}, ValueError, "update_every must be a positive integer, got 0"),
    ({"diag_floor": 0.0}, ValueError, r"diag_floor must be a number in \(0, 1\], got 0.0"),
    ({"diag_floor": 1.5}, ValueError, r"diag_floor must be a number in \(0, 1\], got 1.5"),
    ({"lr_grid": ()}, ValueError, r"lr_grid and hess_init_grid must hold finite numbers > 0, got lr_grid=\(\)"),
    ({"hess_init_grid": (0.5, -1.0)}, ValueError, "lr_grid and hess_init_grid must hold finite numbers > 0"),
])
def test_factor_ivon_probs_refuses_bad_options(problem, kwargs, error, match):
    with pytest.raises(error, match=f"factor_ivon_probs: {match}"):
        factor_ivon_probs(_make_net, problem["train"], problem["val"], [problem["test"][0]], epochs=1, batch_size=32,
                          **kwargs)


def test_rows_in_run_methods_without_a_map_network():
    """Both rows and their "+T" rows from one grid; no MAP grid is trained for them (epochs_of agrees)."""
    from pyro_fa.experiments.classify.data import load_classify

    torch.set_num_threads(1)
    assert set(FACTOR_IVON_ROWS) <= set(METHODS)
    assert "factor-ivon" in QUICK_METHODS  # --quick runs it
    budget = Budget(epochs=2, rank=2, ensemble=2, samples=3, ivon_lrs=(0.1, 0.4), ivon_hess_inits=(0.5,))
    data = load_classify("digits", seed=0).subset(150, 60)
    ticks = []
    rows = run_methods(list(FACTOR_IVON_ROWS), "mlp", data, budget, 0, tick=ticks.append)
    assert set(rows) == {"factor-ivon", "factor-ivon+T", "factor-ivon-ensemble", "factor-ivon-ensemble+T"}
    assert sum(ticks) == epochs_of(list(FACTOR_IVON_ROWS), budget) == 2 * (2 + 1)
    n_test = data.x_test.shape[0]
    assert rows["factor-ivon"]["probs"][0].shape == (3, n_test, 10)
    assert rows["factor-ivon-ensemble"]["probs"][0].shape == (6, n_test, 10)
    assert torch.equal(rows["factor-ivon-ensemble"]["probs"][0][:3], rows["factor-ivon"]["probs"][0])
    assert rows["factor-ivon"]["extra"]["lr"] in (0.1, 0.4) and rows["factor-ivon"]["extra"]["rank"] == 2
    assert rows["factor-ivon-ensemble"]["seconds"] > rows["factor-ivon"]["seconds"]


# ----------------------------------------------------------------------------- pyro-fa uci


def _yacht(n):
    from pyro_fa.datasets import load_uci

    return [load_uci("yacht", s, dtype=torch.float32) for s in range(n)]


def test_uci_choice_ignores_the_test_parts(monkeypatch):
    """The search sees the tuning splits' training parts only: test targets replaced by noise leave the choice,
    its validation log-likelihood and the search table unchanged, and change the test scores."""
    import dataclasses

    from pyro_fa.experiments.uci import factor_ivon as fi
    from pyro_fa.experiments.uci.protocol import METHODS as UCI_METHODS, Budget as UCIBudget

    torch.set_num_threads(1)
    monkeypatch.setattr(fi, "IVON_LRS", (0.1, 0.4))
    monkeypatch.setattr(fi, "IVON_HESS_INITS", (0.5,))
    budget = UCIBudget(steps=60, checkpoints=3, lrs=(3e-3, 1e-2), tune_splits=1, eval_samples=4, test_samples=5,
                       rank=3)
    splits = _yacht(2)
    g = torch.Generator().manual_seed(1)
    other = [dataclasses.replace(d, y_test=torch.randn(d.y_test.shape, generator=g)) for d in splits]
    method = UCI_METHODS["factor-ivon-1x50"]
    a = fi.run_factor_ivon(method, splits, budget, 0)
    b = fi.run_factor_ivon(method, other, budget, 0)
    # prior precisions x 2 settings x the decays x 3 checkpoints
    assert len(a["search"]) == len(budget.precisions) * 2 * len(fi.BETA2S) * 3
    assert a["choice"] == b["choice"] and a["val_ll"] == b["val_ll"] and a["search"] == b["search"]
    assert a["choice"]["lr"] in (0.1, 0.4) and a["choice"]["steps"] in (20, 40, 60)
    assert a["choice"]["precision"] in budget.precisions and a["choice"]["beta2"] in fi.BETA2S
    assert a["val_ll"] == max(row["val_ll"] for row in a["search"])
    assert a["noise_scale"] == b["noise_scale"] and a["ll"] != b["ll"]
    assert len(a["ll"]) == 2 and all(math.isfinite(v) for v in a["ll"] + a["rmse"])


def test_uci_search_stops_early_as_the_other_methods_do(monkeypatch):
    """The column's search stops by the rule of the other methods' search (protocol.train's patience): with a
    held-out log-likelihood that only falls after the first checkpoint, it stops at the first checkpoint past a
    quarter of the steps whose third is at or beyond the best's step (30 of 100, checkpoints every 10); the
    progress still counts every step; the final fit (no checkpoints) runs its steps."""
    from pyro_fa.experiments.uci import factor_ivon as fi
    from pyro_fa.experiments.uci.protocol import Budget as UCIBudget, final_data, tuning_data
    from pyro_fa.nn.batched import BatchedMLP

    torch.set_num_threads(1)
    calls = []

    def falling(means, noise_var, data):
        calls.append(1)
        return means.new_full(means.shape[1:2], -float(len(calls)))  # (R,): worse at every checkpoint

    monkeypatch.setattr(fi, "heldout_ll", falling)
    budget = UCIBudget(steps=100, checkpoints=10, lrs=(3e-3, 1e-2), tune_splits=1, eval_samples=2, rank=2)
    splits = _yacht(1)
    spec = BatchedMLP(splits[0].x_train.shape[1], (8,))
    tune = tuning_data(splits, budget)
    settings = [{"precision": 1.0, "lr": r, "hess_init": 0.5, "beta2": 0.99999} for r in (0.1, 0.4)]
    ticks = []
    _, _, curve = fi._fit(tune.take(torch.tensor([0, 0])), spec, settings, [0, 0], 100, budget, 0, evaluate=True,
                          progress=ticks.append, patience=True, n_configs=2)
    assert [step for step, _ in curve] == [10, 20, 30] and sum(ticks) == 100
    ticks.clear()
    opt, _, curve = fi._fit(final_data(splits), spec, settings[:1], [0], 37, budget, 0, progress=ticks.append)
    assert curve == [] and sum(ticks) == 37 and opt.step_count == 37
    n = final_data(splits).y.shape[-1]
    assert float(opt.weight_decay[0]) == pytest.approx(1.0 / n)
    opt, _, _ = fi._fit(final_data(splits), spec, [{**settings[0], "precision": 10.0}], [0], 2, budget, 0)
    assert float(opt.weight_decay[0]) == pytest.approx(10.0 / n)  # the prior N(0, 1/10): ess * weight decay = 10


@pytest.mark.slow
def test_uci_factor_ivon_learns_the_noise_of_a_known_regression(monkeypatch):
    """y = sin(2x) + 0.3 eps: the learned noise scale is near 0.3 (in original units) and the test RMSE near it.
    (At an initial Hessian of 0.1 the posterior stays broad over the run, beta2 = 0.99999, and the noise learnt
    at its draws is 0.46: the validation log-likelihood must prefer 2.0.)"""
    from pyro_fa.datasets import UCISplit
    from pyro_fa.experiments.uci import factor_ivon as fi
    from pyro_fa.experiments.uci.protocol import METHODS as UCI_METHODS, Budget as UCIBudget

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(500, 1, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.3 * torch.randn(500, generator=g)
    ym, ys = float(y[:400].mean()), float(y[:400].std(unbiased=False))
    split = UCISplit("toy", 0, 1, x[:400], (y[:400] - ym) / ys, x[400:], (y[400:] - ym) / ys, torch.zeros(1),
                     torch.ones(1), ym, ys, n_hidden=50)
    monkeypatch.setattr(fi, "IVON_LRS", (0.4,))
    monkeypatch.setattr(fi, "IVON_HESS_INITS", (0.1, 2.0))
    budget = UCIBudget(steps=1500, checkpoints=5, lrs=(3e-3, 1e-2), tune_splits=1, eval_samples=8, test_samples=20,
                       rank=4)
    out = fi.run_factor_ivon(UCI_METHODS["factor-ivon-1x50"], [split], budget, 0)
    assert out["choice"]["hess_init"] == 2.0
    assert out["noise_scale"][0] == pytest.approx(0.3, rel=0.25)
    assert out["rmse"][0] == pytest.approx(0.3, rel=0.3)


def test_uci_quick_runs_the_factor_ivon_column(tmp_path, capsys):
    from pyro_fa.experiments.uci.protocol import QUICK_METHODS

    torch.set_num_threads(1)
    assert "factor-ivon-1x50" in QUICK_METHODS
    code = cli.main(["uci", "--quick", "--datasets", "yacht", "--methods", "factor-ivon-1x50", "--splits", "2",
                     "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]["yacht"]["factor-ivon-1x50"]
    assert len(results["ll"]) == 2 and all(math.isfinite(v) for v in results["ll"])
    assert results["choice"]["lr"] == 0.4 and results["seconds"] > 0
    assert "FactorIVON (ours) 1×50" in capsys.readouterr().out
