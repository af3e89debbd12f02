r"""The base class of the family every posterior of pyro_fa returns: Gaussians over :math:`\theta \in \mathbb{R}^D`
whose covariance is diagonal plus (or minus) low rank.

.. math::

    \Sigma = \mathrm{diag}(d) + \sigma\, BB^\top, \qquad B \in \mathbb{R}^{D\times K},\ \sigma = \pm 1,

with :math:`d` = :attr:`~FactorNormal.cov_diag`, :math:`B` = :attr:`~FactorNormal.cov_factor` and :math:`\sigma` =
:attr:`~FactorNormal.factor_sign`: :math:`+1` for the covariance form :math:`FF^\top + \Psi`, :math:`-1` for the
precision forms (Woodbury: :math:`(A + UU^\top)^{-1} = A^{-1} - BB^\top`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints

from pyro_fa.distributions.numerics import check_dense_dim

__all__ = ["FactorNormal", "draw"]


class FactorNormal(Distribution):
    r"""A Gaussian over flattened weights with a low-rank-plus-diagonal covariance or precision: the family's interface.

    What :meth:`get_posterior` of every posterior of pyro_fa returns. A member is one of the forms

    * :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` — covariance :math:`FF^\top + \Psi`
      (also a :class:`torch.distributions.LowRankMultivariateNormal`);
    * :class:`~pyro_fa.distributions.LowRankPrecisionNormal`,
      :class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal` — precision :math:`\mathrm{diag}(a) + UU^\top`
      (one low-rank part, or one per block of coordinates);
    * :class:`~pyro_fa.distributions.PointMassNormal` — covariance 0, the mean alone (a posterior at scale 0);

    and :class:`~pyro_fa.distributions.FactorNormalMixture` mixes members (MultiSWAG).

    Every member answers

    * :attr:`loc` = :attr:`mean` = :attr:`mode`, :attr:`variance`, :attr:`stddev` — shape (..., D);
    * :meth:`log_prob`, :meth:`entropy`;
    * :meth:`rsample` / :meth:`sample` ``(sample_shape=(), generator=None)`` — draws of shape
      ``sample_shape + batch_shape + (D,)``; ``generator`` a :class:`torch.Generator` on any device
      (the numbers are drawn on its device, then moved), ``None`` the global generator;
    * :attr:`cov_factor` :math:`B` (..., D, K), :attr:`cov_diag` :math:`d` (..., D), :attr:`factor_sign`
      :math:`\sigma`: :math:`\Sigma = \mathrm{diag}(d) + \sigma BB^\top`;
    * :meth:`covariance_matvec` — :math:`\Sigma v` in :math:`O(DK)`;
    * :attr:`covariance_matrix` — the dense :math:`\Sigma`, refused past
      :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM` (small :math:`D` only).

    The base class supplies :meth:`sample` (``rsample`` without gradients), :meth:`covariance_matvec` and
    :attr:`covariance_matrix` from :attr:`cov_factor`, :attr:`cov_diag` and :attr:`factor_sign`; a form overrides
    them where it has a cheaper or more accurate way.

    See also
    --------
    pyro_fa.SWAG.get_posterior, pyro_fa.laplace.FactorLaplace.get_posterior,
    pyro_fa.AutoLowRankFactorGuide.get_posterior
    """

    support = constraints.real_vector
    has_rsample = True
    #: :math:`\sigma` in :math:`\Sigma = \mathrm{diag}(d) + \sigma BB^\top`: +1 (covariance form), -1 (precision forms)
    factor_sign: float = 1.0

    @property
    def mean(self) -> Tensor:
        """``loc``, shape (..., D)."""
        return self.loc

    @property
    def mode(self) -> Tensor:
        """``loc``, shape (..., D)."""
        return self.loc

    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        raise NotImplementedError

    def sample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws of shape ``sample_shape + batch_shape + event_shape``, without gradients (see :meth:`rsample`)."""
        with torch.no_grad():
            return self.rsample(sample_shape, generator=generator)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r""":math:`\Sigma v = d \odot v + \sigma B(B^\top v)` for ``v`` of shape (..., D), in :math:`O(DK)`."""
        B = self.cov_factor
        low = (v.unsqueeze(-2) @ B).squeeze(-2).unsqueeze(-1)  # (..., K, 1)
        return v * self.cov_diag + self.factor_sign * (B @ low).squeeze(-1)

    @property
    def covariance_matrix(self) -> Tensor:
        r"""The dense :math:`\Sigma`, shape (..., D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
        check_dense_dim(type(self).__name__, "covariance_matrix", self.event_shape[0], self.mean.dtype,
                        "Use variance, cov_factor / cov_diag, covariance_matvec or rsample().")
        B = self.cov_factor
        return torch.diag_embed(self.cov_diag) + self.factor_sign * (B @ B.transpose(-1, -2))


def draw(owner: str, posterior, num_samples=None, generator: Optional[torch.Generator] = None) -> Tensor:
    """The protocol's ``sample(num_samples=None, *, generator=None)`` written once: draws of ``posterior``.

    Shape (num_samples, D), or (D,) when ``num_samples`` is None; ``generator`` is used where the distribution
    takes one. ``owner`` names the caller in the error.

    Raises
    ------
    ValueError
        If ``num_samples`` is neither None nor an integer >= 1.
    """
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 1):
        raise ValueError(f"{owner}: num_samples must be an integer >= 1 or None, got {num_samples!r}.")
    shape = torch.Size() if num_samples is None else torch.Size((num_samples,))
    if generator is None:
        return posterior.sample(shape)
    return posterior.sample(shape, generator=generator)
