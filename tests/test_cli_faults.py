"""`pyro-fa uci` against the faults of real result folders: corrupt and stray unit files, runs of other
budgets or methods in the same folder, unwritable folders, bad devices, a second run, a killed run."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pyro_fa import cli
from pyro_fa._files import atomic_write_bytes
from pyro_fa.experiments.uci import command as uci

fcntl = pytest.importorskip("fcntl")

#: the tiniest run: bundled yacht, one split, one tuning split, ten steps
TINY = ["uci", "--quick", "--datasets", "yacht", "--splits", "1", "--steps", "10", "--no-progress"]
VIFA = ["--methods", "vifa-gaussian-1x50"]


def _run(out, *extra):
    return cli.main([*TINY, "--output-dir", str(out), *extra])


def _units(out, pattern="*"):
    return sorted((out / "units").glob(f"{pattern}.json"))


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A folder holding one finished tiny vifa unit (copied by the tests that spoil it)."""
    out = tmp_path_factory.mktemp("done")
    assert _run(out, *VIFA) == 0
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("payload", [b"", b'{"dataset": "yacht", "unit": "vifa', b"not json at all",
                                     b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"dataset": "yacht"}'],
                         ids=["empty", "truncated", "not-json", "not-utf8", "json-list", "missing-fields"])
def test_unreadable_unit_file_warns_and_is_trained_again(done, tmp_path, capsys, payload):
    out = _copy(done, tmp_path / "out")
    [unit] = _units(out, "yacht__vifa-gaussian-1x50__*")
    good = json.loads(unit.read_text())
    unit.write_bytes(payload)
    with pytest.warns(UserWarning, match=f"ignoring .*{unit.name}.*not a readable unit file"):
        assert _run(out, *VIFA) == 0
    printed = capsys.readouterr().out
    assert "done before" not in printed and "test LL" in printed  # trained again
    assert json.loads(unit.read_text())["methods"].keys() == good["methods"].keys()


def test_unit_files_of_before_the_keys_are_still_read_and_reused(done, tmp_path, capsys):
    """docs/uci/units holds files named <dataset>__<unit>.json without a key: they match by their content."""
    out = _copy(done, tmp_path / "out")
    [unit] = _units(out, "yacht__vifa-gaussian-1x50__*")
    record = json.loads(unit.read_text())
    del record["key"]
    unit.unlink()
    (out / "units" / "yacht__vifa-gaussian-1x50.json").write_text(json.dumps(record))
    assert _run(out, *VIFA) == 0
    assert "done before" in capsys.readouterr().out and len(_units(out)) == 1
    assert _run(out, *VIFA, "--seed", "3") == 0  # another seed: trained, in a keyed file beside it
    assert "done before" not in capsys.readouterr().out and len(_units(out)) == 2


def test_stray_json_does_not_kill_a_run_report_only_or_fresh(done, tmp_path, capsys):
    out = _copy(done, tmp_path / "out")
    for name, payload in (("notes.json", b'{"hello": 1}'), ("empty.json", b""), ("yacht__x.json", b"\xff")):
        (out / "units" / name).write_bytes(payload)
    for extra in ([], ["--report-only"], ["--fresh"]):
        with pytest.warns(UserWarning) as caught:
            assert _run(out, *VIFA, *extra) == 0
        messages = " ".join(str(w.message) for w in caught)
        for name in ("notes.json", "empty.json", "yacht__x.json"):
            assert name in messages
    assert json.loads((out / "results.json").read_text())["results"]["yacht"].keys() == {"vifa-gaussian-1x50"}
    capsys.readouterr()


def test_longer_methods_list_trains_the_new_methods(tmp_path, capsys):
    out = tmp_path / "out"
    assert _run(out, "--methods", "vifa-gaussian-1x50", "swag-em-1x50") == 0
    capsys.readouterr()
    assert _run(out, "--methods", "vifa-gaussian-1x50", "swag-em-1x50", "swag-1x50") == 0
    printed = capsys.readouterr().out
    assert "vifa-gaussian-1x50     done before" in printed
    assert "swag-family            done before" not in printed  # its set of methods grew: trained again
    got = json.loads((out / "results.json").read_text())["results"]["yacht"]
    assert set(got) == {"vifa-gaussian-1x50", "swag-em-1x50", "swag-1x50"}
    # the same longer list again: everything is done
    assert _run(out, "--methods", "vifa-gaussian-1x50", "swag-em-1x50", "swag-1x50") == 0
    assert capsys.readouterr().out.count("done before") == 2


def test_quick_and_full_budgets_keep_their_own_units(tmp_path, capsys):
    out = tmp_path / "out"
    full = ["uci", "--datasets", "yacht", "--splits", "1", "--tune-splits", "1", "--steps", "20", "--no-progress",
            "--output-dir", str(out), *VIFA]
    assert cli.main(full) == 0
    [full_unit] = _units(out)
    full_bytes = full_unit.read_bytes()
    capsys.readouterr()
    assert _run(out, "--steps", "20", *VIFA) == 0  # the quick budget, same steps: another grid
    assert "done before" not in capsys.readouterr().out
    assert len(_units(out)) == 2 and full_unit.read_bytes() == full_bytes  # the full run's unit is untouched
    assert json.loads((out / "results.json").read_text())["budget"]["precisions"] == [0.1, 1.0, 10.0]
    assert cli.main(full) == 0
    assert "done before" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["budget"]["precisions"] == [0.01, 0.1, 1.0, 10.0]
    # another seed or number of splits: new units too
    assert _run(out, "--steps", "20", "--seed", "1", *VIFA) == 0
    assert "done before" not in capsys.readouterr().out and len(_units(out)) == 3


@pytest.fixture
def no_training(monkeypatch):
    def fail(**kwargs):
        raise AssertionError("a unit was trained")

    monkeypatch.setattr(uci, "run_unit", fail)


def test_unwritable_output_dir_fails_before_training(tmp_path, no_training):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=r"--output-dir must be a folder this process can write to, got "
                                         r"'.*a-file/out'"):
        _run(blocker / "out", *VIFA)


def test_read_only_output_dir_fails_before_training(tmp_path, no_training):
    ro = tmp_path / "ro"
    (ro / "units").mkdir(parents=True)
    ro.chmod(0o500)
    (ro / "units").chmod(0o500)
    try:
        try:
            (ro / "units" / "probe").write_text("")
        except OSError:
            pass
        else:
            pytest.skip("this user (root?) writes into a mode-0500 folder: chmod cannot make it read-only")
        with pytest.raises(SystemExit, match="--output-dir must be a folder this process can write to"):
            _run(ro, *VIFA)
    finally:
        (ro / "units").chmod(0o700)
        ro.chmod(0o700)


@pytest.mark.parametrize("device, match", [("meta", "must be a device that holds data, .* got 'meta'"),
                                           ("nope", "must be a torch device, e.g. cpu.* got 'nope'"),
                                           ("cpu:x", "must be a torch device, .* got 'cpu:x'")])
def test_bad_device_is_refused_with_a_message(tmp_path, no_training, device, match):
    with pytest.raises(SystemExit, match=f"--device {match}"):
        _run(tmp_path / "out", "--device", device, *VIFA)


def test_a_second_run_on_the_same_folder_is_refused(tmp_path, no_training):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refusal = f"--output-dir {re.escape(repr(str(out)))} is in use by another pyro-fa uci run"
        with pytest.raises(SystemExit, match=refusal):
            _run(out, *VIFA)
        with pytest.raises(SystemExit, match="in use by another"):
            _run(out, *VIFA, "--report-only")
    # released: the next run gets the folder (and trains: run_unit is stubbed out here, so it fails there)
    with pytest.raises(AssertionError, match="a unit was trained"):
        _run(out, *VIFA)


def test_outputs_are_fsynced_and_follow_the_umask(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        os.umask(0o022)
        atomic_write_bytes(tmp_path / "b.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o644
    assert len(synced) == 4  # the file and its folder, twice
    assert not list(tmp_path.glob("*.part"))


def test_killed_run_resumes_and_its_temp_files_are_removed(tmp_path, capsys):
    """SIGKILL once the first unit file is there; the re-run reuses it, trains the rest, clears `.part` files."""
    out = tmp_path / "out"
    methods = ["vifa-gaussian-1x50", "autonormal-1x50"]
    argv = [*TINY[:-2], "400", "--no-progress", "--output-dir", str(out), "--methods", *methods]
    code = f"import sys; from pyro_fa import cli; sys.exit(cli.main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not _units(out, "yacht__vifa*") and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert len(_units(out, "yacht__vifa*")) == 1 and not _units(out, "yacht__autonormal*")
    stale = out / "units" / ".yacht__autonormal-1x50__0123.json.abcd.part"
    stale.write_text('{"half": ')
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "vifa-gaussian-1x50     done before" in printed and "autonormal-1x50" in printed
    assert not stale.exists() and not list(out.rglob("*.part"))
    assert set(json.loads((out / "results.json").read_text())["results"]["yacht"]) == set(methods)
