r"""The ``"normal"`` family: Pyro's ``AutoNormal``, :math:`q = N(c, \mathrm{diag}(s^2))`.

Parameters ``loc`` (R, D) and ``scale_u`` (R, D), the inverse softplus of :math:`s`,
initialised at ``init_scale``.
"""
from __future__ import annotations

from typing import Dict

import torch.nn.functional as F_
from torch import Tensor
from torch.distributions import Independent, Normal

from pyro_fa.nn.batched.families.base import GuideFamily, _inv_softplus
from pyro_fa.nn.batched.families.registry import register_family

__all__ = ["NormalFamily"]


@register_family("normal")
class NormalFamily(GuideFamily):
    """Pyro's ``AutoNormal``, trained by default with ``Trace_ELBO``."""

    def init(self, vi, loc, init_scale, generator) -> Dict[str, Tensor]:
        # AutoNormal: scale = init_scale (softplus)
        return {"scale_u": _inv_softplus(loc.new_full(loc.shape, init_scale))}

    def distribution(self, vi, p):
        return Independent(Normal(p["loc"], F_.softplus(p["scale_u"]), validate_args=False), 1, validate_args=False)
