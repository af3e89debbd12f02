"""Variational inference with factor-analysis posteriors inside Pyro SVI.

* :class:`AutoLowRankFactorGuide` — what :math:`q` is: N(c, FFᵀ + Ψ) (VIFA) or
  N(c, FFᵀ + σ²I) (VIPPCA) over all latent sites of a model;
* :class:`FactorELBO` — how it is trained: a ``pyro.infer.ELBO`` with the
  entropy and Gaussian / Laplace prior terms in closed form (:class:`JitFactorELBO`:
  the same, compiled by the PyTorch JIT);
* :class:`GaussianPrior`, :class:`LaplacePrior` — the factorised priors whose expected
  log-density under :math:`q` :class:`FactorELBO` knows in closed form; a new one subclasses
  :class:`FactorisedPrior` and plugs in with :func:`register_prior` and
  :func:`register_expected_log_prob` (:mod:`pyro_fa.infer.priors`);
* :class:`Pathfinder` — Gaussians along the L-BFGS path chosen by the ELBO (Zhang et al. 2022), a fast
  factor-analysis posterior on its own or the starting point of the guide (:meth:`Pathfinder.init_guide`);
* :class:`LowRankAffine` — the map from N(0, I) onto :math:`q` that the guide's
  ``get_transform`` returns, for Pyro's ``NeuTraReparam``.
"""
from pyro_fa.infer._jit_elbo import JitFactorELBO
from pyro_fa.infer.batch_match import BatchAndMatch
from pyro_fa.infer.elbo import FactorELBO
from pyro_fa.infer.guide import AutoLowRankFactorGuide
from pyro_fa.infer.pathfinder import Pathfinder
from pyro_fa.infer.priors import (
    FactorisedPrior,
    GaussianPrior,
    LaplacePrior,
    register_expected_log_prob,
    register_prior,
)
from pyro_fa.infer.transforms import LowRankAffine

__all__ = [
    "AutoLowRankFactorGuide",
    "Pathfinder",
    "BatchAndMatch",
    "FactorELBO",
    "JitFactorELBO",
    "FactorisedPrior",
    "GaussianPrior",
    "LaplacePrior",
    "register_prior",
    "register_expected_log_prob",
    "LowRankAffine",
]
