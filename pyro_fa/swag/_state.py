"""Checkpoints of a :class:`~pyro_fa.SWAG`: its extra state composed from its parts', and a saved state checked
whole before any is loaded.

The extra state is SWAG's own counts (``n``, ``scale``, ``shapes``), its collector's
(:meth:`~pyro_fa.swag.IterateCollector.state_dict`: ``n_steps``, ``n_window``, ``n_refused``) and, sharded, the
shard's descriptor; the fit's tensors are SWAG's buffers (or its ``fa`` submodule's).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from pyro_fa._state import check_count

__all__ = ["extra_state", "check_extra_state", "load_extra_state", "check_state", "load_from_state_dict",
           "load_state_dict"]


def extra_state(swag) -> dict:
    counts = swag.collector.state_dict()
    return swag._rows.describe({
        "n_steps": counts["n_steps"], "n": swag._n, "n_window": counts["n_window"], "n_refused": counts["n_refused"],
        "scale": swag._scale, "shapes": [tuple(s) for s in swag._shapes] if swag._shapes is not None else None})


def check_extra_state(swag, state) -> None:
    cls = type(swag).__name__
    if not isinstance(state, dict) or not {"n_steps", "n", "n_window", "shapes"} <= set(state):
        raise ValueError(f"{cls}: the saved state's extra state must be a dict with 'n_steps', 'n', 'n_window' "
                         f"and 'shapes', got {state!r:.200}; nothing was loaded.")
    check_count(cls, state, "n", 0)
    swag.collector.check_state(cls, state)
    shapes = [torch.Size(s) for s in state["shapes"]] if state["shapes"] is not None else None
    if swag._shapes is not None and shapes != swag._shapes:
        raise ValueError(
            f"{cls}: state_dict must come from parameters of shapes "
            f"{[tuple(s) for s in swag._shapes]!r}, got {state['shapes']!r}; nothing was loaded."
        )
    scale = state.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"{cls}: the saved state's 'scale' must be a finite number >= 0, got {scale!r}; "
                         "nothing was loaded.")
    swag._rows.check_shard_state(cls, state)


def load_extra_state(swag, state) -> None:
    check_extra_state(swag, state)
    swag.collector.load_state_dict(state)
    swag._n = int(state["n"])
    swag._scale = float(state.get("scale", 1.0))


def check_state(swag, state_dict, strict: bool, prefix: str = ""):
    """Check a whole saved state (keys relative to ``swag``, its fit's included) before any is written.

    Collective when sharded (every rank must call it). Returns the sharded running total of
    squared deviations (else None) and the submodules to mark as checked, ``[(module, mark)]``,
    once the whole load is.
    """
    if swag.dim is None:  # param-store source not yet resolved: resolve now to build the buffers
        swag._named()
    # keys, shapes, finiteness, extra and optimizer states, then the fit's values
    total = swag._rows.check_state(swag, state_dict, strict,
                                   lambda: swag._fit.check_state_values(swag, state_dict, prefix))
    return total, swag._fit.load_marks(swag, total)


def load_from_state_dict(swag, state_dict, prefix) -> "tuple | None":
    """Before torch loads ``swag``'s entries (a direct load or a parent's): the whole state is checked first.

    Returns ``(total,)`` to apply once loaded, or None when nothing is to be loaded."""
    checked = swag.__dict__.pop("_load_checked", None)
    hint = swag.__dict__.get("_load_strict")
    mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if checked is not None:  # checked whole by a parent (MultiSWAG) with its other members
        return checked[0]
    if mine or hint is not None:
        try:
            total, marks = check_state(swag, mine, True if hint is None else hint, prefix)
        except (TypeError, ValueError) as exc:
            if not prefix:
                raise
            raise type(exc)(f"{exc} (the entries under {prefix!r})") from exc
        for module, mark in marks:
            module.__dict__["_load_checked"] = mark
        return total
    swag._fit.skip_load(swag)  # a parent's non-strict load without our entries: nothing to load
    return None


def load_state_dict(swag, load, state_dict, strict: bool, assign: bool):
    """``swag.load_state_dict``: ``load`` (``nn.Module``'s) with the whole state checked first."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{type(swag).__name__}: state_dict must be a mapping from names to tensors, got "
                        f"{type(state_dict).__name__}.")
    swag.__dict__.pop("_load_checked", None)  # a mark left by a parent's load that stopped midway
    swag.__dict__["_load_strict"] = bool(strict)
    try:
        return load(state_dict, strict=strict, assign=assign)
    finally:
        swag.__dict__.pop("_load_strict", None)
