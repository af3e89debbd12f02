r"""The predictives every posterior offers, by ``pred_type``: one registry, one builder per entry.

A predictive (:class:`~pyro_fa.predictive.SampledPredictive`) is built from a posterior by a *builder*
``builder(source, loader) -> SampledPredictive``, where ``source`` is the posterior seen through
:class:`PredictiveSource`, the few things every builder may read (draws, the network at a weight vector, the
linearisation point). A posterior hands its source to :func:`build_predictive`; it never lists the
``pred_type`` values itself, so a new one is one module that calls :func:`register_predictive` (as
:mod:`pyro_fa.predictive.sampled` does for ``"nn"`` and :mod:`pyro_fa.predictive.glm` for ``"glm"``) and is then
``predict(x, pred_type=...)``, ``tune_scale(..., pred_type=...)`` and ``predictive(pred_type)`` of
:class:`~pyro_fa.swag.SWAG`, :class:`~pyro_fa.swag.MultiSWAG` and :class:`~pyro_fa.laplace.FactorLaplace` alike.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["PredictiveSource", "Predictive", "PREDICTIVES", "DEFAULT_PRED_TYPE", "DEFAULT_LINK_APPROX",
           "register_predictive", "build_predictive", "link_choice"]


class PredictiveSource:
    """A posterior over a module's weights as predictive builders read it (the protocol object).

    Each posterior makes one (``SWAG``'s in :mod:`pyro_fa.swag._prediction`, ``FactorLaplace``'s in
    :mod:`pyro_fa.laplace._predictive`) by overriding these methods; a builder uses only them.

    Attributes
    ----------
    module : nn.Module or None
        The network (None for a posterior over parameters only).
    loc : Tensor of shape (D,)
        The mean, as the predictive's ``loc`` (a sharded posterior: this rank's rows).
    """

    module: Optional[nn.Module] = None
    loc: Optional[Tensor] = None

    def draws(self, num_samples: int, generator: Optional[torch.Generator] = None):
        """``num_samples`` weight vectors at the posterior's scale, shape (S, D)."""
        raise NotImplementedError

    def deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        """Unscaled draws minus the mean, shape (S, D) (what :func:`~pyro_fa.predictive.tune_scale` rescales)."""
        raise NotImplementedError

    def network(self, theta: Tensor, loader=None) -> ContextManager[Callable]:
        """A context yielding the network at the weight vector ``theta`` (``loader``: batch-norm refreshed)."""
        raise NotImplementedError

    def linearization(self, what: str) -> Tuple[nn.Module, Tensor, Sequence[Tensor]]:
        """``(module, the whole mean (D,), the parameters it flattens)``: the point the network is linearised at;
        ``what`` names the caller in an error (a posterior over parameters only has none)."""
        raise NotImplementedError

    def refreshed(self, theta: Tensor, loader=None) -> ContextManager:
        """A context with the batch-norm statistics of ``theta`` refreshed from ``loader`` (nothing without one)."""
        raise NotImplementedError

    def whole(self, theta: Tensor) -> Tensor:
        """A draw as the whole weight vector (D,) (a sharded posterior gathers its ranks' rows)."""
        return theta

    def wrap(self, net: Callable) -> Callable:
        """The callable a builder yields for ``net``: ``net`` itself, or one converting its inputs first."""
        return net


class Predictive(NamedTuple):
    """A registered ``pred_type``: its builder and the link approximations its predictions take."""
    build: Callable[[PredictiveSource, object], object]
    link_approxes: Tuple[str, ...]
    default_link_approx: str


#: the predictive every posterior gives by default (``predictive()``, ``predict(x)``): sampled networks
DEFAULT_PRED_TYPE = "nn"
#: pred_type -> :class:`Predictive` (in the order registered: ``"nn"``, ``"glm"``)
PREDICTIVES: Dict[str, Predictive] = {}
#: ``link_approx=None`` means, per ``pred_type``, this (``"mc"`` for ``"nn"``, ``"probit"`` for ``"glm"``)
DEFAULT_LINK_APPROX: Dict[str, str] = {}


def register_predictive(pred_type: str, build: Callable, *, link_approxes: Sequence[str] = ("mc",),
                        default_link_approx: Optional[str] = None) -> Callable:
    """Register ``build(source, loader) -> SampledPredictive`` as the predictive of ``pred_type``.

    Parameters
    ----------
    pred_type : str
    build : callable
        Reads the posterior through :class:`PredictiveSource` only.
    link_approxes : sequence of str, default ("mc",)
        The ``link_approx`` values its predictions take (``"probit"``: Gaussian outputs in closed form).
    default_link_approx : str, optional
        ``link_approx=None`` means this; default the first of ``link_approxes``.

    Returns
    -------
    callable
        ``build``, so that this may decorate it.

    Raises
    ------
    ValueError
        ``pred_type`` already registered, or ``default_link_approx`` not one of ``link_approxes``.
    """
    if pred_type in PREDICTIVES:
        raise ValueError(f"register_predictive: pred_type must be a new name, got {pred_type!r}, already registered.")
    link_approxes = tuple(link_approxes)
    default = link_approxes[0] if default_link_approx is None else default_link_approx
    if default not in link_approxes:
        raise ValueError(f"register_predictive: default_link_approx must be one of {link_approxes}, got {default!r}.")
    PREDICTIVES[pred_type] = Predictive(build, link_approxes, default)
    DEFAULT_LINK_APPROX[pred_type] = default
    return build


def build_predictive(pred_type: str, source: PredictiveSource, loader=None):
    """The ``pred_type`` predictive of the posterior ``source`` (``pred_type`` checked by the caller)."""
    return PREDICTIVES[pred_type].build(source, loader)


def link_choice(pred_type: str, link_approx: Optional[str]) -> Optional[str]:
    """``link_approx`` where ``pred_type``'s predictions offer a choice of it, else None (its only one, e.g. the
    sampled networks' ``"mc"``); an unknown ``pred_type`` keeps it (the caller refuses the ``pred_type``)."""
    entry = PREDICTIVES.get(pred_type) if isinstance(pred_type, str) else None
    return link_approx if entry is None or len(entry.link_approxes) > 1 else None
