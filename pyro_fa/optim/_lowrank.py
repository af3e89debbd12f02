r"""The linear algebra of :class:`~pyro_fa.optim.FactorIVON`: the exponential-moving low-rank sketch of the
curvature and the Woodbury draws and solves with :math:`\Psi + UU^\top`, in :math:`O(DK^2)` at most.

Factors are stored transposed, :math:`U^\top` of shape (K, D), row-major: every product is then a matrix-vector
product or a thin matrix product along contiguous rows (several times faster than the (D, K) layout's on a CPU).

The sketch holds a symmetric matrix of rank :math:`r` as :math:`S = Q\,\mathrm{diag}(\lambda)\,Q^\top`,
:math:`Q \in \mathbb{R}^{D\times r}` with orthonormal (or zero, "empty") columns. One update folds in
:math:`M` symmetric rank-two terms :math:`\mathrm{sym}(g_j a_j^\top) = \tfrac12(g_ja_j^\top + a_jg_j^\top)`:

.. math::

    S' = \mathrm{top}_r\Big(\beta S + \frac{1-\beta}{M}\sum_{j=1}^M \mathrm{sym}(g_j a_j^\top)\Big),

exactly in the basis :math:`[Q, Q_2]` of :math:`r + 2M` columns (:math:`Q_2` from a QR factorisation of the new
vectors' part orthogonal to :math:`Q`), then truncated to the :math:`r` largest (algebraic) eigenvalues of the
:math:`(r+2M)\times(r+2M)` core (the rank-:math:`r` update of Brand 2006, §3, applied to a symmetric stream;
SLANG's eigen-truncation, Mishkin et al. 2018, §3.2, made deterministic).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["sketch_update", "row_squares", "Woodbury"]

#: columns per chunk of the Gram matrix (a chunk of the (K, D) factor stays in cache)
_CHUNK = 1 << 16


def sketch_update(basis: Tensor, eigvals: Tensor, pairs: Sequence[Tuple[Tensor, Tensor]], beta: float
                  ) -> Tuple[Tensor, Tensor]:
    r"""One update of the exponential-moving rank-:math:`r` sketch (module docstring).

    Parameters
    ----------
    basis : Tensor of shape (r, D)
        :math:`Q^\top`, orthonormal or zero rows.
    eigvals : Tensor of shape (r,)
        :math:`\lambda`.
    pairs : sequence of (Tensor of shape (D,), Tensor of shape (D,))
        The :math:`M` pairs :math:`(g_j, a_j)`.
    beta : float
        :math:`\beta`, the decay.

    Returns
    -------
    (Tensor of shape (r, D), Tensor of shape (r,))
        :math:`Q'^\top` and :math:`\lambda'` (descending).

    Notes
    -----
    :math:`O(D(r + 2M)r)` time (the rotation :math:`[Q, Q_2]E` dominates), :math:`O(D(r+2M))` memory.
    """
    r = basis.shape[0]
    M = len(pairs)
    V = torch.stack([g for g, _ in pairs] + [a for _, a in pairs])  # (2M, D)
    coef = V @ basis.T  # (2M, r)
    R = V - coef @ basis
    again = R @ basis.T  # a second Gram-Schmidt pass ("twice is enough")
    R -= again @ basis
    coef += again
    Q2, R2 = torch.linalg.qr(R.T)  # (D, 2M), (2M, 2M)
    wide = torch.float64
    scale = V.abs().amax().to(wide).clamp_min(torch.finfo(wide).tiny)
    keep = R2.diagonal().abs().to(wide) > 64 * torch.finfo(V.dtype).eps * scale * V.shape[1] ** 0.5
    if not bool(keep.all()):  # a new vector within the span of the others: its direction is left empty
        Q2 = Q2 * keep.to(Q2.dtype)
        R2 = R2 * keep.to(R2.dtype).unsqueeze(-1)
    C = torch.cat([coef.T, R2], 0).to(wide)  # V^T = [Q, Q2] C, (r + 2M, 2M)
    G, A = C[:, :M], C[:, M:]
    core = torch.zeros(r + 2 * M, r + 2 * M, dtype=wide, device=V.device)
    core[:r, :r] = torch.diag(beta * eigvals.to(wide))
    cross = (G @ A.T) * ((1.0 - beta) / M)
    core += 0.5 * (cross + cross.T)
    lam, E = torch.linalg.eigh(core)  # ascending
    lam, E = lam[-r:].flip(0), E[:, -r:].flip(1).to(V.dtype)
    new_basis = torch.addmm(E[r:].T @ Q2.T, E[:r].T, basis)
    return new_basis, lam.to(eigvals.dtype)


def row_squares(factor_t: Tensor) -> Tensor:
    r""":math:`\sum_k U_{dk}^2` per row :math:`d`, shape (D,), from :math:`U^\top` (K, D) (row by row: one pass)."""
    out = factor_t.new_zeros(factor_t.shape[1])
    for row in factor_t:
        out.addcmul_(row, row)
    return out


def _gram(factor_t: Tensor, weights: Tensor) -> Tensor:
    r""":math:`U^\top \mathrm{diag}(w) U` in float64, shape (K, K), by chunks of columns."""
    K, D = factor_t.shape
    out = torch.zeros(K, K, dtype=torch.float64, device=factor_t.device)
    for lo in range(0, D, _CHUNK):
        block = factor_t[:, lo:lo + _CHUNK]
        out += ((block * weights[lo:lo + _CHUNK]) @ block.T).to(torch.float64)
    return out


class Woodbury(NamedTuple):
    r"""The :math:`K\times K` eigen-factorisation behind the draws and solves with :math:`P = \lambda(\Psi + UU^\top)`.

    :math:`A = \Psi^{-1/2}U`, :math:`A^\top A = W\,\mathrm{diag}(s)\,W^\top` (in float64); then (Petersen &
    Pedersen 2012, §3.2.2)

    .. math::

        (\Psi + UU^\top)^{-1} = \Psi^{-1/2}\big(I - A\,W\mathrm{diag}(\tfrac1{1+s})W^\top A^\top\big)\Psi^{-1/2},
        \qquad (I + AA^\top)^{-1/2} = I - A\,W\mathrm{diag}\Big(\frac{1 - (1+s)^{-1/2}}{s}\Big)W^\top A^\top,

    the second the symmetric inverse square root (through the thin SVD :math:`A = QS^{1/2}W^\top`, never formed),
    so that :math:`z = \lambda^{-1/2}\Psi^{-1/2}(I + AA^\top)^{-1/2}\varepsilon \sim N(0, P^{-1})`. The vectors
    :math:`\psi^{-1}`, :math:`(\lambda\psi)^{\pm 1/2}` are kept, so that a draw or a solve is a few fused passes.
    """

    psi: Tensor  # (D,)
    factor_t: Tensor  # U^T, (K, D)
    ess: float  # lambda
    inv_psi: Tensor  # 1 / psi
    root: Tensor  # (lambda psi)^(1/2)
    inv_root: Tensor  # (lambda psi)^(-1/2)
    gram: Tensor  # A^T A, (K, K), float64
    eigvecs: Tensor  # W, (K, K), float64
    eigvals: Tensor  # s, (K,), float64

    @classmethod
    def of(cls, psi: Tensor, factor_t: Tensor, ess: float = 1.0) -> "Woodbury":
        """Factorise for ``psi`` (D,) positive, ``factor_t`` :math:`U^\\top` (K, D) and ``ess`` :math:`\\lambda`:
        :math:`O(DK^2)`."""
        inv_psi = psi.reciprocal()
        gram = _gram(factor_t, inv_psi)
        s, W = torch.linalg.eigh(gram)
        root = (ess * psi).sqrt()
        return cls(psi, factor_t, float(ess), inv_psi, root, root.reciprocal(), gram, W, s.clamp_min(0.0))

    def _small(self, x: Tensor, weights: Tensor) -> Tensor:
        r""":math:`W\mathrm{diag}(w)W^\top x` for a K-vector ``x``, in float64."""
        W = self.eigvecs
        return W @ (weights * (W.T @ x.to(W.dtype)))

    def solve(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)^{-1}v` for ``v`` of shape (D,): two passes over :math:`U^\top`."""
        w = v * self.inv_psi
        c = self._small(self.factor_t @ w, (1.0 + self.eigvals).reciprocal())
        return torch.addcmul(w, c.to(v.dtype) @ self.factor_t, self.inv_psi, value=-1.0)

    def draw(self, eps: Tensor) -> Tuple[Tensor, Tensor]:
        r"""A draw :math:`z \sim N(0, P^{-1})` and :math:`Pz` from standard normal ``eps`` (D,): two passes over
        :math:`U^\top`.

        With :math:`x = (\lambda\psi)^{-1/2}\odot\varepsilon`, :math:`e = U^\top x` and :math:`c_1 =
        W\mathrm{diag}(\frac{1 - (1+s)^{-1/2}}{s})W^\top e`: :math:`z = x - \Psi^{-1}Uc_1` and, as
        :math:`U^\top z = e - A^\top A c_1`, :math:`Pz = (\lambda\psi)^{1/2}\odot\varepsilon + \lambda U(e - A^\top Ac_1
        - c_1)`.
        """
        s = self.eigvals
        tiny = s <= torch.finfo(s.dtype).eps
        weights = torch.where(tiny, torch.full_like(s, 0.5), (1.0 - (1.0 + s).rsqrt()) / torch.where(tiny, 1.0, s))
        x = eps * self.inv_root
        e = (self.factor_t @ x).to(s.dtype)
        c1 = self._small(e, weights)
        both = torch.stack([c1, self.ess * (e - self.gram @ c1 - c1)]).to(eps.dtype) @ self.factor_t  # (2, D)
        return torch.addcmul(x, both[0], self.inv_psi, value=-1.0), torch.addcmul(both[1], self.root, eps)

    def matvec(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)v` for ``v`` of shape (D,)."""
        return self.psi * v + (self.factor_t @ v) @ self.factor_t
