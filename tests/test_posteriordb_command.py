"""``pyro-fa posteriordb``: quick runs on the stand-in posteriors, unit files, resuming, arguments, the methods'
registry, the curves, the choice of Adam's rate, and the goals."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pyro_fa.cli import main


def test_standin_reference_is_the_exact_posterior():
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg, load_standin

    post = gaussian_linreg()
    torch.testing.assert_close(post.reference.mean(0), post.exact.mean, atol=0.02, rtol=0)
    # log_density differs from the exact log posterior by a constant (the evidence)
    z = post.reference[:5]
    diff = post.log_density(z) - post.exact.log_prob(z)
    torch.testing.assert_close(diff, diff[0].expand(5))
    with pytest.raises(KeyError, match="load_standin: name must be one of"):
        load_standin("nope")


def test_quick_run_writes_units_and_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["posteriordb", "--quick", "--methods", "pathfinder", "auto-normal", "--seeds", "1", "--steps", "30",
            "--num-draws", "100", "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    units = sorted((out / "units").glob("*.json"))
    scored = [json.loads(p.read_text()) for p in units if "__tune_lr" not in p.name]
    assert len(scored) == 2 and len(units) == 2 + 2  # the quick grid's two rates for auto-normal
    rec = {r["method"]: r for r in scored}
    assert rec["auto-normal"]["grad_evals"] == 30
    assert [p["step"] for p in rec["auto-normal"]["curve"]] == [25, 30]  # quick checkpoints below --steps
    assert rec["auto-normal"]["lr"] in (0.01, 0.1) and rec["auto-normal"]["tuning"]["grad_evals"] == 2 * 30
    assert rec["pathfinder"]["lr"] is None and rec["pathfinder"]["tuning"] is None
    assert rec["pathfinder"]["grad_evals"] > 0 and rec["pathfinder"]["density_evals"] > 0
    s = rec["pathfinder"]["scores"]
    # an exact-ish Gaussian fit: W1 near the reference-against-itself floor, debiased W1 near 0
    assert s["w1"] < 1.5 * s["w1_floor"] and abs(s["w1_debiased"]) < 0.3 * s["w1_floor"]
    assert s["khat"] < 0.7
    report = (out / "report.md").read_text()
    assert "| pathfinder |" in report and "| auto-normal |" in report and "### Goals" in report

    # run again: every unit is read back, none is fitted (tuning included)
    import pyro_fa.experiments.posteriordb.methods as methods

    def refuse(*a, **k):
        raise AssertionError("a finished unit was fitted again")

    monkeypatch.setattr(methods, "fit_method", refuse)
    assert main(argv) == 0
    assert (out / "report.md").read_text() == report


def test_bad_arguments_exit_2(capsys, tmp_path):
    for argv, message in ((["--seeds", "0"], "argument --seeds: must be a positive integer, got 0"),
                          (["--lr", "0"], "argument --lr: must be a positive number, got '0'"),
                          (["--lr-grid", "0.1", "nan"], "argument --lr-grid: must be a positive number, got 'nan'"),
                          (["--methods", "nope"], "argument --methods: invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as exc:
            main(["posteriordb", *argv, "--output-dir", str(tmp_path / "o")])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_fit_method_refuses_unknown_method_and_a_tuned_method_without_a_rate():
    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method, register_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    with pytest.raises(ValueError, match="fit_method: method must be one of"):
        fit_method("nope", gaussian_linreg(), Budget.quick(), 0)
    with pytest.raises(ValueError, match="fit_method: lr must be a positive float for 'auto-normal', got None"):
        fit_method("auto-normal", gaussian_linreg(), Budget.quick(), 0)
    with pytest.raises(ValueError, match="register_method: name must be a non-empty string, got ''"):
        register_method("", "nothing")


# ---- the registry -------------------------------------------------------------------------------

def test_a_method_registered_in_a_test_is_scored(tmp_path, monkeypatch):
    """One registered function is a new method: the CLI accepts it and its draws are scored (here the exact
    posterior's own draws: debiased W1 near 0, k-hat small, its mean errors small)."""
    import pyro_fa.experiments.posteriordb.methods as methods

    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))

    @methods.register_method("exact-draws", "draws of the stand-in's exact posterior", ours=True)
    def _exact(run):
        z = run.posterior.exact.sample((run.n,))
        return methods.Fit([methods.Point(0, 7, 0, z, run.posterior.exact.log_prob(z))])

    out = tmp_path / "out"
    assert main(["posteriordb", "--quick", "--methods", "exact-draws", "--seeds", "1", "--num-draws", "400",
                 "--output-dir", str(out), "--no-progress"]) == 0
    (unit,) = [json.loads(p.read_text()) for p in (out / "units").glob("*.json")]
    assert unit["method"] == "exact-draws" and unit["grad_evals"] == 7 and unit["error"] is None
    s = unit["scores"]
    assert abs(s["w1_debiased"]) < 0.3 * s["w1_floor"] and s["max_mean_error"] < 0.3 and s["khat"] < 0.5
    assert "| exact-draws |" in (out / "report.md").read_text()


# ---- curves ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["auto-normal", "factor-guide"])
def test_svi_curves_have_one_point_per_checkpoint_and_do_not_perturb_the_run(method):
    """A point per checkpoint below the budget and one at it, gradient evaluations increasing (one per step); the
    draws at the checkpoints leave the optimisation alone (the same parameters as a run drawing only at its end)."""
    import pyro

    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    post = gaussian_linreg()
    budget = Budget(steps=60, checkpoints=(10, 20, 40, 100), num_draws=50)
    fit = fit_method(method, post, budget, 3, lr=0.05)
    assert [p.step for p in fit.points] == [10, 20, 40, 60]
    assert [p.grad_evals for p in fit.points] == [10, 20, 40, 60]
    assert all(p.draws.shape == (50, post.dim) and p.log_q.shape == (50,) for p in fit.points)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    fit_method(method, post, budget, 3, lr=0.05, steps=[60])
    again = dict(pyro.get_param_store().items())
    assert params.keys() == again.keys() and all(torch.equal(params[k], again[k].detach()) for k in params)


def test_scores_along_a_curve_equal_scores_on_fresh_posteriors():
    """The W1 floor is computed once per seed and reused at every checkpoint: the scores are those of a posterior
    scored point by point from scratch; the floor is the reference against itself (independent of the fit)."""
    from pyro_fa.experiments.posteriordb.command import score
    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg
    from pyro_fa.metrics.transport import wasserstein1

    post = gaussian_linreg()
    fit = fit_method("auto-normal", post, Budget(steps=20, checkpoints=(10,), num_draws=100), 0, lr=0.05)
    cached = [score(p, post, 0) for p in fit.points]
    assert cached == [score(p, gaussian_linreg(), 0) for p in fit.points]
    assert cached[0]["w1_floor"] == cached[1]["w1_floor"] > 0
    first = np.random.default_rng(0).permutation(post.reference.shape[0])[:100]  # score's reference subset
    assert cached[1]["w1"] == pytest.approx(wasserstein1(fit.points[1].draws, post.reference[first]))
    assert cached[0]["w1"] != cached[1]["w1"]


def test_the_pathfinder_guide_curve_starts_at_pathfinders_cost():
    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    fit = fit_method("pathfinder-guide", gaussian_linreg(), Budget(steps=30, checkpoints=(10,), num_draws=50), 0,
                     lr=0.01)
    pf = fit.extra["pathfinder_grad_evals"]
    assert [p.step for p in fit.points] == [0, 10, 30]
    assert [p.grad_evals for p in fit.points] == [pf, pf + 10, pf + 30]


# ---- Adam's rate: the ELBO on a tuning seed, never the reference ----------------------------------

def test_elbo_estimate_is_the_evidence_for_the_exact_posterior():
    """For q = p the ELBO is log Z, here the linear-Gaussian model's evidence N(y; 0, X X^T + sigma^2 I)."""
    from pyro_fa.experiments.posteriordb.standins import _linreg_data, gaussian_linreg
    from pyro_fa.experiments.posteriordb.tuning import elbo_estimate

    post = gaussian_linreg()
    X, y = _linreg_data()
    log_z = torch.distributions.MultivariateNormal(
        torch.zeros_like(y), X @ X.T + 0.25 * torch.eye(X.shape[0], dtype=X.dtype)).log_prob(y)
    z = post.exact.sample((50,))
    assert elbo_estimate(post, z, post.exact.log_prob(z)) == pytest.approx(float(log_z), abs=1e-8)
    wide = torch.distributions.MultivariateNormal(post.exact.mean, 4 * post.exact.covariance_matrix)
    zw = wide.sample((2000,))
    assert elbo_estimate(post, zw, wide.log_prob(zw)) < float(log_z) - 1.0
    assert elbo_estimate(post, z, None) == -math.inf


def test_the_rate_is_chosen_by_the_elbo_not_by_the_reference(tmp_path):
    """A posterior whose reference draws are deliberately wrong gets the same rate and the same ELBOs; the
    chosen rate is the grid's largest ELBO; the tuning seed is none of the scored seeds."""
    from pyro_fa.experiments.posteriordb.methods import Budget
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg
    from pyro_fa.experiments.posteriordb.tuning import choose_lr, tuning_seed

    good = gaussian_linreg()
    bad = gaussian_linreg()
    bad.reference = bad.reference * 5 + 100.0
    budget = Budget(steps=40, num_draws=50)
    seeds = [0, 1, 2]
    seed = tuning_seed(seeds)
    assert seed not in seeds and tuning_seed([10_000, 10_001]) not in (10_000, 10_001)
    grid = (0.001, 0.1)
    a = choose_lr("auto-normal", "p", lambda: good, budget, seed, tmp_path / "a", grid)
    b = choose_lr("auto-normal", "p", lambda: bad, budget, seed, tmp_path / "b", grid)
    assert a == {**b, "seconds": a["seconds"], "cpu_seconds": a["cpu_seconds"]}
    assert a["lr"] == max(grid, key=lambda lr: a["elbos"][f"{lr:g}"])
    assert a["lr"] == 0.1  # 40 steps at 0.001 barely leave the prior median
    assert a["grad_evals"] == 2 * 40 and a["seed"] == seed


# ---- the goals on hand-made records ---------------------------------------------------------------

def _rec(post, method, seed, curve, khat, floor=0.1):
    points = [{"step": i, "grad_evals": g, "scores": {"w1_debiased": w, "w1_floor": floor, "khat": khat}}
              for i, (g, w) in enumerate(curve)]
    return {"posterior": post, "method": method, "seed": seed, "curve": points, "scores": points[-1]["scores"],
            "grad_evals": points[-1]["grad_evals"], "error": None}


ROLES = {"auto-lowrank": SimpleNamespace(peer=True, ours=False, guide=False),
         "auto-mvn": SimpleNamespace(peer=True, ours=False, guide=False),
         "factor-guide": SimpleNamespace(peer=False, ours=True, guide=True),
         "pathfinder-guide": SimpleNamespace(peer=False, ours=True, guide=True),
         "pathfinder": SimpleNamespace(peer=False, ours=True, guide=False)}


def _records():
    return [
        # p1: Pyro's best is auto-mvn 0.15 at 1000; pathfinder 0.155 (within the tie 0.01) at 50 <= 100: G1 passes.
        # factor-guide within 1.1x (+ tie) of auto-lowrank at 100 and 1000: G2 passes.
        _rec("p1", "auto-lowrank", 0, [(100, 0.5), (1000, 0.2)], 0.8),
        _rec("p1", "auto-mvn", 0, [(100, 0.4), (1000, 0.15)], 0.5),
        _rec("p1", "factor-guide", 0, [(100, 0.54), (1000, 0.22)], 0.6),
        _rec("p1", "pathfinder", 0, [(50, 0.155)], 0.3),
        # p2: our better fit costs 200 > 1000 / 10: G1 fails. factor-guide 0.5 > 1.1 * 0.4 + 0.01 at 100, but
        # pathfinder-guide passes at 30 (against auto-lowrank's 100) and 130 (against its 1000): G2 passes.
        _rec("p2", "auto-lowrank", 0, [(100, 0.4), (1000, 0.3)], 0.9),
        _rec("p2", "factor-guide", 0, [(100, 0.5), (200, 0.2)], 0.65),
        _rec("p2", "pathfinder-guide", 0, [(30, 0.35), (130, 0.25)], 0.4),
        _rec("p2", "pathfinder", 0, [(50, 0.4)], 0.75),
        # p3: medians over seeds: pathfinder 0.12 at 50 against auto-mvn 0.2 at 1000: G1 passes; no auto-lowrank.
        _rec("p3", "auto-mvn", 0, [(1000, 0.2)], 0.6),
        *[_rec("p3", "pathfinder", s, [(g, w)], k) for s, g, w, k in
          ((0, 40, 0.1, 0.1), (1, 60, 0.9, 0.9), (2, 50, 0.12, 0.2))],
    ]


def test_goals_on_hand_made_records():
    from pyro_fa.experiments.posteriordb.goals import goals

    g = goals(_records(), ROLES)
    assert {n: v["passed"] for n, v in g["g1"].items()} == {"p1": True, "p2": False, "p3": True}
    assert g["g1"]["p1"]["peer"] == ("auto-mvn", 1000, 0.15) and g["g1"]["p1"]["ours"] == ("pathfinder", 50, 0.155)
    assert g["g1"]["p2"]["peer"] == ("auto-lowrank", 1000, 0.3)
    assert g["g1"]["p3"]["ours"] == ("pathfinder", 50, 0.12)
    assert g["g1_share"] == pytest.approx(2 / 3) and g["g1_passed"]
    assert g["g2"]["p1"]["passed"] and g["g2"]["p1"]["method"] == "factor-guide"
    assert g["g2"]["p2"]["passed"] and g["g2"]["p2"]["method"] == "pathfinder-guide"
    assert g["g2"]["p3"] is None and g["g2_passed"] and g["g2_count"] == (2, 2)
    g3 = g["g3"]
    assert g3["counts"] == {"auto-lowrank": 0, "auto-mvn": 2, "factor-guide": 2, "pathfinder": 2,
                            "pathfinder-guide": 1}
    assert g3["ours"][0] == 2 and g3["peer"] == (2, "auto-mvn") and g3["passed"]
    assert g3["per_posterior"]["p2"] == {"ours": (0.4, "pathfinder-guide"), "peer": (0.9, "auto-lowrank")}


def test_goals_fail_where_they_should():
    """G1 below 60%, G2 failing on one posterior (a negative peer value is not loosened by the factor), G3 with
    fewer usable k-hats than the best Pyro guide."""
    from pyro_fa.experiments.posteriordb.goals import goals
    from pyro_fa.experiments.posteriordb.report import goals_table

    records = [r for r in _records() if r["posterior"] != "p3"] + [
        _rec("p4", "auto-lowrank", 0, [(100, -0.02)], 0.1),
        _rec("p4", "factor-guide", 0, [(100, 0.0)], 0.9)]  # 0.0 > -0.02 + 0.002 + 0.01
    khat = {("p1", "factor-guide"): 0.9, ("p1", "auto-lowrank"): 0.5}  # auto-lowrank usable on p1 and p4,
    for r in records:  # each of ours on one posterior
        r["scores"]["khat"] = khat.get((r["posterior"], r["method"]), r["scores"]["khat"])
    g = goals(records, ROLES)
    assert g["g1"]["p4"] is not None and not g["g1"]["p4"]["passed"]
    assert g["g1_share"] == pytest.approx(1 / 3) and not g["g1_passed"]
    assert not g["g2"]["p4"]["passed"] and g["g2"]["p4"]["worst"] == ("factor-guide", 100, 0.0, -0.02)
    assert not g["g2_passed"] and g["g2_count"] == (2, 3)
    assert g["g3"]["counts"]["auto-lowrank"] == 2 and g["g3"]["peer"] == (2, "auto-lowrank")
    assert g["g3"]["ours"][0] == 1 and not g["g3"]["passed"]
    table = goals_table(records, ROLES)
    assert "| p4 | fail" in table and "fail: 2/3 posteriors" in table and "fail: 33% of posteriors" in table


def test_g1_paired_difference_by_hand():
    """Seeds 0-2 of pathfinder (one point) against auto-mvn at its second checkpoint: differences -0.1, 0.2, 0.05
    by hand (mean 0.05, s.d. 0.15, SE 0.15 / sqrt 3); seed 3 has no auto-mvn and is left out; one shared seed
    gives no difference."""
    from pyro_fa.experiments.posteriordb.goals import goals, paired_difference
    from pyro_fa.experiments.posteriordb.report import goals_table

    records = [_rec("p", "auto-mvn", s, [(100, 0.9), (1000, w)], 0.5) for s, w in ((0, 0.3), (1, 0.1), (2, 0.2))]
    records += [_rec("p", "pathfinder", s, [(50, w)], 0.3) for s, w in ((0, 0.2), (1, 0.3), (2, 0.25), (3, 9.0))]
    g1 = goals(records, ROLES)["g1"]["p"]
    assert g1["peer"] == ("auto-mvn", 1000, 0.2) and g1["ours"][0] == "pathfinder"
    mean, se, n = g1["paired"]
    assert n == 3 and mean == pytest.approx(0.05) and se == pytest.approx(0.15 / 3 ** 0.5)
    assert "paired diff 0.05 ± 0.087 (3 seeds)" in goals_table(records, ROLES)
    one = [r for r in records if r["seed"] in (0, 3)]
    assert paired_difference(one, "p", ("pathfinder", 50, 0.2), ("auto-mvn", 1000, 0.3)) is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto-lowrank", "auto-mvn", "auto-laplace", "factor-guide", "factor-guide-jit",
                                    "pathfinder-multi", "pathfinder-guide", "pyro-factor-laplace", "nuts"])
def test_every_method_runs_on_the_standin(method):
    from pyro_fa.experiments.posteriordb.command import score
    from pyro_fa.experiments.posteriordb.methods import METHODS, Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    post = gaussian_linreg()
    fit = fit_method(method, post, Budget(steps=100, num_draws=100, num_paths=2, nuts_warmup=50, laplace_samples=32),
                     0, lr=0.05 if METHODS[method].tuned else None)
    assert fit.draws.shape == (100, post.dim) and fit.grad_evals >= 20
    s = score(fit, post, 0)
    assert s["w1"] > 0 and s["w1_floor"] > 0
