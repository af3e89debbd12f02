"""Metrics for predictive distributions and for covariance approximations.

Regression (Gaussian predictive), classification (probabilities or predictive samples:
accuracy, NLL, Brier, ECE, entropy, mutual information, OOD AUROC), fidelity to a reference
predictive (agreement, total variation, Wasserstein distances, the deep ensemble equivalent)
and distances between covariances, each validated and tested against an independent implementation.
"""
from pyro_fa.metrics.classification import *  # noqa: F401,F403
from pyro_fa.metrics.classification import __all__ as _classification_all
from pyro_fa.metrics.fidelity import *  # noqa: F401,F403
from pyro_fa.metrics.fidelity import __all__ as _fidelity_all
from pyro_fa.metrics.regression import *  # noqa: F401,F403
from pyro_fa.metrics.regression import __all__ as _regression_all

__all__ = list(_regression_all) + [n for n in _classification_all if n not in _regression_all] + list(_fidelity_all)
