"""Input checks shared by the metrics (private)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_finite(value: Tensor, name: str, fn: str) -> Tensor:
    """Return ``value`` if every entry is finite, else a ValueError naming ``fn``, ``name`` and the bad count.

    A metric of a NaN or infinite prediction or target is no number at all (an RMSE
    of NaN, a calibration error that silently skips the NaN rows), so every
    public metric refuses it up front, as scikit-learn's metrics do.
    """
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        raise ValueError(
            f"{fn}: {name} must be finite, got NaN or inf in {int((~finite).sum())} of {value.numel()} entries."
        )
    return value


def check_finite_number(value, name: str, fn: str) -> float:
    """``value`` as a finite float, else a ValueError naming ``fn`` and ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a finite number, got {value!r}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{fn}: {name} must be a finite number, got {number!r}.")
    return number
