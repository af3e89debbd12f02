"""pyro_fa: factor-analysis (low-rank plus diagonal) Gaussian posteriors for Bayesian deep learning.

q(theta) = N(c, F F^T + Psi), fitted either by variational inference inside Pyro SVI or
online (EM or stochastic gradient ascent) from optimizer iterates.
"""
from pyro_fa import linalg
from pyro_fa.fa import BatchFactorAnalysis, OnlineFactorAnalysis
from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.infer import MultiSWAG, SWAG
from pyro_fa.priors import GaussianPrior, LaplacePrior
from pyro_fa import datasets, metrics

__version__ = "0.1.0"

__all__ = [
    "linalg",
    "datasets",
    "metrics",
    "OnlineFactorAnalysis",
    "BatchFactorAnalysis",
    "AutoLowRankFactorGuide",
    "FactorELBO",
    "SWAG",
    "MultiSWAG",
    "GaussianPrior",
    "LaplacePrior",
    "__version__",
]
