"""The UCI benchmark: the protocol on the public batched trainer (tested itself in test_batched.py), the command."""
import json
import math
import os

import numpy as np
import pytest
import torch

from pyro_fa import cli, metrics
from pyro_fa.datasets import load_uci
from pyro_fa.experiments.uci import protocol
from pyro_fa.experiments.uci import command as uci
from pyro_fa.nn import BatchedMLP, BatchedVI


def _toy(N=40, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, p, generator=g)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(N, generator=g)
    return x, y


# ------------------------------------------------------------------ the protocol


def test_validation_split_is_inside_the_training_part():
    """The search sees only the training part: 80 % / 20 % of it, re-standardised on the 80 %."""
    d = load_uci("yacht", split=3)
    x_tr, y_tr, x_va, y_va, y_std = protocol._validation_split(d, 0.2, 3)
    n_val = round(0.2 * 277)
    assert x_tr.shape[0] + x_va.shape[0] == 277 and x_va.shape[0] == n_val
    torch.testing.assert_close(x_tr.mean(0), torch.zeros(6, dtype=x_tr.dtype), atol=1e-10, rtol=0)
    torch.testing.assert_close(y_tr.std(unbiased=False), torch.tensor(1.0, dtype=y_tr.dtype))
    # the rows are the training part's, permuted: undo the affine re-standardisation and compare
    perm = torch.randperm(277, generator=torch.Generator().manual_seed(10_003))
    val, sub = d.x_train[perm[:n_val]], d.x_train[perm[n_val:]]
    mean, std = sub.mean(0), sub.std(0, unbiased=False)
    torch.testing.assert_close(x_va * std + mean, val)
    torch.testing.assert_close(y_va * d.y_train[perm[n_val:]].std(unbiased=False) + d.y_train[perm[n_val:]].mean(),
                               d.y_train[perm[:n_val]])
    # no test row anywhere in the search data
    train_rows = {tuple(np.round(r, 8)) for r in d.x_train.numpy()}
    test_only = {tuple(np.round(r, 8)) for r in d.x_test.numpy()} - train_rows
    assert test_only and not ({tuple(np.round(r, 8)) for r in val.numpy()} & test_only)
    assert y_std == pytest.approx(float(d.y_train[perm[n_val:]].std(unbiased=False)) * d.y_std)


@pytest.mark.parametrize("n_train, expected", [(277, 5), (455, 4), (691, 3), (927, 2), (1439, 2), (7373, 1),
                                               (41157, 1)])
def test_search_uses_enough_splits_for_300_validation_points(n_train, expected):
    """Yacht, Boston, Energy, Concrete, Wine, Kin8nm, Protein training parts: ceil(300 / (0.2 n)), at most 5."""
    assert uci.n_tune_splits(n_train, uci.Budget()) == expected
    assert uci.n_tune_splits(n_train, uci.Budget(tune_splits=2)) == 2


def test_search_grid_per_architecture_and_family():
    """One hidden layer: precision x ``lrs``; two: precision x ``deep_lrs``; VIPPCA: precision x sigma at ``ppca_lr``."""
    b = uci.Budget(precisions=(0.1, 1.0), lrs=(3e-3, 1e-2), deep_lrs=(5e-3,), ppca_lr=2e-3, ppca_scales=(None, 0.01))
    for name in ("vifa-gaussian-1x50", "autonormal-1x50", "lowrank-1x50"):
        assert protocol._configs(uci.METHODS[name], b) == [{"precision": a, "lr": lr} for a in (0.1, 1.0)
                                                       for lr in (3e-3, 1e-2)]
    for name in ("vifa-laplace-2x50", "lowrank-2x50"):
        assert protocol._configs(uci.METHODS[name], b) == [{"precision": 0.1, "lr": 5e-3}, {"precision": 1.0, "lr": 5e-3}]
    for name in ("vippca-gaussian-1x50", "vippca-laplace-2x50"):
        assert protocol._configs(uci.METHODS[name], b) == [{"precision": a, "lr": 2e-3, "sigma": s} for a in (0.1, 1.0)
                                                       for s in (None, 0.01)]
    full = uci.Budget()  # the default grid: 8 points for the 1x50 VI guides, 4 for 2x50 VIFA, 8 for VIPPCA
    assert [len(protocol._configs(uci.METHODS[n], full)) for n in ("vifa-gaussian-1x50", "vifa-gaussian-2x50",
                                                             "vippca-gaussian-2x50")] == [8, 4, 8]
    assert None not in full.ppca_scales


def test_tuning_data_stacks_the_first_splits_validation_parts():
    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(6)]
    tune = uci.tuning_data(splits, uci.Budget())
    assert tune.y.shape == (5, 277 - 55) and tune.y_eval.shape == (5, 55)
    for s in range(5):  # replica s is split s's own validation cut
        torch.testing.assert_close(tune.y_eval[s], protocol._validation_split(splits[s], 0.2, s)[3])
    assert uci.tuning_data(splits[:2], uci.Budget()).y.shape[0] == 2  # never more splits than were loaded


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_train_follows_the_rate_schedule_of_the_budgets_steps(monkeypatch, schedule):
    """The rate at step t is lr (1 + cos(pi t / T)) / 2 over the budget's T steps, also in a fit stopped at t < T:
    a final fit that stops at the chosen step has seen the search's rates."""
    x, y = _toy()
    data = uci.SplitData(x.expand(2, -1, -1), y.expand(2, -1), x.expand(2, -1, -1), y.expand(2, -1), torch.ones(2))
    seen = []
    make = BatchedVI.optimizer

    def recording(self, **kw):
        opt = make(self, **kw)
        opt.register_step_pre_hook(lambda o, *_: seen.append(sorted(g["lr"] for g in o.param_groups)))
        return opt

    monkeypatch.setattr(BatchedVI, "optimizer", recording)
    vi = BatchedVI(BatchedMLP(3, (6,)), "fa", "gaussian", torch.ones(2), torch.tensor([3e-3, 1e-2]), rank=2,
                   generator=torch.Generator().manual_seed(0))
    budget = uci.Budget(steps=40, lr_schedule=schedule)
    uci.train(vi, data, 25, budget, torch.Generator().manual_seed(0))
    assert len(seen) == 25
    for t, rates in enumerate(seen):
        f = (1 + math.cos(math.pi * t / 40)) / 2 if schedule == "cosine" else 1.0
        assert rates == pytest.approx([3e-3 * f, 1e-2 * f], rel=1e-12)


def test_heldout_ll_equals_metrics_per_replica():
    g = torch.Generator().manual_seed(0)
    means = torch.randn(7, 3, 5, generator=g, dtype=torch.float64)
    nv = torch.rand(3, 1, generator=g, dtype=torch.float64) + 0.1
    data = uci.SplitData(torch.zeros(3, 1, 1), torch.zeros(3, 1), torch.zeros(3, 5, 1),
                         torch.randn(3, 5, generator=g, dtype=torch.float64), torch.tensor([1.0, 2.0, 0.5]))
    ll = uci.heldout_ll(means, nv, data)
    full = uci.evaluate(means, nv, data)
    for r in range(3):
        ref = metrics.gaussian_log_likelihood(means[:, r], nv[r], data.y_eval[r], y_std=float(data.y_std[r]))
        torch.testing.assert_close(ll[r], ref)
        torch.testing.assert_close(full["ll"][r], ref)
        torch.testing.assert_close(full["rmse"][r], metrics.rmse(means[:, r], data.y_eval[r], float(data.y_std[r])))
    bad = means.clone()
    bad[0, 1, 0] = float("nan")
    assert uci.heldout_ll(bad, nv, data)[1] == -math.inf and torch.isfinite(uci.heldout_ll(bad, nv, data)[0])
    with pytest.raises(FloatingPointError, match="diverged"):
        uci.evaluate(bad, nv, data)


def test_swag_scale_curve_is_the_held_out_log_likelihood_of_common_draws():
    """The SWAG family's scale search: scale 0 is the mean's prediction, every scale the model average of the
    same draws scaled, each point scored as uci.heldout_ll scores its replica."""
    from pyro_fa.experiments.uci import swag_family

    x, y = _toy(N=60)
    R = 2
    data = uci.SplitData(x[:40].expand(R, -1, -1), y[:40].expand(R, -1), x[40:].expand(R, -1, -1),
                         y[40:].expand(R, -1), torch.tensor([1.0, 2.0]))
    budget = uci.Budget(swag_steps=60, swag_collections=20, swag_warmup=5, swag_batch=10, rank=2)
    swags, model = swag_family._map_then_collect(BatchedMLP(3, (6,)), data, 1.0, 1e-2, 30, 1e-2, budget, ("em",),
                                                 range(R), torch.Generator().manual_seed(0),
                                                 torch.Generator().manual_seed(1))
    scales = [0.0, 1.0, 100.0]
    L = swag_family._scale_curve(swags["em"], model, data, 8, torch.Generator().manual_seed(2), scales)
    assert L.shape == (3, R * 20)
    loc = torch.stack([swags["em"][r].loc for r in range(R)])
    dev = torch.stack([swags["em"][r].predictive().deviations(8, g) for g in [torch.Generator().manual_seed(2)]
                       for r in range(R)], 1)  # the generator shared by the replicas, in replica order
    nv = model.likelihood_scale().detach().pow(2).unsqueeze(-1)
    for i, s in enumerate(scales):
        means = model.mlp.forward(loc + math.sqrt(s) * dev, data.x_eval)
        torch.testing.assert_close(L[i].reshape(R, 20).mean(1), uci.heldout_ll(means, nv, data), rtol=1e-5,
                                   atol=1e-5)
    scale, record = swag_family._choose_scale(swags["em"], model, data, 8, 2)
    assert record["scales"][:3] == [0.0, 0.01, 10 ** -1.5] and scale == record["scale"] in record["scales"]
    # never worse than the mean on the validation points
    assert record["val_ll"][record["scales"].index(scale)] >= record["val_ll"][0]


def test_multiswag_scale_curve_scores_the_mixture_of_members():
    """MultiSWAG's scale search scores each split's mixture of members: every member's draws pooled, per point
    the log of the mean density over all of them (scale 0: the ensemble of the members' means), computed here
    from the members' own draws and Normal densities."""
    from pyro_fa.experiments.uci import swag_family

    x, y = _toy(N=60)
    n, M = 2, 3
    R = n * M  # replica = member * n + split
    data = uci.SplitData(x[:40].expand(R, -1, -1), y[:40].expand(R, -1), x[40:].expand(R, -1, -1),
                         y[40:].expand(R, -1), torch.tensor([1.0, 2.0]).repeat(M))
    budget = uci.Budget(swag_steps=60, swag_collections=20, swag_warmup=5, swag_batch=10, rank=2)
    swags, model = swag_family._map_then_collect(BatchedMLP(3, (6,)), data, 1.0, 1e-2, 30, 1e-2, budget, ("em",),
                                                 range(R), torch.Generator().manual_seed(0),
                                                 torch.Generator().manual_seed(1))
    scales = [0.0, 1.0, 100.0]
    L = swag_family._scale_curve(swags["em"], model, data, 12, torch.Generator().manual_seed(2), scales, members=M)
    assert L.shape == (3, n * 20)
    g = torch.Generator().manual_seed(2)
    dev = [swags["em"][r].predictive().deviations(12 // M, g) for r in range(R)]  # 4 draws a member, replica order
    sd = model.likelihood_scale().detach()
    for i, s in enumerate(scales):
        for split in range(n):
            dens = []
            for member in range(M):
                r = member * n + split
                theta = swags["em"][r].loc + math.sqrt(s) * dev[r] if s else swags["em"][r].loc.unsqueeze(0)
                means = model.mlp.forward(theta.unsqueeze(1).expand(-1, R, -1), data.x_eval)[:, r]  # (S, 20)
                dens.append(torch.distributions.Normal(means, sd[r]).log_prob(data.y_eval[r]).exp())
            ref = torch.cat(dens).mean(0).log() - data.y_std[split].log()
            torch.testing.assert_close(L[i].reshape(n, 20)[split], ref, rtol=1e-4, atol=1e-5)
    scale, record = swag_family._choose_scale(swags["em"], model, data, 12, 2, members=M)
    assert scale == record["scale"] and record["val_ll"][record["scales"].index(scale)] >= record["val_ll"][0]


def test_choose_takes_the_best_mean_over_tuning_splits():
    configs = [{"precision": 1.0, "lr": 0.1}, {"precision": 10.0, "lr": 0.1}]
    curves = [(10, torch.tensor([-2.0, -2.0, -1.0, -4.0])), (20, torch.tensor([-1.5, -1.6, -3.0, -3.0]))]
    choice, val, table = protocol._choose(curves, configs, 2)
    assert choice == {"precision": 1.0, "lr": 0.1, "steps": 20} and val == pytest.approx(-1.55)
    assert len(table) == 4


@pytest.mark.slow
def test_vi_fit_learns_a_regression():
    """A few hundred full-batch steps on yacht: far better than predicting the training mean."""
    splits = [load_uci("yacht", s, dtype=torch.float32) for s in range(2)]
    budget = uci.Budget(steps=600, precisions=(1.0,), lrs=(1e-2,), tune_splits=1, checkpoints=4, test_samples=20)
    res = uci.run_vi(uci.METHODS["vifa-gaussian-1x50"], splits, budget, seed=0)
    # predicting the mean: RMSE = std of y (about 15 in original units), LL about -4.1
    assert max(res["rmse"]) < 5 and min(res["ll"]) > -3.2
    assert res["choice"]["steps"] in {150, 300, 450, 600} and len(res["search"]) == 4


# ------------------------------------------------------------------ the command


@pytest.mark.slow
def test_uci_command_writes_complete_results(tmp_path, capsys):
    out = tmp_path / "uci"
    code = cli.main(["uci", "--quick", "--datasets", "yacht", "--methods", "vifa-gaussian-1x50", "swag-em-1x50",
                     "multiswag-1x50", "--steps", "40", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    got = res["results"]["yacht"]
    assert set(got) == {"vifa-gaussian-1x50", "swag-em-1x50", "multiswag-1x50"}
    for r in got.values():
        assert len(r["ll"]) == 2 and len(r["rmse"]) == 2 and all(math.isfinite(v) for v in r["ll"])
        assert r["choice"]["precision"] in (0.1, 1.0, 10.0)
    for name in ("swag-em-1x50", "multiswag-1x50"):  # the scale chosen on validation, scale 0 (the mean) a candidate
        r, = [got[name]]
        pick = r["scale_choice"]
        assert r["scale"] == pick["scale"] in pick["scales"] and pick["scales"][0] == 0.0
        assert pick["val_ll"][pick["scales"].index(r["scale"])] >= pick["val_ll"][0]
        assert len(r["mean_ll"]) == 2
        if r["scale"] == 0.0:  # the model average at scale 0 is the mean's (SWA's; the ensemble of means) prediction
            np.testing.assert_allclose(r["ll"], r["mean_ll"], rtol=1e-6)
    table = (out / "table.md").read_text()
    assert "VIFA Gaussian 1×50" in table and "-2.36 ± 0.06" in table  # Jiang (2023)'s number beside ours
    assert (out / "ll.png").stat().st_size > 0 and (out / "rmse.png").stat().st_size > 0
    # unit file names carry a hash of everything the results depend on (budget, seed, splits, protocol)
    assert len(list((out / "units").glob("yacht__vifa-gaussian-1x50__*.json"))) == 1
    assert not list(out.rglob("*.part"))
    [swag_unit] = (out / "units").glob("yacht__swag-family__*.json")
    assert json.loads(swag_unit.read_text())["cpu_seconds"] > 0
    # CPU cells add up their process time; CUDA cells (none here) their wall time, apart
    assert res["datasets"]["yacht"]["cpu_seconds"] > 0 and res["datasets"]["yacht"]["cuda_wall_seconds"] == 0
    printed = capsys.readouterr().out
    assert "test LL" in printed
    # the compute line adds up the units' process time; a run this short prints it in seconds
    assert f"compute: {res['datasets']['yacht']['cpu_seconds']:.0f} CPU-seconds in the cells" in printed
    # a second run reuses the units of the same budget, and the report is the same
    cli.main(["uci", "--quick", "--datasets", "yacht", "--methods", "vifa-gaussian-1x50", "swag-em-1x50",
              "multiswag-1x50", "--steps", "40", "--output-dir", str(out), "--no-progress"])
    assert "done before" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["results"] == res["results"]


def test_report_amounts_read_at_every_scale():
    assert uci._amount(6732.3, "CPU-") == "1.87 CPU-hours" and uci._amount(3366.2) == "0.94 hours"
    assert uci._amount(14.6, "CPU-") == "15 CPU-seconds" and uci._amount(359.4) == "359 seconds"


def test_uci_command_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["uci", "--datasets", "titanic"])
    assert "invalid choice: 'titanic'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["uci", "--methods", "mcmc"])
    assert "invalid choice: 'mcmc'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--splits must be in 1\.\.20 for 'yacht', got 25"):
        cli.main(["uci", "--datasets", "yacht", "--splits", "25", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--steps must be >= 10"):
        cli.main(["uci", "--quick", "--steps", "5", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--tune-splits must be at most the 2 splits"):
        cli.main(["uci", "--quick", "--tune-splits", "3", "--output-dir", str(tmp_path), "--no-progress"])
    with pytest.raises(SystemExit, match="no results of this budget"):
        cli.main(["uci", "--quick", "--report-only", "--output-dir", str(tmp_path / "empty")])
    assert not (tmp_path / "empty").exists()
    with pytest.raises(SystemExit, match=r"missing file .*bostonHousing.*PYRO_FA_DATA"):
        cli.main(["uci", "--quick", "--datasets", "boston", "--data-dir", str(tmp_path / "nowhere"),
                  "--output-dir", str(tmp_path)])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process table from /proc")
def test_parallel_workers_exit_when_the_command_is_killed(tmp_path):
    """`pyro-fa uci --jobs 2` killed outright: its pool's workers stop too, instead of training on unseen."""
    import signal
    import subprocess
    import sys
    import time

    code = ("from pyro_fa import cli; cli.main(['uci', '--quick', '--datasets', 'yacht', '--methods', "
            "'vifa-gaussian-1x50', 'autonormal-1x50', '--steps', '1000000', '--jobs', '2', '--no-progress', "
            f"'--output-dir', {str(tmp_path)!r}])")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def workers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if stat[0] != "Z" and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                found.append((int(pid), int(stat[1])))
        return found

    try:
        deadline = time.time() + 120
        while len([w for w, ppid in workers() if ppid == parent.pid]) < 2:
            assert parent.poll() is None and time.time() < deadline, "the workers never started"
            time.sleep(0.5)
        pids = [w for w, ppid in workers() if ppid == parent.pid]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 30
        while any(w in pids for w, _ in workers()) and time.time() < deadline:
            time.sleep(0.5)
        alive = [w for w, _ in workers() if w in pids]
        for w in alive:
            os.kill(w, signal.SIGKILL)
        assert not alive, "pool workers outlived the killed command"
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not list(tmp_path.glob("units/*.json"))  # nothing half-way, and no late unit from an orphan
