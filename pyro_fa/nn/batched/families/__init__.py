r"""Guide families of :class:`~pyro_fa.nn.BatchedVI`, one module each, registered by name.

* :class:`GuideFamily` — the public base class a new family subclasses (its parameters'
  initialisation and its distribution; the draws and the ELBO follow);
* :class:`WhitenedLowRankFamily` — the base of the low-rank families,
  :math:`q = N(c, S(GG^\top + I)S)`, with their O(DK²) ELBO;
* :func:`register_family` — names a family for ``BatchedVI(family="name")``
  (:data:`FAMILIES`, :func:`get_family`), as ``register_kl`` plugs in a KL pair.

The built-in families: ``"fa"`` (:mod:`.fa`), ``"ppca"`` (:mod:`.ppca`), ``"lowrank"``
(:mod:`.lowrank`), ``"normal"`` (:mod:`.normal`), ``"delta"`` (:mod:`.delta`).
"""
from pyro_fa.nn.batched.families.base import GuideFamily
from pyro_fa.nn.batched.families.registry import FAMILIES, get_family, register_family
from pyro_fa.nn.batched.families.whitened import WhitenedLowRankFamily
from pyro_fa.nn.batched.families.fa import FactorFamily  # noqa: E402  (registration order is FAMILIES' order)
from pyro_fa.nn.batched.families.ppca import PPCAFamily
from pyro_fa.nn.batched.families.lowrank import LowRankFamily
from pyro_fa.nn.batched.families.normal import NormalFamily
from pyro_fa.nn.batched.families.delta import DeltaFamily

__all__ = [
    "GuideFamily",
    "WhitenedLowRankFamily",
    "register_family",
    "get_family",
    "FAMILIES",
    "FactorFamily",
    "PPCAFamily",
    "LowRankFamily",
    "NormalFamily",
    "DeltaFamily",
]
