r"""Held-out scores of R replicas' predictive mixtures at once, through :mod:`pyro_fa.metrics`.

Replica :math:`r`'s predictive at :math:`x_m` is the model average over its :math:`S` draws

.. math::

    p_r(y \mid x_m) = \frac1S \sum_{s=1}^S N\big(y;\ \mu_{srm},\ v_{sr}\big),

given as ``means`` of shape (S, R, M) (e.g. :meth:`BatchedVI.predict <pyro_fa.nn.BatchedVI.predict>`, or
draws of SWAG posteriors through :class:`~pyro_fa.nn.BatchedMLP`) and ``noise_var`` of shape (R, 1)
or (S, R, 1).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor

from pyro_fa import metrics

__all__ = ["replica_log_likelihood", "replica_metrics"]


def _check(means, noise_var, y, y_std, fn: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate; return noise_var as (S, R, 1), y as (R, M) and y_std as a tensor of shape (R,)."""
    for name, value in (("means", means), ("noise_var", noise_var), ("y", y)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}.")
    if means.dim() != 3:
        raise ValueError(f"{fn}: means must have shape (S, R, M), got {tuple(means.shape)}.")
    S, R, M = means.shape
    if noise_var.dim() == 1 and noise_var.shape[0] == R:
        noise_var = noise_var.unsqueeze(-1)
    if tuple(noise_var.shape) not in ((R, 1), (S, R, 1)):
        raise ValueError(f"{fn}: noise_var must have shape ({R},), ({R}, 1) or ({S}, {R}, 1), got "
                         f"{tuple(noise_var.shape)}.")
    if y.dim() == 1 and y.shape[0] == M:
        y = y.expand(R, M)
    if tuple(y.shape) != (R, M):
        raise ValueError(f"{fn}: y must have shape ({M},) or ({R}, {M}), one target per predicted point, got "
                         f"{tuple(y.shape)}.")
    # a tensor keeps its dtype (float32 scales stay float32 in the float32 score); a float is kept in float64
    y_std = (y_std.to(means.device) if isinstance(y_std, Tensor)
             else torch.as_tensor(y_std, dtype=torch.float64, device=means.device))
    if y_std.dim() > 1 or y_std.numel() not in (1, R) or not bool(((y_std > 0) & (y_std < math.inf)).all()):
        raise ValueError(f"{fn}: y_std must be a positive finite float or a Tensor of shape ({R},) of them, got "
                         f"{y_std.tolist()}.")
    nv = noise_var.expand(S, R, 1) if noise_var.dim() == 2 else noise_var
    return nv, y, y_std.expand(R)


@torch.no_grad()
def replica_log_likelihood(means: Tensor, noise_var: Tensor, y: Tensor, *, y_std=1.0) -> Tensor:
    r"""Mean held-out log-likelihood of every replica's mixture; ``-inf`` where a replica diverged.

    .. math::

        \mathrm{LL}_r = \frac1M \sum_m \log \frac1S \sum_s N(y_{rm}; \mu_{srm}, v_{sr})
        - \log \texttt{y\_std}_r,

    in one call of :func:`pyro_fa.metrics.gaussian_log_likelihood` over all replicas'
    points, in the dtype of ``means``: cheap enough to score checkpoints during training.

    Parameters
    ----------
    means : Tensor of shape (S, R, M)
    noise_var : Tensor of shape (R,), (R, 1) or (S, R, 1)
    y : Tensor of shape (R, M) or (M,)
    y_std : float or Tensor of shape (R,), default 1.0
        Scale of standardised targets: the result is in the original units.

    Returns
    -------
    Tensor of shape (R,)
        ``-inf`` for a replica whose means or variances are not finite, or whose
        variances are not positive (the others are unaffected).

    Raises
    ------
    TypeError, ValueError
        For arguments of another type or shape.

    Examples
    --------
    >>> means, y = torch.zeros(4, 2, 3), torch.zeros(3)
    >>> replica_log_likelihood(means, torch.ones(2), y)  # -log(2 pi) / 2
    tensor([-0.9189, -0.9189])
    """
    nv, y, y_std = _check(means, noise_var, y, y_std, "replica_log_likelihood")
    S, R, M = means.shape
    ok = torch.isfinite(means).all(-1).all(0) & torch.isfinite(nv).all(-1).all(0) & (nv > 0).all(-1).all(0)
    means = torch.where(ok.unsqueeze(-1), means, torch.zeros_like(means))
    nv = torch.where(ok.unsqueeze(-1), nv, torch.ones_like(nv)).expand(S, R, M)
    per_point = metrics.gaussian_log_likelihood(means.reshape(S, R * M), nv.reshape(S, R * M),
                                                y.reshape(R * M), reduction="none")
    ll = per_point.reshape(R, M).mean(1) - y_std.to(per_point.dtype).log()
    return torch.where(ok, ll, torch.full_like(ll, -math.inf))


@torch.no_grad()
def replica_metrics(means: Tensor, noise_var: Tensor, y: Tensor, *, y_std=1.0) -> Dict[str, Tensor]:
    r"""Test log-likelihood, RMSE and calibration error of every replica's mixture, in float64.

    Per replica: :func:`pyro_fa.metrics.gaussian_log_likelihood` (of the mixture, as
    in :func:`replica_log_likelihood`), :func:`pyro_fa.metrics.rmse` of the mixture's
    mean and the error of :func:`pyro_fa.metrics.calibration`, in the units of ``y``
    times ``y_std``.

    Parameters
    ----------
    means : Tensor of shape (S, R, M)
    noise_var : Tensor of shape (R,), (R, 1) or (S, R, 1)
    y : Tensor of shape (R, M) or (M,)
    y_std : float or Tensor of shape (R,), default 1.0

    Returns
    -------
    dict of float64 Tensors of shape (R,)
        ``"log_likelihood"``, ``"rmse"``, ``"calibration_error"``.

    Raises
    ------
    FloatingPointError
        If a replica's means or variances are not finite (its fit diverged; see
        :func:`replica_log_likelihood` for scores that mark it ``-inf`` instead).
    TypeError, ValueError
        For arguments of another type or shape.

    Examples
    --------
    >>> out = replica_metrics(torch.zeros(4, 2, 3), torch.ones(2), torch.ones(3), y_std=torch.tensor([1.0, 2.0]))
    >>> out["rmse"]
    tensor([1., 2.], dtype=torch.float64)
    """
    nv, y, y_std = _check(means, noise_var, y, y_std, "replica_metrics")
    bad = ~(torch.isfinite(means).all(-1).all(0) & torch.isfinite(nv).all(-1).all(0))
    if bool(bad.any()):
        raise FloatingPointError(f"replica_metrics: means and noise_var must be finite, got non-finite values in "
                                 f"replicas {torch.nonzero(bad).reshape(-1).tolist()} (their fits diverged).")
    ll, rmse, cal = [], [], []
    for r in range(means.shape[1]):
        m, v, t, s = means[:, r].double(), nv[:, r].double(), y[r].double(), float(y_std[r])
        ll.append(metrics.gaussian_log_likelihood(m, v, t, y_std=s))
        rmse.append(metrics.rmse(m, t, y_std=s))
        cal.append(metrics.calibration(m, v, t).error)
    return {"log_likelihood": torch.stack(ll), "rmse": torch.stack(rmse),
            "calibration_error": torch.stack(cal).to(torch.float64)}
