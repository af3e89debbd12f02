"""Argument validation of the ``pyro-fa`` subcommands: bad values exit 2 with argparse's message, before any work."""
import pytest

from pyro_fa.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["vifa-synthetic", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["vifa-synthetic", "--particles", "0"], "argument --particles: must be a positive integer, got 0"),
        (["vifa-synthetic", "--trials", "-2"], "argument --trials: must be a positive integer, got -2"),
        (["vifa-synthetic", "--steps", "ten"], "argument --steps: must be an integer, got 'ten'"),
        (["vifa-linreg", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["vifa-linreg", "--particles", "0"], "argument --particles: must be a positive integer, got 0"),
        (["vifa-linreg", "--split", "-1"], "argument --split: must be a non-negative integer, got -1"),
        (["sgd-iterates", "--epochs", "-1"], "argument --epochs: must be a positive integer, got -1"),
        (["sgd-iterates", "--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
        (["sgd-iterates", "--pretrain-epochs", "-1"],
         "argument --pretrain-epochs: must be a non-negative integer, got -1"),
        (["sgd-iterates", "--window", "0"], "argument --window: must be a positive integer, got 0"),
        (["linreg-ensembles", "--folds", "0"], "argument --folds: must be an integer from 1 to 10, got 0"),
        (["linreg-ensembles", "--folds", "99"], "argument --folds: must be an integer from 1 to 10, got 99"),
        (["linreg-ensembles", "--epochs", "-1"], "argument --epochs: must be a positive integer, got -1"),
    ],
)
def test_bad_argument_exits_2_with_message(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("folds", ["1", "10"])
def test_linreg_ensembles_accepts_folds_in_range(folds):
    from pyro_fa.cli import build_parser

    args = build_parser().parse_args(["linreg-ensembles", "--folds", folds])
    assert args.folds == int(folds)


def test_linreg_ensembles_records_the_folds_it_runs(tmp_path, monkeypatch):
    """The recorded fold count is the number of folds actually run."""
    import json

    import torch

    from pyro_fa.experiments import linreg_ensembles

    monkeypatch.setattr(linreg_ensembles, "_load",
                        lambda name, data_dir=None: (torch.randn(40, 3, dtype=torch.float64),
                                                     torch.randn(40, dtype=torch.float64)))
    calls = []

    def fake_fold(X, y, idx, seed, pretrain_epochs, epochs):
        calls.append(seed)
        return {m: 1.0 + 0.1 * len(calls) for m in linreg_ensembles.METHODS}

    monkeypatch.setattr(linreg_ensembles, "run_fold", fake_fold)
    main(["linreg-ensembles", "--datasets", "yacht", "--folds", "2", "--output-dir", str(tmp_path)])
    assert len(calls) == 2
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert result["yacht"]["folds"] == 2


@pytest.mark.parametrize("module", ["vifa_synthetic", "vifa_linreg"])
def test_vifa_markdown_written_atomically(module):
    """vifa-* write their .md through the atomic writer (no half-written report after a kill)."""
    import importlib

    mod = importlib.import_module(f"pyro_fa.experiments.{module}")
    source = open(mod.__file__).read()
    assert ".write_text(" not in source
    assert f'atomic_write_text(out_dir / "{module}.md", text)' in source


def test_the_parser_imports_no_experiment_until_its_subcommand_is_parsed():
    """``pyro-fa --help`` and building the parser import no experiment module; parsing a subcommand imports that
    experiment only."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from pyro_fa import cli\n"
            "def experiments():\n"
            "    return sorted(m for m in sys.modules if m.startswith('pyro_fa.experiments.') and m != 'pyro_fa.experiments._io')\n"
            "parser = cli.build_parser()\n"
            "assert experiments() == [], experiments()\n"
            "help = parser.format_help()\n"
            "assert 'classify' in help and 'uci' in help, help\n"
            "assert experiments() == [], experiments()\n"
            "args = parser.parse_args(['linreg-ensembles', '--folds', '3'])\n"
            "assert args.folds == 3 and args._module.__name__ == 'pyro_fa.experiments.linreg_ensembles'\n"
            "assert experiments() == ['pyro_fa.experiments.linreg_ensembles'], experiments()\n"
            "try:\n"
            "    cli.main(['--help'])\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0\n"
            "assert experiments() == ['pyro_fa.experiments.linreg_ensembles'], experiments()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "EXPERIMENT" in done.stdout


def test_a_subcommands_help_lists_its_own_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["classify", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--merge" in out and "--rows-from" in out and "--output-dir" in out
