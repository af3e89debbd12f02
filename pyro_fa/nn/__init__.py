"""Bayesian neural networks with factor-analysis posteriors, for plain torch users.

* :class:`BayesianNetwork` — a torch module + prior + likelihood + guide, trained with
  :class:`~pyro_fa.FactorELBO` in Pyro SVI, with ``predict`` / ``predict_proba`` / ``evaluate``.
"""
from pyro_fa.nn.network import BayesianNetwork

__all__ = ["BayesianNetwork"]
