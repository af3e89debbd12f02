r"""The ``"fa"`` family: :class:`~pyro_fa.AutoLowRankFactorGuide` (VIFA), :math:`q = N(c, S(GG^\top + I)S)`.

Parameters ``loc`` (R, D), ``factor`` G (R, D, K) and ``log_scale`` (R, D), initialised as
the guide initialises them: orthogonal G with columns of norm :math:`\sqrt{D/K}`,
:math:`s = \mathrm{init\_scale}/\sqrt 2`. Trained by default with the FactorELBO.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import Tensor

from pyro_fa.fa.linalg import orthogonal_init
from pyro_fa.nn.batched.families.registry import register_family
from pyro_fa.nn.batched.families.whitened import WhitenedLowRankFamily

__all__ = ["FactorFamily"]


@register_family("fa")
class FactorFamily(WhitenedLowRankFamily):
    """:class:`~pyro_fa.AutoLowRankFactorGuide` with ``noise="diagonal"`` (Brownlie 2021, §4.3)."""

    default_estimator = "factor"
    #: columns of ``log_scale``: D (one scale per weight) here, 1 for PPCA
    isotropic = False

    def init(self, vi, loc, init_scale, generator) -> Dict[str, Tensor]:
        # AutoLowRankFactorGuide: orthogonal G with columns of norm sqrt(D / K); s = init_scale / sqrt(2)
        R, D = loc.shape
        K = vi.rank
        factor = torch.stack([
            orthogonal_init(D, K, scale=math.sqrt(D / K), dtype=loc.dtype, device=loc.device, generator=generator)
            for _ in range(R)])
        width = 1 if self.isotropic else D
        return {"factor": factor, "log_scale": loc.new_full((R, width), math.log(init_scale / math.sqrt(2)))}

    def whitened(self, vi, p):
        return p["loc"], p["factor"], p["log_scale"].exp()
