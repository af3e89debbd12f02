"""The "Add an experiment" example of docs/architecture.md: a toy module registered with the CLI runs as
``pyro-fa toy``, with the options every subcommand has."""
import json
import re
import sys
import types
from pathlib import Path

import pytest

from pyro_fa import cli

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture
def toy(monkeypatch):
    """The docs' toy experiment as the module ``toy_experiment``, registered as ``pyro-fa toy`` for one test."""
    section = ARCHITECTURE.read_text().split("## Add an experiment", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    module = types.ModuleType("toy_experiment")
    exec(compile(code, "docs/architecture.md (Add an experiment)", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "toy_experiment", module)
    monkeypatch.setitem(cli.EXPERIMENTS, "toy", "toy_experiment")
    monkeypatch.setitem(cli._HELP, "toy", "The mean of a few standard normal draws.")
    return module


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
