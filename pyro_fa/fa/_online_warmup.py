r"""The warm-up of an online factor-analysis fit, and the scale of its data.

An :class:`~pyro_fa.OnlineFactorAnalysis` first only gathers the running moments: :math:`F, \psi` keep
their initial values for ``warmup`` vectors (Brownlie 2021, §5.1), and while every vector seen is the
same there is no scale to fit at all, so the warm-up waits. These functions take the model and decide:
whether its vectors have spread apart (:func:`has_spread`), the fitter's step after the moments took a
batch (:func:`fit_step`), the early end of the warm-up (:func:`end_warmup`) and the floor of
:math:`\psi` relative to the data's variances (:func:`floor_values`).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["has_spread", "fit_step", "end_warmup", "floor_values"]


def has_spread(model) -> bool:
    r"""Whether the vectors ``model`` has seen have spread apart (a fit has something to fit).

    True when the mean running variance times the dtype's epsilon (the relative floor of
    :math:`\psi`) is a normal number of the state's dtype. Identical vectors, e.g. the
    iterates of a learning-rate warm-up that starts at 0 or of frozen first steps, have
    none. Remembered once true (the squared deviations only grow); O(D) until then.
    """
    if model.__dict__.get("_spread_seen", False):
        return True
    total = model._sq_dev_sum()
    info = torch.finfo(model.loc.dtype)
    spread = info.eps * total / (max(model._n, 1) * model.dim) >= info.tiny
    model.__dict__["_spread_seen"] = spread
    return spread


def fit_step(model, d: Tensor, n_old: int, B: int, spread_before: bool) -> None:
    r"""The fitter's step after the running moments took a batch of B vectors (centred ``d``, shape (B, D)).

    While the vectors have not spread apart (all equal so far) there is no scale to fit:
    the warm-up waits, counting them as one vector (``model.warmup`` grows by the repeats),
    and :math:`F, \psi` keep their initial values; EM then rescales at the first vector
    that differs, and the M-step (or the ascent) starts ``warmup`` vectors after the first.
    """
    n = model._n
    spread = spread_before or model._has_spread()
    if not spread:
        model.warmup += n - max(n_old, 1)
    model._bind_state(model.fitter.update(model.fit_state, model._ctx, d, n_old, B, spread and not spread_before))


def end_warmup(model) -> None:
    """End ``model``'s warm-up at the vectors seen so far (see :meth:`OnlineFactorAnalysis.finish_warmup`)."""
    if model._n > model.warmup:
        return
    cls = type(model).__name__
    if not model.fitter.finishes_warmup:
        model.fitter.finish_warmup(model.fit_state, model._ctx)  # raises: this method cannot end its warm-up early
    if model._n <= model.rank:
        raise RuntimeError(f"{cls}: finish_warmup() needs more than rank={model.rank} observations, got {model._n}.")
    if not model._has_spread():
        raise RuntimeError(f"{cls}: finish_warmup() needs observations that differ, got {model._n} identical ones "
                           "(no spread to fit a factor to). Update with more.")
    model.warmup = model._n - 1  # as if planned: the first M-step follows update warmup + 1
    model._bind_state(model.fitter.finish_warmup(model.fit_state, model._ctx))
    model._cache = None


def floor_values(model, var: Tensor) -> Tensor:
    r"""The floor of :math:`\psi` for the variances ``var``: ``model.min_variance`` times each.

    A coordinate that never moved gets a tiny floor relative to the others' (its row of :math:`F` is
    zero, so it does not enter the capacitance), never below the smallest normal number (a denormal
    :math:`\psi` is 0 under ``torch.set_flush_denormal(True)``).
    """
    info = torch.finfo(var.dtype)
    tiny = (info.eps * model._var_mean(var)).clamp_min(info.tiny)
    return (model.min_variance * var).clamp_min(tiny)
