"""Input checks shared by the linear models (private).

The checks every layer shares (a positive float, a device) are in :mod:`pyro_fa._validation`.
"""
from __future__ import annotations

import numbers
from typing import Tuple

import torch
from torch import Tensor, nn


def integer(cls: str, arg: str, value, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{cls}: {arg} must be an int, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{cls}: {arg} must be >= {minimum}, got {value!r}.")
    return int(value)


def check_basis(cls: str, basis) -> nn.Module:
    """A module with integer ``in_features`` / ``out_features`` (any :class:`pyro_fa.basis.Basis` qualifies)."""
    if not isinstance(basis, nn.Module) or not all(
        isinstance(getattr(basis, a, None), numbers.Integral) for a in ("in_features", "out_features")
    ):
        raise TypeError(
            f"{cls}: basis must be a torch.nn.Module with int attributes in_features and out_features "
            f"(e.g. a pyro_fa.basis.Basis), got {basis!r}."
        )
    return basis


def module_dtype_device(module: nn.Module, cls: str = "", arg: str = "basis") -> Tuple[torch.dtype, torch.device]:
    """dtype and device of the first floating parameter or buffer of ``module``, else the defaults.

    A module on the ``meta`` device (shapes without data) is refused with a ValueError naming ``cls`` and ``arg``.
    """
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            if t.device.type == "meta":
                raise ValueError(f"{cls}: {arg} must hold data on a device such as 'cpu' or 'cuda', got tensors on "
                                 "the meta device (shapes only). Build it on a real device or call .to_empty().")
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device("cpu")


def as_inputs(cls: str, X, in_features: int, dtype: torch.dtype, device, arg: str = "X") -> Tensor:
    """``X`` (tensor or array-like) as a finite (N, in_features) tensor of ``dtype`` on ``device``."""
    try:
        X = torch.as_tensor(X, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{cls}: {arg} must be a tensor or array of numbers, got {type(X).__name__} ({err}).") from None
    if X.dim() != 2 or X.shape[1] != in_features:
        raise ValueError(f"{cls}: {arg} must have shape (N, {in_features}), got {tuple(X.shape)}.")
    if X.shape[0] == 0:
        raise ValueError(f"{cls}: {arg} must have at least one row, got shape {tuple(X.shape)}.")
    if not torch.isfinite(X).all():
        raise ValueError(f"{cls}: {arg} must be finite, got NaN or inf entries.")
    return X


def as_targets(cls: str, y, n: int, dtype: torch.dtype, device, arg: str = "y") -> Tensor:
    """``y`` as a finite tensor of shape (n,)."""
    try:
        y = torch.as_tensor(y, device=device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{cls}: {arg} must be a tensor or array of numbers, got {type(y).__name__} ({err}).") from None
    if y.dtype == torch.bool:
        y = y.to(dtype)
    if y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.shape != (n,):
        raise ValueError(f"{cls}: {arg} must have shape ({n},) to match X, got {tuple(y.shape)}.")
    if y.is_complex():
        raise TypeError(f"{cls}: {arg} must be real, got dtype {y.dtype}.")
    y = y.to(dtype)
    if not torch.isfinite(y).all():
        raise ValueError(f"{cls}: {arg} must be finite, got NaN or inf entries.")
    return y
