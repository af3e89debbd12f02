r"""The predictive of a posterior over a module's weights, by sampled networks.

Draws :math:`\theta_s \sim q` are turned into networks (the module with the draw's
weights) and their outputs are averaged (Bayesian model averaging):

.. math::

    p(y \mid x, \mathcal D) \approx \frac1S \sum_{s=1}^S p(y \mid x, \theta_s),
    \qquad \log \frac1S \sum_{s=1}^S e^{\ell_s} = \mathrm{logsumexp}_s\,\ell_s - \log S .

:class:`SampledPredictive` is what every posterior hands out for prediction
(``SWAG.predictive()``, :class:`~pyro_fa.nn.BayesianNetwork`, the Laplace posterior
to come); :func:`~pyro_fa.predictive.tune_scale` reads it for the scale search.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.predictive.registry import register_predictive

__all__ = ["SampledPredictive", "log_mean_exp"]


def log_mean_exp(values: Tensor, dim: int = 0) -> Tensor:
    r""":math:`\log \frac1S \sum_s e^{v_s}` along ``dim``, as ``logsumexp - log S`` (finite where the mean underflows).

    Parameters
    ----------
    values : Tensor of shape (S, ...)
        Log-densities (or log-probabilities) under S draws, along ``dim``.
    dim : int, default 0

    Returns
    -------
    Tensor
        ``values`` reduced over ``dim``.

    Examples
    --------
    >>> log_mean_exp(torch.tensor([0.0, 0.0])).item()
    0.0
    """
    return torch.logsumexp(values, dim) - math.log(values.shape[dim])


class SampledPredictive:
    r"""Predict by running a module under weight draws from a posterior.

    A posterior supplies two callables: how to draw weights, and how to turn a
    draw into a network; this class runs the networks and averages them. Posteriors
    that are Gaussian over a flattened weight vector also give ``loc`` and
    unscaled ``deviations``, so that :func:`~pyro_fa.predictive.tune_scale` can try
    scales :math:`s` on common draws :math:`\theta = c + \sqrt{s}\,\delta`.

    Parameters
    ----------
    sample : callable
        ``sample(num_samples, generator) -> sequence of draws`` (e.g. a Tensor of
        shape (S, D), or a list of dicts of Pyro sites).
    network : callable
        ``network(draw) -> context manager`` yielding a callable, the network with
        the draw's weights (e.g. the module with the draw loaded into its
        parameters, restored on exit), or the network linearised at the mean and
        evaluated at the draw (:func:`~pyro_fa.predictive.linearized_network`, a
        posterior's ``predictive(pred_type="glm")``).
    module : nn.Module or callable, optional
        The network whose weights the posterior describes; ``None`` when the
        posterior has no module to run (parameters of a Pyro model only).
    loc : Tensor of shape (D,), optional
        The posterior mean :math:`c` of the flattened weights.
    deviations : callable, optional
        ``deviations(num_samples, generator) -> Tensor of shape (S, D)``: unscaled
        draws :math:`\delta \sim N(0, FF^\top + \Psi)`.

    Examples
    --------
    A point mass at the module's own weights, as a predictive:

    >>> net = torch.nn.Linear(2, 1)
    >>> point = SampledPredictive(lambda S, g: [None] * S, lambda draw: contextlib.nullcontext(net), module=net)
    >>> x = torch.randn(4, 2)
    >>> torch.equal(point.average(point.sample(3), x), net(x).detach())
    True
    """

    def __init__(self, sample: Callable[[int, Optional[torch.Generator]], Sequence[Any]],
                 network: Callable[[Any], ContextManager[Callable]], *, module=None, loc: Optional[Tensor] = None,
                 deviations: Optional[Callable[[int, Optional[torch.Generator]], Tensor]] = None):
        for name, value in (("sample", sample), ("network", network)):
            if not callable(value):
                raise TypeError(f"SampledPredictive: {name} must be callable, got {type(value).__name__}.")
        if (loc is None) != (deviations is None):
            raise ValueError("SampledPredictive: loc and deviations must be given together (the scale search "
                             f"needs both), got loc={'None' if loc is None else 'a Tensor'} and deviations="
                             f"{'None' if deviations is None else 'a callable'}.")
        self.sample = sample
        self.network = network
        self.module = module
        self.loc = loc
        self.deviations = deviations

    @torch.no_grad()
    def outputs(self, draws: Sequence[Any], *args, fn: Optional[Callable[[Tensor], Tensor]] = None,
                **kwargs) -> Tensor:
        """The network's outputs under each draw, stacked: shape (S, ...).

        Parameters
        ----------
        draws : sequence
            From :attr:`sample` (S draws).
        *args, **kwargs
            The network's inputs.
        fn : callable, optional
            Applied to each output (e.g. ``lambda z: z.softmax(-1)``); default the identity.
        """
        outs = []
        for draw in draws:
            with self.network(draw) as net:
                out = net(*args, **kwargs)
                outs.append(fn(out) if fn is not None else out)
        return torch.stack(outs)

    @torch.no_grad()
    def average(self, draws: Sequence[Any], *args, fn: Optional[Callable[[Tensor], Tensor]] = None,
                **kwargs) -> Tensor:
        r"""The model average :math:`\frac1S \sum_s fn(f_{\theta_s}(x))`, one output in memory at a time.

        Parameters as for :meth:`outputs`; the outputs are summed in draw order.
        """
        total = None
        for draw in draws:
            with self.network(draw) as net:
                out = net(*args, **kwargs)
                out = fn(out) if fn is not None else out
            total = out.clone() if total is None else total.add_(out)
        if total is None:
            raise ValueError("SampledPredictive: draws must hold at least one draw, got none.")
        return total / len(draws)

    @torch.no_grad()
    def log_average_proba(self, draws: Sequence[Any], *args, **kwargs) -> Tensor:
        r"""Log class probabilities of the model average for a network returning logits (..., C).

        :math:`\mathrm{logsumexp}_s\,\mathrm{log\_softmax}(z_s) - \log S` (see :func:`log_mean_exp`): a class
        that every draw gives a probability below the dtype's smallest number keeps a finite value.
        """
        return log_mean_exp(self.outputs(draws, *args, fn=lambda z: z.log_softmax(-1), **kwargs))


def _sampled_networks(source, loader) -> SampledPredictive:
    """``pred_type="nn"``: the network at each draw (with ``loader``, its batch-norm statistics refreshed)."""
    return SampledPredictive(source.draws, lambda theta: source.network(theta, loader), module=source.module,
                             loc=source.loc, deviations=source.deviations)


register_predictive("nn", _sampled_networks)
