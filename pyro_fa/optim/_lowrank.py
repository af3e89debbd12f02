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

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["sketch_update", "sketch_update_stacked", "row_squares", "factorise", "kept_buffer", "welford_mean",
           "Woodbury"]

#: columns per chunk of the Gram matrix (a chunk of the (K, D) factor stays in cache)
_CHUNK = 1 << 16
#: columns per chunk of the rotation (a chunk of the input and of the output both stay in cache)
_SMALL_CHUNK = 1 << 15
#: a second Gram-Schmidt pass when a vector keeps less than this fraction of its norm after the first
_REORTHOGONALISE = 2.0 / 3.0


def sketch_update(basis: Tensor, eigvals: Tensor, pairs: Sequence[Tuple[Tensor, Tensor]], beta: float, *,
                  out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
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
    out : Tensor of shape (r, D), optional
        Where to write :math:`Q'^\top`; may be ``basis`` itself (the rotation goes by chunks of columns, each
        chunk read before it is written). A new tensor when None.

    Returns
    -------
    (Tensor of shape (r, D), Tensor of shape (r,))
        :math:`Q'^\top` and :math:`\lambda'` (descending).

    Notes
    -----
    :math:`O(D(r + 2M)r)` time (the rotation :math:`[Q, Q_2]E` dominates), :math:`O(D(r+2M))` memory. The new
    vectors are orthogonalised against :math:`Q` once, and a second time only where the first pass cancelled more
    than a third of a vector's norm (Daniel, Gragg, Kaufman & Stewart 1976; "twice is enough"), the only case in
    which one pass leaves more than rounding error along :math:`Q`.
    """
    V = torch.stack([g for g, _ in pairs] + [a for _, a in pairs])  # (2M, D)
    new_basis, lam, _ = sketch_update_stacked(basis, eigvals, V, beta, out=out)
    return new_basis, lam


def sketch_update_stacked(basis: Tensor, eigvals: Tensor, V: Tensor, beta: float, *, out: Optional[Tensor] = None,
                          cap_weights: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    r""":func:`sketch_update` with the pairs stacked, ``V`` = :math:`[g_1, ..., g_M, a_1, ..., a_M]` (2M, D),
    used as scratch (overwritten). With ``cap_weights`` :math:`w` (D,), also :math:`\sum_d |Q'_{dk}|\,w_d` per new
    row :math:`k`, computed while the rotation's chunk is in cache (else None)."""
    r = basis.shape[0]
    M = V.shape[0] // 2
    wide = torch.float64
    scale = torch.stack(torch.aminmax(V)).abs().amax().to(wide).clamp_min(torch.finfo(wide).tiny)  # max |V|
    norms = V.norm(dim=1)
    coef = _project(basis, V)  # (2M, r)
    R = _deflate(V, coef, basis)  # V's storage
    if bool((R.norm(dim=1) < _REORTHOGONALISE * norms).any()):  # a second pass where the first cancelled
        again = _project(basis, R)
        _deflate(R, again, basis)
        coef += again
    tol = 64 * torch.finfo(V.dtype).eps * scale * V.shape[1] ** 0.5
    R2 = _orthonormalise_rows(R)  # R now holds Q2^T (2M, D); R2 (2M, 2M)
    Q2 = R.T
    keep = R2.diagonal().abs().to(wide) > tol
    if not bool(keep.all()):  # a new vector within the span of the others: its direction is left empty
        Q2 = Q2 * keep.to(Q2.dtype)
        R2 = R2 * keep.to(R2.dtype).unsqueeze(-1)
    C = torch.cat([coef.T, R2], 0).to(wide)  # V^T = [Q, Q2] C, (r + 2M, 2M)
    G, A = C[:, :M], C[:, M:]
    core = torch.zeros(r + 2 * M, r + 2 * M, dtype=wide, device=basis.device)
    core[:r, :r] = torch.diag(beta * eigvals.to(wide))
    cross = (G @ A.T) * ((1.0 - beta) / M)
    core += 0.5 * (cross + cross.T)
    lam, E = torch.linalg.eigh(core)  # ascending
    lam, E = lam[-r:].flip(0), E[:, -r:].flip(1).to(basis.dtype)
    sums = None if cap_weights is None else basis.new_zeros(r)
    new_basis = _rotate(basis, Q2.T.contiguous(), E[:r].T.contiguous(), E[r:].T.contiguous(), out, cap_weights, sums)
    return new_basis, lam.to(eigvals.dtype), sums


def _project(basis: Tensor, V: Tensor) -> Tensor:
    r""":math:`VQ` (rows of ``V`` (n, D) against the rows of ``basis`` :math:`Q^\top` (r, D)): a matrix-vector
    product per row, faster on a CPU than the (n, D) x (D, r) product."""
    return torch.stack([basis @ v for v in V])


def _deflate(R: Tensor, coef: Tensor, basis: Tensor) -> Tensor:
    r"""``R -= coef @ basis`` in place, a vector-matrix product per row of ``R``."""
    for row, c in zip(R, coef):
        row.addmv_(basis.T, c, alpha=-1.0)
    return R


def _orthonormalise_rows(R: Tensor) -> Tensor:
    r"""Gram-Schmidt on the rows of ``R`` (n, D), in place, each row orthogonalised twice ("twice is enough"):
    afterwards ``R`` holds :math:`Q_2^\top` and the returned (n, n) upper-triangular :math:`R_2` has
    :math:`R_{\text{before}}^\top = Q_2R_2` (the thin QR factorisation, with :math:`\mathrm{diag}(R_2) \ge 0`,
    in the rows' dtype; a row of zero norm stays zero). As Householder's QR, a row within the span of the rows
    before it leaves a unit row along its rounding noise (its diagonal entry tiny)."""
    n = R.shape[0]
    R2 = R.new_zeros(n, n)
    for j in range(n):
        row = R[j]
        for _ in range(2 if j else 0):
            c = R[:j] @ row
            row.addmv_(R[:j].T, c, alpha=-1.0)
            R2[:j, j] += c
        norm = row.norm()
        R2[j, j] = norm
        if bool(norm > 0):
            row.div_(norm)
    return R2


def _rotate(basis: Tensor, extra_t: Tensor, E1: Tensor, E2: Tensor, out: Optional[Tensor],
            weights: Optional[Tensor] = None, sums: Optional[Tensor] = None) -> Tensor:
    r""":math:`E_1 Q^\top + E_2 Q_2^\top` by chunks of columns into ``out`` (a chunk of the product depends only on the
    same chunk of :math:`Q^\top` and :math:`Q_2^\top`, so ``out`` may be ``basis``); a skinny product by chunks
    runs in cache, several times faster than one product over all of :math:`D`. With ``weights``, adds
    :math:`|\text{chunk}|\,w` to ``sums`` (K,) chunk by chunk."""
    out = torch.empty_like(basis) if out is None else out
    K, D = basis.shape
    work = basis.new_empty(K, min(D, _SMALL_CHUNK))
    for lo in range(0, D, _SMALL_CHUNK):
        cols = slice(lo, lo + _SMALL_CHUNK)
        tmp = work[:, :basis[:, cols].shape[1]]
        torch.mm(E1, basis[:, cols], out=tmp).addmm_(E2, extra_t[:, cols])
        out[:, cols].copy_(tmp)
        if weights is not None:
            sums.addmv_(tmp.abs(), weights[cols])
    return out


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


def welford_mean(avg: Optional[Tensor], new: Tensor, count: int) -> Tensor:
    """The running mean of ``count`` values, as ivon-opt keeps it (bit for bit): ``new`` itself for the first."""
    return new if avg is None else avg + (new - avg) / count


def kept_buffer(buffers: dict, name: str, like: Tensor) -> Tensor:
    """``buffers[name]`` if it has ``like``'s shape, dtype and device, else a new one stored there (a new tensor of
    megabytes costs about as much in page faults as the arithmetic on it)."""
    b = buffers.get(name)
    if b is None or b.shape != like.shape or b.dtype != like.dtype or b.device != like.device:
        b = buffers[name] = torch.empty_like(like)
    return b


def factorise(basis: Tensor, eigvals: Tensor, total: Tensor, floor: float, ess: float, buffers: dict) -> "Woodbury":
    r"""The :class:`Woodbury` factorisation of :math:`\Psi + UU^\top` for FactorIVON's state, in one pass by chunks.

    :math:`U^\top = \mathrm{diag}(\lambda_+^{1/2})\,Q^\top` (``eigvals``, ``basis``), each column :math:`d` then
    shrunk so that its squared norm is at most :math:`(1 - \rho)\max(t_d, 0)` (``floor`` :math:`\rho`, ``total``
    :math:`t = h + \delta`), and :math:`\psi = t - \mathrm{rowsq}(U)`. The row norms, the shrinking,
    :math:`\psi` and the Gram matrix are computed chunk by chunk while the chunk is in cache, with no (K, D)
    temporary. The result's tensors are written into ``buffers`` (name -> tensor, filled on first use; a new
    tensor of 4 MB or more costs about as much in page faults as the arithmetic on it): the previous
    factorisation from the same ``buffers`` is overwritten.
    """
    K, D = basis.shape
    scale = eigvals.clamp_min(0).sqrt().unsqueeze(-1)
    out = kept_buffer(buffers, "factor_t", basis)
    psi, inv_psi, root, inv_root = (kept_buffer(buffers, n, total) for n in ("psi", "inv_psi", "root", "inv_root"))
    gram = torch.zeros(K, K, dtype=torch.float64, device=basis.device)
    tiny = torch.finfo(basis.dtype).tiny
    for lo in range(0, D, _CHUNK):
        cols = slice(lo, lo + _CHUNK)
        block = torch.mul(basis[:, cols], scale, out=out[:, cols])
        room = total[cols].clamp_min(0).mul_(1.0 - floor)
        rows = block.square().sum(0)
        shrink = rows > room
        if bool(shrink.any()):
            block.mul_(torch.where(shrink, (room / rows.clamp_min(tiny)).sqrt(), 1.0))
        torch.sub(total[cols], torch.minimum(rows, room), out=psi[cols])
        torch.reciprocal(psi[cols], out=inv_psi[cols])
        torch.mul(psi[cols], ess, out=root[cols]).sqrt_()
        torch.reciprocal(root[cols], out=inv_root[cols])
        gram += ((block * inv_psi[cols]) @ block.T).to(torch.float64)
    s, W = torch.linalg.eigh(gram)
    return Woodbury(psi, out, float(ess), inv_psi, root, inv_root, gram, W, s.clamp_min(0.0))


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

    def solve(self, v: Tensor, overwrite: bool = False, out: Optional[Tensor] = None) -> Tensor:
        r""":math:`(\Psi + UU^\top)^{-1}v` for ``v`` of shape (D,): two passes over :math:`U^\top`; with
        ``overwrite``, ``v``'s storage is used as scratch; the result goes to ``out`` (a new tensor if None)."""
        w = torch.mul(v, self.inv_psi, out=out) if out is not None else v * self.inv_psi
        c = self._small(self.factor_t @ w, (1.0 + self.eigvals).reciprocal())
        back = torch.mv(self.factor_t.T, c.to(v.dtype), out=v) if overwrite else c.to(v.dtype) @ self.factor_t
        return w.addcmul_(back, self.inv_psi, value=-1.0)

    def draw(self, eps: Tensor, out: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None)
             ) -> Tuple[Tensor, Tensor]:
        r"""A draw :math:`z \sim N(0, P^{-1})` and :math:`Pz` from standard normal ``eps`` (D,): three passes over
        :math:`U^\top` (one product :math:`U^\top x`, two vector-matrix products back).

        With :math:`x = (\lambda\psi)^{-1/2}\odot\varepsilon`, :math:`e = U^\top x` and :math:`c_1 =
        W\mathrm{diag}(\frac{1 - (1+s)^{-1/2}}{s})W^\top e`: :math:`z = x - \Psi^{-1}Uc_1` and, as
        :math:`U^\top z = e - A^\top A c_1`, :math:`Pz = (\lambda\psi)^{1/2}\odot\varepsilon + \lambda U(e - A^\top Ac_1
        - c_1)`. ``out``: D-vectors to write :math:`z` and :math:`Pz` into (None: new ones).
        """
        s = self.eigvals
        tiny = s <= torch.finfo(s.dtype).eps
        weights = torch.where(tiny, torch.full_like(s, 0.5), (1.0 - (1.0 + s).rsqrt()) / torch.where(tiny, 1.0, s))
        x = torch.mul(eps, self.inv_root, out=out[0]) if out[0] is not None else eps * self.inv_root
        e = (self.factor_t @ x).to(s.dtype)
        c1 = self._small(e, weights)
        # two vector-matrix products (faster than one (2, K) x (K, D)), in place: a new D-vector costs page faults
        back = torch.mv(self.factor_t.T, c1.to(eps.dtype), out=out[1]) if out[1] is not None else \
            c1.to(eps.dtype) @ self.factor_t
        noise = x.addcmul_(back, self.inv_psi, value=-1.0)
        torch.mv(self.factor_t.T, (self.ess * (e - self.gram @ c1 - c1)).to(eps.dtype), out=back)
        return noise, back.addcmul_(self.root, eps)

    def matvec(self, v: Tensor) -> Tensor:
        r""":math:`(\Psi + UU^\top)v` for ``v`` of shape (D,)."""
        return self.psi * v + (self.factor_t @ v) @ self.factor_t
