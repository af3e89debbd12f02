r"""A Laplace approximation sharded by coordinates over ``torch.distributed`` ranks.

With ``FactorLaplace(..., process_group=...)`` rank :math:`r` of :math:`W` holds rows :math:`[lo_r, hi_r)` of
:math:`\theta_*`, :math:`F` and :math:`\psi` (the layout of ``OnlineFactorAnalysis(process_group=...)``,
:func:`~pyro_fa.distributed.shard_bounds`), :math:`D_r \approx D/W` rows, never the whole :math:`D\times K`
factor. Everything the posterior computes is row-local or a sum over :math:`D` of a few numbers per row:

* the capacitance :math:`C = I + U^\top A^{-1} U` (:math:`K\times K`) and :math:`\sum_d \log a_d`: one
  all-reduce of :math:`K^2 + 1` numbers, after which every Woodbury solve, the determinant and the variances
  are row-local;
* a draw: :math:`P^{-1}z` with :math:`z = A^{1/2}\varepsilon_1 + U\varepsilon_2` needs :math:`B^\top z`
  (:math:`K` numbers per draw), :math:`\varepsilon_2` shared by the ranks, :math:`\varepsilon_1` per rank;
* the GLM predictive: :math:`J\,\mathrm{diag}(1/a)\,J^\top - (JB)(JB)^\top` from each rank's columns of the
  per-example Jacobians, :math:`C^2 + CK` numbers per example all-reduced;
* the log marginal likelihood: three sums over :math:`D` more, by an all-reduce that gradients pass through.

Gradients (the marginal likelihood's, for the prior precision and the noise): a sum over the ranks passes the
gradient back unchanged (every rank evaluates the same objective of the summed values, so the gradient of
one rank's partial sum is that of the sum), and a hyperparameter that every rank holds enters the ranks'
partial sums through :func:`replicated`, whose backward pass sums the ranks' partial gradients: every rank
ends with the gradient of the whole objective.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.distributed.sharding import Sharding, resolve_group, shard_bounds
from pyro_fa.distributions.numerics import wide_dtype
from pyro_fa.distributions import FactorNormal
from pyro_fa.distributions.precision import woodbury_quadratic as _woodbury_quadratic

__all__ = ["ShardedLowRankPrecisionNormal", "all_reduce_sum", "replicated", "make_laplace_sharding"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; the backward pass is the identity (every rank differentiates the same objective)."""

    @staticmethod
    def forward(ctx, x: Tensor, sharding) -> Tensor:
        buf = x.detach().to(dtype=torch.float64, device=sharding.device).clone()
        sharding.all_reduce(buf)
        return buf.to(dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def all_reduce_sum(x: Tensor, sharding) -> Tensor:
    """``x`` summed over the ranks of ``sharding`` (carried in float64); differentiable, collective."""
    return _AllReduceSum.apply(x, sharding)


class _Replicated(torch.autograd.Function):
    """The identity; the backward pass sums the gradient over the ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, sharding) -> Tensor:
        ctx.sharding = sharding
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        buf = grad.to(dtype=torch.float64, device=ctx.sharding.device).clone()
        ctx.sharding.all_reduce(buf)
        return buf.to(dtype=grad.dtype, device=grad.device), None


def replicated(x: Tensor, sharding) -> Tensor:
    """``x``, a value every rank holds, as it enters this rank's partial sums: the backward pass all-reduces its
    gradient (collective in the backward pass: every rank differentiates the same objective)."""
    return _Replicated.apply(x, sharding)


def make_laplace_sharding(process_group, dim: int, owner: str):
    """The :class:`~pyro_fa.distributed.Sharding` of ``dim`` rows over ``process_group`` (even blocks in rank order).

    Raises (on every rank alike) when ``torch.distributed`` is not initialised, ``process_group`` is not a
    group of this process, or ``dim`` is smaller than the world size.
    """
    import torch.distributed as dist

    group = resolve_group(process_group, owner)
    W = dist.get_world_size(group)
    if dim < W:
        raise ValueError(f"{owner}: a sharded fit needs at least one weight per rank, got D={dim} weights for "
                         f"{W} ranks.")
    return Sharding(group, dim, [shard_bounds(dim, W, r) for r in range(W)])


class ShardedLowRankPrecisionNormal(FactorNormal):
    r"""This rank's rows of :math:`N(\mu, P^{-1})`, :math:`P = \mathrm{diag}(a) + UU^\top`, over a sharded :math:`\theta`.

    The algebra of :class:`~pyro_fa.distributions.LowRankPrecisionNormal` with its sums over :math:`D`
    all-reduced; every method that needs one is collective (all ranks call it, with the same arguments).
    The sharded precision form of the family :class:`~pyro_fa.distributions.FactorNormal`
    (:math:`\Sigma = \mathrm{diag}(1/a) - BB^\top`, ``factor_sign`` -1): ``event_shape`` is the whole
    ``(D,)``, the tensors it returns and takes are this rank's rows; :attr:`covariance_matrix` is refused.

    Parameters
    ----------
    loc : Tensor of shape (D_r,)
    prec_factor : Tensor of shape (D_r, K)
    prec_diag : Tensor of shape (D_r,), positive
        This rank's rows of :math:`\mu`, :math:`U` and :math:`a`.
    sharding : pyro_fa.distributed.Sharding
    """

    def __init__(self, loc: Tensor, prec_factor: Tensor, prec_diag: Tensor, sharding):
        name = type(self).__name__
        if loc.shape != (sharding.size,) or prec_diag.shape != (sharding.size,) or prec_factor.dim() != 2 \
                or prec_factor.shape[0] != sharding.size:
            raise ValueError(f"{name}: loc, prec_factor and prec_diag must hold this rank's {sharding.size} rows, "
                             f"got shapes {tuple(loc.shape)}, {tuple(prec_factor.shape)}, {tuple(prec_diag.shape)}.")
        self.loc, self.prec_factor, self.prec_diag, self.sharding = loc, prec_factor, prec_diag, sharding
        self._cached: Optional[Tuple[Tensor, Tensor]] = None
        super().__init__(torch.Size(), torch.Size([sharding.dim]), validate_args=False)

    arg_constraints = {}  # this rank's rows: torch's argument and sample checks would expect all D
    has_rsample = True
    factor_sign = -1.0

    def _reduced(self) -> Tuple[Tensor, Tensor]:
        r""":math:`\sum_d \log a_d` and the Cholesky factor of the capacitance, float64 (one all-reduce, cached)."""
        if self._cached is None:
            wide = wide_dtype(self.loc.device)
            a = self.prec_diag.to(wide)
            W = self.prec_factor.to(wide) * a.rsqrt().unsqueeze(-1)
            K = W.shape[-1]
            local = torch.cat([a.log().sum().reshape(1), (W.T @ W).reshape(-1)])
            total = all_reduce_sum(local, self.sharding)
            cap = torch.eye(K, dtype=wide, device=W.device) + total[1:].reshape(K, K)
            self._cached = (total[0], torch.linalg.cholesky(cap))
        return self._cached

    @property
    def _capacitance_tril(self) -> Tensor:
        return self._reduced()[1]

    @property
    def cov_factor(self) -> Tensor:
        r"""This rank's rows of :math:`B = A^{-1}UL^{-\top}` (shape (D_r, K)): :math:`P^{-1} = A^{-1} - BB^\top`."""
        L = self._capacitance_tril
        AU = self.prec_factor.to(L.dtype) / self.prec_diag.to(L.dtype).unsqueeze(-1)
        return torch.linalg.solve_triangular(L, AU.T, upper=False).T.to(self.loc.dtype)

    @property
    def cov_diag(self) -> Tensor:
        """This rank's rows of :math:`1/a`, shape (D_r,)."""
        return self.prec_diag.reciprocal()

    def log_det_precision(self) -> Tensor:
        r""":math:`\log\det P` of the whole precision, a scalar (differentiable; collective)."""
        log_a, L = self._reduced()
        return (log_a + 2 * L.diagonal().log().sum()).to(self.loc.dtype)

    def covariance_quadratic(self, v: Tensor) -> Tensor:
        r""":math:`v^\top P^{-1} v` of the whole vector from this rank's rows ``v`` (shape (D_r,)), a scalar
        (differentiable; collective: one all-reduce of K + 1 numbers)."""
        L = self._capacitance_tril
        a, w = self.prec_diag.to(L.dtype), v.to(L.dtype)
        local = torch.cat([(w.pow(2) / a).sum().reshape(1), self.prec_factor.to(L.dtype).T @ (w / a)])
        return _woodbury_quadratic(all_reduce_sum(local, self.sharding), L).to(v.dtype)

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def variance(self) -> Tensor:
        """This rank's rows of the diagonal of :math:`P^{-1}`, shape (D_r,) (collective on first use)."""
        B = self.cov_factor.to(torch.float64)
        return (self.prec_diag.to(torch.float64).reciprocal() - B.pow(2).sum(-1)).to(self.loc.dtype)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        r"""This rank's rows of :math:`P^{-1}v = v/a - B(B^\top v)` from this rank's rows of ``v`` (..., D_r).

        Collective (one all-reduce of K numbers per vector; differentiable).
        """
        B = self.cov_factor
        low = all_reduce_sum((v.unsqueeze(-2) @ B).squeeze(-2), self.sharding)
        return v / self.prec_diag - (B @ low.unsqueeze(-1)).squeeze(-1)

    @property
    def covariance_matrix(self) -> Tensor:
        """Refused: the whole D x D matrix is on no rank."""
        raise RuntimeError(f"{type(self).__name__}: covariance_matrix needs the whole D x D matrix, got a "
                           "distribution sharded over a process group.")

    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        r"""This rank's rows of draws :math:`\mu + P^{-1}z`, shape ``sample_shape + (D_r,)`` (collective).

        :math:`z = A^{1/2}\varepsilon_1 + U\varepsilon_2`: :math:`\varepsilon_2` (K numbers per draw) is drawn by
        rank 0 and broadcast, :math:`\varepsilon_1` by each rank for its rows from a generator seeded by rank 0
        and the rank, so the rows gathered over the ranks are one draw of the whole vector; :math:`P^{-1}z`
        needs :math:`B^\top z`, one all-reduce of K numbers per draw.
        """
        shape = torch.Size(sample_shape)
        S, K = int(shape.numel()), self.prec_factor.shape[-1]
        self.sharding.agree_sizes(type(self).__name__, "number of draws", S)
        ref = self.loc
        h, gen = self.sharding.shared_normal(S, K, generator, ref.dtype, ref.device)
        eps = torch.randn(S, ref.shape[-1], generator=gen, dtype=ref.dtype, device=ref.device)
        z = self.prec_diag.sqrt() * eps + h @ self.prec_factor.T
        B = self.cov_factor
        Btz = all_reduce_sum(z @ B, self.sharding)
        return (ref + z / self.prec_diag - Btz @ B.T).reshape(shape + ref.shape)

    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density of whole vectors given by this rank's rows ``value`` (..., D_r); collective."""
        if value.shape[-1] != self.loc.shape[-1]:
            raise ValueError(f"{type(self).__name__}: value must have last dimension {self.loc.shape[-1]} (this "
                             f"rank's rows), got shape {tuple(value.shape)!r}.")
        batch = value.shape[:-1]
        self.sharding.agree_sizes(type(self).__name__, "number of vectors to log_prob", int(batch.numel()))
        d = (value - self.loc).reshape(-1, value.shape[-1]).to(torch.float64)
        U = self.prec_factor.to(torch.float64)
        local = torch.cat([(d.pow(2) * self.prec_diag.to(torch.float64)).sum(-1, keepdim=True), d @ U], -1)
        total = all_reduce_sum(local, self.sharding)
        quad = total[:, 0] + total[:, 1:].pow(2).sum(-1)
        out = 0.5 * (self.log_det_precision().to(torch.float64) - self.sharding.dim * math.log(2 * math.pi) - quad)
        return out.reshape(batch).to(self.loc.dtype)

    def entropy(self) -> Tensor:
        r""":math:`\tfrac D2(1 + \log 2\pi) - \tfrac12\log\det P`, a scalar (collective)."""
        return 0.5 * self.sharding.dim * (1.0 + math.log(2 * math.pi)) - 0.5 * self.log_det_precision()
