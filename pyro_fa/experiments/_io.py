"""Small helpers shared by the experiment modules: atomic result files, tables, and the command line's plumbing
(the output folder, the device, progress bars)."""
from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from pyro_fa._files import atomic_write_bytes


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that the file appears complete or not at all."""
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_savefig(fig, path, **kwargs) -> None:
    """Save a matplotlib figure atomically (the format follows the file's suffix)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or None, **kwargs)
    atomic_write_bytes(path, buffer.getvalue())


def pay_lazy_imports() -> None:
    """Build a throwaway torch optimizer: torch imports its compiler stack (``torch._dynamo``, about a second) at
    the first optimizer a process builds, so an experiment pays it here, before its clocks start, and no method's
    seconds carry it (whichever method ran first in a process used to)."""
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def mean_se(values: Sequence[float]):
    """Mean and standard error (sample standard deviation / sqrt(n)) of ``values``."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(values) / n
    if n == 1:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ unit files (resumable runs)
def unit_path(folder, key: dict, stem: str) -> Path:
    """``<folder>/units/<stem>__<hash of key>.json``: the file of one unit of work, named by everything its
    results depend on (``key``), so that runs of other budgets, seeds or methods keep their own files beside it.

    A command writes a unit's file (atomically) as soon as the unit is done and, run again, reuses every file
    whose recorded key equals the key it needs (:func:`read_record`): an interrupted run loses only the units
    in progress.
    """
    import hashlib

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(folder) / "units" / f"{stem}__{digest}.json"


def read_record(path, fields: dict, command: str, what: str = "unit file",
                then: str = "its unit, if this run asks for it, is computed again.", optional: dict = None):
    """The JSON object in ``path``, or None (with a warning naming the file) when it is not a readable ``what``:
    empty, truncated, not JSON, not UTF-8, or a JSON object lacking one of ``fields`` (name -> type) or holding
    one of ``optional`` with another type."""
    import warnings

    try:
        record = json.loads(Path(path).read_bytes().decode("utf-8"))
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        missing = [k for k, t in fields.items() if not isinstance(record.get(k), t)]
        missing += [k for k, t in (optional or {}).items() if k in record and not isinstance(record[k], t)]
        if missing:
            raise ValueError(f"no valid {', '.join(missing)}")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        warnings.warn(f"{command}: ignoring {path}, which is not a readable {what} ({err}); {then}", stacklevel=3)
        return None
    return record


# ------------------------------------------------------------------ argparse types
def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (argparse reports "argument --x: must be a positive integer, got 0")."""
    return _bounded_int(text, 1, None)


def nonnegative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0."""
    return _bounded_int(text, 0, None)


def int_in_range(low: int, high: int):
    """argparse ``type=`` factory: an integer in ``[low, high]``."""
    def parse(text: str) -> int:
        return _bounded_int(text, low, high)

    parse.__name__ = f"integer from {low} to {high}"
    return parse


def _bounded_int(text: str, low: int, high):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if high is not None and not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {value}")
    if value < low:
        kind = "a positive integer" if low == 1 else ("a non-negative integer" if low == 0 else f"an integer >= {low}")
        raise argparse.ArgumentTypeError(f"must be {kind}, got {value}")
    return value


# ------------------------------------------------------------------ the command line's shared plumbing
def output_dir_arg(text: str) -> str:
    """argparse ``type=`` of ``--output-dir``: a non-empty path (``""`` would write into the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a folder path, got {text!r} (say '.' for the current folder)")
    return text


class OutputFolder:
    """The result folder of one ``pyro-fa`` run: checked, created and locked before any work.

    Entering creates the folder (and ``subfolders``), proves that a file can be written there, takes an
    exclusive, non-blocking ``flock`` on ``<folder>/.lock`` (a second run on the folder is refused, the
    first is left alone) and removes the ``.part`` temporary files a killed run left. The lock is the
    kernel's: it goes with the process, so a killed run leaves no stale lock (the file stays, unlocked);
    where ``fcntl`` is missing (Windows) there is no lock. If the run then fails and the folder was made
    by this run and holds nothing but the lock file, it is removed again.

    Parameters
    ----------
    path : str or Path
        ``--output-dir``.
    command : str
        The command, e.g. ``"pyro-fa classify"``; every message starts with it.
    subfolders : sequence of str, default ()
        Folders inside ``path`` the run writes to (created and checked too).

    Raises
    ------
    SystemExit
        With a one-line message naming ``--output-dir``: when it is empty, is (or lies under) a file, cannot
        be written to, or is in use by another run.
    """

    def __init__(self, path, command: str, subfolders: Sequence[str] = ()):
        self.path, self.command, self.subfolders = Path(path), command, tuple(subfolders)
        self.fd = None
        self._made: list = []

    def __enter__(self) -> "OutputFolder":
        import tempfile

        if not str(self.path).strip():
            raise SystemExit(f"{self.command}: --output-dir must be a folder path, got ''.")
        folders = [self.path] + [self.path / s for s in self.subfolders]
        self._made = [p for p in [*reversed(self.path.absolute().parents), *folders] if not p.exists()]
        try:
            for folder in folders:
                folder.mkdir(parents=True, exist_ok=True)
            for folder in folders:
                with tempfile.TemporaryFile(dir=folder):
                    pass
        except OSError as err:
            self._remove_made()
            raise SystemExit(f"{self.command}: --output-dir must be a folder this process can write to, got "
                             f"{str(self.path)!r} ({err.strerror or err}).") from None
        self._lock()  # refused: the folder is another run's now, left as it is
        for folder in folders:
            for part in folder.glob(".*.part"):
                try:
                    part.unlink()
                except OSError:
                    pass
        return self

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        import os

        lock = self.path / ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            raise SystemExit(f"{self.command}: --output-dir {str(self.path)!r} is in use by another {self.command} "
                             f"run{f' (process {holder})' if holder else ''}, which holds {str(lock)!r}; wait for "
                             "it to end, or choose another --output-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def _remove_made(self) -> None:
        """Remove the folders this run made, deepest first, while they are empty (but for the lock file, when
        this run holds it)."""
        for folder in reversed(self._made):
            if not folder.is_dir():
                continue
            if folder == self.path and self.fd is not None:
                if {p.name for p in folder.iterdir()} - {".lock"}:
                    break
                (folder / ".lock").unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                break
        self._made = []

    def __exit__(self, exc_type, exc, tb):
        import os

        if exc_type is not None and not (exc_type is SystemExit and exc.code in (0, None)):
            self._remove_made()  # a run that failed before writing leaves no empty folder behind
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
        return False


def check_device(name: str, command: str):
    """The ``--device`` of ``command`` as a ``torch.device``, refused up front when it cannot hold data.

    Raises
    ------
    SystemExit
        When ``name`` is no torch device, is ``meta`` (shapes only), is CUDA where torch sees none, or cannot
        hold a tensor here.
    """
    import torch

    hint = "e.g. cpu, cuda or cuda:0"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SystemExit(f"{command}: --device must be a torch device, {hint}, got {name!r}.") from None
    if dev.type == "meta":
        raise SystemExit(f"{command}: --device must be a device that holds data, {hint}, got {name!r} "
                         "(meta tensors have shapes only).")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{command}: --device {name!r} needs CUDA, which this torch does not see.")
    try:
        torch.zeros(1, device=dev).cpu()
    except (RuntimeError, AssertionError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"{command}: --device must be a device this torch can use, {hint}, got {name!r} "
                         f"({first}).") from None
    return dev


def _interactive(stream) -> bool:
    """Whether progress bars belong on ``stream``: a terminal, or a Jupyter kernel (tqdm.auto draws widgets)."""
    import sys

    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    return "ipykernel" in sys.modules and type(stream).__module__.startswith("ipykernel")


def progress_bar(*, total=None, desc: str, unit: str = "it", enabled: bool = True, **kwargs):
    """A tqdm bar where someone watches (a terminal or a notebook), and none otherwise.

    In a log file, a pipe or CI, a bar's carriage returns garble the output; there the bar is disabled
    (its methods do nothing) and the subcommands' one line per finished unit (written with
    :meth:`tqdm.tqdm.write`) is the progress report.

    Parameters
    ----------
    total : int, optional
    desc : str
    unit : str, default "it"
    enabled : bool, default True
        ``False`` (``--no-progress``) hides the bar on a terminal too.
    **kwargs
        Passed to ``tqdm``.
    """
    import sys

    from tqdm.auto import tqdm

    kwargs.setdefault("mininterval", 1.0)
    stream = kwargs.get("file") or sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, disable=not (enabled and _interactive(stream)), **kwargs)


class quiet_plate_guess:
    """Silence Pyro's ``INFO Guessed max_plate_nesting = n`` inside the block (restored on exit).

    For an ELBO whose guess must run as Pyro runs it: Pyro's ``Trace_ELBO`` draws from the global
    random generator while it guesses, so passing ``max_plate_nesting`` would change the fits'
    random draws. Where the guess leaves the generator alone (:class:`~pyro_fa.FactorELBO`), pass
    ``max_plate_nesting`` instead.
    """

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("pyro.infer.elbo")
        self.level = self.logger.level
        self.logger.setLevel(max(self.level, logging.WARNING))
        return self

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
        return False
