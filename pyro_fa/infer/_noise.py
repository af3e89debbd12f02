r"""The noise models of :class:`~pyro_fa.infer.AutoLowRankFactorGuide`: what :math:`\Psi` is and how it is stored.

``NOISE_MODELS`` maps the guide's ``noise`` option to a class; the guide holds one instance
(``guide.noise_model``) and asks it for its ``scale`` parameter, its stored shape and how a
per-coordinate noise variance (e.g. :meth:`Pathfinder.init_guide <pyro_fa.infer.Pathfinder.init_guide>`'s)
becomes that parameter. A new noise model is a class with these four methods and an entry here.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from pyro.nn import PyroParam
from torch import Tensor

__all__ = ["DiagonalNoise", "IsotropicNoise", "NOISE_MODELS"]


class DiagonalNoise:
    r"""Factor analysis (VIFA, Brownlie 2021, §4.3): :math:`\Psi = \mathrm{diag}(s)^2`, one learned scale per coordinate."""

    name = "diagonal"

    def __init__(self, noise_scale: Optional[float] = None):
        self.noise_scale = noise_scale  # the guide refuses a fixed scale for this model

    def stored_shape(self, dim: int) -> Optional[Tuple[int, ...]]:
        """Shape of the ``scale`` parameter kept in Pyro's param store (``None``: not stored)."""
        return (dim,)

    def install(self, guide, like: Tensor, s0: float) -> None:
        """Create ``guide.scale`` at :math:`s_0` on ``like``'s dtype and device."""
        guide.scale = PyroParam(like.new_full(like.shape, s0), constraint=guide.scale_constraint)

    def scale_from_variances(self, psi: Tensor) -> Tensor:
        r""":math:`s` of shape (D,) whose square matches the noise variances ``psi`` (D,)."""
        return psi.sqrt()

    def assign(self, guide, s: Tensor) -> None:
        """Write :meth:`scale_from_variances`'s ``s`` (D,) into ``guide.scale``."""
        guide.scale = s


class IsotropicNoise(DiagonalNoise):
    r"""Probabilistic PCA (VIPPCA, Jiang 2023, §2): :math:`\Psi = s^2 I`, one scale, learned or fixed (``noise_scale``)."""

    name = "isotropic"

    def stored_shape(self, dim: int) -> Optional[Tuple[int, ...]]:
        return () if self.noise_scale is None else None  # a fixed scale is a buffer, never stored

    def install(self, guide, like: Tensor, s0: float) -> None:
        if self.noise_scale is None:
            guide.scale = PyroParam(like.new_tensor(s0), constraint=guide.scale_constraint)
        else:
            guide.register_buffer("scale", like.new_tensor(self.noise_scale))

    def scale_from_variances(self, psi: Tensor) -> Tensor:
        return psi.mean().sqrt().expand(psi.shape[0])

    def assign(self, guide, s: Tensor) -> None:
        if self.noise_scale is None:
            guide.scale = s[0]


#: ``noise`` option -> noise model class.
NOISE_MODELS: Dict[str, type] = {"diagonal": DiagonalNoise, "isotropic": IsotropicNoise}
