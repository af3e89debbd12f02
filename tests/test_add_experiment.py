"""The "Add an experiment" example of docs/architecture.md: a toy module registered with the CLI runs as
``pyro-fa toy``, with the options every subcommand has."""
import json
import re
import sys
from pathlib import Path

import pytest

from pyro_fa import cli

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """The docs' toy experiment written as the one file ``toy.py`` of a package of experiments, found by the
    CLI's discovery (as ``pyro_fa/experiments/`` is) and registered as ``pyro-fa toy`` for one test."""
    section = ARCHITECTURE.read_text().split("## Add an experiment", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    package = tmp_path / "toy_experiments"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_private.py").write_text('HELP = "never a subcommand: private"\n')
    (package / "notes.py").write_text("# no HELP: not a subcommand\n")
    (package / "toy.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    found, helps = cli._discover(package, "toy_experiments")
    assert found == {"toy": "toy_experiments.toy"}
    assert helps == {"toy": "The mean of a few standard normal draws."}
    monkeypatch.setitem(cli.EXPERIMENTS, "toy", found["toy"])
    monkeypatch.setitem(cli._HELP, "toy", helps["toy"])
    yield
    for name in ("toy_experiments.toy", "toy_experiments"):
        sys.modules.pop(name, None)


def test_every_experiment_of_the_package_is_found_without_importing_it():
    """The nine experiments of pyro_fa/experiments/ are the subcommands, each with its module's HELP."""
    assert set(cli.EXPERIMENTS) == {"online-fa", "vifa-synthetic", "vifa-linreg", "sgd-iterates",
                                    "linreg-ensembles", "uci", "classify", "revrand", "posteriordb", "hmc-reference"}
    assert cli.EXPERIMENTS["uci"] == "pyro_fa.experiments.uci.command"
    assert cli.EXPERIMENTS["online-fa"] == "pyro_fa.experiments.online_fa"
    assert cli._HELP["uci"].startswith("The UCI Bayesian-neural-network benchmark")


def test_the_docs_toy_experiment_runs_as_a_subcommand(toy, tmp_path, capsys):
    out = tmp_path / "toy"
    assert cli.main(["toy", "--quick", "--seed", "3", "--output-dir", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["draws"] == 10
    assert "mean of 10 draws" in capsys.readouterr().out
    assert cli.main(["toy", "--draws", "5", "--seed", "3", "--output-dir", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["draws"] == 5


def test_the_toy_experiment_gets_every_subcommands_options(toy, tmp_path, capsys):
    args = cli.build_parser().parse_args(["toy", "--no-progress"])
    assert (args.quick, args.seed, args.no_progress, args._name) == (False, 0, True, "toy")
    with pytest.raises(SystemExit):
        cli.main(["toy", "--draws", "0", "--output-dir", str(tmp_path)])
    assert "--draws" in capsys.readouterr().err
