r"""The computational helpers of :class:`~pyro_fa.linear_model.GeneralizedLinearModel` (private): the linear
predictor over vectorised particles, the block size of chunked prediction and the SVI row batches."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_CHUNK_ELEMENTS = 2 ** 22  # rows x columns of one block of features or of samples x rows at prediction


def _linear_predictor(Phi: Tensor, w: Tensor) -> Tensor:
    r""":math:`f = \Phi w` for ``w`` of shape (D,) or (..., 1, D) (vectorised particles): shape (M,) or (..., M)."""
    if w.dim() == 1:
        return Phi @ w
    # the latent sits outside the data plate, so its batch shape ends in a 1 at the plate's dim
    return (w @ Phi.T).squeeze(-2)


class _Batches:
    """Row indices for SVI: epochs of a random permutation cut into batches (None: the full data)."""

    def __init__(self, n: int, batch_size: Optional[int], device):
        self.n, self.batch_size, self.device = n, batch_size, device
        self._perm: Optional[Tensor] = None
        self._pos = n

    def next(self) -> Optional[Tensor]:
        if self.batch_size is None:
            return None
        if self._pos + self.batch_size > self.n:
            self._perm = torch.randperm(self.n, device=self.device)
            self._pos = 0
        idx = self._perm[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx
