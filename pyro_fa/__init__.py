"""pyro_fa: factor-analysis (low-rank plus diagonal) Gaussian posteriors for Bayesian deep learning.

q(theta) = N(c, F F^T + Psi) (or its precision form), got three ways on one core:

* :mod:`pyro_fa.distributions` — the one family of posteriors over the flattened weights (torch only);
* :mod:`pyro_fa.fa` — the core: the FA model's linear algebra, online (EM, SGA) and batch fitting;
* :mod:`pyro_fa.infer` — variational inference in Pyro SVI: :class:`AutoLowRankFactorGuide`,
  :class:`FactorELBO` (:class:`JitFactorELBO` compiled), :class:`GaussianPrior`, :class:`LaplacePrior`
  (:class:`FactorisedPrior` to add one);
* :mod:`pyro_fa.swag` — posteriors from optimizer iterates: :class:`SWAG`, :class:`MultiSWAG`;
* :mod:`pyro_fa.laplace` — post-hoc Laplace approximations with a factor-analysis curvature:
  :class:`FactorLaplace` (a torch network), :class:`PyroFactorLaplace` (a Pyro model at its MAP);
* :mod:`pyro_fa.optim` — a posterior learned while training: :class:`~pyro_fa.optim.FactorIVON` (IVON with a
  low-rank-plus-diagonal precision);
* :mod:`pyro_fa.predictive` — the prediction protocol every posterior shares (:class:`~pyro_fa.predictive.Posterior`:
  ``predict``, ``predict_proba``, ``tune_scale``, ...), temperature scaling, the GLM predictive;
* adapters: :mod:`pyro_fa.nn` (Bayesian torch networks), :mod:`pyro_fa.sklearn` (estimators);
* :mod:`pyro_fa.metrics`, :mod:`pyro_fa.datasets`; the ``pyro-fa`` command (:mod:`pyro_fa.experiments`).
"""
from pyro_fa import datasets, distributed, distributions, fa, infer, laplace, metrics, optim, predictive, swag
from pyro_fa.fa import BatchFactorAnalysis, OnlineFactorAnalysis
from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO, FactorisedPrior, GaussianPrior, LaplacePrior
from pyro_fa.infer import JitFactorELBO
from pyro_fa.laplace import FactorLaplace, PyroFactorLaplace
from pyro_fa.swag import MultiSWAG, SWAG

__version__ = "0.1.0"

__all__ = [
    "distributions",
    "fa",
    "infer",
    "swag",
    "laplace",
    "optim",
    "predictive",
    "datasets",
    "metrics",
    "OnlineFactorAnalysis",
    "BatchFactorAnalysis",
    "AutoLowRankFactorGuide",
    "FactorELBO",
    "JitFactorELBO",
    "SWAG",
    "MultiSWAG",
    "FactorLaplace",
    "PyroFactorLaplace",
    "FactorisedPrior",
    "GaussianPrior",
    "LaplacePrior",
    "__version__",
]
