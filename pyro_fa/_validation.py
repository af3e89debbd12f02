"""Argument checks and dtype names shared by every layer (private to pyro_fa; layer 0: needs only torch).

Each check names the caller and the argument in its error, in the form
``"<Class>: <argument> must be <expected>, got <value!r>."``, and returns the value in the
form the caller stores.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["TORCH_DTYPES", "check_device", "positive_float"]

#: the dtype names the scikit-learn layer accepts (``dtype=`` of its estimators) -> the torch dtype; None is float64
TORCH_DTYPES = {
    None: torch.float64,
    "float64": torch.float64,
    "float32": torch.float32,
    torch.float64: torch.float64,
    torch.float32: torch.float32,
}


def positive_float(cls: str, arg: str, value) -> float:
    """``value`` as a positive finite float.

    Parameters
    ----------
    cls : str
        The caller's name, the start of the message.
    arg : str
        The argument's name.
    value : numbers.Real
        The value given (not a bool).

    Returns
    -------
    float

    Raises
    ------
    TypeError
        If ``value`` is not a real number (or is a bool).
    ValueError
        If it is not finite or not positive.

    Examples
    --------
    >>> positive_float("MyGuide", "init_scale", 1)
    1.0
    >>> positive_float("MyGuide", "init_scale", 0.0)
    Traceback (most recent call last):
    ...
    ValueError: MyGuide: init_scale must be a positive finite float, got 0.0.
    """
    return _positive(cls, arg, value, "a positive float", "a positive finite float")


def positive_number(cls: str, arg: str, value) -> float:
    """``value`` as a positive finite float, for the hyperparameters of priors and metrics.

    As :func:`positive_float`, with the messages "must be a real number" (``TypeError``) and
    "must be a positive finite number" (``ValueError``).

    Examples
    --------
    >>> positive_number("GaussianPrior", "precision", 2)
    2.0
    >>> positive_number("GaussianPrior", "precision", -1)
    Traceback (most recent call last):
    ...
    ValueError: GaussianPrior: precision must be a positive finite number, got -1.0.
    """
    return _positive(cls, arg, value, "a real number", "a positive finite number")


def _positive(cls: str, arg: str, value, type_words: str, value_words: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{cls}: {arg} must be {type_words}, got {value!r}.")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{cls}: {arg} must be {value_words}, got {value!r}.")
    return value


def check_scale(cls: str, value, arg: str = "scale") -> float:
    """``value`` as a posterior's covariance scale: a finite real number >= 0 (0 is the mean), as a float.

    Examples
    --------
    >>> check_scale("SWAG", 0)
    0.0
    >>> check_scale("SWAG", -1)
    Traceback (most recent call last):
    ...
    ValueError: SWAG: scale must be a finite number >= 0, got -1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{cls}: {arg} must be a finite number >= 0, got {value!r}.")
    return float(value)


def check_device(cls: str, device, arg: str = "device") -> torch.device:
    """``device`` (None: the CPU) as a :class:`torch.device` that holds data and is available here.

    Parameters
    ----------
    cls : str
        The caller's name, the start of the message.
    device : str, torch.device or None
        The device given.
    arg : str, default "device"
        The argument's name.

    Returns
    -------
    torch.device

    Raises
    ------
    TypeError
        If ``device`` is not a str, a torch.device or None.
    ValueError
        If it names no torch device, the ``meta`` device (shapes without data), or CUDA where
        CUDA is not available.

    Examples
    --------
    >>> check_device("MyEstimator", None)
    device(type='cpu')
    >>> check_device("MyEstimator", "meta")
    Traceback (most recent call last):
    ...
    ValueError: MyEstimator: device must hold data ('cpu' or 'cuda'), got 'meta': meta tensors have shapes only.
    """
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"{cls}: {arg} must be a str, a torch.device or None, got {device!r}.")
    try:
        dev = torch.device(device if device is not None else "cpu")
    except RuntimeError:
        raise ValueError(f"{cls}: {arg} must name a torch device such as 'cpu' or 'cuda', got {device!r}.") from None
    if dev.type == "meta":
        raise ValueError(
            f"{cls}: {arg} must hold data ('cpu' or 'cuda'), got {device!r}: meta tensors have shapes only."
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{cls}: {arg} must be available, got {device!r} but CUDA is not available.")
    return dev
