r"""A Gaussian over a torch network's weights as a :class:`~pyro_fa.predictive.Posterior`: the prediction protocol
for a posterior learned while training (:meth:`FactorIVON.posterior <pyro_fa.optim.FactorIVON.posterior>`)."""
from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from pyro_fa.distributions import FactorNormal, PointMassNormal, draw
from pyro_fa.predictive import Posterior, build_predictive, check_pred_type, linearized_moments
from pyro_fa.predictive.glm import check_eval_mode
from pyro_fa.predictive.registry import PredictiveSource
from pyro_fa._validation import check_scale

__all__ = ["WeightPosterior"]


class WeightPosterior(Posterior):
    r"""A posterior :math:`q(\theta)` over a module's weights, given as a distribution, with every prediction verb.

    Wraps a :class:`~pyro_fa.distributions.FactorNormal` member over the flattened ``params`` (in their order)
    and the ``module`` they belong to; answers the protocol of :class:`~pyro_fa.predictive.Posterior`:
    :meth:`get_posterior`, :meth:`sample`, ``predict`` / ``predict_proba`` / ``predict_log_proba`` with
    ``pred_type="nn"`` (the network at sampled weights, by :func:`torch.func.functional_call`, nothing written
    into the module) or ``"glm"`` (linearised at the mean, closed form with ``link_approx="probit"``),
    ``log_likelihood`` and ``tune_scale``. :attr:`scale` :math:`s` multiplies the covariance.

    Parameters
    ----------
    module : nn.Module
        The network, in eval mode when predicting.
    distribution : FactorNormal
        :math:`q` over the :math:`D` weights of ``params``, e.g. ``FactorIVON.get_posterior()``.
    params : sequence of Tensors, optional
        Parameters of ``module`` the weights stand for, in flattening order; default every parameter of
        ``module`` that requires grad. The others keep their values.

    Raises
    ------
    TypeError
        ``module`` not a module, ``distribution`` not a member of the family.
    ValueError
        ``params`` not the module's, or of another total size than the distribution's.

    See also
    --------
    pyro_fa.optim.FactorIVON.posterior : builds one from the optimizer's state.

    Examples
    --------
    >>> from pyro_fa.distributions import LowRankPrecisionNormal
    >>> net = torch.nn.Linear(2, 1)
    >>> q = LowRankPrecisionNormal(torch.zeros(3), torch.zeros(3, 1), torch.ones(3))
    >>> WeightPosterior(net, q).predict(torch.ones(4, 2), num_samples=5).shape
    torch.Size([4, 1])
    """

    def __init__(self, module: nn.Module, distribution: FactorNormal, params: Optional[Sequence[Tensor]] = None):
        name = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{name}: module must be a torch.nn.Module, got {type(module).__name__}.")
        if not isinstance(distribution, FactorNormal):
            raise TypeError(f"{name}: distribution must be a pyro_fa.distributions.FactorNormal, got "
                            f"{type(distribution).__name__}.")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if params is not None:
            by_id = {id(p): n for n, p in module.named_parameters()}
            missing = [i for i, p in enumerate(params) if id(p) not in by_id]
            if missing:
                raise ValueError(f"{name}: params must be parameters of module, got tensors at positions {missing} "
                                 "that are not.")
            named = [(by_id[id(p)], p) for p in params]
        D = sum(p.numel() for _, p in named)
        if distribution.event_shape != (D,):
            raise ValueError(f"{name}: distribution must be over the {D} weights of params, got event shape "
                             f"{tuple(distribution.event_shape)!r}.")
        self.module, self.distribution = module, distribution
        self._names = [n for n, _ in named]
        self._shapes = [p.shape for _, p in named]
        self._params: List[Tensor] = [p for _, p in named]
        self._scale = 1.0

    @property
    def loc(self) -> Tensor:
        """The mean, shape (D,)."""
        return self.distribution.mean

    @property
    def scale(self) -> float:
        r"""The covariance scale :math:`s`: predictions (and :meth:`get_posterior`) use :math:`N(m, s\Sigma)`;
        :meth:`tune_scale` chooses it on validation data (0: the mean's network)."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = check_scale(type(self).__name__, value)
        self._scale = value

    def get_posterior(self) -> FactorNormal:
        """The distribution at :attr:`scale`: the one given at scale 1, a
        :class:`~pyro_fa.distributions.PointMassNormal` at 0, else its draws' deviations scaled (see
        :meth:`sample`; the moments of ``get_posterior()`` are those at scale 1 unless the scale is 0 or 1)."""
        if self._scale == 0.0:
            return PointMassNormal(self.loc.clone())
        return self.distribution

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Weight vectors, shape (num_samples, D), or (D,) for ``None``: :math:`m + \\sqrt{s}(\\theta - m)`,
        :math:`\\theta \\sim q`."""
        theta = draw(type(self).__name__, self.distribution, num_samples, generator)
        if self._scale == 1.0:
            return theta
        return torch.add(self.loc, theta - self.loc, alpha=math.sqrt(self._scale))

    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return draw(type(self).__name__, self.distribution, num_samples, generator) - self.loc

    def _network(self, theta: Tensor):
        parts = {n: t.view(s) for n, t, s in zip(self._names, theta.split([p.numel() for p in self._params]),
                                                  self._shapes)}
        return lambda *x: functional_call(self.module, parts, x)

    def predictive(self, pred_type: str = "nn", *, loader=None):
        """The predictive of ``pred_type`` (:class:`~pyro_fa.predictive.SampledPredictive`); ``loader`` must be
        None (the module is run in eval mode, its batch-norm statistics as they are)."""
        name = type(self).__name__
        check_pred_type(name, pred_type)
        if loader is not None:
            raise ValueError(f"{name}: loader must be None (the module is run in eval mode), got "
                             f"{type(loader).__name__}.")
        check_eval_mode(name, self.module)
        return build_predictive(pred_type, _Source(self), loader)

    def _linearized_marginals(self, inputs, chunk_size):
        q = self.distribution
        mean, var = linearized_moments(self.module, self.loc, inputs, cov_diag=q.cov_diag, cov_factor=q.cov_factor,
                                       factor_sign=q.factor_sign, scale=self._scale, chunk_size=chunk_size,
                                       params=self._params, diagonal=True)
        with torch.no_grad():  # the module's own output shape: (N,) or (N, C)
            one = self._network(self.loc)(*(x[:1] for x in inputs)).dim() == 1
        return [(mean.squeeze(-1), var.squeeze(-1)) if one else (mean, var)]


class _Source(PredictiveSource):
    """A :class:`WeightPosterior` as the predictive builders read it."""

    def __init__(self, post: WeightPosterior):
        self.post, self.module, self.loc = post, post.module, post.loc

    def draws(self, num_samples, generator=None):
        return self.post.sample(num_samples, generator=generator)

    def deviations(self, num_samples, generator=None):
        return self.post._deviations(num_samples, generator)

    def network(self, theta, loader=None):
        return contextlib.nullcontext(self.post._network(theta))

    def linearization(self, what):
        return self.module, self.loc, self.post._params

    def refreshed(self, theta, loader=None):
        return contextlib.nullcontext()
