r"""SWAG's predictive: sampled networks or the linearised (GLM) network.

A part of :class:`~pyro_fa.swag.SWAG` (kept apart so that the posterior's state and collection stay
readable): it supplies what :class:`~pyro_fa.predictive.Posterior` asks of a posterior (:meth:`predictive`,
the linearised outputs' moments), reading the posterior through ``loc``, ``cov_factor``, ``cov_diag``,
``scale``, ``sample`` and the parameter source; ``predict``, ``predict_proba``, ``predict_log_proba``,
``predictive_samples``, ``log_likelihood`` and ``tune_scale`` are the protocol's, shared with every posterior.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.predictive.glm import check_pred_type, linearized_moments, linearized_network
from pyro_fa.predictive.posterior import Posterior
from pyro_fa.predictive.sampled import SampledPredictive

__all__ = ["SWAGPrediction"]


class SWAGPrediction(Posterior):
    """The predictive of :class:`~pyro_fa.swag.SWAG` (see there and :class:`~pyro_fa.predictive.Posterior`)."""

    def predictive(self, pred_type: str = "nn", *, loader=None) -> SampledPredictive:
        r"""This posterior's predictive: draws of :meth:`sample` run in the module, or in its linearisation.

        Parameters
        ----------
        pred_type : {"nn", "glm"}, default "nn"
            ``"nn"``: the network at each draw :math:`\theta`. ``"glm"``: the network linearised at
            the mean, :math:`f(x; c) + J_x(\theta - c)` (Immer, Korzepa & Bauer 2021, §3), one
            forward-mode product per draw (:func:`~pyro_fa.predictive.linearized_network`).
        loader : iterable, optional
            Batch-norm refresh per draw (see :meth:`sampled_weights`); for ``"glm"`` the statistics
            are those of the mean :math:`c`, where the network is linearised.

        Returns
        -------
        SampledPredictive
            With ``loc`` :math:`c` and unscaled ``deviations`` :math:`Fh + \Psi^{1/2}\varepsilon`, for
            :func:`~pyro_fa.predictive.tune_scale`; ``module`` is ``None`` for a posterior over
            parameters only.

        Raises
        ------
        RuntimeError
            If nothing has been collected yet, or ``"glm"`` for a posterior over parameters only.
        ValueError
            An unknown ``pred_type``.
        """
        check_pred_type(type(self).__name__, pred_type)
        if self._n == 0:
            self._check_ready("predictive()")
        return {"nn": self._nn_predictive, "glm": self._glm_predictive}[pred_type](self._source.module, loader)

    def _nn_predictive(self, module, loader) -> SampledPredictive:
        @contextlib.contextmanager
        def network(theta):
            with self.sampled_weights(theta, loader=loader):
                yield module

        return SampledPredictive(self._draws, network, module=module, loc=self.loc,
                                 deviations=self._scale_search_deviations)

    def _draws(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return self.sample(num_samples, generator=generator)

    def _glm_params(self, what: str):
        """The module and its collected parameters, for linearising (a posterior built from an nn.Module)."""
        module = self._source.module
        if module is None:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a SWAG built from an nn.Module (the network "
                               "is linearised in its weights), got parameters only. Use pred_type='nn'.")
        return module, [p for _, p in self._named()]

    def _glm_predictive(self, module, loader) -> SampledPredictive:
        module, params = self._glm_params("pred_type='glm'")
        loc = self._full_theta(self.loc)  # sharded: the whole mean, as every draw is whole

        @contextlib.contextmanager
        def network(theta):
            if loader is None:
                yield linearized_network(module, loc, theta, params)
            else:  # batch-norm statistics of the mean, the linearisation point
                with self.sampled_weights(loc, loader=loader):
                    yield linearized_network(module, loc, theta, params)

        return SampledPredictive(self._draws, network, module=module, loc=self.loc,
                                 deviations=self._scale_search_deviations)

    def linearized_moments(self, *args, chunk_size: Optional[int] = None,
                           diagonal: bool = False) -> Tuple[Tensor, Tensor]:
        r"""Mean and covariance of the linearised network's outputs, :math:`f(x; c)` and :math:`s\,J_x(FF^\top + \Psi)J_x^\top`.

        See :func:`pyro_fa.predictive.linearized_moments` (called with :attr:`loc`, :attr:`cov_factor`,
        :attr:`cov_diag` and :attr:`scale`).

        Parameters
        ----------
        *args
            The module's inputs, each of shape (N, ...).
        chunk_size : int, optional
            Examples per chunk of per-example Jacobians.
        diagonal : bool, default False
            Only the variances (the contraction :math:`C` times cheaper; the Jacobians cost the same).

        Returns
        -------
        mean : Tensor of shape (N, C)
        cov : Tensor of shape (N, C, C), or (N, C) with ``diagonal=True``

        Raises
        ------
        RuntimeError
            Nothing collected, a posterior over parameters only, or one sharded over a process group.
        """
        cls = type(self).__name__
        self._check_ready("linearized_moments()")
        module, params = self._glm_params("linearized_moments()")
        if self._sharding is not None:
            raise RuntimeError(f"{cls}: linearized_moments() needs the whole factor, got a SWAG sharded as "
                               f"{self.sharding!r}; use pred_type='glm' with link_approx='mc' (sampled, collective).")
        return linearized_moments(module, self.loc, args, cov_diag=self.cov_diag, cov_factor=self.cov_factor,
                                  scale=self._scale, chunk_size=chunk_size, params=params, diagonal=diagonal)

    def _scale_search_deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        self._check_ready("tune_scale()")
        return self._deviations(num_samples, generator)

    def _linearized_marginals(self, inputs, chunk_size):
        """The linearised outputs' means and variances (one Gaussian), in the module output's shape."""
        mean, var = self.linearized_moments(*inputs, chunk_size=chunk_size, diagonal=True)
        return [_glm_mean_variance(self._source.module, inputs, mean, var, None)]


def _glm_mean_variance(module, args, mean: Tensor, var: Tensor, noise_std):
    """The GLM's (mean, marginal variance) in the module's output shape, the noise variance (checked) added if given."""
    if noise_std is not None:
        noise = torch.as_tensor(noise_std, dtype=var.dtype, device=var.device)
        var = var + (noise.unsqueeze(-1) if noise.dim() == 1 else noise).square()  # (N,) noise: one per example
    with torch.no_grad():  # the module's own output shape: (N,) or (N, C)
        squeeze = module(*(x[:1] for x in args)).dim() == 1
    return (mean.squeeze(-1), var.squeeze(-1)) if squeeze else (mean, var)
