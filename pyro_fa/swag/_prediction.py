r"""SWAG's predictions: sampled networks or the linearised (GLM) network, model averages and their likelihood.

A mixin of :class:`~pyro_fa.swag.SWAG` (kept apart so that the posterior's state and collection stay
readable): every method reads the posterior through ``loc``, ``cov_factor``, ``cov_diag``, ``scale``,
``sample`` and the parameter source, and predicts through :mod:`pyro_fa.predictive`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.predictive import (SampledPredictive, bma_log_likelihood, check_pred_type, linearized_moments,
                                 linearized_network, log_mean_exp, probit_proba)
from pyro_fa.swag._params import positive_int as _positive_int

__all__ = ["SWAGPrediction"]


class SWAGPrediction:
    """Prediction methods of :class:`~pyro_fa.swag.SWAG` (see there)."""

    def predictive(self, loader=None, pred_type: str = "nn") -> SampledPredictive:
        r"""This posterior's predictive: draws of :meth:`sample` run in the module, or in its linearisation.

        Parameters
        ----------
        loader : iterable, optional
            Batch-norm refresh per draw (see :meth:`sampled_weights`); for ``"glm"`` the statistics
            are those of the mean :math:`c`, where the network is linearised.
        pred_type : {"nn", "glm"}, default "nn"
            ``"nn"``: the network at each draw :math:`\theta`. ``"glm"``: the network linearised at
            the mean, :math:`f(x; c) + J_x(\theta - c)` (Immer, Korzepa & Bauer 2021, §3), one
            forward-mode product per draw (:func:`~pyro_fa.predictive.linearized_network`).

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
        module = self._source.module
        if pred_type == "glm":
            return self._glm_predictive(module, loader)

        @contextlib.contextmanager
        def network(theta):
            with self.sampled_weights(theta, loader=loader):
                yield module

        return SampledPredictive(lambda S, generator: self.sample(S, generator=generator), network,
                                 module=module, loc=self.loc, deviations=self._scale_search_deviations)

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

        return SampledPredictive(lambda S, generator: self.sample(S, generator=generator), network,
                                 module=module, loc=self.loc, deviations=self._scale_search_deviations)

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

    @torch.no_grad()
    def predict(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None, loader=None,
                generator: Optional[torch.Generator] = None, pred_type: str = "nn", noise_std=None,
                chunk_size: Optional[int] = None, **kwargs):
        r"""Bayesian model average: the mean of ``fn(module(*args))`` over sampled weights; or the GLM's mean and variance.

        Parameters
        ----------
        *args, **kwargs
            The module's inputs (e.g. ``x`` of shape (N, ...)).
        num_samples : int, default 30
            Draws (``pred_type="nn"``).
        fn : callable, optional
            Applied to each output before averaging, e.g. ``lambda z: z.softmax(-1)``
            to average predictive probabilities; default the identity (``"nn"`` only).
        loader : iterable, optional
            Batch-norm refresh per sample (see :meth:`sampled_weights`; ``"nn"`` only).
        generator : torch.Generator, optional
        pred_type : {"nn", "glm"}, default "nn"
            ``"glm"``: the linearised network's Gaussian outputs in closed form (regression),
            :math:`f(x; c)` and :math:`\mathrm{diag}(s\,J_x\Sigma J_x^\top) + \sigma^2`
            (:meth:`linearized_moments`).
        noise_std : float or Tensor, optional
            ``"glm"``: the observation noise :math:`\sigma` added to the variance; default none (the
            variance of the mean function).
        chunk_size : int, optional
            ``"glm"``: examples per chunk of per-example Jacobians.

        Returns
        -------
        Tensor
            ``"nn"``: the average, of the module's output shape.
        (mean, variance) : Tensors of the module's output shape (N, C) or (N,)
            ``"glm"``: per output, the marginal variances.

        Raises
        ------
        ValueError
            An unknown ``pred_type``; ``fn``, ``loader`` or module keyword inputs with ``"glm"``;
            ``noise_std`` not positive and finite.
        """
        cls = type(self).__name__
        check_pred_type(cls, pred_type)
        if pred_type == "glm":
            if fn is not None or loader is not None or kwargs:
                raise ValueError(f"{cls}: predict(pred_type='glm') gives the linearised outputs' mean and variance "
                                 "for positional inputs, so fn, loader and keyword inputs must not be given, got "
                                 f"fn={fn!r}, loader={loader!r}, keywords {sorted(kwargs)!r}. Use "
                                 "predictive(pred_type='glm').average(...) to average a function of sampled "
                                 "linearised outputs.")
            if noise_std is not None:  # refused before the Jacobians are computed
                noise = torch.as_tensor(noise_std)
                if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
                    raise ValueError(f"{cls}: noise_std must be positive and finite, got {noise_std!r}.")
            mean, var = self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True)
            return _glm_mean_variance(self._source.module, args, mean, var, noise_std)
        _positive_int(cls, "num_samples", num_samples)
        module = self._source.module
        if module is None:
            raise RuntimeError(f"{cls}: predict() needs a SWAG built from an nn.Module; use to_guide() with "
                               "pyro.infer.Predictive for Pyro models.")
        thetas = self.sample(num_samples, generator=generator)
        return self.predictive(loader).average(thetas, *args, fn=fn, **kwargs)

    @torch.no_grad()
    def predictive_samples(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None,
                           generator: Optional[torch.Generator] = None, pred_type: str = "nn", **kwargs) -> Tensor:
        """The module's (``pred_type="glm"``: the linearised module's) outputs under ``num_samples`` sampled weights, stacked: shape (S, ...).

        ``fn`` is applied to each output (e.g. ``lambda z: z.softmax(-1)``); the
        result is what :mod:`pyro_fa.metrics` takes as predictive samples.
        """
        cls = type(self).__name__
        check_pred_type(cls, pred_type)
        _positive_int(cls, "num_samples", num_samples)
        if self._source.module is None:
            raise RuntimeError(f"{cls}: predictive_samples() needs a SWAG built from an nn.Module; use to_guide() "
                               "with pyro.infer.Predictive for Pyro models.")
        thetas = self.sample(num_samples, generator=generator)
        return self.predictive(pred_type=pred_type).outputs(thetas, *args, fn=fn, **kwargs)

    def predict_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                      pred_type: str = "nn", link_approx: str = "mc", chunk_size: Optional[int] = None,
                      **kwargs) -> Tensor:
        r"""Class probabilities of the Bayesian model average for a module that returns logits (N, C).

        Parameters
        ----------
        *args, **kwargs
            The module's inputs.
        num_samples : int, default 30
            Draws (``link_approx="mc"``).
        generator : torch.Generator, optional
        pred_type : {"nn", "glm"}, default "nn"
            Sampled networks, or the network linearised at the mean (:meth:`predictive`).
        link_approx : {"mc", "probit"}, default "mc"
            ``"mc"``: the average of the softmax over draws. ``"probit"`` (``pred_type="glm"`` only):
            :func:`~pyro_fa.predictive.probit_proba` of the linearised logits' mean and covariance
            (:meth:`linearized_moments`), no sampling (Daxberger et al. 2021, §2).
        chunk_size : int, optional
            ``"probit"``: examples per chunk of per-example Jacobians.

        Returns
        -------
        Tensor of shape (N, C)

        Raises
        ------
        ValueError
            An unknown ``pred_type`` or ``link_approx``, or ``"probit"`` with ``"nn"``.
        """
        check_pred_type(type(self).__name__, pred_type, link_approx)
        if link_approx == "probit":
            if kwargs:
                raise ValueError(f"{type(self).__name__}: link_approx='probit' takes positional inputs only, got "
                                 f"keywords {sorted(kwargs)!r}.")
            return probit_proba(*self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True))
        if pred_type == "glm":
            _positive_int(type(self).__name__, "num_samples", num_samples)
            thetas = self.sample(num_samples, generator=generator)
            return self.predictive(pred_type="glm").average(thetas, *args, fn=lambda z: z.softmax(-1), **kwargs)
        return self.predict(*args, num_samples=num_samples, fn=lambda z: z.softmax(-1), generator=generator,
                            **kwargs)

    def predict_log_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                          pred_type: str = "nn", link_approx: str = "mc", chunk_size: Optional[int] = None,
                          **kwargs) -> Tensor:
        r"""Log class probabilities of the Bayesian model average for a module that returns logits (..., C).

        .. math::

            \log \frac1S \sum_{s=1}^S \mathrm{softmax}(z_s) = \mathrm{logsumexp}_s\,
            \mathrm{log\_softmax}(z_s) - \log S,

        computed in that form, so that a class every draw gives a probability below the
        dtype's smallest number keeps a finite log-probability (``predict_proba(...).log()``
        would give ``-inf``). ``pred_type`` and ``link_approx`` as in :meth:`predict_proba`
        (``"probit"``: the log-softmax of the moderated logits).

        Returns
        -------
        Tensor of shape (..., C)
        """
        check_pred_type(type(self).__name__, pred_type, link_approx)
        if link_approx == "probit":
            if kwargs:  # as predict_proba: keyword inputs would be dropped
                raise ValueError(f"{type(self).__name__}: link_approx='probit' takes positional inputs only, got "
                                 f"keywords {sorted(kwargs)!r}.")
            mean, var = self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True)
            return probit_proba(mean, var, log=True)
        logp = self.predictive_samples(*args, num_samples=num_samples, fn=lambda z: z.log_softmax(-1),
                                       generator=generator, pred_type=pred_type, **kwargs)
        return log_mean_exp(logp)

    def log_likelihood(self, inputs, targets, likelihood="categorical", *, num_samples: int = 30,
                       noise_std=None, seed: int = 0) -> float:
        """Test log-likelihood per point of the Bayesian model average at the current :attr:`scale`.

        ``likelihood`` is ``"categorical"`` (logits), ``"gaussian"`` (means, with
        ``noise_std``) or a callable, as in :meth:`tune_scale`.
        """
        return bma_log_likelihood(self, inputs, targets, likelihood, num_samples=num_samples,
                                  noise_std=noise_std, seed=seed)


def _glm_mean_variance(module, args, mean: Tensor, var: Tensor, noise_std):
    """The GLM's (mean, marginal variance) in the module's output shape, the noise variance (checked) added if given."""
    if noise_std is not None:
        noise = torch.as_tensor(noise_std, dtype=var.dtype, device=var.device)
        var = var + (noise.unsqueeze(-1) if noise.dim() == 1 else noise).square()  # (N,) noise: one per example
    with torch.no_grad():  # the module's own output shape: (N,) or (N, C)
        squeeze = module(*(x[:1] for x in args)).dim() == 1
    return (mean.squeeze(-1), var.squeeze(-1)) if squeeze else (mean, var)
