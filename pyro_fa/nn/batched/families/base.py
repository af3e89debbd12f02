r"""``GuideFamily``: the base class of every guide family of :class:`~pyro_fa.nn.BatchedVI`.

A family says *what* :math:`q_r(\theta)` is for R replicas at once (its parameters and
their initialisation, its distribution); :class:`~pyro_fa.nn.BatchedVI` says *how* it is
trained (the model, the prior, the likelihood, the estimators, the optimiser), as
GPyTorch keeps a variational distribution apart from its strategy.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.distributions import Distribution, LowRankMultivariateNormal
from pyro_fa import _random

__all__ = ["GuideFamily"]


class GuideFamily:
    r"""Base class of a guide family: :math:`q_r(\theta)` over :math:`\mathbb{R}^D` for R replicas.

    Subclass it and register the subclass with
    :func:`~pyro_fa.nn.batched.families.register_family` to add a family
    (the architecture guide\'s "Add a guide family"):

    * :meth:`init` (required): the family's parameters besides ``loc``, each of shape (R, ...);
    * :meth:`distribution` (required): :math:`q` of every replica, a batch of R torch
      distributions with event shape (D,) that has ``rsample``, ``log_prob``, ``mean``,
      ``variance`` and ``entropy`` (``None`` for a point mass at ``loc``);
    * :meth:`rsample` and :meth:`loss` (optional): the draws and the negative ELBO; the
      defaults take them from :meth:`distribution`, as Pyro's ``Trace_ELBO`` and
      :class:`~pyro_fa.FactorELBO` would.

    A family is stateless: one instance per :class:`~pyro_fa.nn.BatchedVI`, its methods given
    the trainer ``vi`` and the parameters ``p`` (a dict of tensors of shape (R, ...), in
    replica order, ``p["loc"]`` of shape (R, D)).

    Attributes
    ----------
    name : str
        The registered name (set by ``register_family``); ``None`` when unregistered.
    estimators : tuple of str
        The estimators the family accepts: ``"factor"`` (closed-form entropy and expected
        log-prior), ``"trace"`` (Monte Carlo log joint minus :math:`\log q`), ``"map"`` (the
        log joint at the point). A family with one estimator always uses it.
    default_estimator : str
        The estimator when ``BatchedVI(estimator=None)``.
    uses_rank : bool
        Whether ``BatchedVI(rank=K)`` must satisfy :math:`1 \le K \le D`.
    options : tuple of str
        The family-specific ``BatchedVI`` arguments it accepts (``"guide_noise_scale"``).
    """

    name: Optional[str] = None
    estimators: Tuple[str, ...] = ("factor", "trace")
    default_estimator: str = "trace"
    uses_rank: bool = False
    options: Tuple[str, ...] = ()

    # ------------------------------------------------------------ to implement
    def init(self, vi, loc: Tensor, init_scale: float, generator: Optional[torch.Generator]) -> Dict[str, Tensor]:
        """The family's initial parameters besides ``loc``.

        Parameters
        ----------
        vi : BatchedVI
            The trainer (``vi.rank``, ``vi.replicas``, ``vi.mlp.dim``).
        loc : Tensor of shape (R, D)
            The initial means; gives the dtype and device.
        init_scale : float
            The initial marginal standard deviation asked for.
        generator : torch.Generator, optional
            For random initial values (on the generator's device, then moved).

        Returns
        -------
        dict of str to Tensor of shape (R, ...)
        """
        raise NotImplementedError(f"{type(self).__name__} must implement init(vi, loc, init_scale, generator).")

    def distribution(self, vi, p: Dict[str, Tensor]) -> Optional[Distribution]:
        """:math:`q` of every replica: batch shape (R,), event shape (D,); ``None`` for a point mass."""
        raise NotImplementedError(f"{type(self).__name__} must implement distribution(vi, p).")

    # ------------------------------------------------------------- defaults
    def rsample(self, vi, p: Dict[str, Tensor], num_samples: int,
                generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Reparameterised draws :math:`\theta_s \sim q_r`, shape (S, R, D) (S = 1 for a point mass).

        From torch's global RNG, or ``generator`` (for a ``LowRankMultivariateNormal`` or a
        distribution with ``mean`` and ``stddev``, such as an ``Independent`` ``Normal``).
        """
        q = self.distribution(vi, p)
        if q is None:
            return p["loc"].unsqueeze(0)
        return q.rsample((num_samples,)) if generator is None else _rsample_with(q, num_samples, generator)

    def loss(self, vi, p: Dict[str, Tensor], x: Tensor, y: Tensor, dataset_size: int, particles: int) -> Tensor:
        r"""Negative ELBO of every replica, shape (R,), by ``vi.estimator``.

        ``"factor"``: :math:`-\overline{\log p(y\mid\theta)} - \mathbb{E}_q\log p(\theta) - H[q]`
        with the prior's closed form at ``q.mean``, ``q.variance`` and ``q.entropy()``;
        ``"trace"``: :math:`-\overline{\log p(y, \theta) - \log q(\theta)}`; ``"map"``:
        :math:`-\log p(y, \theta)` at ``loc``; averages over ``particles`` draws of :meth:`rsample`.
        """
        q = self.distribution(vi, p)
        theta = p["loc"].unsqueeze(0) if q is None else q.rsample((particles,))  # (S, R, D)
        loglik = vi._loglik(p, theta, x, y, dataset_size)
        return -_ELBOS[vi.estimator](vi, q, theta, loglik)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _inv_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


def _rsample_with(q, num_samples: int, generator: torch.Generator) -> Tensor:
    """Draw from a (batched) LowRankMultivariateNormal or Independent Normal with an explicit generator."""
    loc = q.mean
    kw = {"generator": generator, "dtype": loc.dtype, "device": loc.device}
    if isinstance(q, LowRankMultivariateNormal):
        K = q.cov_factor.shape[-1]
        eps_w = _random.randn((num_samples,) + loc.shape[:-1] + (K,), **kw)
        eps_d = _random.randn((num_samples,) + loc.shape, **kw)
        return loc + (q.cov_factor @ eps_w.unsqueeze(-1)).squeeze(-1) + q.cov_diag.sqrt() * eps_d
    return loc + q.stddev * _random.randn((num_samples,) + loc.shape, **kw)


def _map_elbo(vi, q, theta: Tensor, loglik: Tensor) -> Tensor:
    """AutoDelta's objective: the log joint at the point."""
    return (loglik + vi._prior_log_prob(theta)).mean(0)


def _trace_elbo(vi, q, theta: Tensor, loglik: Tensor) -> Tensor:
    """Trace_ELBO: the log joint minus log q at the draws."""
    return (loglik + vi._prior_log_prob(theta) - q.log_prob(theta)).mean(0)


def _factor_elbo(vi, q, theta: Tensor, loglik: Tensor) -> Tensor:
    """FactorELBO: the prior's closed form at q's mean and variance, and q's entropy."""
    return loglik.mean(0) + vi._expected_prior(q.mean, q.variance) + q.entropy()


#: estimator name -> ``(vi, q, theta, loglik) -> ELBO`` of every replica, shape (R,)
_ELBOS = {"map": _map_elbo, "trace": _trace_elbo, "factor": _factor_elbo}
