"""The argument checks of :class:`~pyro_fa.optim.FactorIVON`, in the package's error format."""
from __future__ import annotations

import math
import numbers
from typing import Dict, List

import torch

__all__ = ["check_curvature", "check_hyperparameters", "check_params", "check_shared"]

#: the curvature estimates the low-rank part can be fed -> whether it needs ``batch_size``
CURVATURES = {"stein": False, "fisher": True}

NAME = "FactorIVON"

#: hyperparameter -> (test, what it must be); ``float("inf")`` passes where the test allows it
_RULES = {
    "lr": (lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"),
    "ess": (lambda v: v > 0 and math.isfinite(v), "a positive finite number"),
    "hess_init": (lambda v: v > 0 and math.isfinite(v), "a positive finite number"),
    "beta1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "beta2": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "weight_decay": (lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"),
    "clip_radius": (lambda v: v > 0 and not math.isnan(v), "a positive number (inf: no clipping)"),
    "diag_floor": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
}


def check_hyperparameters(values: Dict[str, object], name_of: str = NAME) -> None:
    """Refuse a hyperparameter outside its range (``ValueError``) or not a real number (``TypeError``); the
    messages start with ``name_of``."""
    for name, value in values.items():
        test, words = _RULES[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name_of}: {name} must be a real number, got {value!r}.")
        if not test(float(value)):
            raise ValueError(f"{name_of}: {name} must be {words}, got {value!r}.")


def check_count(name: str, value, minimum: int, name_of: str = NAME) -> int:
    """``value`` as an integer >= ``minimum`` (messages starting with ``name_of``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name_of}: {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_curvature(curvature, batch_size, name_of: str = NAME):
    """``(curvature, batch_size)`` checked: a key of :data:`CURVATURES`; ``batch_size`` a positive integer where
    the estimate needs it (``"fisher"`` is scaled by it), else None."""
    if curvature not in CURVATURES:
        raise ValueError(f"{name_of}: curvature must be one of {tuple(CURVATURES)!r}, got {curvature!r}.")
    if not CURVATURES[curvature]:
        if batch_size is not None:
            raise ValueError(f"{name_of}: batch_size is used by curvature='fisher' only, got batch_size="
                             f"{batch_size!r} with curvature={curvature!r}.")
        return curvature, None
    if batch_size is None:
        raise ValueError(f"{name_of}: curvature={curvature!r} needs batch_size, the number of examples each gradient "
                         "averages over (its estimate is scaled by it), got None.")
    return curvature, check_count("batch_size", batch_size, 1, name_of)


def check_params(params: List[torch.Tensor]):
    """``(D, dtype, device)`` of the parameters: at least one, floating point, one dtype, one device."""
    if not params:
        raise ValueError(f"{NAME}: params must hold at least one tensor, got none.")
    dtypes = sorted({str(p.dtype) for p in params})
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"{NAME}: params must be on one device, got {devices!r}.")
    if len(dtypes) > 1 or not params[0].dtype.is_floating_point:
        raise ValueError(f"{NAME}: params must share one floating-point dtype, got {dtypes!r}.")
    return sum(p.numel() for p in params), params[0].dtype, params[0].device


def check_shared(groups, rank: int) -> None:
    """With ``rank`` > 0 the low-rank part spans every group: ``ess``, ``weight_decay`` and ``beta2`` must agree."""
    if rank == 0:
        return
    for name in ("ess", "weight_decay", "beta2"):
        values = [g[name] for g in groups]
        if len(set(values)) > 1:
            raise ValueError(f"{NAME}: {name} must be the same in every param group when rank > 0 (the low-rank "
                             f"part couples the groups), got {values!r}. Use rank=0 for per-group values.")


def check_dimension(D: int, rank: int, pairs: int) -> None:
    """The sketch's basis of ``rank + 2 * pairs`` columns must fit in ``D`` dimensions."""
    if rank and rank + 2 * pairs > D:
        raise ValueError(f"{NAME}: rank + 2 * (draws per step) must be at most the number of weights {D}, got rank="
                         f"{rank} with {pairs} draw(s). Lower rank or mc_samples.")
