"""How an :class:`~pyro_fa.OnlineFactorAnalysis` holds its fitter's state, and its reusable work memory.

The fitter's :class:`~pyro_fa.fa.fitters.FitState` keeps its tensors as the model's buffers (parameters),
under the keys the state names, so that ``.to()``, ``state_dict()`` and the checkpoint keys are the model's:
:func:`bind_state` registers them, :func:`current_state` re-reads those that ``.to()`` or a load replaced.
:class:`Workspace` holds the length-D and (rows, K) work arrays that an update reuses.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor, nn

from pyro_fa.fa.fitters import FitState

__all__ = ["bind_state", "current_state", "Workspace"]


def current_state(module: nn.Module) -> FitState:
    """The state ``module`` holds, its tensor fields pointed at the module's current buffers (parameters)."""
    state = module.__dict__["_fit_state"]
    params, buffers = module._parameters, module._buffers
    for field, key in state.tensor_fields().items():  # buffers that .to() or a load replaced
        t = params.get(key) if key in params else buffers.get(key)
        if getattr(state, field) is not t:
            setattr(state, field, t)
    return state


def bind_state(module: nn.Module, state: FitState) -> None:
    """Make ``module`` hold ``state``: its tensor fields become the module's buffers (parameters) under their keys."""
    for field, key in state.tensor_fields().items():
        t = getattr(state, field)
        if field in state.parameters:
            if module._parameters.get(key) is not t:
                module.register_parameter(key, t)
        elif t is None:
            module._buffers.pop(key, None)
        elif key in module._buffers:
            module._buffers[key] = t
        else:
            module.register_buffer(key, t)
    module.__dict__["_fit_state"] = state


class Workspace:
    """Work arrays an update reuses: length-``rows`` vectors by name, and two (rows, K) blocks.

    Allocating them per update costs page faults at :math:`D = 10^6` (8 MB a vector); each is
    reallocated only when the dtype or device asked for changes (after ``.to()``).
    """

    def __init__(self, rows: int, rank: int):
        self.rows = rows
        self.rank = rank
        self._vectors: Dict[str, Tensor] = {}
        self._blocks = None

    def vector(self, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A persistent length-``rows`` work vector called ``name``."""
        buf = self._vectors.get(name)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = self._vectors[name] = torch.empty(self.rows, dtype=dtype, device=device)
        return buf

    def block_rows(self, element_size: int) -> int:
        """Rows per block of a pass over a (rows, K) array: about 1 MB, so that a few blocks stay in cache."""
        return max(1, min(self.rows, (1 << 20) // (self.rank * element_size)))

    def blocks(self, rows: int, like: Tensor) -> Tensor:
        """Two (rows, K) blocks of ``like``'s dtype and device (EM's M-step products and statistic rows; SGA's
        gradient rows and a temporary)."""
        w = self._blocks
        if w is None or w.shape[1] < rows or w.dtype != like.dtype or w.device != like.device:
            w = self._blocks = like.new_empty(2, rows, self.rank)
        return w
