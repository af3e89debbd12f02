r"""Predictives: what a posterior over a module's weights predicts, shared by every posterior.

* :class:`Posterior` — the prediction protocol, written once: ``predictive``, ``predict``, ``predict_proba``,
  ``predict_log_proba``, ``predictive_samples``, ``log_likelihood``, ``tune_scale`` with one signature on
  ``SWAG``, ``MultiSWAG`` and ``FactorLaplace``;
* :class:`SampledPredictive` — draws → networks → outputs, model averages
  (:meth:`~SampledPredictive.average`, :meth:`~SampledPredictive.log_average_proba`) and
  :func:`log_mean_exp`; ``SWAG`` / ``MultiSWAG`` and :class:`~pyro_fa.nn.BayesianNetwork`
  predict through it;
* :func:`tune_scale`, :func:`select_scale`, :func:`bma_log_likelihood`, :class:`ScaleSearch`,
  :class:`ScaleSelectionWarning` — the posterior's scale chosen on validation data by a rule
  that never does worse there than the mean (scale 0), for any posterior with a ``scale`` and a
  ``predictive()`` (or ``members`` that have them);
* :func:`fit_temperature`, :class:`TemperatureScaling` — post-hoc temperature on any classifier's
  logits or model average's log class probabilities, fitted on validation data (Guo et al. 2017);
* :func:`linearized_moments`, :func:`probit_proba`, :func:`linearized_network` — the linearised
  (GLM) predictive: the outputs' mean and covariance :math:`f(x; c),\ J_x \Sigma J_x^\top` without a
  D × D matrix, the probit approximation, the linearised network at a draw (``pred_type="glm"``);
* :func:`register_predictive`, :class:`PredictiveSource`, :data:`PREDICTIVES` — the one registry of predictives by
  ``pred_type`` (``"nn"``, ``"glm"``): a builder per entry, reading any posterior through its
  :class:`PredictiveSource`, so that a new ``pred_type`` is one module;
* :data:`Likelihood`, :func:`normalize_likelihood` — the one likelihood vocabulary (``"classification"``,
  ``"regression"``; aliases ``"categorical"``, ``"gaussian"``); :func:`point_log_likelihood` — the per-point
  log-likelihoods by name or callable.

This layer needs only torch: the posteriors (``pyro_fa.swag``, ``pyro_fa.nn``) import it,
never the other way round.
"""
from pyro_fa.predictive.glm import (DEFAULT_LINK_APPROX, LINK_APPROXES, PRED_TYPES, check_pred_type,
                                    linearized_moments, linearized_network, probit_proba, resolve_link_approx)
from pyro_fa.predictive.likelihood import (LIKELIHOOD_ALIASES, LIKELIHOODS, Likelihood, check_targets,
                                           normalize_likelihood, point_log_likelihood)
from pyro_fa.predictive.posterior import Posterior, class_log_proba, mixture_moments
from pyro_fa.predictive.registry import (DEFAULT_PRED_TYPE, PREDICTIVES, PredictiveSource, build_predictive,
                                         register_predictive)
from pyro_fa.predictive.sampled import SampledPredictive, log_mean_exp
from pyro_fa.predictive.scale import (DEFAULT_SCALES, ScaleSearch, ScaleSelectionWarning, bma_log_likelihood,
                                     select_scale, tune_scale)
from pyro_fa.predictive.temperature import TemperatureScaling, fit_temperature

__all__ = ["Posterior", "class_log_proba", "mixture_moments", "Likelihood", "LIKELIHOOD_ALIASES",
           "normalize_likelihood", "resolve_link_approx", "DEFAULT_LINK_APPROX", "SampledPredictive", "log_mean_exp", "tune_scale", "select_scale", "bma_log_likelihood", "ScaleSearch",
           "ScaleSelectionWarning", "DEFAULT_SCALES", "fit_temperature", "TemperatureScaling", "point_log_likelihood",
           "check_targets", "LIKELIHOODS", "linearized_moments", "linearized_network", "probit_proba", "check_pred_type", "PRED_TYPES", "LINK_APPROXES",
           "PREDICTIVES", "PredictiveSource", "register_predictive", "build_predictive", "DEFAULT_PRED_TYPE"]
