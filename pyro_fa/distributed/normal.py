r"""This rank's rows of a factor-analysis normal over a sharded :math:`\theta \in \mathbb{R}^D`.

The distribution :meth:`~pyro_fa.OnlineFactorAnalysis.get_posterior` and
:meth:`~pyro_fa.SWAG.get_posterior` return under a ``process_group``: the algebra of
:class:`torch.distributions.LowRankMultivariateNormal` with its sums over :math:`D` all-reduced
by a :class:`~pyro_fa.distributed.Sharding` (:mod:`pyro_fa.distributed.sharding`).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.distributions import FactorNormal

__all__ = ["ShardedLowRankNormal"]


class ShardedLowRankNormal(FactorNormal):
    r"""This rank's rows of :math:`N(c, FF^\top + \Psi)` over a sharded :math:`\theta \in \mathbb{R}^D`.

    The sharded covariance form of the family :class:`~pyro_fa.distributions.FactorNormal`: its
    ``event_shape`` is the whole ``(D,)``, while :attr:`mean`, :attr:`variance`, :attr:`cov_factor`,
    :attr:`cov_diag`, the draws and the values :meth:`log_prob` takes are this rank's rows (last dimension
    :math:`D_r`); :meth:`log_prob`, :meth:`entropy`, :meth:`rsample` and :meth:`covariance_matvec` are
    collective, :attr:`covariance_matrix` is refused (the whole matrix is on no rank).

    What :meth:`~pyro_fa.OnlineFactorAnalysis.get_posterior` and
    :meth:`~pyro_fa.SWAG.get_posterior` return under a ``process_group``: the same
    algebra as :class:`torch.distributions.LowRankMultivariateNormal`, with the sums
    over :math:`D` all-reduced. Every method that needs them is collective.

    Parameters
    ----------
    loc : Tensor of shape (D_r,)
    cov_factor : Tensor of shape (D_r, K)
    cov_diag : Tensor of shape (D_r,)
        This rank's rows.
    sharding : Sharding
    """

    arg_constraints = {}  # this rank's rows: torch's argument and sample checks would expect all D
    has_rsample = True

    def __init__(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, sharding):
        self.loc, self.cov_factor, self.cov_diag = loc, cov_factor, cov_diag
        self.sharding = sharding
        super().__init__(torch.Size(), torch.Size([sharding.dim]), validate_args=False)

    @property
    def mean(self) -> Tensor:
        """This rank's rows of the mean, shape (D_r,)."""
        return self.loc

    @property
    def variance(self) -> Tensor:
        """This rank's rows of the marginal variances, shape (D_r,)."""
        return self.cov_factor.pow(2).sum(-1) + self.cov_diag

    def marginal(self) -> LowRankMultivariateNormal:
        """The marginal distribution of this rank's coordinates (no collective)."""
        from pyro_fa.distributions import StableLowRankMultivariateNormal

        return StableLowRankMultivariateNormal(self.loc, self.cov_factor, self.cov_diag)

    def _sums(self, *extra: Tensor) -> Tuple[Tensor, Tensor, List[Tensor]]:
        F, psi = self.cov_factor, self.cov_diag
        from pyro_fa.distributions.numerics import whitened_gram

        # the capacitance as the Gram matrix of Psi^-1/2 F summed in float64 (and carried so): positive
        # definite by construction where float32 sums are not (tiny psi against F)
        _, (logdet_psi, cap, *rest) = self.sharding.reduce(
            (), psi.double().log().sum().reshape(1), whitened_gram(F, psi), *(e.double() for e in extra))
        cap.diagonal().add_(1.0)
        L = torch.linalg.cholesky(cap)
        return logdet_psi[0], L, rest

    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density of whole vectors given by this rank's rows ``value`` of shape (..., D_r).

        Collective: two all-reduces (the batch size, checked alike on every rank, then
        :math:`1 + K^2 + N(K + 1)` numbers for N vectors).
        """
        if value.shape[-1] != self.loc.shape[-1]:
            raise ValueError(f"ShardedLowRankNormal: value must have last dimension {self.loc.shape[-1]} (this "
                             f"rank's rows), got shape {tuple(value.shape)!r}.")
        batch = value.shape[:-1]
        self.sharding.agree_sizes("ShardedLowRankNormal", "number of vectors to log_prob", int(batch.numel()))
        r = (value - self.loc).reshape(-1, value.shape[-1]).double()  # the sums over D in float64
        psi = self.cov_diag.double()
        logdet_psi, L, (maha, u) = self._sums((r.pow(2) / psi).sum(-1), (r / psi) @ self.cov_factor.double())
        v = torch.linalg.solve_triangular(L, u.T, upper=False)  # (K, N)
        quad = maha - v.pow(2).sum(0)
        logdet = logdet_psi + 2 * L.diagonal().log().sum()
        out = -0.5 * (self.sharding.dim * math.log(2 * math.pi) + logdet + quad)
        return out.reshape(batch).to(self.loc.dtype)

    def entropy(self) -> Tensor:
        """Entropy of the whole distribution (collective: one all-reduce of 1 + K² numbers)."""
        logdet_psi, L, _ = self._sums()
        logdet = logdet_psi + 2 * L.diagonal().log().sum()
        return (0.5 * self.sharding.dim * (1.0 + math.log(2 * math.pi)) + 0.5 * logdet).to(self.loc.dtype)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r"""This rank's rows of :math:`\Sigma v` from this rank's rows of ``v`` (..., D_r).

        Collective: one all-reduce of :math:`F^\top v` (K numbers per vector); every rank passes the same
        batch shape.
        """
        B = self.cov_factor
        _, (low,) = self.sharding.reduce((), (v.unsqueeze(-2) @ B).squeeze(-2))
        return v * self.cov_diag + (B @ low.unsqueeze(-1)).squeeze(-1)

    @property
    def covariance_matrix(self) -> Tensor:
        """Refused: the whole D x D matrix is on no rank (:meth:`marginal` has this rank's block)."""
        raise RuntimeError(f"{type(self).__name__}: covariance_matrix needs the whole D x D matrix, got a "
                           "distribution sharded over a process group. Use marginal() for this rank's block.")

    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        r"""This rank's rows of draws :math:`c + Fh + \Psi^{1/2}\varepsilon`, shape ``sample_shape + (D_r,)``.

        One :math:`h` per draw, shared by all ranks (see :meth:`Sharding.shared_normal`),
        noise :math:`\varepsilon` drawn per rank: the rows gathered over the ranks are
        one draw of the whole vector. Collective.
        """
        shape = torch.Size(sample_shape)
        S, K = int(shape.numel()), self.cov_factor.shape[-1]
        self.sharding.agree_sizes("ShardedLowRankNormal", "number of draws", S)
        ref = self.loc
        h, gen = self.sharding.shared_normal(S, K, generator, ref.dtype, ref.device)
        eps = torch.randn(S, ref.shape[-1], generator=gen, dtype=ref.dtype, device=ref.device)
        out = eps.mul_(self.cov_diag.sqrt()).add_(h @ self.cov_factor.T).add_(ref)
        return out.reshape(shape + ref.shape)
