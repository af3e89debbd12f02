"""pyro_fa.datasets: standard UCI splits, train-only standardisation, download, bad input."""
import functools
import http.server
import os
import threading
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from pyro_fa import datasets
from pyro_fa.datasets import list_uci, load_uci, load_uci_raw, uci_n_splits

DATA = os.environ.get("PYRO_FA_DATA")
needs_data = pytest.mark.skipif(
    not (DATA and (Path(DATA) / "yacht" / "data.txt").is_file()),
    reason="needs the UCI data (set PYRO_FA_DATA to a folder holding the benchmark's dataset folders)",
)
NAMES = ["boston", "concrete", "energy", "kin8nm", "naval", "power", "protein", "wine", "yacht"]


def _raw(name):
    """The files read independently of the package: data, features, target column."""
    folder = Path(DATA) / datasets.UCI_DATASETS[name]
    data = np.array([[float(v) for v in line.split()] for line in (folder / "data.txt").read_text().splitlines()
                     if line.strip()])
    ints = lambda f: [int(float(v)) for v in (folder / f).read_text().split()]  # noqa: E731
    return folder, data, ints


# ---------------------------------------------------------------------------------------
# the shared copy of the real data


def test_list_uci():
    assert list_uci() == NAMES


@needs_data
@pytest.mark.parametrize("name", NAMES)
def test_standard_split(name):
    folder, data, ints = _raw(name)
    n_splits = 5 if name == "protein" else 20
    assert uci_n_splits(name) == n_splits
    split = n_splits - 1
    d = load_uci(name, split=split)
    train, test = ints(f"index_train_{split}.txt"), ints(f"index_test_{split}.txt")
    feats, target = ints("index_features.txt"), ints("index_target.txt")[0]
    n = data.shape[0]
    # 90 % / 10 %, disjoint, covering every row
    assert d.x_train.shape == (len(train), len(feats)) and d.x_test.shape == (len(test), len(feats))
    assert len(train) + len(test) == n and not set(train) & set(test)
    assert abs(len(test) - 0.1 * n) <= 1
    assert (d.name, d.split, d.n_splits) == (name, split, n_splits)
    assert (d.n_hidden, d.n_epochs) == ((100, 20) if name == "protein" else (50, 40))
    assert d.x_train.dtype == torch.float64
    # train-only standardisation: the training part has mean 0, std 1 (constant columns: std 1, values 0)
    x_raw_tr = data[train][:, feats]
    const = np.ptp(x_raw_tr, axis=0) == 0
    np.testing.assert_allclose(d.x_train.mean(0).numpy(), 0, atol=1e-9)
    np.testing.assert_allclose(d.x_train.std(0, unbiased=False).numpy(), np.where(const, 0.0, 1.0), atol=1e-9)
    np.testing.assert_allclose(d.x_std.numpy()[const], 1.0)
    assert abs(float(d.y_train.mean())) < 1e-9 and abs(float(d.y_train.std(unbiased=False)) - 1) < 1e-9
    assert abs(float(d.y_test.mean())) > 1e-6  # the test part is standardised with the training statistics
    # the round trip to the original units
    np.testing.assert_allclose((d.y_test * d.y_std + d.y_mean).numpy(), data[test, target], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose((d.y_train * d.y_std + d.y_mean).numpy(), data[train, target], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose((d.x_test * d.x_std + d.x_mean).numpy(), data[test][:, feats], rtol=1e-10, atol=1e-10)
    assert d.y_mean == pytest.approx(data[train, target].mean()) and d.y_std == pytest.approx(data[train, target].std())


@needs_data
def test_naval_has_constant_columns():
    d = load_uci("naval", split=0)
    assert (d.x_std == 1).sum() >= 1 and torch.isfinite(d.x_test).all()


@needs_data
def test_raw_rows_dtype_device_and_aliases():
    _, data, ints = _raw("yacht")
    X, y = load_uci_raw("yacht")
    np.testing.assert_array_equal(X.numpy(), data[:, ints("index_features.txt")])
    np.testing.assert_array_equal(y.numpy(), data[:, ints("index_target.txt")[0]])
    d32 = load_uci("yacht", split=3, dtype=torch.float32, device="cpu")
    assert d32.x_train.dtype == d32.y_test.dtype == torch.float32 and d32.x_train.device.type == "cpu"
    assert load_uci("bostonHousing").name == load_uci("Boston").name == "boston"
    assert isinstance(load_uci("yacht", split=np.int64(1)).split, int)


@needs_data
def test_data_dir_argument_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRO_FA_DATA", str(tmp_path))  # empty: would fail
    assert load_uci("yacht", data_dir=DATA).x_train.shape[0] == 277
    with pytest.raises(FileNotFoundError, match=r"missing file .*yacht.*n_splits\.txt.*PYRO_FA_DATA"):
        load_uci("yacht")


# ---------------------------------------------------------------------------------------
# a small fake dataset in the benchmark layout (no real data needed)


def _fake(root, folder="yacht", n=20, n_splits=2, protocol=True, seed=0):
    rng = np.random.default_rng(seed)
    path = Path(root) / folder
    path.mkdir(parents=True, exist_ok=True)
    data = rng.normal(size=(n, 4)) * [1.0, 2.0, 3.0, 4.0] + [0.0, 1.0, 2.0, 3.0]
    data[:, 2] = 7.0  # a constant input column
    np.savetxt(path / "data.txt", data)
    (path / "index_features.txt").write_text("0\n1\n2\n")
    (path / "index_target.txt").write_text("3\n")
    (path / "n_splits.txt").write_text(f"{n_splits}\n")
    if protocol:
        (path / "n_hidden.txt").write_text("50\n")
        (path / "n_epochs.txt").write_text("40\n")
    for i in range(n_splits):
        perm = rng.permutation(n)
        np.savetxt(path / f"index_train_{i}.txt", perm[: n - n // 10], fmt="%d")
        np.savetxt(path / f"index_test_{i}.txt", perm[n - n // 10:], fmt="%d")
    return path, data


def test_fake_dataset_standardisation_and_optional_protocol(tmp_path):
    path, data = _fake(tmp_path, protocol=False)
    d = load_uci("yacht", split=1, data_dir=tmp_path)
    assert d.x_train.shape == (18, 3) and d.x_test.shape == (2, 3)
    assert d.n_hidden is None and d.n_epochs is None
    assert d.x_std[2] == 1 and (d.x_train[:, 2] == 0).all() and (d.x_test[:, 2] == 0).all()
    test = np.loadtxt(path / "index_test_1.txt", dtype=int)
    np.testing.assert_allclose((d.y_test * d.y_std + d.y_mean).numpy(), data[test, 3])


def test_environment_variable_is_used(tmp_path, monkeypatch):
    _fake(tmp_path)
    monkeypatch.setenv("PYRO_FA_DATA", str(tmp_path))
    assert uci_n_splits("yacht") == 2 and load_uci("yacht").n_hidden == 50


def test_cache_folder_honours_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert datasets.default_cache_dir() == tmp_path / "pyro_fa" / "uci"
    _fake(tmp_path / "pyro_fa" / "uci")  # already in the cache: nothing is downloaded
    monkeypatch.setattr(datasets.urllib.request, "urlopen", _no_network)
    assert load_uci("yacht").x_train.shape == (18, 3)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert datasets.default_cache_dir() == tmp_path / "home" / ".cache" / "pyro_fa" / "uci"


# ---------------------------------------------------------------------------------------
# download, against a local HTTP server


def _no_network(*args, **kwargs):
    raise urllib.error.URLError("network is unreachable")


@pytest.fixture
def server(tmp_path):
    """A local HTTP server with the benchmark's layout <root>/<folder>/data/<file>; yields (url, root, log)."""
    root = tmp_path / "server"
    log = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            log.append(self.path)
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/UCI_Datasets", root, log
    finally:
        httpd.shutdown()
        httpd.server_close()


def _serve(root, **kw):
    src, data = _fake(root / "UCI_Datasets" / "_tmp", **kw)
    dst = root / "UCI_Datasets" / "yacht" / "data"
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    return dst, data


def test_download_into_the_cache(server, tmp_path, monkeypatch):
    url, root, log = server
    served, data = _serve(root)
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "BASE_URL", url)
    monkeypatch.setattr(datasets, "BUNDLED_DIR", tmp_path / "nothing bundled")
    d = load_uci("yacht", split=1)
    cache = tmp_path / "cache" / "pyro_fa" / "uci" / "yacht"
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in served.iterdir())
    for p in served.iterdir():
        assert (cache / p.name).read_bytes() == p.read_bytes()
    assert d.n_hidden == 50 and d.x_train.shape == (18, 3)
    n_requests = len(log)
    load_uci("yacht", split=0)  # from the cache: no new request
    assert len(log) == n_requests


def test_interrupted_download_resumes_and_optional_files_may_be_absent(server, tmp_path):
    url, root, log = server
    served, _ = _serve(root, protocol=False)
    (served / "index_test_1.txt").rename(tmp_path / "held_back")
    dest = tmp_path / "dl"
    with pytest.raises(FileNotFoundError, match=r"index_test_1\.txt.*(404|Not Found).*no local copy.*PYRO_FA_DATA"):
        datasets.download_uci("yacht", dest, base_url=url)
    got = {p.name for p in (dest / "yacht").iterdir()}
    assert "index_test_1.txt" not in got and "data.txt" in got and not any(n.endswith(".part") for n in got)
    (tmp_path / "held_back").rename(served / "index_test_1.txt")
    log.clear()
    datasets.download_uci("yacht", dest, base_url=url)
    # only the missing file and the two optional protocol files (404) are asked for again
    assert sorted(log) == sorted(f"/UCI_Datasets/yacht/data/{f}" for f in
                                 ("index_test_1.txt", "n_hidden.txt", "n_epochs.txt"))
    assert load_uci("yacht", split=1, data_dir=dest).n_hidden is None


def test_offline_with_nothing_local(tmp_path, monkeypatch):
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(datasets.urllib.request, "urlopen", _no_network)
    monkeypatch.setattr(datasets, "BUNDLED_DIR", tmp_path / "nothing bundled")
    with pytest.raises(FileNotFoundError, match=r"could not download .*yacht/data/data\.txt.*network is unreachable"
                       r".*no local copy.*pyro_fa/uci/yacht.*set PYRO_FA_DATA"):
        load_uci("yacht")
    assert not (tmp_path / "pyro_fa" / "uci" / "yacht").exists() or not any(
        (tmp_path / "pyro_fa" / "uci" / "yacht").iterdir())


def test_bundled_yacht_offline_with_nothing_local(tmp_path, monkeypatch):
    """yacht ships with the package: it loads with no data folder, no cache and no network."""
    monkeypatch.delenv("PYRO_FA_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(datasets.urllib.request, "urlopen", _no_network)
    d = load_uci("yacht", split=19)
    assert d.n_splits == 20 and d.x_train.shape == (277, 6) and d.x_test.shape == (31, 6)
    assert not (tmp_path / "pyro_fa").exists()  # nothing written to the cache
    # the same rows as the benchmark's files: target column 6 of data.txt in the original units
    raw = np.loadtxt(datasets.BUNDLED_DIR / "yacht" / "data.txt")
    test_rows = np.loadtxt(datasets.BUNDLED_DIR / "yacht" / "index_test_19.txt").astype(int)
    np.testing.assert_allclose(d.y_test.numpy() * d.y_std + d.y_mean, raw[test_rows, 6], rtol=1e-12)
    with pytest.raises(FileNotFoundError, match="could not download .*bostonHousing"):
        load_uci("boston")  # not bundled: still the download path and its error


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(datasets.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        datasets._atomic_write_bytes(tmp_path / "x" / "data.txt", b"1 2\n")
    assert list((tmp_path / "x").iterdir()) == []


# ---------------------------------------------------------------------------------------
# bad input


def test_unknown_name_and_bad_split(tmp_path):
    _fake(tmp_path)
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'; expected one of boston, concrete, .*yacht"):
        load_uci("mnist", data_dir=tmp_path)
    with pytest.raises(TypeError, match="name must be a str, got 3"):
        load_uci(3, data_dir=tmp_path)
    with pytest.raises(ValueError, match=r"split must be in 0\.\.1 for 'yacht', got 2"):
        load_uci("yacht", split=2, data_dir=tmp_path)
    with pytest.raises(ValueError, match=r"split must be in 0\.\.1 for 'yacht', got -1"):
        load_uci("yacht", split=-1, data_dir=tmp_path)
    with pytest.raises(TypeError, match="split must be an int, got 0.5"):
        load_uci("yacht", split=0.5, data_dir=tmp_path)


@pytest.mark.parametrize("fname", ["data.txt", "index_features.txt", "index_train_1.txt", "n_splits.txt"])
def test_missing_file(tmp_path, fname):
    path, _ = _fake(tmp_path)
    (path / fname).unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing file .*{fname.replace('.', r'[.]')}\. Get the files of "
                                                r"https://.*/yacht/data/ .*PYRO_FA_DATA"):
        load_uci("yacht", split=1, data_dir=tmp_path)


@pytest.mark.parametrize("fname, text, match", [
    ("data.txt", "1 2 3 4\n1 2 x 4\n", r"malformed file .*data\.txt \("),
    ("data.txt", "1 2 3 4\n1 2 3\n", r"malformed file .*data\.txt \("),
    ("data.txt", "", r"malformed file .*data\.txt: expected a non-empty table of finite numbers"),
    ("data.txt", "1 2 3 4\n1 2 nan 4\n", r"malformed file .*data\.txt: expected a non-empty table of finite"),
    ("index_features.txt", "0\none\n", r"malformed file .*index_features\.txt \(.*one"),
    ("index_features.txt", "0\n1.5\n", r"index_features\.txt: expected non-negative integers below 4"),
    ("index_features.txt", "0\n9\n", r"index_features\.txt: expected non-negative integers below 4"),
    ("index_target.txt", "2\n3\n", r"index_target\.txt: expected one column index, got 2"),
    ("index_train_0.txt", "0\n-1\n", r"index_train_0\.txt: expected non-negative integers below 20"),
    ("n_splits.txt", "2\n3\n", r"n_splits\.txt: expected one positive integer"),
    ("n_splits.txt", "0\n", r"n_splits\.txt: expected one positive integer"),
    ("n_hidden.txt", "fifty\n", r"malformed file .*n_hidden\.txt"),
])
def test_malformed_file(tmp_path, fname, text, match):
    path, _ = _fake(tmp_path)
    datasets._read_matrix_cached.cache_clear()
    (path / fname).write_text(text)
    with pytest.raises(ValueError, match=match + r".*Get the files of"):
        load_uci("yacht", split=0, data_dir=tmp_path)


def test_overlapping_split(tmp_path):
    path, _ = _fake(tmp_path)
    (path / "index_test_0.txt").write_text((path / "index_train_0.txt").read_text().split()[0] + "\n")
    with pytest.raises(ValueError, match=r"malformed split 0 .*index_train_0\.txt and index_test_0\.txt share rows"):
        load_uci("yacht", split=0, data_dir=tmp_path)


def test_experiments_load_through_this_module(tmp_path):
    from pyro_fa.experiments import linreg_ensembles, vifa_linreg

    path, data = _fake(tmp_path)
    X, y = linreg_ensembles._load("yacht", data_dir=tmp_path)
    np.testing.assert_array_equal(X.numpy(), data[:, :3])
    np.testing.assert_array_equal(y.numpy(), data[:, 3])
    X, y = vifa_linreg._load_split("yacht", 1, data_dir=tmp_path)
    d = load_uci("yacht", 1, data_dir=tmp_path)
    assert torch.equal(X, d.x_train) and torch.equal(y, d.y_train)
    (path / "data.txt").unlink()
    with pytest.raises(SystemExit, match=r"pyro-fa linreg-ensembles: load_uci: missing file .*data\.txt"):
        linreg_ensembles._load("yacht", data_dir=tmp_path)
    with pytest.raises(SystemExit, match=r"pyro-fa vifa-linreg: load_uci: missing file .*data\.txt"):
        vifa_linreg._load_split("yacht", 0, data_dir=tmp_path)
