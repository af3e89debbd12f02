r"""The linear algebra of :class:`~pyro_fa.optim.BatchedFactorIVON`: :mod:`pyro_fa.optim._lowrank`'s sketch update
and Woodbury factorisation, draws and solves, for R independent replicas at once (a leading replica dimension).

Each function is, replica by replica, the unbatched function's arithmetic (the same formulas and the same
decisions: the second Gram-Schmidt pass, the dropped directions, the row shrinking), without its chunking by
columns (meant for networks small enough to batch): equal to it to rounding (``tests/test_factor_ivon_batched.py``).
Shapes: bases :math:`Q^\top` (R, K, D), eigenvalues (R, K), vectors (R, D), stacked pairs (R, 2M, D).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

__all__ = ["BatchedWoodbury", "factorise_batched", "sketch_update_batched"]

#: a second Gram-Schmidt pass when a vector keeps less than this fraction of its norm after the first (as unbatched)
_REORTHOGONALISE = 2.0 / 3.0


def _orthonormalise_rows(R: Tensor) -> Tensor:
    r""":func:`pyro_fa.optim._lowrank._orthonormalise_rows` per replica: Gram-Schmidt twice on the rows of ``R``
    (B, n, D), in place; returns the (B, n, n) upper-triangular :math:`R_2` (:math:`R^\top = Q_2R_2`)."""
    B, n, _ = R.shape
    R2 = R.new_zeros(B, n, n)
    for j in range(n):
        row = R[:, j]
        for _ in range(2 if j else 0):
            c = (R[:, :j] @ row.unsqueeze(-1)).squeeze(-1)  # (B, j)
            row.sub_((c.unsqueeze(-2) @ R[:, :j]).squeeze(-2))
            R2[:, :j, j] += c
        norm = row.norm(dim=-1)
        R2[:, j, j] = norm
        row.div_(torch.where(norm > 0, norm, 1.0).unsqueeze(-1))
    return R2


def sketch_update_batched(basis: Tensor, eigvals: Tensor, V: Tensor, beta: float, cap_weights: Tensor
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    r""":func:`pyro_fa.optim._lowrank.sketch_update_stacked` per replica.

    Parameters
    ----------
    basis : Tensor of shape (R, r, D)
        :math:`Q^\top` per replica.
    eigvals : Tensor of shape (R, r)
    V : Tensor of shape (R, 2M, D)
        :math:`[g_1, ..., g_M, a_1, ..., a_M]` per replica (overwritten).
    beta : float or Tensor of shape (R,)
        The decay, one per replica or shared.
    cap_weights : Tensor of shape (R, D)

    Returns
    -------
    (Tensor (R, r, D), Tensor (R, r), Tensor (R, r), Tensor (R,) bool)
        The new bases, eigenvalues (descending), :math:`\sum_d |Q'_{dk}|\,w_d`, and which replicas' updates are
        finite: a replica whose core matrix is not finite gets a zero core (its results are to be discarded), so
        that one replica's overflow cannot stop the others' eigendecompositions.
    """
    r = basis.shape[-2]
    M = V.shape[-2] // 2
    wide = torch.float64
    beta = torch.as_tensor(beta, dtype=wide, device=basis.device).reshape(-1, 1)  # (R, 1) or (1, 1)
    scale = V.abs().amax((-2, -1)).to(wide).clamp_min(torch.finfo(wide).tiny)  # (R,)
    norms = V.norm(dim=-1)
    coef = V @ basis.mT  # (R, 2M, r)
    V.sub_(coef @ basis)
    again = (V.norm(dim=-1) < _REORTHOGONALISE * norms).any(-1)  # (R,): the unbatched test, per replica
    if bool(again.any()):
        more = (V @ basis.mT) * again[:, None, None].to(V.dtype)
        V.sub_(more @ basis)
        coef = coef + more
    tol = 64 * torch.finfo(V.dtype).eps * scale * V.shape[-1] ** 0.5
    R2 = _orthonormalise_rows(V)  # V now holds Q2^T (R, 2M, D)
    keep = R2.diagonal(dim1=-2, dim2=-1).abs().to(wide) > tol.unsqueeze(-1)  # (R, 2M)
    Q2t = V * keep.unsqueeze(-1).to(V.dtype)
    R2 = R2 * keep.unsqueeze(-1).to(R2.dtype)
    C = torch.cat([coef.mT, R2], -2).to(wide)  # (R, r + 2M, 2M)
    G, A = C[..., :M], C[..., M:]
    core = torch.zeros(*C.shape[:-2], r + 2 * M, r + 2 * M, dtype=wide, device=basis.device)
    core[..., :r, :r] = torch.diag_embed(beta * eigvals.to(wide))
    cross = (G @ A.mT) * ((1.0 - beta) / M).unsqueeze(-1)
    core += 0.5 * (cross + cross.mT)
    finite = torch.isfinite(core).all(-1).all(-1)
    core = torch.where(finite[:, None, None], core, 0.0)
    lam, E = torch.linalg.eigh(core)  # ascending
    lam, E = lam[..., -r:].flip(-1), E[..., -r:].flip(-1).to(basis.dtype)
    new_basis = E[..., :r, :].mT @ basis + E[..., r:, :].mT @ Q2t
    sums = (new_basis.abs() @ cap_weights.unsqueeze(-1)).squeeze(-1)
    return new_basis, lam.to(eigvals.dtype), sums, finite


def factorise_batched(basis: Tensor, eigvals: Tensor, total: Tensor, floor: float, ess: Tensor) -> "BatchedWoodbury":
    r""":func:`pyro_fa.optim._lowrank.factorise` per replica: ``basis`` (R, K, D), ``eigvals`` (R, K), ``total``
    :math:`h + \delta` (R, D), ``ess`` (R,)."""
    factor_t = basis * eigvals.clamp_min(0).sqrt().unsqueeze(-1)
    room = total.clamp_min(0).mul(1.0 - floor)
    rows = factor_t.square().sum(-2)
    shrink = rows > room
    factor_t = factor_t * torch.where(shrink, (room / rows.clamp_min(torch.finfo(basis.dtype).tiny)).sqrt(),
                                      1.0).unsqueeze(-2)
    psi = total - torch.minimum(rows, room)
    inv_psi = psi.reciprocal()
    root = (psi * ess.unsqueeze(-1)).sqrt()
    gram = ((factor_t * inv_psi.unsqueeze(-2)) @ factor_t.mT).to(torch.float64)
    s, W = torch.linalg.eigh(gram)
    return BatchedWoodbury(psi, factor_t, ess, inv_psi, root, root.reciprocal(), gram, W, s.clamp_min(0.0))


class BatchedWoodbury(NamedTuple):
    r""":class:`pyro_fa.optim._lowrank.Woodbury` for R replicas: every field with a leading replica dimension
    (``ess`` (R,), ``gram`` and ``eigvecs`` (R, K, K), ``eigvals`` (R, K))."""

    psi: Tensor
    factor_t: Tensor
    ess: Tensor
    inv_psi: Tensor
    root: Tensor
    inv_root: Tensor
    gram: Tensor
    eigvecs: Tensor
    eigvals: Tensor

    def _small(self, x: Tensor, weights: Tensor) -> Tensor:
        r""":math:`W\mathrm{diag}(w)W^\top x` for K-vectors ``x`` (..., R, K), in float64."""
        W = self.eigvecs
        return (W @ (weights * (W.mT @ x.to(W.dtype).unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)).squeeze(-1)

    def _up(self, v: Tensor) -> Tensor:
        r""":math:`U^\top v` per replica, (..., R, D) -> (..., R, K)."""
        return (self.factor_t * v.unsqueeze(-2)).sum(-1)  # on a CPU several times faster than a batched matvec

    def _down(self, c: Tensor, dtype) -> Tensor:
        r""":math:`Uc` per replica, (..., R, K) -> (..., R, D)."""
        return (c.to(dtype).unsqueeze(-2) @ self.factor_t).squeeze(-2)

    def solve(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)^{-1}v` per replica, ``v`` (R, D)."""
        w = v * self.inv_psi
        c = self._small(self._up(w), (1.0 + self.eigvals).reciprocal())
        return w - self._down(c, v.dtype) * self.inv_psi

    def draw(self, eps: Tensor) -> Tuple[Tensor, Tensor]:
        r"""Draws :math:`z \sim N(0, P^{-1})` and :math:`Pz` from standard normals ``eps`` (..., R, D), as
        :meth:`pyro_fa.optim._lowrank.Woodbury.draw` per replica."""
        s = self.eigvals
        tiny = s <= torch.finfo(s.dtype).eps
        weights = torch.where(tiny, torch.full_like(s, 0.5), (1.0 - (1.0 + s).rsqrt()) / torch.where(tiny, 1.0, s))
        x = eps * self.inv_root
        e = self._up(x).to(s.dtype)
        c1 = self._small(e, weights)
        noise = x - self._down(c1, eps.dtype) * self.inv_psi
        gram_c1 = (self.gram @ c1.unsqueeze(-1)).squeeze(-1)
        precision = self._down(self.ess.unsqueeze(-1) * (e - gram_c1 - c1), eps.dtype) + self.root * eps
        return noise, precision
