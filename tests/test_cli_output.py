"""What every ``pyro-fa`` subcommand does with its output folder and its terminal: the folder is checked and
locked before any work (one helper for all), ``""`` is refused, bars only where someone watches, no Pyro
INFO chatter, and one-line refusals for what a run cannot do (a missing package, missing data, a bad device)."""
import io
import logging
import sys

import pytest

from pyro_fa import cli
from pyro_fa.experiments import _io

fcntl = pytest.importorskip("fcntl")

#: a cheap, valid invocation of every subcommand (the work itself never starts in these tests)
CHEAP = {
    "online-fa": ["--quick"],
    "vifa-synthetic": ["--quick"],
    "vifa-linreg": ["--quick"],
    "sgd-iterates": ["--quick"],
    "linreg-ensembles": ["--quick"],
    "uci": ["--quick"],
    "classify": ["--quick", "--datasets", "digits"],
    "revrand": ["--quick", "--tables", "3"],
    "posteriordb": ["--quick", "--methods", "pathfinder"],
    "hmc-reference": ["--quick"],
}


def test_every_subcommand_is_covered():
    assert set(CHEAP) == set(cli.EXPERIMENTS)


@pytest.fixture
def no_work(monkeypatch):
    """Every subcommand's work fails loudly: a test that reaches it has let a bad folder through."""
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError("the run started its work")

    for name, module in cli.EXPERIMENTS.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "_run", refuse, raising=False)
        monkeypatch.setattr(mod, "_run_locked", refuse, raising=False)


@pytest.mark.parametrize("name", sorted(CHEAP))
def test_output_dir_that_is_a_file_is_refused_before_any_work(name, tmp_path, no_work):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    for out in (blocker, blocker / "out"):
        with pytest.raises(SystemExit, match=rf"^pyro-fa {name}: --output-dir must be a folder this process can "
                                             rf"write to, got '.*a-file(/out)?' \("):
            cli.main([name, *CHEAP[name], "--no-progress", "--output-dir", str(out)])
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("name", sorted(CHEAP))
def test_a_second_run_on_a_folder_in_use_is_refused(name, tmp_path, no_work):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.json").write_text("{}")
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match=f"--output-dir '{out}' is in use by another pyro-fa {name} run"):
            cli.main([name, *CHEAP[name], "--no-progress", "--output-dir", str(out)])
    assert (out / "earlier.json").read_text() == "{}"
    # released: the next run gets the folder and starts its work
    with pytest.raises(AssertionError, match="started its work"):
        cli.main([name, *CHEAP[name], "--no-progress", "--output-dir", str(out)])


@pytest.mark.parametrize("name", sorted(CHEAP))
def test_empty_output_dir_is_refused_by_argparse(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main([name, *CHEAP[name], "--output-dir", ""])
    assert exc.value.code == 2
    assert "argument --output-dir: must be a folder path, got ''" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_output_folder_refused_run_leaves_no_empty_folder(tmp_path):
    out = tmp_path / "new" / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with _io.OutputFolder(out, "pyro-fa test", subfolders=("units",)):
            assert (out / "units").is_dir() and (out / ".lock").is_file()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    # a run that wrote something keeps its folder; a folder that was there stays
    with pytest.raises(RuntimeError):
        with _io.OutputFolder(out, "pyro-fa test"):
            (out / "partial.json").write_text("{}")
            raise RuntimeError("boom")
    assert (out / "partial.json").is_file()
    with _io.OutputFolder(out, "pyro-fa test"):
        (out / ".x.json.abc.part").write_text("")  # a killed run's temporary file: removed by the next run
    with _io.OutputFolder(out, "pyro-fa test"):
        assert not list(out.glob("*.part"))


def test_classify_refuses_a_locked_folder_before_training(tmp_path, monkeypatch):
    """Two classify runs on one folder: the second is refused, the first's files are untouched."""
    from pyro_fa.experiments.classify import command as classify

    monkeypatch.setattr(classify, "run_benchmark", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    with _io.OutputFolder(tmp_path, "pyro-fa classify"):  # the first run, still going
        with pytest.raises(SystemExit, match="in use by another pyro-fa classify run"):
            cli.main(["classify", "--datasets", "digits", "--methods", "map", "--output-dir", str(tmp_path)])


# ----------------------------------------------------------------------------- bad arguments, up front


@pytest.mark.parametrize("argv, message", [
    (["classify", "--threads", "0"], "argument --threads: must be a positive integer, got 0"),
    (["classify", "--threads", "two"], "argument --threads: must be an integer, got 'two'"),
    (["uci", "--threads", "0"], "argument --threads: must be a positive integer, got 0"),
    (["uci", "--jobs", "0"], "argument --jobs: must be a positive integer, got 0"),
])
def test_bad_counts_exit_2_naming_the_argument(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device, match", [("meta", "must be a device that holds data, .* got 'meta'"),
                                           ("nope", "must be a torch device, e.g. cpu.* got 'nope'")])
def test_revrand_refuses_a_device_that_holds_no_data_before_any_work(device, match, tmp_path, no_work):
    with pytest.raises(SystemExit, match=f"^pyro-fa revrand: --device {match}"):
        cli.main(["revrand", "--quick", "--tables", "3", "--device", device, "--output-dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_revrand_without_uci_data_fails_in_one_line_before_any_work(tmp_path, monkeypatch, no_work):
    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("PYRO_FA_DATA", str(empty))
    for extra in ([], ["--data-dir", str(empty)]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["revrand", "--quick", *extra, "--output-dir", str(tmp_path / "out")])
        message = str(exc.value.code)
        assert message.startswith("pyro-fa revrand: Tables 2 (boston) and 4 (protein) need the UCI data")
        assert "PYRO_FA_DATA" in message and "--data-dir" in message and "\n" not in message
    assert not (tmp_path / "out").exists()
    # Table 3 alone (scikit-learn's digits) needs no UCI data: it reaches its work
    with pytest.raises(AssertionError, match="started its work"):
        cli.main(["revrand", "--quick", "--tables", "3", "--output-dir", str(tmp_path / "out")])


def test_classify_without_mnist1d_fails_in_one_line(tmp_path, monkeypatch, no_work):
    monkeypatch.setitem(sys.modules, "mnist1d", None)  # import mnist1d raises ImportError
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    with pytest.raises(SystemExit) as exc:
        cli.main(["classify", "--quick", "--output-dir", str(tmp_path / "out")])
    message = str(exc.value.code)
    assert message.startswith("pyro-fa classify: --datasets mnist1d needs the mnist1d package")
    assert "pip install 'pyro_fa[classify]'" in message and "\n" not in message
    assert not (tmp_path / "out").exists()
    # digits alone needs no mnist1d
    with pytest.raises(AssertionError, match="started its work"):
        cli.main(["classify", "--quick", "--datasets", "digits", "--output-dir", str(tmp_path / "out")])


def test_classify_peer_named_but_not_installed_fails_in_one_line(tmp_path, monkeypatch, no_work):
    from pyro_fa.experiments.classify import baselines as _classify_peers
    from pyro_fa.experiments.classify import command as classify

    monkeypatch.setattr(classify, "peers_available", lambda: {"laplace": False, "ivon": False})
    monkeypatch.setattr(_classify_peers, "unavailable_reasons",
                        lambda: {"laplace": "ModuleNotFoundError: No module named 'laplace'",
                                 "ivon": "ModuleNotFoundError: No module named 'ivon'"})
    for peer in ("laplace", "ivon"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["classify", "--quick", "--datasets", "digits", "--methods", "map", peer,
                      "--output-dir", str(tmp_path / "out")])
        message = str(exc.value.code)
        assert message.startswith(f"pyro-fa classify: --methods {peer} needs laplace-torch / ivon-opt")
        assert "No module named" in message and '".[peers]"' in message and "\n" not in message
    # left to the default list, the peers are skipped with a word, and the run starts
    with pytest.raises(AssertionError, match="started its work"):
        cli.main(["classify", "--quick", "--datasets", "digits", "--output-dir", str(tmp_path / "out")])


# ----------------------------------------------------------------------------- terminal hygiene


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_only_on_a_terminal():
    for stream, drawn in ((_Terminal(), True), (io.StringIO(), False)):
        bar = _io.progress_bar(total=3, desc="unit", file=stream, mininterval=0)
        for _ in range(3):
            bar.update()
        bar.close()
        assert ("\r" in stream.getvalue()) is drawn
    stream = _Terminal()
    bar = _io.progress_bar(total=3, desc="unit", file=stream, enabled=False)  # --no-progress
    bar.update()
    bar.close()
    assert stream.getvalue() == ""


def test_quick_subcommand_output_has_no_carriage_returns(tmp_path, capfd):
    """A run whose stdout and stderr are not a terminal (a log, CI) prints lines, not a bar's redraws."""
    code = cli.main(["uci", "--quick", "--datasets", "yacht", "--splits", "1", "--steps", "20",
                     "--methods", "vifa-gaussian-1x50", "--output-dir", str(tmp_path)])
    assert code == 0
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    assert "yacht vifa-gaussian-1x50" in out  # one line per unit


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def pyro_log():
    handler = _Records()
    logger = logging.getLogger("pyro.infer.elbo")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)  # what a user's logging set-up may ask for; Pyro's own is INFO
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_vifa_fits_do_not_log_pyros_plate_guess(pyro_log):
    from pyro_fa.experiments import vifa_linreg, vifa_synthetic

    X, y, _, _ = vifa_synthetic.make_data(0)
    for method in vifa_synthetic.METHODS:
        vifa_synthetic.fit(method, X[:50], y[:50], seed=0, steps=2, lr=0.01, particles=2)
    vifa_linreg.fit_vifa(X[:50], y[:50], 0.01, 0.1, "gaussian", steps=2, lr=0.01, particles=2, seed=0)
    assert not [m for m in pyro_log if "Guessed max_plate_nesting" in m]
    # the guard: Pyro does log its guess when it makes one (with vectorised particles)
    import pyro
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    def model():
        pyro.sample("z", pyro.distributions.Normal(0.0, 1.0))

    pyro.clear_param_store()
    SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.1}),
        Trace_ELBO(num_particles=2, vectorize_particles=True)).step()
    assert any("Guessed max_plate_nesting" in m for m in pyro_log)


def test_uci_reference_lines_read_apart():
    """The published SLANG / Bayes-by-backprop / MC dropout lines differ in colour, line style and marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from pyro_fa.experiments.uci import report as rep

    results = {"yacht": {"vifa-gaussian-1x50": {"ll": [-1.0, -1.1], "rmse": [0.8, 0.9]}}}
    fig = rep.figure(results, {"vifa-gaussian-1x50": "VIFA"}, "ll")
    try:
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines() if ln.get_label() in rep.PUBLISHED}
        assert set(lines) == set(rep.PUBLISHED)
        for attr in (lambda ln: to_rgb(ln.get_color()), lambda ln: ln.get_linestyle(), lambda ln: ln.get_marker()):
            assert len({attr(ln) for ln in lines.values()}) == len(lines)
        # none in the colours of the methods' points (C0, C1, C2)
        points = {to_rgb(f"C{i}") for i in range(3)}
        assert not {to_rgb(ln.get_color()) for ln in lines.values()} & points
    finally:
        plt.close(fig)

