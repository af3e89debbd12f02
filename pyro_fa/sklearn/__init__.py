"""scikit-learn estimators backed by pyro_fa's torch implementations.

>>> from pyro_fa.sklearn import FactorAnalysis   # drop-in for sklearn.decomposition.FactorAnalysis
"""
from pyro_fa.sklearn._factor_analysis import FactorAnalysis

__all__ = ["FactorAnalysis"]
