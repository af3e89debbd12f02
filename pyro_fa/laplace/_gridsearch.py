r"""The grid search of :class:`~pyro_fa.laplace.FactorLaplace`'s prior precision: each value of a grid scored by
the validation negative log-likelihood of the predictive (``optimize_prior_precision("gridsearch", ...)``), or,
with ``temperature=True``, by that NLL after a temperature fitted on the same points (Guo, Pleiss, Sun &
Weinberger, "On calibration of modern neural networks", 2017).

The likelihood's part (how a validation batch is scored, which ``link_approx`` it reads) is looked up in
:data:`_VALIDATION_NLLS`.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from pyro_fa.laplace._loaders import n_examples, reiterable
from pyro_fa.predictive.glm import check_pred_type
from pyro_fa.predictive.registry import link_choice

__all__ = ["gridsearch_prior_precision"]

_DEFAULT_GRID = tuple(10.0 ** (k / 4) for k in range(-16, 17))  # 1e-4 ... 1e4


def gridsearch_prior_precision(la, val_loader, grid, pred_type, link_approx, n_samples, temperature=False):
    """``(the chosen prior precision, its temperature or None)``; the scores kept in ``grid_scores_`` (and
    ``grid_tempered_`` with ``temperature``)."""
    name = type(la).__name__
    if val_loader is None:
        raise ValueError(f"{name}: method='gridsearch' needs val_loader, got None.")
    val_loader = reiterable(name, val_loader, "val_loader")  # every grid value scored on all of it
    # link_approx as predict_proba reads it: only for a classifier's GLM ("nn" always samples)
    check_pred_type(name, pred_type, _VALIDATION_NLLS[la.likelihood].link(pred_type, link_approx))
    values = list(_DEFAULT_GRID if grid is None else grid)
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                         or not math.isfinite(v) for v in values):
        raise ValueError(f"{name}: grid must be a non-empty sequence of positive finite floats, got {grid!r}.")
    saved = la._buffers["prior_precision"]
    scores, tempered = [], []
    try:
        for v in values:  # a fresh tensor per value: the saved one is never written
            la._buffers["prior_precision"] = torch.full_like(saved, v)
            if temperature:
                raw, t_nll, t = _tempered_validation_nll(la, val_loader, pred_type, link_approx, n_samples)
                scores.append(raw)
                tempered.append((t_nll, t))
            else:
                scores.append(_validation_nll(la, val_loader, pred_type, link_approx, n_samples))
    finally:
        la._buffers["prior_precision"] = saved
    bad = [v for v, sc in zip(values, scores) if not math.isfinite(sc)]
    bad += [v for v, (sc, _) in zip(values, tempered) if not math.isfinite(sc) and v not in bad]
    if bad:
        raise ValueError(f"{name}: optimize_prior_precision('gridsearch'): the validation NLL is not finite at "
                         f"prior precision(s) {bad!r} of grid (val_loader holds non-finite inputs or targets, "
                         "or the predictive failed). The prior precision was left as it was.")
    la.grid_scores_ = (values, scores)
    if not temperature:
        return saved.new_full(saved.shape, values[int(torch.tensor(scores).argmin())]), None
    la.grid_tempered_ = (values, [sc for sc, _ in tempered], [t for _, t in tempered])
    k = min(range(len(values)), key=lambda i: tempered[i][0])  # the first of equal scores, as argmin
    return saved.new_full(saved.shape, values[k]), tempered[k][1]


def _tempered_validation_nll(la, loader, pred_type, link_approx, n_samples):
    """``(raw NLL, tempered NLL, temperature)`` per validation point of the classifier's predictive: the
    temperature of least NLL fitted to the log of its probabilities (float64, floored at 1e-300)."""
    from pyro_fa.predictive.temperature import fit_temperature

    logs, ys = [], []
    for batch in loader:
        x, y = la._batch(batch, "val_loader")
        p = la.predict_proba(x, pred_type=pred_type, link_approx=link_choice(pred_type, link_approx),
                             num_samples=n_samples)
        logs.append(p.detach().to(torch.float64).clamp_min(1e-300).log())
        ys.append(y.long().reshape(-1).to(p.device))
    if not logs:
        raise ValueError(f"{type(la).__name__}: val_loader must yield at least one batch, got none.")
    z, y = torch.cat(logs), torch.cat(ys)
    raw = float(-z.gather(-1, y[:, None]).mean())
    if not (math.isfinite(raw) and bool(torch.isfinite(z).all())):
        return math.nan, math.nan, math.nan
    t = fit_temperature(z, y)
    return raw, float(-(z / t).log_softmax(-1).gather(-1, y[:, None]).mean()), t


def _validation_nll(la, loader, pred_type, link_approx, n_samples) -> float:
    total, count = 0.0, 0
    for batch in loader:
        x, y = la._batch(batch, "val_loader")
        total += _VALIDATION_NLLS[la.likelihood].nll(la, x, y, pred_type, link_approx, n_samples)
        count += n_examples(x)
    if count == 0:
        raise ValueError(f"{type(la).__name__}: val_loader must yield at least one batch, got none.")
    return total / count


def _categorical_nll(la, x, y, pred_type, link_approx, n_samples) -> float:
    """The summed negative log class probability of the labels under the predictive."""
    p = la.predict_proba(x, pred_type=pred_type, link_approx=link_choice(pred_type, link_approx),
                         num_samples=n_samples)
    return float(-p.gather(-1, y.long().reshape(-1, 1)).clamp_min(1e-300).log().sum())


def _gaussian_nll(la, x, y, pred_type, link_approx, n_samples) -> float:
    """The summed negative log density of the targets under the predictive's Gaussian (mean, variance)."""
    mean, var = la.predict(x, pred_type=pred_type, num_samples=n_samples, return_var=True)
    y = y.to(mean.dtype).reshape(mean.shape)
    return float(0.5 * ((y - mean).pow(2) / var + var.log() + math.log(2 * math.pi)).sum())


class _ValidationNLL(NamedTuple):
    """A likelihood's validation score: the link approximation it reads, and its summed NLL of a batch."""
    link: Callable
    nll: Callable


#: likelihood -> how the grid search scores a validation batch (a regression's predictive takes no link_approx)
_VALIDATION_NLLS = {"classification": _ValidationNLL(link_choice, _categorical_nll),
                    "regression": _ValidationNLL(lambda pred_type, link_approx: None, _gaussian_nll)}
