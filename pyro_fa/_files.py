"""Writing files so that they appear complete or not at all."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
