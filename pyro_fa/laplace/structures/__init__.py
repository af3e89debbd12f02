r"""Curvature structures of :class:`~pyro_fa.laplace.FactorLaplace` (:mod:`pyro_fa.laplace.structures.base`):
``"dense"`` (:class:`DenseLowRank`, one rank) and ``"blocks"`` (:class:`Blocks`, a rank per layer), and
:func:`register_structure` for a new one."""
from pyro_fa.laplace.structures.base import STRUCTURES, Structure, get_structure, register_structure
from pyro_fa.laplace.structures.dense import DenseLowRank
from pyro_fa.laplace.structures.blocks import Blocks

__all__ = ["Structure", "DenseLowRank", "Blocks", "STRUCTURES", "register_structure", "get_structure"]
