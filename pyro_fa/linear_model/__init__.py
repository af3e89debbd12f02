"""Bayesian linear and generalised linear models on (random) bases, after revrand.

- :class:`StandardLinearModel`: Bayesian linear regression with the exact
  Gaussian posterior and evidence-maximised hyperparameters.
- :class:`GeneralizedLinearModel`: Gaussian, Bernoulli, Poisson (or custom)
  likelihoods, fitted by SVI with a factor-analysis posterior
  (:class:`~pyro_fa.AutoLowRankFactorGuide` + :class:`~pyro_fa.FactorELBO`).
- :mod:`~pyro_fa.linear_model.likelihoods`: the GLM's likelihoods, one :class:`Likelihood` class per name,
  added with :func:`register_likelihood`.
- :class:`SLMRegressor`, :class:`GLMRegressor`, :class:`GLMClassifier`:
  scikit-learn estimators on random Fourier features (plus a linear basis).

References
----------
Steinberg, Tiao, McCalman, Reid & O'Callaghan (2016), *revrand: technical
report*, CSIRO Data61.
"""
from pyro_fa.linear_model.glm import GeneralizedLinearModel
from pyro_fa.linear_model.likelihoods import Likelihood, register_likelihood
from pyro_fa.linear_model.slm import DegenerateEvidenceWarning, StandardLinearModel
from pyro_fa.linear_model._sklearn import GLMClassifier, GLMRegressor, SLMRegressor

__all__ = [
    "StandardLinearModel",
    "GeneralizedLinearModel",
    "SLMRegressor",
    "GLMRegressor",
    "GLMClassifier",
    "DegenerateEvidenceWarning",
    "Likelihood",
    "register_likelihood",
]
