r"""The ``"lowrank"`` family: Pyro's ``AutoLowRankMultivariateNormal``.

Parameters ``loc`` (R, D), ``cov_factor`` (R, D, K) and ``scale_u`` (R, D), the inverse
softplus of the scale, initialised as Pyro does: ``cov_factor`` :math:`\sim N(0, 1/K)`,
scale :math:`\sqrt{0.5}\,\mathrm{init\_scale}`. With ``cov_factor`` as G and the softplus
scale as s it is :math:`N(c, S(GG^\top + I)S)`.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F_
from torch import Tensor

from pyro_fa.nn.batched.families.base import _inv_softplus
from pyro_fa.nn.batched.families.registry import register_family
from pyro_fa.nn.batched.families.whitened import WhitenedLowRankFamily

__all__ = ["LowRankFamily"]


@register_family("lowrank")
class LowRankFamily(WhitenedLowRankFamily):
    """Pyro's ``AutoLowRankMultivariateNormal``, trained by default with ``Trace_ELBO``."""

    def init(self, vi, loc, init_scale, generator) -> Dict[str, Tensor]:
        # AutoLowRankMultivariateNormal: cov_factor ~ N(0, 1/K), scale = sqrt(0.5) init_scale (softplus)
        R, D = loc.shape
        K = vi.rank
        return {"cov_factor": torch.randn(R, D, K, generator=generator, dtype=loc.dtype).to(loc.device) / math.sqrt(K),
                "scale_u": _inv_softplus(loc.new_full((R, D), math.sqrt(0.5) * init_scale))}

    def whitened(self, vi, p):
        return p["loc"], p["cov_factor"], F_.softplus(p["scale_u"])
