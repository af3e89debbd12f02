"""``pyro-fa revrand`` (the revrand technical report's Tables 2-4): metrics, arguments, bars and the quick run."""
import json
import math

import pytest
import torch

from pyro_fa import cli
from pyro_fa.experiments.revrand import report as rep
from pyro_fa.experiments.revrand import command as revrand
from pyro_fa.experiments.revrand.models import median_distance
from pyro_fa.experiments.revrand.tables import load_digits_35

# ----------------------------------------------------------------------------- metrics against hand computations


def test_msll_by_hand():
    # y = (0, 1), predictive N(0, 1) and N(0, 4); the trivial model N(0.5, 0.25):
    #   -log N(0; 0, 1) + log N(0; .5, .25) = log 2 - 1/2
    #   -log N(1; 0, 4) + log N(1; .5, .25) = 2 log 2 + 1/8 - 1/2
    y = torch.tensor([0.0, 1.0])
    log_p = rep.gaussian_log_density(y, torch.zeros(2), torch.tensor([1.0, 4.0]))
    expected = (3 * math.log(2) - 0.875) / 2
    assert rep.msll(log_p, y, train_mean=0.5, train_var=0.25) == pytest.approx(expected, abs=1e-12)


def test_msll_of_the_trivial_model_is_zero_and_units_do_not_matter():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(50, generator=g, dtype=torch.float64)
    mean = torch.randn(50, generator=g, dtype=torch.float64)
    var = torch.rand(50, generator=g, dtype=torch.float64) + 0.1
    trivial = rep.gaussian_log_density(y, torch.full_like(y, 0.3), torch.full_like(y, 2.0))
    assert rep.msll(trivial, y, 0.3, 2.0) == pytest.approx(0.0, abs=1e-12)
    a, b = 7.0, -3.0  # y' = a y + b: every density gains -log a, so the difference is unchanged
    ours = rep.msll(rep.gaussian_log_density(y, mean, var), y, 0.3, 2.0)
    y2 = a * y + b
    scaled = rep.msll(rep.gaussian_log_density(y2, a * mean + b, a * a * var), y2, a * 0.3 + b, a * a * 2.0)
    assert scaled == pytest.approx(ours, abs=1e-10)


def test_smse_and_r2_by_hand():
    y, pred = [1.0, 2.0, 3.0, 6.0], [1.0, 1.0, 4.0, 6.0]
    # MSE 2/4, test variance (ddof 0) 14/4; sum of squared residuals 2, total 14
    assert rep.smse(pred, y) == pytest.approx(1 / 7, abs=1e-12)
    assert rep.r2_score(pred, y) == pytest.approx(6 / 7, abs=1e-12)
    assert rep.smse([3.0] * 4, y) == pytest.approx(1.0)  # the test mean scores 1


def test_msll_bad_input():
    with pytest.raises(ValueError, match="train_var must be > 0"):
        rep.msll([0.0], [0.0], 0.0, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        rep.msll([0.0, 1.0], [0.0], 0.0, 1.0)


def test_median_distance_and_digits_subset():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    assert median_distance(x) == pytest.approx(5.0)  # distances 5, 5, 10
    x, y = load_digits_35()
    assert x.shape == (365, 64) and int(y.sum()) == 182 and set(y.tolist()) == {0.0, 1.0}


# ----------------------------------------------------------------------------- bars


def _boston(slm, glm):
    return {"methods": {"slm": {"r2": [slm[0]] * 2, "msll": [slm[1]] * 2},
                        "glm": {"r2": [glm[0]] * 2, "msll": [glm[1]] * 2}}}


def test_bar_checks():
    tables = {
        "2": _boston((0.91, -1.6), (0.85, -0.8)),
        "3": {"methods": {"glm": {"log_loss": 0.10}, "gp": {"log_loss": 0.12}}},
        "4": {"methods": {"glm": {"8": {"msll": [-0.5]}, "16": {"msll": [-0.2]}},
                          "gp": {"8": {"msll": [-0.4]}, "16": {"msll": [-0.3]}}}},
    }
    got = {c["check"]: c["ok"] for c in rep.bar_checks(tables)}
    assert got == {
        "SLM R² >= 0.90": True, "SLM MSLL <= -1.5": True,
        "GLM R² > the report's GLM (0.8411)": True, "GLM MSLL < the report's GLM (-0.9209)": False,
        "GLM log-loss <= GP classifier (Laplace)": True,
        "GLM MSLL < GP subset (SD), size 8": True, "GLM MSLL < GP subset (SD), size 16": False,
    }
    assert "NOT met" in rep.bar_summary(rep.bar_checks(tables))
    assert rep.bar_checks({}) == []


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, message", [
    (["--tables", "5"], "argument --tables: invalid choice: '5'"),
    (["--folds", "1"], "argument --folds: must be an integer from 2 to 10, got 1"),
    (["--folds", "11"], "argument --folds: must be an integer from 2 to 10, got 11"),
    (["--components", "0"], "argument --components: must be a positive integer, got 0"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--steps", "ten"], "argument --steps: must be an integer, got 'ten'"),
])
def test_bad_argument_exits_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["revrand", *argv, "--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_device_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="--device"):
        cli.main(["revrand", "--device", "nonsense", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_budget_from_arguments():
    parse = cli.build_parser().parse_args
    b = revrand.budget_from_args(parse(["revrand", "--quick", "--folds", "3", "--components", "64", "8", "64",
                                        "--steps", "77"]))
    assert (b.folds, b.components, b.steps, b.large_steps) == (3, (8, 64), 77, 77)
    assert revrand.budget_from_args(parse(["revrand"])) == revrand.Budget()
    assert parse(["revrand"]).tables == ["2", "3", "4"]


# ----------------------------------------------------------------------------- the quick run


def _finite(x):
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite(v) for v in x if v is not None)
    return not isinstance(x, float) or math.isfinite(x)


def _have_uci(*names):
    from pyro_fa.datasets import load_uci_raw

    try:
        for name in names:
            load_uci_raw(name)
    except FileNotFoundError:
        return False
    return True


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    if not _have_uci("boston", "protein"):
        pytest.skip("needs the UCI boston and protein data (PYRO_FA_DATA)")
    assert cli.main(["revrand", "--quick", "--no-progress", "--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["tables"]) == {"2", "3", "4"}
    boston, digits, large = (results["tables"][k]["methods"] for k in ("2", "3", "4"))
    assert set(boston) == {"slm", "glm", "gp", "rf", "svm"} and set(digits) == {"glm", "logistic", "svm", "gp", "rf"}
    for name, r in boston.items():
        assert len(r["r2"]) == 2 and _finite(r["r2"]) and _finite(r["seconds"])
        assert (r["msll"] == [None, None]) == (name in ("rf", "svm")) and _finite(r["msll"])
    for r in digits.values():
        assert 0 < r["log_loss"] < 5 and 0 <= r["error_pct"] <= 100
    assert set(large) == {"glm", "gp"} and set(large["glm"]) == set(large["gp"]) == {"16", "32"}
    for per_size in large.values():
        for r in per_size.values():
            assert _finite(r["smse"]) and _finite(r["msll"]) and r["smse"][0] > 0
    assert {c["table"] for c in results["bar"]} == {"2", "3", "4"}
    report = (tmp_path / "report.md").read_text()
    assert "0.9018 (0.0134)" in report and "USPS" in report and "SARCOS" in report and "## The bars" in report
    assert "Table 2" in capsys.readouterr().out


def test_a_quick_run_says_its_bars_are_not_the_bar(tmp_path, monkeypatch, capsys):
    """Under the bars, a run of another budget than the full one says its "NOT met" rows are not the bar."""
    bar = [{"table": "3", "check": "GLM log-loss <= GP classifier (Laplace)", "ok": False, "detail": "0.2 vs 0.1"}]

    def fake_tables(tables, budget, seed, output_dir, device="cpu", progress=True, data_dir=None):
        return {"budget": budget.record(), "bar": bar, "seconds": 1.0}

    monkeypatch.setattr(revrand, "run_tables", fake_tables)
    for argv, noted in ((["--quick"], True), ([], False)):
        assert cli.main(["revrand", *argv, "--tables", "3", "--output-dir", str(tmp_path)]) == 0
        printed = capsys.readouterr().out
        assert "NOT met" in printed
        assert (revrand.SMALL_RUN_NOTE in printed) is noted
