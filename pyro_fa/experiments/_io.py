"""Small helpers shared by the experiment modules: atomic result files and tables."""
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
