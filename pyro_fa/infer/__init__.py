"""Variational inference with factor-analysis posteriors inside Pyro SVI.

* :class:`AutoLowRankFactorGuide` — what :math:`q` is: N(c, FFᵀ + Ψ) (VIFA) or
  N(c, FFᵀ + σ²I) (VIPPCA) over all latent sites of a model;
* :class:`FactorELBO` — how it is trained: a ``pyro.infer.ELBO`` with the
  entropy and Gaussian / Laplace prior terms in closed form.
"""
from pyro_fa.infer.elbo import FactorELBO
from pyro_fa.infer.guide import AutoLowRankFactorGuide
from pyro_fa.infer.multiswag import MultiSWAG
from pyro_fa.infer.swag import SWAG

__all__ = ["AutoLowRankFactorGuide", "FactorELBO", "SWAG", "MultiSWAG"]
