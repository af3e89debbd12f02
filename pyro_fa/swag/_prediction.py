r"""SWAG's predictive: sampled networks or the linearised (GLM) network.

What :class:`~pyro_fa.predictive.Posterior` asks of a posterior (its predictive, the linearised outputs'
moments), built from a :class:`~pyro_fa.swag.SWAG` through ``loc``, ``cov_factor``, ``cov_diag``, ``scale``,
``sample`` and the followed weights; SWAG's methods call these functions. ``predict``, ``predict_proba``,
``predict_log_proba``, ``predictive_samples``, ``log_likelihood`` and ``tune_scale`` are the protocol's, shared
with every posterior. The predictive of each ``pred_type`` is the one registry's
(:mod:`pyro_fa.predictive.registry`), built from the SWAG seen as a :class:`SWAGSource`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.predictive.glm import linearized_moments as _linearized_moments
from pyro_fa.predictive.registry import PredictiveSource

__all__ = ["PREDICTIVES", "SWAGSource", "linearized_moments", "linearized_marginals"]


class SWAGSource(PredictiveSource):
    """A :class:`~pyro_fa.swag.SWAG` as the predictive builders read it (:mod:`pyro_fa.predictive.registry`)."""

    def __init__(self, swag):
        self.swag, self.module, self.loc = swag, swag._source.module, swag.loc

    def draws(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return self.swag.sample(num_samples, generator=generator)

    def deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        self.swag._check_ready("tune_scale()")
        return self.swag._deviations(num_samples, generator)

    @contextlib.contextmanager
    def network(self, theta, loader=None):
        with self.swag.sampled_weights(theta, loader=loader):
            yield self.module

    def linearization(self, what: str):
        module, params = _glm_params(self.swag, what)
        return module, self.swag._rows.full_theta(self.swag.loc, self.swag.dim), params  # sharded: the whole mean

    def refreshed(self, theta, loader=None):
        """The module's batch-norm statistics at ``theta`` from ``loader`` (nothing to do without one)."""
        return contextlib.nullcontext() if loader is None else self.swag.sampled_weights(theta, loader=loader)


def _glm_params(swag, what: str):
    """The module and its collected parameters, for linearising (a posterior built from an nn.Module)."""
    module = swag._source.module
    if module is None:
        raise RuntimeError(f"{type(swag).__name__}: {what} needs a SWAG built from an nn.Module (the network "
                           "is linearised in its weights), got parameters only. Use pred_type='nn'.")
    return module, [p for _, p in swag._named()]


def linearized_moments(swag, args, chunk_size: Optional[int] = None, diagonal: bool = False) -> Tuple[Tensor, Tensor]:
    """:meth:`SWAG.linearized_moments <pyro_fa.swag.SWAG.linearized_moments>`."""
    swag._check_ready("linearized_moments()")
    module, params = _glm_params(swag, "linearized_moments()")
    swag._rows.require_whole(type(swag).__name__, "linearized_moments()")
    return _linearized_moments(module, swag.loc, args, cov_diag=swag.cov_diag, cov_factor=swag.cov_factor,
                               scale=swag.scale, chunk_size=chunk_size, params=params, diagonal=diagonal)


def linearized_marginals(swag, inputs, chunk_size):
    """The linearised outputs' means and variances (one Gaussian), in the module output's shape."""
    mean, var = linearized_moments(swag, inputs, chunk_size=chunk_size, diagonal=True)
    return [_glm_mean_variance(swag._source.module, inputs, mean, var, None)]


def _glm_mean_variance(module, args, mean: Tensor, var: Tensor, noise_std):
    """The GLM's (mean, marginal variance) in the module's output shape, the noise variance (checked) added if given."""
    if noise_std is not None:
        noise = torch.as_tensor(noise_std, dtype=var.dtype, device=var.device)
        var = var + (noise.unsqueeze(-1) if noise.dim() == 1 else noise).square()  # (N,) noise: one per example
    with torch.no_grad():  # the module's own output shape: (N,) or (N, C)
        squeeze = module(*(x[:1] for x in args)).dim() == 1
    return (mean.squeeze(-1), var.squeeze(-1)) if squeeze else (mean, var)
