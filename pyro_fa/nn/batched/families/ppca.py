r"""The ``"ppca"`` family: :class:`~pyro_fa.AutoLowRankFactorGuide` with ``noise="isotropic"`` (VIPPCA).

As ``"fa"`` with one ``log_scale`` per replica, :math:`\Psi = \sigma^2 I`; ``guide_noise_scale``
fixes :math:`\sigma` of some replicas (NaN where it is learned), as the guide's ``noise_scale``
does: those replicas' ``log_scale`` gets no gradient.
"""
from __future__ import annotations

import torch

from pyro_fa.nn.batched.families.fa import FactorFamily
from pyro_fa.nn.batched.families.registry import register_family

__all__ = ["PPCAFamily"]


@register_family("ppca")
class PPCAFamily(FactorFamily):
    """:class:`~pyro_fa.AutoLowRankFactorGuide` with ``noise="isotropic"`` (Jiang 2023, §2–3)."""

    isotropic = True
    options = ("guide_noise_scale",)

    def whitened(self, vi, p):
        s = p["log_scale"].exp()
        fixed = vi._guide_scale  # (R, 1), NaN where learned, or None
        return p["loc"], p["factor"], (s if fixed is None else torch.where(fixed.isnan(), s, fixed))
