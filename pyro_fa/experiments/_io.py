"""Small helpers shared by the experiment modules: atomic result files and tables."""
from __future__ import annotations

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
