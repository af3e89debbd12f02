"""Bayesian neural networks with factor-analysis posteriors, for plain torch users.

* :class:`BayesianNetwork` — a torch module + prior + likelihood + guide, trained with
  :class:`~pyro_fa.FactorELBO` in Pyro SVI, with ``predict`` / ``predict_proba`` / ``evaluate``;
  :meth:`BayesianNetwork.fit_many` trains several copies of an MLP regression in one batch.
* :mod:`pyro_fa.nn.batched` — many independent fits of one MLP regression as one batch of
  tensors: :class:`BatchedMLP`, :class:`BatchedVI`, :func:`fit_batched`,
  :func:`replica_log_likelihood`, :func:`replica_metrics`.
"""
from pyro_fa.nn.batched import BatchedMLP, BatchedVI, fit_batched, replica_log_likelihood, replica_metrics
from pyro_fa.nn.network import BayesianNetwork

__all__ = ["BayesianNetwork", "BatchedMLP", "BatchedVI", "fit_batched", "replica_log_likelihood", "replica_metrics"]
