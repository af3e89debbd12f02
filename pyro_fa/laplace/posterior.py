r"""The Gaussian whose *precision* is low rank plus diagonal: the posterior of a factor-analysis Laplace approximation.

.. math::

    \theta \sim N(\mu, P^{-1}), \qquad P = A + UU^\top, \quad A = \mathrm{diag}(a),\; U \in \mathbb{R}^{D\times K}.

Everything is :math:`O(DK^2)` through the :math:`K\times K` capacitance
:math:`C = I + U^\top A^{-1} U` (Woodbury identity and matrix determinant lemma, e.g. Petersen & Pedersen,
*The Matrix Cookbook*, 2012, §3.2.2 and §A.3.1): no :math:`D\times D` tensor unless
:attr:`~LowRankPrecisionNormal.covariance_matrix` or :attr:`~LowRankPrecisionNormal.precision_matrix` is asked
for at small :math:`D`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import lazy_property

from pyro_fa.fa.linalg import check_dense_dim
from pyro_fa.fa.moments import wide_dtype

__all__ = ["LowRankPrecisionNormal"]


class LowRankPrecisionNormal(Distribution):
    r"""Multivariate normal :math:`N(\mu, P^{-1})` with precision :math:`P = \mathrm{diag}(a) + UU^\top`.

    The counterpart of :class:`torch.distributions.LowRankMultivariateNormal` (low-rank plus diagonal
    *covariance*) for a Laplace approximation, whose curvature, not covariance, is fitted by factor
    analysis. The capacitance :math:`C = I + U^\top A^{-1}U` is formed and factorised in float64 (as
    :class:`pyro_fa.fa.normal.StableLowRankMultivariateNormal` does), so float32 states stay well
    conditioned.

    .. math::

        P^{-1} = A^{-1} - A^{-1}U C^{-1} U^\top A^{-1}, \qquad
        \log\det P = \sum_d \log a_d + \log\det C.

    Parameters
    ----------
    loc : Tensor of shape (D,)
        :math:`\mu`.
    prec_factor : Tensor of shape (D, K)
        :math:`U`.
    prec_diag : Tensor of shape (D,)
        :math:`a`, positive.
    validate_args : bool, optional

    Notes
    -----
    Construction costs :math:`O(DK^2)`; a draw, a log-density or the variances :math:`O(DK)` each
    (:math:`O(DK^2)` for the variances). Memory :math:`O(DK)`.

    Examples
    --------
    >>> q = LowRankPrecisionNormal(torch.zeros(3), torch.ones(3, 1), torch.ones(3))
    >>> torch.allclose(q.variance, torch.linalg.inv(torch.eye(3) + torch.ones(3, 3)).diagonal())
    True
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "prec_factor": constraints.independent(constraints.real, 2),
        "prec_diag": constraints.independent(constraints.positive, 1),
    }
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: Tensor, prec_factor: Tensor, prec_diag: Tensor, validate_args: Optional[bool] = None):
        name = type(self).__name__
        if loc.dim() != 1:
            raise ValueError(f"{name}: loc must have shape (D,), got {tuple(loc.shape)!r}.")
        D = loc.shape[0]
        if prec_factor.dim() != 2 or prec_factor.shape[0] != D:
            raise ValueError(f"{name}: prec_factor must have shape ({D}, K), got {tuple(prec_factor.shape)!r}.")
        if prec_diag.shape != (D,):
            raise ValueError(f"{name}: prec_diag must have shape ({D},), got {tuple(prec_diag.shape)!r}.")
        self.loc, self.prec_factor, self.prec_diag = loc, prec_factor, prec_diag
        super().__init__(torch.Size(), torch.Size((D,)), validate_args=validate_args)

    # ------------------------------------------------------------------ factorisations (cached)
    @lazy_property
    def _capacitance_tril(self) -> Tensor:
        r"""Cholesky factor of :math:`C = I + U^\top A^{-1} U`, shape (K, K), in float64."""
        wide = wide_dtype(self.loc.device)
        W = self.prec_factor.to(wide) * self.prec_diag.to(wide).rsqrt().unsqueeze(-1)
        K = W.shape[-1]
        C = torch.eye(K, dtype=wide, device=W.device) + W.T @ W
        return torch.linalg.cholesky(C)

    @lazy_property
    def cov_factor(self) -> Tensor:
        r""":math:`B = A^{-1} U L^{-\top}` of shape (D, K), with :math:`LL^\top = C`: :math:`P^{-1} = A^{-1} - BB^\top`."""
        wide = self._capacitance_tril.dtype
        AU = self.prec_factor.to(wide) / self.prec_diag.to(wide).unsqueeze(-1)
        B = torch.linalg.solve_triangular(self._capacitance_tril, AU.T, upper=False).T
        return B.to(self.loc.dtype)

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`1/a`, shape (D,): the diagonal part of :math:`P^{-1} = \mathrm{diag}(1/a) - BB^\top`."""
        return self.prec_diag.reciprocal()

    def log_det_precision(self) -> Tensor:
        r""":math:`\log\det P`, a scalar (differentiable in ``prec_factor`` and ``prec_diag``)."""
        L = self._capacitance_tril
        return (self.prec_diag.to(L.dtype).log().sum() + 2 * L.diagonal().log().sum()).to(self.loc.dtype)

    # ------------------------------------------------------------------ moments
    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def mode(self) -> Tensor:
        return self.loc

    @lazy_property
    def variance(self) -> Tensor:
        r"""Diagonal of :math:`P^{-1}`, shape (D,): :math:`1/a_d - \sum_k B_{dk}^2`, in :math:`O(DK^2)`."""
        wide = self._capacitance_tril.dtype
        AU = self.prec_factor.to(wide) / self.prec_diag.to(wide).unsqueeze(-1)
        B = torch.linalg.solve_triangular(self._capacitance_tril, AU.T, upper=False).T
        return (self.prec_diag.to(wide).reciprocal() - B.pow(2).sum(-1)).to(self.loc.dtype)

    @property
    def covariance_matrix(self) -> Tensor:
        r"""The dense :math:`P^{-1}`, shape (D, D); refused past :data:`pyro_fa.fa.linalg.MAX_DENSE_DIM`."""
        D = self.loc.shape[0]
        check_dense_dim(type(self).__name__, "covariance_matrix", D, self.loc.dtype,
                        "Use variance, cov_factor / cov_diag, or rsample().")
        B = self.cov_factor
        return torch.diag_embed(self.cov_diag) - B @ B.T

    @property
    def precision_matrix(self) -> Tensor:
        r"""The dense :math:`P`, shape (D, D); refused past :data:`pyro_fa.fa.linalg.MAX_DENSE_DIM`."""
        D = self.loc.shape[0]
        check_dense_dim(type(self).__name__, "precision_matrix", D, self.loc.dtype,
                        "Use prec_factor and prec_diag.")
        return torch.diag_embed(self.prec_diag) + self.prec_factor @ self.prec_factor.T

    # ------------------------------------------------------------------ algebra
    def precision_matvec(self, v: Tensor) -> Tensor:
        r""":math:`Pv` for ``v`` of shape (..., D), in :math:`O(DK)`."""
        return v * self.prec_diag + (v @ self.prec_factor) @ self.prec_factor.T

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r""":math:`P^{-1}v` for ``v`` of shape (..., D), in :math:`O(DK)` (Woodbury)."""
        B = self.cov_factor
        return v / self.prec_diag - (v @ B) @ B.T

    def covariance_quadratic(self, v: Tensor) -> Tensor:
        r""":math:`v^\top P^{-1} v` for ``v`` of shape (D,), a scalar (differentiable), by Woodbury:
        :math:`\sum_d v_d^2/a_d - \|L^{-1}U^\top A^{-1}v\|^2`, in the capacitance's float64 (the two sums
        cancel where :math:`v` lies in the low-rank part)."""
        L = self._capacitance_tril
        a, w = self.prec_diag.to(L.dtype), v.to(L.dtype)
        sums = torch.cat([(w.pow(2) / a).sum().reshape(1), self.prec_factor.to(L.dtype).T @ (w / a)])
        return _woodbury_quadratic(sums, L).to(v.dtype)

    # ------------------------------------------------------------------ Distribution API
    def rsample(self, sample_shape=torch.Size()) -> Tensor:
        r"""Draws of shape ``sample_shape + (D,)``: :math:`\mu + P^{-1}z`, :math:`z = A^{1/2}\varepsilon_1 + U\varepsilon_2 \sim N(0, P)`.

        The covariance of :math:`P^{-1}z` is :math:`P^{-1}PP^{-1} = P^{-1}`; cost :math:`O(DK)` per draw.
        """
        shape = self._extended_shape(sample_shape)
        K = self.prec_factor.shape[-1]
        eps_d = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        eps_k = torch.randn(tuple(sample_shape) + (K,), dtype=self.loc.dtype, device=self.loc.device)
        z = self.prec_diag.sqrt() * eps_d + eps_k @ self.prec_factor.T
        return self.loc + self.covariance_matvec(z)

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log N(x; \mu, P^{-1}) = \tfrac12(\log\det P - D\log 2\pi - (x-\mu)^\top P (x-\mu))`, shape ``value.shape[:-1]``."""
        if self._validate_args:
            self._validate_sample(value)
        d = value - self.loc
        quad = (d.pow(2) * self.prec_diag).sum(-1) + (d @ self.prec_factor).pow(2).sum(-1)
        D = self.loc.shape[0]
        return 0.5 * (self.log_det_precision() - D * math.log(2 * math.pi) - quad)

    def entropy(self) -> Tensor:
        r""":math:`\tfrac D2 (1 + \log 2\pi) - \tfrac12 \log\det P`, a scalar."""
        D = self.loc.shape[0]
        return 0.5 * D * (1.0 + math.log(2 * math.pi)) - 0.5 * self.log_det_precision()

    def expand(self, batch_shape, _instance=None):
        if tuple(batch_shape) != ():
            raise NotImplementedError(f"{type(self).__name__}: batch shapes are not supported, got {batch_shape!r}.")
        return self


def _woodbury_quadratic(sums: Tensor, L: Tensor) -> Tensor:
    r""":math:`v^\top P^{-1}v` from ``sums`` :math:`= (\sum_d v_d^2/a_d, U^\top A^{-1}v)` (shape (K + 1,), summed
    over all rows) and the capacitance's Cholesky factor ``L``."""
    return sums[0] - torch.linalg.solve_triangular(L, sums[1:].unsqueeze(-1), upper=False).pow(2).sum()
