r"""SWAG's predictive: sampled networks or the linearised (GLM) network.

What :class:`~pyro_fa.predictive.Posterior` asks of a posterior (its predictive, the linearised outputs'
moments), built from a :class:`~pyro_fa.swag.SWAG` through ``loc``, ``cov_factor``, ``cov_diag``, ``scale``,
``sample`` and the followed weights; SWAG's methods call these functions. ``predict``, ``predict_proba``,
``predict_log_proba``, ``predictive_samples``, ``log_likelihood`` and ``tune_scale`` are the protocol's, shared
with every posterior. The predictive of each ``pred_type`` is looked up in :data:`PREDICTIVES`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.predictive.glm import linearized_moments as _linearized_moments, linearized_network
from pyro_fa.predictive.sampled import SampledPredictive

__all__ = ["PREDICTIVES", "linearized_moments", "linearized_marginals"]


def _draws(swag):
    def draws(num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return swag.sample(num_samples, generator=generator)
    return draws


def _deviations(swag):
    def deviations(num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        swag._check_ready("tune_scale()")
        return swag._deviations(num_samples, generator)
    return deviations


def _nn_predictive(swag, loader) -> SampledPredictive:
    """The network at each draw :math:`\\theta`."""
    module = swag._source.module

    @contextlib.contextmanager
    def network(theta):
        with swag.sampled_weights(theta, loader=loader):
            yield module

    return SampledPredictive(_draws(swag), network, module=module, loc=swag.loc, deviations=_deviations(swag))


def _glm_params(swag, what: str):
    """The module and its collected parameters, for linearising (a posterior built from an nn.Module)."""
    module = swag._source.module
    if module is None:
        raise RuntimeError(f"{type(swag).__name__}: {what} needs a SWAG built from an nn.Module (the network "
                           "is linearised in its weights), got parameters only. Use pred_type='nn'.")
    return module, [p for _, p in swag._named()]


def _glm_predictive(swag, loader) -> SampledPredictive:
    """The network linearised at the mean, :math:`f(x; c) + J_x(\\theta - c)`, at each draw."""
    module, params = _glm_params(swag, "pred_type='glm'")
    loc = swag._rows.full_theta(swag.loc, swag.dim)  # sharded: the whole mean, as every draw is whole

    @contextlib.contextmanager
    def network(theta):
        if loader is None:
            yield linearized_network(module, loc, theta, params)
        else:  # batch-norm statistics of the mean, the linearisation point
            with swag.sampled_weights(loc, loader=loader):
                yield linearized_network(module, loc, theta, params)

    return SampledPredictive(_draws(swag), network, module=module, loc=swag.loc, deviations=_deviations(swag))


PREDICTIVES: Dict[str, Callable] = {"nn": _nn_predictive, "glm": _glm_predictive}  # by pred_type


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
