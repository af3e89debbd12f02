r"""The linear algebra of :class:`~pyro_fa.optim.FactorIVON`: the exponential-moving low-rank sketch of the
curvature and the Woodbury square root and solve of :math:`\Psi + UU^\top`, all in :math:`O(DK^2)` at most.

The sketch holds a symmetric matrix of rank :math:`r` as :math:`S = Q\,\mathrm{diag}(\lambda)\,Q^\top`,
:math:`Q \in \mathbb{R}^{D\times r}` with orthonormal (or zero, "empty") columns. One step folds in
:math:`M` symmetric rank-two terms :math:`\mathrm{sym}(g_j a_j^\top) = \tfrac12(g_ja_j^\top + a_jg_j^\top)`:

.. math::

    S' = \mathrm{top}_r\Big(\beta S + \frac{1-\beta}{M}\sum_{j=1}^M \mathrm{sym}(g_j a_j^\top)\Big),

exactly in the basis :math:`[Q, Q_2]` of :math:`r + 2M` columns (:math:`Q_2` from a QR factorisation of the new
vectors' part orthogonal to :math:`Q`), then truncated to the :math:`r` largest (algebraic) eigenvalues of the
:math:`(r+2M)\times(r+2M)` core (the rank-:math:`r` update of Brand 2006, §3, applied to a symmetric stream;
the eigen-truncation of SLANG, Mishkin et al. 2018, §3.2, made deterministic).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["sketch_update", "Woodbury"]


def sketch_update(basis: Tensor, eigvals: Tensor, pairs: Sequence[Tuple[Tensor, Tensor]], beta: float
                  ) -> Tuple[Tensor, Tensor]:
    r"""One step of the exponential-moving rank-:math:`r` sketch (module docstring).

    Parameters
    ----------
    basis : Tensor of shape (D, r)
        :math:`Q`, orthonormal or zero columns.
    eigvals : Tensor of shape (r,)
        :math:`\lambda`.
    pairs : sequence of (Tensor of shape (D,), Tensor of shape (D,))
        The :math:`M` pairs :math:`(g_j, a_j)`.
    beta : float
        :math:`\beta`, the decay.

    Returns
    -------
    (Tensor of shape (D, r), Tensor of shape (r,))
        :math:`Q'` and :math:`\lambda'` (descending).

    Notes
    -----
    :math:`O(D(r + 2M)r)` time (the rotation :math:`[Q, Q_2]E` dominates), :math:`O(D(r+2M))` memory.
    """
    r = basis.shape[1]
    M = len(pairs)
    V = torch.stack([g for g, _ in pairs] + [a for _, a in pairs], 1)  # (D, 2M)
    coef = basis.T @ V  # (r, 2M)
    R = V - basis @ coef
    again = basis.T @ R  # a second Gram-Schmidt pass ("twice is enough")
    R -= basis @ again
    coef += again
    Q2, R2 = torch.linalg.qr(R)  # (D, 2M), (2M, 2M)
    wide = torch.float64
    scale = V.abs().amax().to(wide).clamp_min(torch.finfo(wide).tiny)
    keep = R2.diagonal().abs().to(wide) > 64 * torch.finfo(V.dtype).eps * scale * V.shape[0] ** 0.5
    if not bool(keep.all()):  # a new vector within the span of the others: its column is left empty
        Q2 = Q2 * keep.to(Q2.dtype)
        R2 = R2 * keep.to(R2.dtype).unsqueeze(-1)
    C = torch.cat([coef, R2], 0).to(wide)  # V = [Q, Q2] C, (r + 2M, 2M)
    G, A = C[:, :M], C[:, M:]
    core = torch.zeros(r + 2 * M, r + 2 * M, dtype=wide, device=V.device)
    core[:r, :r] = torch.diag(beta * eigvals.to(wide))
    cross = (G @ A.T) * ((1.0 - beta) / M)
    core += 0.5 * (cross + cross.T)
    lam, E = torch.linalg.eigh(core)  # ascending
    lam, E = lam[-r:].flip(0), E[:, -r:].flip(1).to(V.dtype)
    new_basis = torch.addmm(Q2 @ E[r:], basis, E[:r])
    return new_basis, lam.to(eigvals.dtype)


class Woodbury(NamedTuple):
    r"""The :math:`K\times K` eigen-factorisation behind the draws and solves with :math:`\Psi + UU^\top`.

    :math:`A = \Psi^{-1/2}U`, :math:`A^\top A = W\,\mathrm{diag}(s)\,W^\top` (eigenvalues :math:`s \ge 0`, in
    float64); then (Petersen & Pedersen 2012, §3.2.2)

    .. math::

        (\Psi + UU^\top)^{-1} = \Psi^{-1/2}\big(I - A\,W\mathrm{diag}(\tfrac1{1+s})W^\top A^\top\big)\Psi^{-1/2},
        \qquad (I + AA^\top)^{-1/2} = I - A\,W\mathrm{diag}\Big(\frac{1 - (1+s)^{-1/2}}{s}\Big)W^\top A^\top,

    the second the symmetric inverse square root (through the thin SVD :math:`A = QS^{1/2}W^\top`, never formed),
    so that :math:`z = \Psi^{-1/2}(I + AA^\top)^{-1/2}\varepsilon \sim N(0, (\Psi + UU^\top)^{-1})`.
    """

    psi: Tensor  # (D,)
    factor: Tensor  # U, (D, K)
    scaled: Tensor  # A = Psi^{-1/2} U, (D, K)
    eigvecs: Tensor  # W, (K, K), float64
    eigvals: Tensor  # s, (K,), float64

    @classmethod
    def of(cls, psi: Tensor, factor: Tensor) -> "Woodbury":
        """Factorise :math:`\\Psi + UU^\\top` for ``psi`` (D,) positive and ``factor`` (D, K): :math:`O(DK^2)`."""
        scaled = factor * psi.rsqrt().unsqueeze(-1)
        gram = (scaled.T @ scaled).to(torch.float64)
        s, W = torch.linalg.eigh(gram)
        return cls(psi, factor, scaled, W, s.clamp_min(0.0))

    def _low(self, v: Tensor, weights: Tensor) -> Tensor:
        r""":math:`A\,W\mathrm{diag}(w)W^\top A^\top v`, :math:`O(DK)`."""
        W = self.eigvecs
        small = W @ (weights * (W.T @ (self.scaled.T @ v).to(W.dtype)))
        return self.scaled @ small.to(v.dtype)

    def solve(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)^{-1}v` for ``v`` of shape (D,), :math:`O(DK)`."""
        root = self.psi.rsqrt()
        w = v * root
        return (w - self._low(w, (1.0 + self.eigvals).reciprocal())) * root

    def inverse_root(self, eps: Tensor) -> Tensor:
        r""":math:`\Psi^{-1/2}(I + AA^\top)^{-1/2}\varepsilon` for ``eps`` of shape (D,): a draw of
        :math:`N(0, (\Psi + UU^\top)^{-1})` from standard normal ``eps``, :math:`O(DK)`."""
        s = self.eigvals
        tiny = s <= torch.finfo(s.dtype).eps
        weights = torch.where(tiny, torch.full_like(s, 0.5), (1.0 - (1.0 + s).rsqrt()) / torch.where(tiny, 1.0, s))
        return (eps - self._low(eps, weights)) * self.psi.rsqrt()

    def matvec(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)v` for ``v`` of shape (D,), :math:`O(DK)`."""
        return self.psi * v + self.factor @ (self.factor.T @ v)
