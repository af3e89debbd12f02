r"""The ``"delta"`` family: Pyro's ``AutoDelta``, a point mass at ``loc`` (MAP).

No parameter besides ``loc`` (R, D); the loss is minus the log joint at the point
(estimator ``"map"``, whatever is asked), and prediction uses that one point.
"""
from __future__ import annotations

from pyro_fa.nn.batched.families.base import GuideFamily
from pyro_fa.nn.batched.families.registry import register_family

__all__ = ["DeltaFamily"]


@register_family("delta")
class DeltaFamily(GuideFamily):
    """Pyro's ``AutoDelta``: maximum a posteriori."""

    estimators = ("map",)
    default_estimator = "map"

    def init(self, vi, loc, init_scale, generator):
        return {}

    def distribution(self, vi, p):
        return None
