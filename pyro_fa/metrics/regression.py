r"""Regression metrics of Gaussian predictives: RMSE, test log-likelihood, calibration; distances of Gaussians.

The predictive of a Bayesian model average (BMA) over S posterior samples
:math:`\theta_s` is the Gaussian mixture

.. math::

    p(y \mid x) = \frac{1}{S} \sum_{s=1}^S N\big(y;\ \mu_s(x),\ \sigma_s^2(x)\big).

Predictions are passed as tensors ``pred_means`` and ``pred_vars`` of shape
(S, N) (a (N,) tensor is one sample, S = 1; ``pred_vars`` may be anything that
broadcasts, e.g. a scalar noise variance or (S, 1) per-sample noise), in the
standardised units of :func:`pyro_fa.datasets.load_uci`; ``y_mean`` and ``y_std``
turn the numbers into the original units of y, as the UCI benchmark reports
them (Hernández-Lobato & Adams 2015). Every metric refuses NaN or infinite
predictions, variances and targets with a ``ValueError`` naming the argument
(as the classification metrics do): a non-finite prediction is a failure to
report, not a number to average.

:func:`relative_frobenius_distance` and :func:`gaussian_wasserstein2` are those
of :mod:`pyro_fa.fa.linalg`, re-exported here.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Union

import torch
from torch import Tensor

from pyro_fa.fa.linalg import gaussian_wasserstein2, relative_frobenius_distance
from pyro_fa.metrics._checks import check_finite, check_finite_number

__all__ = [
    "rmse", "gaussian_log_likelihood", "calibration", "Calibration", "mixture_cdf",
    "relative_frobenius_distance", "gaussian_wasserstein2",
]

DEFAULT_LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05, 0.10, …, 0.95
#: reduction -> what is done to the per-point values
_REDUCTIONS = {"mean": Tensor.mean, "none": lambda per_point: per_point}


def _check_tensor(value, name: str, fn: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}.")
    return value


def _check_scale(y_std, fn: str) -> float:
    try:
        y_std = float(y_std)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: y_std must be a positive finite number, got {y_std!r}.") from None
    if not (math.isfinite(y_std) and y_std > 0):
        raise ValueError(f"{fn}: y_std must be a positive finite number, got {y_std!r}.")
    return y_std


def _mixture(pred_means: Tensor, pred_vars: Tensor, y: Tensor, fn: str):
    """Validate; return means and variances of shape (S, N) and y of shape (N,)."""
    for name, v in (("pred_means", pred_means), ("pred_vars", pred_vars), ("y", y)):
        _check_tensor(v, name, fn)
        check_finite(v, name, fn)
    if y.dim() != 1:
        raise ValueError(f"{fn}: y must have shape (N,), got {tuple(y.shape)}.")
    if pred_means.dim() == 1:
        pred_means = pred_means.unsqueeze(0)
    if pred_means.dim() != 2 or pred_means.shape[-1] != y.shape[0]:
        raise ValueError(
            f"{fn}: pred_means must have shape (S, N) or (N,) with N = {y.shape[0]}, got {tuple(pred_means.shape)}."
        )
    try:
        pred_vars = torch.broadcast_to(pred_vars, pred_means.shape)
    except RuntimeError as err:
        raise ValueError(
            f"{fn}: pred_vars must broadcast to pred_means' shape {tuple(pred_means.shape)}, "
            f"got {tuple(pred_vars.shape)}."
        ) from err
    if not bool((pred_vars > 0).all()):
        raise ValueError(f"{fn}: pred_vars must be positive; got a minimum of {float(pred_vars.min())!r}.")
    return pred_means, pred_vars.to(pred_means.dtype), y.to(pred_means.dtype)


def rmse(pred_mean: Tensor, y: Tensor, y_std: float = 1.0) -> Tensor:
    r"""Root mean squared error in the original units of y.

    .. math:: \mathrm{RMSE} = y_{\rm std} \sqrt{\tfrac1N \textstyle\sum_n (\hat y_n - y_n)^2}

    Parameters
    ----------
    pred_mean : Tensor of shape (N,), or (S, N)
        Predictive mean; with (S, N), the per-sample means, averaged over S first
        (the BMA's mean).
    y : Tensor of shape (N,)
        Targets, in the same (standardised) units as ``pred_mean``.
    y_std : float, default 1.0
        Scale of the standardisation (``UCISplit.y_std``).

    Returns
    -------
    Tensor, a scalar.

    Raises
    ------
    TypeError
        If ``pred_mean`` or ``y`` is not a tensor.
    ValueError
        If the shapes do not match, an entry is NaN or infinite, or ``y_std`` is
        not positive and finite.

    Examples
    --------
    >>> round(float(rmse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]), y_std=2.0)), 4)
    2.8284
    """
    for name, v in (("pred_mean", pred_mean), ("y", y)):
        _check_tensor(v, name, "rmse")
        check_finite(v, name, "rmse")
    y_std = _check_scale(y_std, "rmse")
    if pred_mean.dim() == 2:
        pred_mean = pred_mean.mean(0)
    if y.dim() != 1 or pred_mean.shape != y.shape:
        raise ValueError(
            f"rmse: pred_mean must have shape (N,) or (S, N) matching y of shape (N,), "
            f"got {tuple(pred_mean.shape)} and {tuple(y.shape)}."
        )
    return (pred_mean - y.to(pred_mean.dtype)).pow(2).mean().sqrt() * y_std


def gaussian_log_likelihood(pred_means: Tensor, pred_vars: Union[Tensor, float], y: Tensor, y_mean: float = 0.0,
                            y_std: float = 1.0, reduction: str = "mean") -> Tensor:
    r"""Test log-likelihood of the Bayesian model average, in the original units of y.

    .. math::

        \log p(y_n) = \log \frac1S \sum_s N\big(y_n^{\rm o};\ y_{\rm std}\,\mu_{sn} + y_{\rm mean},\
        y_{\rm std}^2 \sigma_{sn}^2\big)
        = \operatorname{logsumexp}_s \log N(y_n; \mu_{sn}, \sigma^2_{sn}) - \log S - \log y_{\rm std},

    with :math:`y^{\rm o}_n = y_{\rm std}\, y_n + y_{\rm mean}`; the shift ``y_mean``
    does not change the value.

    Parameters
    ----------
    pred_means : Tensor of shape (S, N) or (N,)
        Predictive means of the S posterior samples (standardised units).
    pred_vars : Tensor broadcastable to (S, N), or float
        Predictive variances (noise variance, plus any per-sample variance), positive.
    y : Tensor of shape (N,)
        Standardised test targets.
    y_mean, y_std : float
        The standardisation of y (``UCISplit.y_mean``, ``UCISplit.y_std``).
    reduction : {"mean", "none"}, default "mean"
        ``"mean"``: the mean over test points (a scalar, the benchmark's "test LL");
        ``"none"``: the per-point values, shape (N,).

    Returns
    -------
    Tensor, a scalar or of shape (N,). Higher is better.

    Raises
    ------
    TypeError
        If ``pred_means`` or ``y`` is not a tensor.
    ValueError
        If the shapes do not broadcast, an entry (or ``y_mean``) is NaN or
        infinite, a variance is not positive, or ``y_std`` is not positive and
        finite.

    Examples
    --------
    >>> ll = gaussian_log_likelihood(torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1))
    >>> round(float(ll), 6) == round(-0.5 * math.log(2 * math.pi), 6)
    True
    """
    fn = "gaussian_log_likelihood"
    if not isinstance(pred_vars, Tensor) and isinstance(pred_means, Tensor):
        pred_vars = torch.as_tensor(pred_vars, dtype=pred_means.dtype, device=pred_means.device)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be 'mean' or 'none', got {reduction!r}.")
    y_std = _check_scale(y_std, fn)
    means, variances, y = _mixture(pred_means, pred_vars, y, fn)
    y_mean = check_finite_number(y_mean, "y_mean", fn)
    # in original units: y_o = y_std * y + y_mean, mu_o = y_std * mu + y_mean, var_o = y_std^2 var
    resid = (y * y_std + y_mean) - (means * y_std + y_mean)
    var_o = variances * (y_std * y_std)
    log_pdf = -0.5 * (resid.pow(2) / var_o + var_o.log() + math.log(2 * math.pi))  # (S, N)
    per_point = torch.logsumexp(log_pdf, dim=0) - math.log(log_pdf.shape[0])
    return _REDUCTIONS[reduction](per_point)


def mixture_cdf(pred_means: Tensor, pred_vars: Union[Tensor, float], y: Tensor) -> Tensor:
    r"""CDF of the BMA mixture at the targets (the probability integral transform), shape (N,).

    .. math:: F_n(y_n) = \frac1S \sum_s \Phi\big((y_n - \mu_{sn}) / \sigma_{sn}\big)

    Arguments and errors are those of :func:`calibration`.
    """
    return _pit(pred_means, pred_vars, y, "mixture_cdf")


def _pit(pred_means, pred_vars, y, fn: str) -> Tensor:
    if not isinstance(pred_vars, Tensor) and isinstance(pred_means, Tensor):
        pred_vars = torch.as_tensor(pred_vars, dtype=pred_means.dtype, device=pred_means.device)
    means, variances, y = _mixture(pred_means, pred_vars, y, fn)
    return torch.special.ndtr((y - means) / variances.sqrt()).mean(0)


class Calibration(NamedTuple):
    """Coverage of central predictive intervals.

    Attributes
    ----------
    levels : Tensor of shape (L,)
        Nominal probabilities of the central intervals.
    coverage : Tensor of shape (L,)
        Fraction of targets inside each interval.
    error : Tensor, a scalar
        Calibration error, the mean of ``|coverage - levels|``.
    """

    levels: Tensor
    coverage: Tensor
    error: Tensor


def calibration(pred_means: Tensor, pred_vars: Union[Tensor, float], y: Tensor,
                levels: Union[Sequence[float], Tensor] = DEFAULT_LEVELS) -> Calibration:
    r"""Coverage of the BMA mixture's central predictive intervals, and the calibration error.

    The central interval of level :math:`p` is
    :math:`[F^{-1}(\tfrac{1-p}2), F^{-1}(\tfrac{1+p}2)]` with :math:`F` the mixture's
    CDF; since :math:`F` is continuous and increasing, :math:`y` lies in it exactly
    when :math:`|2F(y) - 1| \le p`, so no quantile has to be inverted. Calibration
    (and this metric) does not depend on the standardisation of y.

    Parameters
    ----------
    pred_means : Tensor of shape (S, N) or (N,)
    pred_vars : Tensor broadcastable to (S, N), or float; positive
    y : Tensor of shape (N,)
    levels : sequence of floats in (0, 1), or Tensor of shape (L,); default 0.05, 0.10, …, 0.95

    Returns
    -------
    Calibration
        ``levels`` (L,), ``coverage`` (L,), ``error`` = mean ``|coverage - levels|``.

    Raises
    ------
    TypeError
        If ``pred_means``, ``pred_vars`` or ``y`` is not a tensor (or a float for
        ``pred_vars``).
    ValueError
        If the shapes do not broadcast, an entry is NaN or infinite, a variance
        is not positive, or a level is outside (0, 1).

    Examples
    --------
    >>> cal = calibration(torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([-2.0, -0.1, 0.1, 2.0]), levels=[0.5])
    >>> cal.coverage.tolist(), round(float(cal.error), 3)
    ([0.5], 0.0)
    """
    fn = "calibration"
    pit = _pit(pred_means, pred_vars, y, fn)
    levels = torch.as_tensor(levels, dtype=pit.dtype, device=pit.device).reshape(-1)
    if levels.numel() == 0 or not bool(((levels > 0) & (levels < 1)).all()):
        raise ValueError(f"{fn}: levels must be a non-empty set of probabilities in (0, 1), got {levels.tolist()!r}.")
    inside = (2 * pit - 1).abs().unsqueeze(0) <= levels.unsqueeze(1)  # (L, N)
    coverage = inside.to(pit.dtype).mean(1)
    return Calibration(levels, coverage, (coverage - levels).abs().mean())
