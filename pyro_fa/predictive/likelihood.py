r"""The likelihood vocabulary of every posterior's predictions, and per-point log-likelihoods of a network's output.

One vocabulary, laplace-torch's names (:data:`Likelihood`): ``"classification"`` (the output is logits of
shape (N, C), :math:`\log \mathrm{softmax}(z)_y`; one logit of shape (N,) or (N, 1) is a Bernoulli's) and
``"regression"`` (the output is means of shape (N,) or (N, 1), :math:`\log N(y \mid \mu, \sigma^2)` with the
given observation noise :math:`\sigma`). :func:`normalize_likelihood` maps the aliases ``"categorical"`` and
``"gaussian"`` to them, once, at the boundary; everything after it dispatches on the two names through
registries (:data:`LOG_LIKELIHOODS`, :data:`TARGET_CHECKS`, :data:`OBSERVATION_NOISE`). A callable
``(output, targets) -> Tensor of shape (N,)`` is used as it is.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Literal, Optional

import torch
from torch import Tensor

__all__ = ["Likelihood", "LIKELIHOODS", "LIKELIHOOD_ALIASES", "normalize_likelihood", "point_log_likelihood",
           "check_targets", "LOG_LIKELIHOODS", "TARGET_CHECKS", "OBSERVATION_NOISE"]

#: the likelihoods every posterior's predictions take (laplace-torch's names)
Likelihood = Literal["classification", "regression"]
LIKELIHOODS = ("classification", "regression")
#: likelihood name -> whether it has an observation noise (a regression's ``noise_std``, FactorLaplace's
#: ``sigma_noise``); a classifier's is fixed (its curvature and evidence take :math:`\sigma = 1`)
OBSERVATION_NOISE: Dict[str, bool] = {"classification": False, "regression": True}
#: other names accepted at the boundary, and what they mean
LIKELIHOOD_ALIASES = {"categorical": "classification", "gaussian": "regression"}


def normalize_likelihood(owner: str, likelihood, *, allow_callable: bool = False):
    """``likelihood`` as one of :data:`LIKELIHOODS` (aliases mapped), or the callable itself when allowed.

    Parameters
    ----------
    owner : str
        The caller's name, for the error message (e.g. ``"SWAG"``).
    likelihood : {"classification", "regression", "categorical", "gaussian"} or callable
    allow_callable : bool, default False
        Return a callable ``(output, targets) -> Tensor of shape (N,)`` unchanged instead of refusing it.

    Returns
    -------
    str or callable

    Raises
    ------
    ValueError
        Anything else, naming the accepted values.

    Examples
    --------
    >>> normalize_likelihood("SWAG", "categorical")
    'classification'
    """
    if allow_callable and callable(likelihood):
        return likelihood
    if isinstance(likelihood, str):
        name = LIKELIHOOD_ALIASES.get(likelihood, likelihood)
        if name in LIKELIHOODS:
            return name
    accepted = ", ".join(repr(v) for v in LIKELIHOODS)
    raise ValueError(f"{owner}: likelihood must be one of {accepted}, got {likelihood!r}."
                     + (" (A callable (output, targets) -> per-point log-likelihood is accepted too.)"
                        if allow_callable else ""))


def _classification(fn: str, noise_std) -> Callable[[Tensor, Tensor], Tensor]:
    def classification(logits: Tensor, y: Tensor) -> Tensor:
        if logits.dim() == 1 or (logits.dim() == 2 and logits.shape[-1] == 1):  # one Bernoulli logit
            z = logits.reshape(-1)
            if z.shape != y.shape:
                raise ValueError(f"{fn}: the model's output must be logits of shape (N, C) with N={y.shape[0]}, got "
                                 f"{tuple(logits.shape)!r}.")
            logits = torch.stack([torch.zeros_like(z), z], -1)
        if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
            raise ValueError(f"{fn}: the model's output must be logits of shape (N, C) with N={y.shape[0]}, got "
                             f"{tuple(logits.shape)!r}.")
        C = logits.shape[-1]
        bad = (y < 0) | (y >= C)
        if bool(bad.any()):
            raise ValueError(f"{fn}: targets must be class labels in [0, {C}) for the model's {C} logits, got "
                             f"{int(bad.sum())} outside, e.g. {y[bad][:5].tolist()!r}.")
        return logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return classification


def _regression(fn: str, noise_std) -> Callable[[Tensor, Tensor], Tensor]:
    if noise_std is None:
        raise ValueError(f"{fn}: noise_std must be given for likelihood='regression' (the observation noise's "
                         "standard deviation, a positive number or a tensor broadcasting to (N,)), got None.")
    noise = torch.as_tensor(noise_std)
    if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
        raise ValueError(f"{fn}: noise_std must be positive and finite, got {noise_std!r}.")

    def regression(mean: Tensor, y: Tensor) -> Tensor:
        if mean.dim() == 2 and mean.shape[-1] == 1:
            mean = mean.squeeze(-1)
        if mean.shape != y.shape:
            raise ValueError(f"{fn}: the model's output must be means of shape ({y.shape[0]},) or "
                             f"({y.shape[0]}, 1), got {tuple(mean.shape)!r}.")
        sd = noise.to(mean)
        return -0.5 * ((y - mean) / sd).square() - sd.log() - 0.5 * math.log(2 * math.pi)
    return regression


#: likelihood name -> builder ``(caller, noise_std) -> (output, targets) -> per-point log-likelihood``
LOG_LIKELIHOODS: Dict[str, Callable] = {"classification": _classification, "regression": _regression}


def point_log_likelihood(likelihood, noise_std, fn: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The function ``(output, targets) -> Tensor of shape (N,)`` that scores one draw's output.

    Parameters
    ----------
    likelihood : {"classification", "regression"} (or an alias) or callable
        A callable is returned as it is.
    noise_std : float or Tensor, optional
        The observation noise's standard deviation (positive, broadcasting to (N,)), for ``"regression"``.
    fn : str
        The caller's name, for error messages.

    Raises
    ------
    ValueError
        An unknown ``likelihood``; ``noise_std`` missing or not positive and finite for ``"regression"``;
        at call time, an output of the wrong shape or class labels outside the logits.
    """
    likelihood = normalize_likelihood(fn, likelihood, allow_callable=True)
    if callable(likelihood):
        return likelihood
    return LOG_LIKELIHOODS[likelihood](fn, noise_std)


def _classification_targets(targets: Tensor, fn: str) -> None:
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"{fn}: targets must hold integer class labels for likelihood='classification', got dtype "
                        f"{targets.dtype}.")


def _regression_targets(targets: Tensor, fn: str) -> None:
    if not targets.is_floating_point():
        raise TypeError(f"{fn}: targets must be floating point for likelihood='regression', got dtype "
                        f"{targets.dtype}.")


#: likelihood name -> the check of its targets' dtype
TARGET_CHECKS: Dict[str, Callable[[Tensor, str], None]] = {"classification": _classification_targets,
                                                           "regression": _regression_targets}


def check_targets(targets, likelihood: Optional[str], fn: str) -> Tensor:
    """Check validation or test ``targets`` of shape (N,) for ``likelihood`` (``None``: a callable's, any dtype).

    Raises
    ------
    TypeError
        Not a Tensor; float labels for ``"classification"``; integer values for ``"regression"``.
    ValueError
        Not of shape (N,) with N >= 1 (an (N, 1) column is named, with the fix); an unknown ``likelihood``.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(f"{fn}: targets must be a torch.Tensor of shape (N,), got {type(targets).__name__}.")
    if targets.dim() != 1 or targets.shape[0] == 0:
        raise ValueError(f"{fn}: targets must have shape (N,) with N >= 1, got {tuple(targets.shape)!r}."
                         + (" Flatten it (targets.reshape(-1))." if targets.dim() == 2 and targets.shape[1] == 1
                            else ""))
    if likelihood is not None:
        TARGET_CHECKS[normalize_likelihood(fn, likelihood)](targets, fn)
    return targets
