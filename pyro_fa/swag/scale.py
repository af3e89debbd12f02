"""The scale search of :mod:`pyro_fa.predictive.scale`, under the name the iterate layer's users know.

:func:`tune_scale` takes any posterior with a ``scale`` and a ``predictive()``; it lives in
:mod:`pyro_fa.predictive` with the other predictives.
"""
from pyro_fa.predictive.scale import DEFAULT_SCALES, ScaleSearch, bma_log_likelihood, tune_scale

__all__ = ["ScaleSearch", "tune_scale", "bma_log_likelihood", "DEFAULT_SCALES"]
