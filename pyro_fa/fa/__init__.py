"""Fitting factor-analysis models: online (EM, SGA) and batch EM."""
from pyro_fa.fa.batch import BatchFactorAnalysis, ScatterStatistics
from pyro_fa.fa.online import OnlineFactorAnalysis

__all__ = ["BatchFactorAnalysis", "ScatterStatistics", "OnlineFactorAnalysis"]
