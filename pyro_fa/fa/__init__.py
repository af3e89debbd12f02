"""The core every posterior of the library shares (variational, from optimizer iterates): the factor-analysis model N(c, FFᵀ + Ψ) and how it is fitted.

* :mod:`pyro_fa.fa.linalg` — Woodbury / matrix-determinant-lemma algebra of FFᵀ + Ψ in O(DK²);
* :class:`OnlineFactorAnalysis` — one vector at a time: online EM or online SGA, O(DK) memory;
* :mod:`pyro_fa.fa.fitters` — the fitting methods behind one protocol, registered by name
  (:func:`~pyro_fa.fa.fitters.register_fitter`), each owning a typed state: :mod:`~pyro_fa.fa.fitters.em`,
  :mod:`~pyro_fa.fa.fitters.sga`, :mod:`~pyro_fa.fa.fitters.sketch`;
* :class:`BatchFactorAnalysis`, :class:`ScatterStatistics` — batch EM / SVD-based fitting from
  streamed scatter statistics;
* :class:`RunningMoments` — exact running mean and variance in float64 for any state dtype.
"""
from pyro_fa.fa import linalg
from pyro_fa.fa.batch import BatchFactorAnalysis, ScatterStatistics
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.fa.online import OnlineFactorAnalysis
from pyro_fa.fa import fitters  # noqa: F401  its modules' fitters register themselves

__all__ = ["linalg", "BatchFactorAnalysis", "ScatterStatistics", "OnlineFactorAnalysis", "RunningMoments"]
