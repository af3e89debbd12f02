r""":class:`~pyro_fa.laplace.FactorLaplace` as the predictive builders read it, and its likelihood-specific
predictions.

:class:`LaplaceSource` is the approximation seen through :class:`~pyro_fa.predictive.registry.PredictiveSource`:
draws at :attr:`~pyro_fa.laplace.FactorLaplace.scale`, the network at a weight vector by
``torch.func.functional_call`` (no weights written into the model), and the MAP :math:`\theta_*` as the point
the GLM linearises at; every registered ``pred_type`` is built from it
(:func:`~pyro_fa.predictive.registry.build_predictive`). :data:`FORWARD` and :data:`NOISE_STD` are the
likelihood's part of ``la(x)`` and of the predictive's default observation noise.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from pyro_fa.predictive.registry import PredictiveSource

__all__ = ["LaplaceSource", "FORWARD", "NOISE_STD"]


class LaplaceSource(PredictiveSource):
    """A fitted :class:`~pyro_fa.laplace.FactorLaplace` as the predictive builders read it."""

    def __init__(self, la):
        self.la, self.module, self.loc = la, la.model, la.loc

    def draws(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return self.la._draws(num_samples, generator)

    def deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return self.la._deviations(num_samples, generator)

    def network(self, theta: Tensor, loader=None):
        """The network at ``theta`` (sharded: gathered from the ranks' rows); ``loader`` is refused earlier."""
        la, whole = self.la, self.la._whole(theta)
        return contextlib.nullcontext(lambda *x: la._f(whole, la._inputs(x)))

    def linearization(self, what: str):
        return self.la.model, self.la._whole(self.la.loc), self.la._params

    def refreshed(self, theta: Tensor, loader=None):
        return contextlib.nullcontext()  # the model is in eval mode: its batch-norm statistics are fixed

    def whole(self, theta: Tensor) -> Tensor:
        return self.la._whole(theta)

    def wrap(self, net: Callable) -> Callable:
        la = self.la
        return lambda *x: net(*la._inputs(x))


#: likelihood -> laplace-torch's ``la(x, **kw)``: class probabilities, or (mean, variance) with the noise added
FORWARD: Dict[str, Callable] = {
    "classification": lambda la, x, kw: la.predict_proba(x, **kw),
    "regression": lambda la, x, kw: la.predict(x, return_var=True, **kw),
}
#: likelihood -> the observation noise the predictive adds when none is given (a classifier's: none)
NOISE_STD: Dict[str, Callable] = {
    "classification": lambda la: None,
    "regression": lambda la: la.sigma_noise,
}
