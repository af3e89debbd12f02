"""``pyro-fa posteriordb``: quick runs on the stand-in posteriors, unit files, resuming, arguments."""
import json

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
    assert len(units) == 2
    rec = {json.loads(p.read_text())["method"]: json.loads(p.read_text()) for p in units}
    assert rec["auto-normal"]["grad_evals"] == 30
    assert rec["pathfinder"]["grad_evals"] > 0 and rec["pathfinder"]["density_evals"] > 0
    s = rec["pathfinder"]["scores"]
    # an exact-ish Gaussian fit: W1 near the reference-against-itself floor, debiased W1 near 0
    assert s["w1"] < 1.5 * s["w1_floor"] and abs(s["w1_debiased"]) < 0.3 * s["w1_floor"]
    assert s["khat"] < 0.7
    report = (out / "report.md").read_text()
    assert "| pathfinder |" in report and "| auto-normal |" in report

    # run again: every unit is read back, none is fitted
    import pyro_fa.experiments.posteriordb.methods as methods

    def refuse(*a, **k):
        raise AssertionError("a finished unit was fitted again")

    monkeypatch.setattr(methods, "fit_method", refuse)
    assert main(argv) == 0
    assert (out / "report.md").read_text() == report


def test_bad_arguments_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["posteriordb", "--seeds", "0", "--output-dir", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert "argument --seeds: must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["posteriordb", "--methods", "nuts", "--output-dir", str(tmp_path / "o")])
    assert exc.value.code == 2


def test_fit_method_refuses_unknown_method():
    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    with pytest.raises(ValueError, match="fit_method: method must be one of"):
        fit_method("nuts", gaussian_linreg(), Budget.quick(), 0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto-lowrank", "auto-mvn", "auto-laplace", "factor-guide", "pathfinder-multi",
                                    "pathfinder-guide"])
def test_every_method_runs_on_the_standin(method):
    from pyro_fa.experiments.posteriordb.command import score
    from pyro_fa.experiments.posteriordb.methods import Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import gaussian_linreg

    post = gaussian_linreg()
    fit = fit_method(method, post, Budget(steps=100, num_draws=100, guide_steps_after_pathfinder=20, num_paths=2), 0)
    assert fit.draws.shape == (100, post.dim) and fit.grad_evals >= 20
    s = score(fit, post, 0)
    assert s["w1"] > 0 and s["w1_floor"] > 0
