"""Checking a ``state_dict`` whole before any of it is loaded.

``torch.nn.Module.load_state_dict`` copies every entry that fits as it goes and
raises at the end: a state of the wrong rank leaves the mean, the variances and
the count overwritten and the factor not, a mixture that later updates build on.
The modules that accumulate a fit check everything first and load nothing when
something does not fit.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict

import torch
from torch import nn

_EXTRA = "_extra_state"


def check_state_dict(module: nn.Module, state_dict: Any, strict: bool = True) -> None:
    """Raise ``ValueError`` / ``TypeError`` if ``state_dict`` cannot be loaded whole into ``module``.

    Checks the keys (when ``strict``), each tensor's shape against the module's own and
    its values (finite), each submodule's extra state (through its ``_check_extra_state``
    method where it has one) and the optimizer states that the module saves under keys
    ending in ``_optimizer_state`` (through ``_check_optimizer_state``).
    """
    cls = type(module).__name__
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{cls}: state_dict must be a mapping from names to tensors, got {type(state_dict).__name__}.")
    own: Dict[str, Any] = module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"{cls}: state_dict must hold the entries of this model's state, got missing keys {missing!r} and "
                f"unexpected keys {unexpected!r}. It comes from another configuration (method, rank, warm-up "
                "averaging); nothing was loaded."
            )
    modules = dict(module.named_modules())
    # extra states first: they name what the state came from (parameter shapes, counts)
    for key, value in sorted(state_dict.items(), key=lambda kv: not kv[0].endswith(_EXTRA)):
        if key not in own:
            continue
        mine = own[key]
        if key.endswith(_EXTRA):
            owner = modules.get(key[: -len(_EXTRA)].rstrip("."))
            check = getattr(owner, "_check_extra_state", None)
            if check is not None:
                check(value)
        elif key.endswith("_optimizer_state"):
            owner = modules.get(key[: -len("_optimizer_state")].rstrip("."))
            check = getattr(owner, "_check_optimizer_state", None)
            if check is not None:
                check(value)
        elif torch.is_tensor(mine):
            if not torch.is_tensor(value):
                raise TypeError(f"{cls}: state_dict[{key!r}] must be a tensor, got {type(value).__name__}; "
                                "nothing was loaded.")
            if value.shape != mine.shape:
                raise ValueError(
                    f"{cls}: state_dict[{key!r}] must have shape {tuple(mine.shape)!r} like this model's, got "
                    f"{tuple(value.shape)!r} (another dim or rank?); nothing was loaded."
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{cls}: state_dict[{key!r}] must be finite, got NaN or inf; nothing was loaded.")


def check_optimizer_state(cls: str, optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Check a saved optimizer state against ``optimizer``'s parameters (groups, sizes, moment shapes)."""
    if not isinstance(state, Mapping) or "param_groups" not in state or "state" not in state:
        raise ValueError(f"{cls}: the saved optimizer state must be an optimizer's state_dict(), got {state!r:.80}; "
                         "nothing was loaded.")
    groups = optimizer.param_groups
    saved = state["param_groups"]
    if len(saved) != len(groups) or any(len(g["params"]) != len(s.get("params", ())) for g, s in zip(groups, saved)):
        raise ValueError(f"{cls}: the saved optimizer state must have this optimizer's parameter groups, got "
                         f"{[len(s.get('params', ())) for s in saved]!r} parameters per group against "
                         f"{[len(g['params']) for g in groups]!r}; nothing was loaded.")
    params = {}
    for g, s in zip(groups, saved):
        params.update(zip(s["params"], g["params"]))
    for pid, entry in state["state"].items():
        p = params.get(pid)
        if p is None or not isinstance(entry, Mapping):
            raise ValueError(f"{cls}: the saved optimizer state must refer to this optimizer's parameters, got "
                             f"an entry for parameter {pid!r}; nothing was loaded.")
        for name, v in entry.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                raise ValueError(f"{cls}: the saved optimizer state's {name!r} must have shape {tuple(p.shape)!r}, "
                                 f"got {tuple(v.shape)!r}; nothing was loaded.")
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise ValueError(f"{cls}: the saved optimizer state's {name!r} must be finite, got NaN or inf; "
                                 "nothing was loaded.")


def check_count(cls: str, state: Mapping, key: str, default=None) -> None:
    """An extra-state count must be a non-negative integer."""
    v = state.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{cls}: the saved state's {key!r} must be a non-negative integer, got {v!r}; "
                         "nothing was loaded.")
