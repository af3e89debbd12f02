"""Checkpoints of a :class:`~pyro_fa.SWAG`: its extra state, and a saved state checked whole before any is loaded."""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from pyro_fa._state import check_count
from pyro_fa.distributed.sharding import raise_agreed

__all__ = ["SWAGState"]


class SWAGState:
    """The checkpoints of a :class:`~pyro_fa.SWAG` (a mixin over its state and its fit's)."""

    def get_extra_state(self):
        state = {"n_steps": self._n_steps, "n": self._n, "n_window": self._n_window, "n_refused": self._n_refused,
                 "scale": self._scale, "shapes": [tuple(s) for s in self._shapes] if self._shapes is not None else None}
        if self._sharding is not None:
            state["shard"] = self._sharding.descriptor()
        return state

    def _check_extra_state(self, state) -> None:
        cls = type(self).__name__
        if not isinstance(state, dict) or not {"n_steps", "n", "n_window", "shapes"} <= set(state):
            raise ValueError(f"{cls}: the saved state's extra state must be a dict with 'n_steps', 'n', 'n_window' "
                             f"and 'shapes', got {state!r:.200}; nothing was loaded.")
        for key in ("n_steps", "n", "n_window", "n_refused"):
            check_count(cls, state, key, 0)
        shapes = [torch.Size(s) for s in state["shapes"]] if state["shapes"] is not None else None
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(
                f"{cls}: state_dict must come from parameters of shapes "
                f"{[tuple(s) for s in self._shapes]!r}, got {state['shapes']!r}; nothing was loaded."
            )
        scale = state.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"{cls}: the saved state's 'scale' must be a finite number >= 0, got {scale!r}; "
                             "nothing was loaded.")
        if state["n_window"] >= self.window:
            raise ValueError(f"{cls}: the saved state's 'n_window' must be < window={self.window}, got "
                             f"{state['n_window']!r}; nothing was loaded.")
        self._check_shard_state(state)

    def set_extra_state(self, state):
        self._check_extra_state(state)
        self._n_steps, self._n, self._n_window = int(state["n_steps"]), int(state["n"]), int(state["n_window"])
        self._n_refused = int(state.get("n_refused", 0))
        self._scale = float(state.get("scale", 1.0))

    def _check_state(self, state_dict, strict: bool, prefix: str = ""):
        """Check a whole saved state (keys relative to this module, its fit's included) before any is written.

        Collective when sharded (every rank must call it). Returns the sharded running total of
        squared deviations (else None) and the submodules to mark as checked, ``[(module, mark)]``,
        once the whole load is.
        """
        if self.dim is None:  # param-store source not yet resolved: resolve now to build the buffers
            self._named()
        total = self._check_loadable(state_dict, strict)  # keys, shapes, finiteness, extra and optimizer states
        raise_agreed(self._sharding, type(self).__name__, lambda: self._check_state_values(state_dict, prefix))
        return total, self._fit.load_marks(self, total)

    def _check_state_values(self, state_dict, prefix: str) -> None:
        self._fit.check_state_values(self, state_dict, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # runs for a direct load_state_dict and for a parent module's (MultiSWAG, a user's model) alike: the
        # whole state of this posterior, its fit's included, is checked before any of it is written
        checked = self.__dict__.pop("_load_checked", None)
        hint = self.__dict__.get("_load_strict")
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        total = None
        if checked is not None:  # checked whole by a parent (MultiSWAG) with its other members
            total = checked[0]
        elif mine or hint is not None:
            try:
                total, marks = self._check_state(mine, True if hint is None else hint, prefix)
            except (TypeError, ValueError) as exc:
                if not prefix:
                    raise
                raise type(exc)(f"{exc} (the entries under {prefix!r})") from exc
            for module, mark in marks:
                module.__dict__["_load_checked"] = mark
        else:  # a parent's non-strict load without our entries: nothing to load
            self._fit.skip_load(self)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._loaded_total(total)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict`, checked whole first: on error nothing is loaded.

        The same checks run when a parent module (:class:`~pyro_fa.MultiSWAG`, a model
        holding this posterior) loads its state.

        Raises
        ------
        ValueError, TypeError
            If an entry is missing or unexpected (``strict``), has another shape
            (other parameters, ``rank`` or ``window``), holds NaN / inf, a noise
            variance :math:`\\psi \\le 0` or a capacitance that is not positive definite,
            or the extra or optimizer state does not fit; the posterior is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{type(self).__name__}: state_dict must be a mapping from names to tensors, got "
                            f"{type(state_dict).__name__}.")
        self.__dict__.pop("_load_checked", None)  # a mark left by a parent's load that stopped midway
        self.__dict__["_load_strict"] = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_load_strict", None)
