r"""The fitted state of :class:`~pyro_fa.laplace.FactorLaplace`: its buffers' layout, their replacement in new
storage and their checked loading, and the tuned settings held in buffers (``temperature``, ``scale``).

Plain functions of the approximation ``la`` (:func:`load_state_dict` is its method, bound by
:func:`~pyro_fa.laplace._prior.method`). The factor's buffers are its curvature structure's
(:mod:`pyro_fa.laplace.structures`: ``cov_factor`` for ``"dense"``; ``block_factor_0``, ... and ``block_ranks``
for ``"blocks"``), which refuses the state of another layout naming both and gives its buffers the shapes a
state holds (``rank="auto"``).
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa._state import check_state_dict
from pyro_fa._validation import check_scale
from pyro_fa.laplace._prior import show

__all__ = ["replace", "layout_tensor", "load_state_dict", "temperature", "scale"]

_LAYOUT = "parameter_layout"
_SCALE = "predictive_scale"


def replace(la, **values: Tensor) -> None:
    """Rebind buffers to ``values`` (new tensors, never written in place): tensors handed out earlier
    (``state_dict()``, attributes, a posterior) keep their values."""
    for key, value in values.items():
        old = la._buffers[key]
        la._buffers[key] = value.detach().to(dtype=old.dtype, device=old.device).reshape(old.shape)


# ------------------------------------------------------------------ what the state came from


def _parameter_layout(la) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(name, shape)`` of each parameter tensor the approximation is over, in the order of :attr:`loc`."""
    return [(n, tuple(p.shape)) for n, p in la._named]


def layout_tensor(la, device) -> Tensor:
    """The buffer ``parameter_layout``, int64 of shape (L, 2 + the largest ndim): per parameter tensor the
    CRC-32 of its name, its ndim and its shape (padded with zeros)."""
    layout = _parameter_layout(la)
    width = max(1, max(len(shape) for _, shape in layout))
    rows = [[zlib.crc32(n.encode()), len(shape), *shape] + [0] * (width - len(shape)) for n, shape in layout]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _check_parameter_layout(la, saved) -> None:
    """Refuse a saved ``parameter_layout`` of other parameters (another network or subset with as many weights)."""
    name = type(la).__name__
    mine = _parameter_layout(la)
    if not torch.is_tensor(saved) or saved.dim() != 2 or saved.shape[1] < 2 or saved.dtype != torch.int64:
        raise ValueError(f"{name}: state_dict['parameter_layout'] must be an int64 Tensor of shape (L, 2 + ndim), "
                         f"got {saved!r:.120}; nothing was loaded.")
    theirs = []
    for row in saved.tolist():
        ndim = row[1]
        if not 0 <= ndim <= len(row) - 2:
            raise ValueError(f"{name}: state_dict['parameter_layout'] holds a row {row!r} with ndim out of range; "
                             "nothing was loaded.")
        theirs.append((row[0], tuple(row[2:2 + ndim])))
    ours = [(zlib.crc32(n.encode()), shape) for n, shape in mine]
    if theirs == ours:
        return
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    here = f"{mine[i][0]!r} of shape {mine[i][1]!r}" if i < len(mine) else "none"
    there = ("none" if i >= len(theirs) else f"shape {theirs[i][1]!r}"
             + ("" if i >= len(ours) or theirs[i][0] == ours[i][0] else " and another name"))
    raise ValueError(f"{name}: state_dict must come from parameters named and shaped as this one's ({len(mine)} "
                     f"tensors; at position {i}: {here}), got {there} ({len(theirs)} tensors): the state of "
                     "another network or subset; nothing was loaded.")


def load_state_dict(la, state_dict, strict: bool = True, assign: bool = False):
    """Load a saved fit, checked whole first (keys, shapes, finite values, a positive prior precision and noise,
    a non-negative diagonal and count, the factor's layout and the blocks' ranks): nothing loaded when it
    does not fit.

    The buffers get new storage (with ``assign=False``, the default): a ``state_dict()`` or posterior taken
    earlier keeps its values. Likewise :meth:`fit` and :meth:`optimize_prior_precision` never write into a
    tensor handed out, so ``torch.save(la.state_dict(), ...)`` of a fitted approximation stays that fit.

    Raises
    ------
    ValueError
        A state of another network or subset (the parameters' names and shapes, saved in ``parameter_layout``,
        differ; a state saved without it is loaded unchecked on this point), a state of the other layout (a rank per block for an int rank or the other way round), other
        ``block_ranks``, missing or unexpected keys, shapes, non-finite or out-of-range values.

    Notes
    -----
    A state saved before :attr:`scale` was (without ``predictive_scale``) loads as it did then: the scale is left
    as it is.
    """
    name = type(la).__name__
    if isinstance(state_dict, Mapping):
        la._structure.check_layout(name, state_dict, la.rank)
        if _LAYOUT in state_dict:
            _check_parameter_layout(la, state_dict[_LAYOUT])
        else:  # saved before the parameters' names and shapes were: not checkable on this point
            state_dict = {**state_dict, _LAYOUT: la._buffers[_LAYOUT]}
        if _SCALE not in state_dict:  # saved before the scale was: it stays as it is
            state_dict = {**state_dict, _SCALE: la._buffers[_SCALE]}
    kept = dict(la._buffers)
    try:  # the block factors take the shapes of the state's ranks ("auto"), back as they were when refused
        if isinstance(state_dict, Mapping):
            la._structure.prepare_load(name, la._buffers, state_dict)
        _check_state(la, state_dict, strict)
    except BaseException:
        la._buffers.update(kept)
        raise
    # new storage for every buffer: tensors handed out earlier (a previous state_dict()) are not overwritten
    for key, buf in list(la._buffers.items()):
        if buf is not None and key in state_dict:
            la._buffers[key] = torch.empty_like(buf)
    return torch.nn.Module.load_state_dict(la, state_dict, strict=strict, assign=assign)


def _check_state(la, state_dict, strict: bool) -> None:
    """What :meth:`load_state_dict` checks besides the layout: keys, shapes, values, the shard."""
    check_state_dict(la, state_dict, strict)
    name = type(la).__name__
    if la._sharding is not None and "shard" in state_dict:
        saved, mine = [int(v) for v in state_dict["shard"]], [int(v) for v in la.shard]
        if saved != mine:
            raise ValueError(f"{name}: state_dict must come from rank {mine[2]} of world size {mine[1]} holding "
                             f"rows [{mine[3]}, {mine[4]}) of D={mine[0]}, like this one, got rank {saved[2]} "
                             f"of {saved[1]} holding [{saved[3]}, {saved[4]}) of D={saved[0]}; nothing was "
                             "loaded. Save and load each rank's own state_dict.")
    for key, what in (("prior_precision", "positive"), ("sigma_noise", "positive"), ("cov_diag", "non-negative"),
                      ("n_data", "non-negative"), ("fitted_temperature", "non-negative"),
                      (_SCALE, "non-negative")):
        v = state_dict.get(key)
        if torch.is_tensor(v) and v.numel() and not bool((v > 0).all() if what == "positive" else (v >= 0).all()):
            raise ValueError(f"{name}: state_dict[{key!r}] must be {what}, got {show(v)}; nothing was loaded.")


def _get_temperature(la) -> Optional[float]:
    t = float(la.fitted_temperature)
    return None if t == 0.0 else t


def _set_temperature(la, value: Optional[float]) -> None:
    replace(la, fitted_temperature=torch.tensor(0.0 if value is None else float(value), dtype=torch.float64))


#: the approximation's ``temperature``
temperature = property(_get_temperature, _set_temperature, doc="""The temperature of the last prior-precision choice
(``optimize_prior_precision``), None without one; saved in ``state_dict`` as ``fitted_temperature`` (0 for None).""")


def _get_scale(la) -> float:
    return float(la.predictive_scale)


def _set_scale(la, value: float) -> None:
    replace(la, predictive_scale=torch.tensor(check_scale(type(la).__name__, value), dtype=torch.float64))


#: the approximation's ``scale``
scale = property(_get_scale, _set_scale, doc=r"""The predictive's covariance scale :math:`s`: predictions use
:math:`N(\theta_*, s\,P^{-1})`.

Default 1 (the Laplace approximation itself); :meth:`tune_scale` chooses it on validation data, 0 being the MAP
network; :meth:`get_posterior` and :meth:`sample` use it too. Saved in ``state_dict`` as ``predictive_scale``, in
the approximation's dtype (a value set is rounded to it, so that a reloaded approximation predicts as this one).""")
