r"""Per-point log-likelihoods of a network's output, by name or as a callable.

``"categorical"``: the output is logits of shape (N, C), :math:`\log \mathrm{softmax}(z)_y`;
``"gaussian"``: the output is means of shape (N,) or (N, 1), :math:`\log N(y \mid \mu, \sigma^2)`
with the given observation noise :math:`\sigma`; a callable ``(output, targets) -> Tensor of
shape (N,)`` is used as it is.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

__all__ = ["LIKELIHOODS", "point_log_likelihood", "check_targets"]

LIKELIHOODS = ("categorical", "gaussian")


def point_log_likelihood(likelihood, noise_std, fn: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The function ``(output, targets) -> Tensor of shape (N,)`` that scores one draw's output.

    Parameters
    ----------
    likelihood : {"categorical", "gaussian"} or callable
        A callable is returned as it is.
    noise_std : float or Tensor, optional
        The observation noise's standard deviation (positive, broadcasting to (N,)), for ``"gaussian"``.
    fn : str
        The caller's name, for error messages.

    Raises
    ------
    ValueError
        An unknown ``likelihood``; ``noise_std`` missing or not positive and finite for ``"gaussian"``;
        at call time, an output of the wrong shape or class labels outside the logits.
    """
    if callable(likelihood):
        return likelihood
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"{fn}: likelihood must be one of {LIKELIHOODS} or a callable (output, targets) -> "
                         f"per-point log-likelihood, got {likelihood!r}.")
    if likelihood == "categorical":
        def categorical(logits: Tensor, y: Tensor) -> Tensor:
            if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
                raise ValueError(f"{fn}: the model's output must be logits of shape (N, C) with N={y.shape[0]}, got "
                                 f"{tuple(logits.shape)!r}.")
            C = logits.shape[-1]
            bad = (y < 0) | (y >= C)
            if bool(bad.any()):
                raise ValueError(f"{fn}: targets must be class labels in [0, {C}) for the model's {C} logits, got "
                                 f"{int(bad.sum())} outside, e.g. {y[bad][:5].tolist()!r}.")
            return logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return categorical
    if noise_std is None:
        raise ValueError(f"{fn}: noise_std must be given for likelihood='gaussian' (the observation noise's "
                         "standard deviation, a positive number or a tensor broadcasting to (N,)), got None.")
    noise = torch.as_tensor(noise_std)
    if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
        raise ValueError(f"{fn}: noise_std must be positive and finite, got {noise_std!r}.")

    def gaussian(mean: Tensor, y: Tensor) -> Tensor:
        if mean.dim() == 2 and mean.shape[-1] == 1:
            mean = mean.squeeze(-1)
        if mean.shape != y.shape:
            raise ValueError(f"{fn}: the model's output must be means of shape ({y.shape[0]},) or "
                             f"({y.shape[0]}, 1), got {tuple(mean.shape)!r}.")
        sd = noise.to(mean)
        return -0.5 * ((y - mean) / sd).square() - sd.log() - 0.5 * math.log(2 * math.pi)
    return gaussian


def check_targets(targets, likelihood, fn: str) -> Tensor:
    """Check validation or test ``targets`` of shape (N,) for ``likelihood`` (``None``: a callable's, any dtype).

    Raises
    ------
    TypeError
        Not a Tensor; float labels for ``"categorical"``; integer values for ``"gaussian"``.
    ValueError
        Not of shape (N,) with N >= 1 (an (N, 1) column is named, with the fix).
    """
    if not isinstance(targets, Tensor):
        raise TypeError(f"{fn}: targets must be a torch.Tensor of shape (N,), got {type(targets).__name__}.")
    if targets.dim() != 1 or targets.shape[0] == 0:
        raise ValueError(f"{fn}: targets must have shape (N,) with N >= 1, got {tuple(targets.shape)!r}."
                         + (" Flatten it (targets.reshape(-1))." if targets.dim() == 2 and targets.shape[1] == 1
                            else ""))
    if likelihood == "categorical" and (targets.is_floating_point() or targets.dtype == torch.bool):
        raise TypeError(f"{fn}: targets must hold integer class labels for likelihood='categorical', got dtype "
                        f"{targets.dtype}.")
    if likelihood == "gaussian" and not targets.is_floating_point():
        raise TypeError(f"{fn}: targets must be floating point for likelihood='gaussian', got dtype {targets.dtype}.")
    return targets
