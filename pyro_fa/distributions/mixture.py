r"""Mixtures of members of the family: MultiSWAG's posterior :math:`\sum_m w_m N(c_m, \Sigma_m)`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Categorical, MixtureSameFamily

from pyro_fa.distributions.base import FactorNormal
from pyro_fa.distributions.numerics import check_dense_dim

__all__ = ["FactorNormalMixture"]


class FactorNormalMixture(MixtureSameFamily):
    r"""A :class:`~torch.distributions.MixtureSameFamily` whose components are one batched member of the family.

    .. math::

        q(\theta) = \sum_{m=1}^M w_m\, N(c_m, \Sigma_m), \qquad
        \mathrm{Cov}_q = \sum_m w_m \big(\Sigma_m + (c_m - \bar c)(c_m - \bar c)^\top\big),\ \bar c = \sum_m w_m c_m.

    torch's :attr:`mean`, :attr:`variance` and :meth:`log_prob` (a log-sum-exp over the components); besides,
    :meth:`sample` / :meth:`rsample`-free draws with a ``generator``, :meth:`covariance_matvec` and the dense
    :attr:`covariance_matrix` (small :math:`D`). Not Gaussian, so no ``cov_factor`` / ``cov_diag`` and no
    closed-form entropy.

    Parameters
    ----------
    mixture_distribution : torch.distributions.Categorical
        The weights :math:`w`, batch shape ().
    component_distribution : FactorNormal
        The components, batch shape (M,), event shape (D,): a
        :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` over stacked factors, or a
        :class:`~pyro_fa.distributions.PointMassNormal` over stacked means.
    validate_args : bool, optional

    Raises
    ------
    TypeError
        If ``component_distribution`` is not a :class:`~pyro_fa.distributions.FactorNormal`.
    ValueError
        If its batch shape is not (M,).

    Examples
    --------
    >>> from pyro_fa.distributions import PointMassNormal
    >>> q = FactorNormalMixture(Categorical(logits=torch.zeros(2)), PointMassNormal(torch.tensor([[0.0], [2.0]])))
    >>> q.mean, q.variance
    (tensor([1.]), tensor([1.]))
    """

    def __init__(self, mixture_distribution: Categorical, component_distribution: FactorNormal,
                 validate_args: Optional[bool] = None):
        if not isinstance(component_distribution, FactorNormal):
            raise TypeError(f"FactorNormalMixture: component_distribution must be a FactorNormal, got "
                            f"{type(component_distribution).__name__}.")
        if len(component_distribution.batch_shape) != 1:
            raise ValueError(f"FactorNormalMixture: component_distribution must have batch shape (M,), got "
                             f"{tuple(component_distribution.batch_shape)!r}.")
        super().__init__(mixture_distribution, component_distribution, validate_args=validate_args)

    def sample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws of shape ``sample_shape + (D,)``: a component per draw by the weights, then a draw from it.

        Without ``generator``, torch's :meth:`MixtureSameFamily.sample` (the global generator); with one, the
        components' indices and draws come from ``generator`` (on any device).
        """
        if generator is None:
            return super().sample(sample_shape)
        shape = torch.Size(sample_shape)
        n = int(shape.numel())
        ref = self.component_distribution.mean
        with torch.no_grad():
            probs = self.mixture_distribution.probs.to(generator.device)
            idx = torch.multinomial(probs, n, replacement=True, generator=generator).to(ref.device)
            comp = self.component_distribution.sample((n,), generator=generator)  # (n, M, D)
            out = comp[torch.arange(n, device=ref.device), idx]
        return out.reshape(shape + self.event_shape)

    def _centred_means(self):
        w = self.mixture_distribution.probs
        means = self.component_distribution.mean  # (M, D)
        return w, means - (w.unsqueeze(-1) * means).sum(0)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r""":math:`\mathrm{Cov}_q v` for ``v`` of shape (..., D), in :math:`O(MDK)`."""
        w, dev = self._centred_means()
        comp = self.component_distribution.covariance_matvec(v.unsqueeze(-2))  # (..., M, D)
        comp = comp + (v.unsqueeze(-2) * dev).sum(-1, keepdim=True) * dev
        return (w.unsqueeze(-1) * comp).sum(-2)

    @property
    def covariance_matrix(self) -> Tensor:
        r"""The dense :math:`\mathrm{Cov}_q`, shape (D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
        check_dense_dim(type(self).__name__, "covariance_matrix", self.event_shape[0], self.mean.dtype,
                        "Use variance, covariance_matvec or sample().")
        w, dev = self._centred_means()
        comp = self.component_distribution.covariance_matrix + dev.unsqueeze(-1) * dev.unsqueeze(-2)
        return (w.reshape(-1, 1, 1) * comp).sum(0)
