"""Posteriors from optimizer iterates: a factor-analysis posterior fitted to an ordinary optimizer's steps.

* :class:`SWAG` — collects θ_t from a torch or Pyro optimizer and fits N(c, FFᵀ + Ψ) online
  (EM or SGA, O(DK) memory) or as classic SWAG (Maddox et al., "A Simple Baseline for Bayesian
  Uncertainty in Deep Learning", 2019);
* :class:`MultiSWAG` — an equally weighted mixture of independently trained SWAG posteriors
  (Wilson & Izmailov, "Bayesian Deep Learning and a Probabilistic Perspective of Generalization",
  2020);
* :class:`IterateCollector` — when a SWAG collects (its schedule) and what it refuses (the divergence
  guard); subclass it for another schedule;
* :class:`FactorPosteriorGuide` — either of them as a guide for ``pyro.infer.Predictive``;
* :func:`tune_scale` — the posterior's scale chosen by validation log-likelihood (from
  :mod:`pyro_fa.predictive`, where prediction lives for every posterior).
"""
from pyro_fa.predictive import DEFAULT_SCALES, ScaleSearch, bma_log_likelihood, tune_scale
from pyro_fa.swag._collect import IterateCollector
from pyro_fa.swag.guide import FactorPosteriorGuide
from pyro_fa.swag.multiswag import MultiSWAG
from pyro_fa.swag.swag import SWAG

__all__ = ["SWAG", "MultiSWAG", "IterateCollector", "FactorPosteriorGuide", "tune_scale", "bma_log_likelihood",
           "ScaleSearch", "DEFAULT_SCALES"]
