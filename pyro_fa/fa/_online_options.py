"""The constructor arguments of :class:`~pyro_fa.OnlineFactorAnalysis`, checked at the boundary.

One function, :func:`check_arguments`: every argument is refused here (``"<Class>: <argument> must be
<expected>, got <value!r>."``) before the model allocates anything, and the fitting method is resolved
once, from a fitter object or the name it is registered under.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from pyro_fa.fa.fitters import Fitter, resolve_fitter

__all__ = ["check_arguments", "DEFAULT_WARMUP", "FITTER_OPTIONS"]

DEFAULT_WARMUP = 100  # warmup=None: max(DEFAULT_WARMUP, rank)
# the keyword options of the built-in fitters that the constructor still takes with method=<name> (each fitter
# takes those that apply to it: Fitter.from_options); with a fitter object they must keep these defaults
FITTER_OPTIONS = dict(lr=1e-2, optimizer=None, optimizer_kwargs=None, step_scale=2.0, expand=True, step_ramp=None,
                      lr_decay_after=None, average=True, m_step_every=None)


def _is_count(value, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def check_arguments(name: str, dim, rank, method, warmup, options: Dict[str, Any], init_scale, min_variance,
                    dtype, device) -> Tuple[Fitter, int, torch.dtype, torch.device]:
    """Check the constructor's arguments; return the fitter, the warm-up, the dtype and the device.

    ``name`` is the class that checks (it starts the messages); ``options`` the keyword options of the
    built-in fitters (:data:`FITTER_OPTIONS`' keys).

    Raises
    ------
    ValueError, TypeError
        ``"<name>: <argument> must be <expected>, got <value!r>."`` for the first argument refused.
    """
    if not _is_count(dim, 2):
        raise ValueError(f"{name}: dim must be an integer >= 2, got {dim!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < dim:
        raise ValueError(f"{name}: rank must be an integer in [1, dim) = [1, {dim}), got {rank!r}.")
    if isinstance(method, Fitter):
        changed = sorted(k for k, v in options.items() if v is not FITTER_OPTIONS[k] and v != FITTER_OPTIONS[k])
        if changed:
            raise ValueError(f"{name}: {', '.join(changed)} must be given to the fitter object with method="
                             f"{type(method).__name__}(...), got them beside it.")
    # a name is checked here and built with the options that apply to it; dispatched once
    fitter = resolve_fitter(method, name, **options)
    if warmup is None:
        warmup = max(DEFAULT_WARMUP, rank)  # rank is checked above
    if not _is_count(warmup, 1):
        raise ValueError(f"{name}: warmup must be a positive integer, got {warmup!r}.")
    _check_fitter_options(name, **options)
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"{name}: init_scale must be a positive finite number, got {init_scale!r}.")
    if not (isinstance(min_variance, (int, float)) and 0 < min_variance < 1):
        raise ValueError(f"{name}: min_variance must be in (0, 1), got {min_variance!r}.")
    fitter.check(name, rank=rank, warmup=warmup)  # the fitter's options (a fitter object's too)
    dtype = dtype or torch.get_default_dtype()
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"{name}: dtype must be torch.float32 or torch.float64, got {dtype!r}. Half precision cannot hold "
            "the factor's statistics (nor factorise them on the CPU): fit a float32 copy of the vectors."
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "meta":
        raise ValueError(f"{name}: device must hold data (e.g. 'cpu' or 'cuda'), got {device!r}: a fit on the "
                         "meta device has no values to update.")
    return fitter, warmup, dtype, device


def _check_fitter_options(name: str, *, lr, step_scale, expand, step_ramp, lr_decay_after, m_step_every,
                          **_: Optional[Any]) -> None:
    """The built-in fitters' keyword options, checked whatever the method (as the constructor always did)."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"{name}: lr must be a positive finite number, got {lr!r}.")
    if not (isinstance(step_scale, (int, float)) and math.isfinite(step_scale) and step_scale >= 1):
        raise ValueError(f"{name}: step_scale must be a finite number >= 1, got {step_scale!r}.")
    if not isinstance(expand, bool):
        raise TypeError(f"{name}: expand must be True or False, got {expand!r}.")
    if step_ramp is not None and not _is_count(step_ramp, 1):
        raise ValueError(f"{name}: step_ramp must be a positive integer or None, got {step_ramp!r}.")
    if lr_decay_after is not None and not _is_count(lr_decay_after, 0):
        raise ValueError(f"{name}: lr_decay_after must be a non-negative integer or None, got {lr_decay_after!r}.")
    if m_step_every is not None and not _is_count(m_step_every, 1):
        raise ValueError(f"{name}: m_step_every must be a positive integer or None, got {m_step_every!r}.")
