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
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

from pyro_fa import _random
from pyro_fa.distributions.base import FactorNormal
from pyro_fa.distributions.numerics import check_dense_dim, wide_dtype

__all__ = ["LowRankPrecisionNormal", "BlockLowRankPrecisionNormal", "woodbury_quadratic"]


class _PrecisionNormal(FactorNormal):
    r"""What a Gaussian :math:`N(\mu, P^{-1})` given by its precision's factors shares: the moments, the log-density
    from :meth:`log_det_precision` and a :meth:`_precision_quadratic`, the entropy; no batch shapes. In the family's
    terms :math:`\Sigma = \mathrm{diag}(1/a) - BB^\top` (:attr:`factor_sign` = -1)."""

    factor_sign = -1.0

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def mode(self) -> Tensor:
        return self.loc

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log N(x; \mu, P^{-1}) = \tfrac12(\log\det P - D\log 2\pi - (x-\mu)^\top P (x-\mu))`, shape ``value.shape[:-1]``."""
        if self._validate_args:
            self._validate_sample(value)
        quad = self._precision_quadratic(value - self.loc)
        return 0.5 * (self.log_det_precision() - self.loc.shape[0] * math.log(2 * math.pi) - quad)

    def entropy(self) -> Tensor:
        r""":math:`\tfrac D2 (1 + \log 2\pi) - \tfrac12 \log\det P`, a scalar."""
        return 0.5 * self.loc.shape[0] * (1.0 + math.log(2 * math.pi)) - 0.5 * self.log_det_precision()

    def expand(self, batch_shape, _instance=None):
        if tuple(batch_shape) != ():
            raise NotImplementedError(f"{type(self).__name__}: batch shapes are not supported, got {batch_shape!r}.")
        return self


class LowRankPrecisionNormal(_PrecisionNormal):
    r"""Multivariate normal :math:`N(\mu, P^{-1})` with precision :math:`P = \mathrm{diag}(a) + UU^\top`.

    The counterpart of :class:`torch.distributions.LowRankMultivariateNormal` (low-rank plus diagonal
    *covariance*) for a Laplace approximation, whose curvature, not covariance, is fitted by factor
    analysis. The capacitance :math:`C = I + U^\top A^{-1}U` is formed and factorised in float64 (as
    :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` does), so float32 states stay well
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
    @lazy_property
    def variance(self) -> Tensor:
        r"""Diagonal of :math:`P^{-1}`, shape (D,): :math:`1/a_d - \sum_k B_{dk}^2`, in :math:`O(DK^2)`."""
        wide = self._capacitance_tril.dtype
        AU = self.prec_factor.to(wide) / self.prec_diag.to(wide).unsqueeze(-1)
        B = torch.linalg.solve_triangular(self._capacitance_tril, AU.T, upper=False).T
        return (self.prec_diag.to(wide).reciprocal() - B.pow(2).sum(-1)).to(self.loc.dtype)

    @property
    def covariance_matrix(self) -> Tensor:
        r"""The dense :math:`P^{-1}`, shape (D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
        D = self.loc.shape[0]
        check_dense_dim(type(self).__name__, "covariance_matrix", D, self.loc.dtype,
                        "Use variance, cov_factor / cov_diag, or rsample().")
        B = self.cov_factor
        return torch.diag_embed(self.cov_diag) - B @ B.T

    @property
    def precision_matrix(self) -> Tensor:
        r"""The dense :math:`P`, shape (D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
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
        return woodbury_quadratic(sums, L).to(v.dtype)

    # ------------------------------------------------------------------ Distribution API
    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draws of shape ``sample_shape + (D,)``: :math:`\mu + P^{-1}z`, :math:`z = A^{1/2}\varepsilon_1 + U\varepsilon_2 \sim N(0, P)`.

        The covariance of :math:`P^{-1}z` is :math:`P^{-1}PP^{-1} = P^{-1}`; cost :math:`O(DK)` per draw.
        ``generator``: a :class:`torch.Generator` on any device (``None``: the global one).
        """
        shape = self._extended_shape(sample_shape)
        K = self.prec_factor.shape[-1]
        eps_d = _random.randn(shape, generator, self.loc.dtype, self.loc.device)
        eps_k = _random.randn(tuple(sample_shape) + (K,), generator, self.loc.dtype, self.loc.device)
        z = self.prec_diag.sqrt() * eps_d + eps_k @ self.prec_factor.T
        return self.loc + self.covariance_matvec(z)

    def _precision_quadratic(self, d: Tensor) -> Tensor:
        r""":math:`d^\top P d` for ``d`` of shape (..., D)."""
        return (d.pow(2) * self.prec_diag).sum(-1) + (d @ self.prec_factor).pow(2).sum(-1)


def woodbury_quadratic(sums: Tensor, L: Tensor) -> Tensor:
    r""":math:`v^\top P^{-1}v` from ``sums`` :math:`= (\sum_d v_d^2/a_d, U^\top A^{-1}v)` (shape (K + 1,), summed
    over all rows) and the capacitance's Cholesky factor ``L``."""
    return sums[0] - torch.linalg.solve_triangular(L, sums[1:].unsqueeze(-1), upper=False).pow(2).sum()


class BlockLowRankPrecisionNormal(_PrecisionNormal):
    r"""Multivariate normal :math:`N(\mu, P^{-1})` whose precision's low-rank part is block diagonal.

    .. math::

        P = \mathrm{diag}(a) + \mathrm{blockdiag}_b(U_bU_b^\top), \qquad U_b \in \mathbb{R}^{D_b\times K_b},

    the blocks tiling the coordinates in order (:math:`[0, e_1), [e_1, e_2), \dots, [e_{B-1}, D)`). It is
    :class:`LowRankPrecisionNormal` with :math:`U = \mathrm{blockdiag}(U_b)`, and the same interface, but as
    :math:`A` is diagonal the capacitance :math:`C = I + U^\top A^{-1}U = \mathrm{blockdiag}(C_b)`,
    :math:`C_b = I + U_b^\top A_b^{-1}U_b`, is block diagonal too: each block is factorised on its own, the
    inverse and the determinant are the blocks',

    .. math::

        P^{-1} = \mathrm{blockdiag}_b\big(A_b^{-1} - B_bB_b^\top\big), \quad B_b = A_b^{-1}U_bL_b^{-\top},
        \qquad \log\det P = \sum_d \log a_d + \sum_b \log\det C_b,

    and no :math:`D\times\sum_b K_b` matrix with zeros off the blocks is held (a separate class, not an option
    of :class:`LowRankPrecisionNormal`: every method differs, and the single block keeps its code unchanged).
    The capacitances are factorised in float64, as there.

    Parameters
    ----------
    loc : Tensor of shape (D,)
        :math:`\mu`.
    prec_factors : sequence of (int, int, Tensor)
        ``(lo, hi, U_b)`` with ``U_b`` of shape (hi - lo, K_b) (``K_b`` may be 0), the ranges tiling
        ``[0, D)`` in order.
    prec_diag : Tensor of shape (D,)
        :math:`a`, positive.
    validate_args : bool, optional

    Raises
    ------
    ValueError
        Shapes that disagree, ranges that do not tile ``[0, D)``, a block of another dtype or device than ``loc``.

    Notes
    -----
    Construction costs :math:`O(\sum_b D_bK_b^2)` instead of :math:`O(D(\sum_b K_b)^2)`, memory
    :math:`O(\sum_b D_bK_b)` instead of :math:`O(D\sum_b K_b)`; a draw or a log-density :math:`O(\sum_b D_bK_b)`.
    :attr:`prec_factor` and :attr:`cov_factor` form the dense :math:`D\times\sum_b K_b` matrices on request.

    Examples
    --------
    >>> q = BlockLowRankPrecisionNormal(torch.zeros(3), [(0, 2, torch.ones(2, 1)), (2, 3, torch.ones(1, 1))],
    ...                                 torch.ones(3))
    >>> torch.allclose(q.variance, torch.tensor([2 / 3, 2 / 3, 1 / 2]))
    True
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "prec_diag": constraints.independent(constraints.positive, 1),
    }
    def __init__(self, loc: Tensor, prec_factors: Sequence[Tuple[int, int, Tensor]], prec_diag: Tensor,
                 validate_args: Optional[bool] = None):
        name = type(self).__name__
        if loc.dim() != 1:
            raise ValueError(f"{name}: loc must have shape (D,), got {tuple(loc.shape)!r}.")
        D = loc.shape[0]
        if prec_diag.shape != (D,):
            raise ValueError(f"{name}: prec_diag must have shape ({D},), got {tuple(prec_diag.shape)!r}.")
        blocks = list(prec_factors)
        end = 0
        for block in blocks:
            lo, hi, U = block if isinstance(block, (tuple, list)) and len(block) == 3 else (None, None, None)
            if lo != end or not isinstance(hi, int) or hi <= lo or not torch.is_tensor(U) or U.dim() != 2 \
                    or U.shape[0] != hi - lo:
                raise ValueError(f"{name}: prec_factors must be (lo, hi, U_b) with U_b of shape (hi - lo, K_b), the "
                                 f"ranges tiling [0, {D}) in order, got {_layout(blocks)!r}.")
            if U.dtype != loc.dtype or U.device != loc.device:
                raise ValueError(f"{name}: prec_factors must be on loc's dtype and device ({loc.dtype}, "
                                 f"{loc.device}), got ({U.dtype}, {U.device}) for block [{lo}, {hi}).")
            end = hi
        if end != D or not blocks:
            raise ValueError(f"{name}: prec_factors must tile [0, {D}) in order, got {_layout(blocks)!r}.")
        self.loc, self.prec_diag = loc, prec_diag
        self.prec_factors = [(int(lo), int(hi), U) for lo, hi, U in blocks]
        self._sizes = [hi - lo for lo, hi, _ in self.prec_factors]
        super().__init__(torch.Size(), torch.Size((D,)), validate_args=validate_args)

    def _split(self, v: Tensor):
        """``v`` (..., D) as its blocks' pieces (..., D_b)."""
        return v.split(self._sizes, dim=-1)

    # ------------------------------------------------------------------ factorisations (cached)
    @lazy_property
    def _capacitance_trils(self):
        r"""Each block's Cholesky factor of :math:`C_b = I + U_b^\top A_b^{-1} U_b`, shape (K_b, K_b), in float64."""
        wide = wide_dtype(self.loc.device)
        trils = []
        for (_, _, U), a in zip(self.prec_factors, self._split(self.prec_diag.to(wide))):
            W = U.to(wide) * a.rsqrt().unsqueeze(-1)
            trils.append(torch.linalg.cholesky(torch.eye(W.shape[-1], dtype=wide, device=W.device) + W.T @ W))
        return trils

    def _wide_cov_factors(self):
        r"""Each block's :math:`B_b = A_b^{-1}U_bL_b^{-\top}` (D_b, K_b), in the capacitance's float64."""
        wide = wide_dtype(self.loc.device)
        return [torch.linalg.solve_triangular(L, (U.to(wide) / a.unsqueeze(-1)).T, upper=False).T
                for (_, _, U), a, L in zip(self.prec_factors, self._split(self.prec_diag.to(wide)),
                                           self._capacitance_trils)]

    @lazy_property
    def cov_factors(self):
        r"""``(lo, hi, B_b)`` per block, ``B_b`` of shape (D_b, K_b): :math:`P^{-1} = A^{-1} - \mathrm{blockdiag}(B_bB_b^\top)`
        (what :func:`~pyro_fa.predictive.glm.linearized_moments` takes as ``cov_factor``)."""
        return [(lo, hi, B.to(self.loc.dtype)) for (lo, hi, _), B in zip(self.prec_factors, self._wide_cov_factors())]

    @property
    def cov_factor(self) -> Tensor:
        r"""The dense :math:`\mathrm{blockdiag}(B_b)` of shape (D, :math:`\sum_b K_b`), zeros off the blocks: formed on
        request, :math:`O(D\sum_b K_b)` memory (:attr:`cov_factors` holds the blocks)."""
        return _dense(self.cov_factors, self.loc)

    @property
    def prec_factor(self) -> Tensor:
        r"""The dense :math:`U = \mathrm{blockdiag}(U_b)` of shape (D, :math:`\sum_b K_b`): formed on request."""
        return _dense(self.prec_factors, self.loc)

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`1/a`, shape (D,)."""
        return self.prec_diag.reciprocal()

    def log_det_precision(self) -> Tensor:
        r""":math:`\log\det P = \sum_d \log a_d + \sum_b \log\det C_b`, a scalar (differentiable)."""
        wide = wide_dtype(self.loc.device)
        total = self.prec_diag.to(wide).log().sum()
        for L in self._capacitance_trils:
            total = total + 2 * L.diagonal().log().sum()
        return total.to(self.loc.dtype)

    # ------------------------------------------------------------------ moments
    @lazy_property
    def variance(self) -> Tensor:
        r"""Diagonal of :math:`P^{-1}`, shape (D,), in :math:`O(\sum_b D_bK_b^2)`."""
        wide = wide_dtype(self.loc.device)
        low = torch.cat([B.pow(2).sum(-1) for B in self._wide_cov_factors()])
        return (self.prec_diag.to(wide).reciprocal() - low).to(self.loc.dtype)

    @property
    def covariance_matrix(self) -> Tensor:
        r"""The dense :math:`P^{-1}`, shape (D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
        check_dense_dim(type(self).__name__, "covariance_matrix", self.loc.shape[0], self.loc.dtype,
                        "Use variance, cov_factors / cov_diag, or rsample().")
        B = self.cov_factor
        return torch.diag_embed(self.cov_diag) - B @ B.T

    @property
    def precision_matrix(self) -> Tensor:
        r"""The dense :math:`P`, shape (D, D); refused past :data:`~pyro_fa.distributions.numerics.MAX_DENSE_DIM`."""
        check_dense_dim(type(self).__name__, "precision_matrix", self.loc.shape[0], self.loc.dtype,
                        "Use prec_factors and prec_diag.")
        U = self.prec_factor
        return torch.diag_embed(self.prec_diag) + U @ U.T

    # ------------------------------------------------------------------ algebra
    def precision_matvec(self, v: Tensor) -> Tensor:
        r""":math:`Pv` for ``v`` of shape (..., D), in :math:`O(\sum_b D_bK_b)`."""
        low = [(vb @ U) @ U.T for vb, (_, _, U) in zip(self._split(v), self.prec_factors)]
        return v * self.prec_diag + torch.cat(low, -1)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r""":math:`P^{-1}v` for ``v`` of shape (..., D), in :math:`O(\sum_b D_bK_b)` (Woodbury per block)."""
        low = [(vb @ B) @ B.T for vb, (_, _, B) in zip(self._split(v), self.cov_factors)]
        return v / self.prec_diag - torch.cat(low, -1)

    def covariance_quadratic(self, v: Tensor) -> Tensor:
        r""":math:`v^\top P^{-1} v` for ``v`` of shape (D,), a scalar (differentiable): the blocks' Woodbury
        quadratics (:meth:`LowRankPrecisionNormal.covariance_quadratic`) summed, in float64."""
        wide = wide_dtype(self.loc.device)
        total = v.new_zeros((), dtype=wide)
        for vb, ab, (_, _, U), L in zip(self._split(v.to(wide)), self._split(self.prec_diag.to(wide)),
                                        self.prec_factors, self._capacitance_trils):
            sums = torch.cat([(vb.pow(2) / ab).sum().reshape(1), U.to(wide).T @ (vb / ab)])
            total = total + woodbury_quadratic(sums, L)
        return total.to(v.dtype)

    # ------------------------------------------------------------------ Distribution API
    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draws of shape ``sample_shape + (D,)``: :math:`\mu + P^{-1}z`, :math:`z = A^{1/2}\varepsilon_1 +
        \mathrm{blockdiag}(U_b)\varepsilon_2 \sim N(0, P)`; the same random numbers, in the same order, as
        :meth:`LowRankPrecisionNormal.rsample` with the dense :math:`U`, so the same draws up to rounding."""
        shape = self._extended_shape(sample_shape)
        ranks = [U.shape[-1] for _, _, U in self.prec_factors]
        eps_d = _random.randn(shape, generator, self.loc.dtype, self.loc.device)
        eps_k = _random.randn(tuple(sample_shape) + (sum(ranks),), generator, self.loc.dtype, self.loc.device)
        low = [e @ U.T for e, (_, _, U) in zip(eps_k.split(ranks, dim=-1), self.prec_factors)]
        z = self.prec_diag.sqrt() * eps_d + torch.cat(low, -1)
        return self.loc + self.covariance_matvec(z)

    def _precision_quadratic(self, d: Tensor) -> Tensor:
        r""":math:`d^\top P d` for ``d`` of shape (..., D), block by block."""
        quad = (d.pow(2) * self.prec_diag).sum(-1)
        for db, (_, _, U) in zip(self._split(d), self.prec_factors):
            quad = quad + (db @ U).pow(2).sum(-1)
        return quad


def _layout(blocks):
    """The ranges and factor shapes of ``(lo, hi, U_b)`` blocks, for an error message."""
    return [(b[0], b[1], tuple(b[2].shape) if torch.is_tensor(b[2]) else type(b[2]).__name__)
            if isinstance(b, (tuple, list)) and len(b) == 3 else b for b in blocks]


def _dense(blocks, ref: Tensor) -> Tensor:
    """``blockdiag`` of ``(lo, hi, F_b)`` blocks, shape (D, sum of K_b), zeros off the blocks."""
    out = ref.new_zeros(ref.shape[0], sum(F.shape[-1] for _, _, F in blocks))
    col = 0
    for lo, hi, F in blocks:
        out[lo:hi, col:col + F.shape[-1]] = F
        col += F.shape[-1]
    return out
