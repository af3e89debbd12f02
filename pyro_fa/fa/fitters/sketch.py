r"""Factor analysis refitted from a streamed sketch of the scatter (``method="sketch"``).

Online EM sums E-steps made under every intermediate factor; on the autocorrelated,
drifting iterates of SGD those stale E-steps keep it off batch FA's covariance error
(measured: see ``benchmarks/results/measurements_from_docstrings.md``). This fitter keeps no
E-step at all: it keeps a rank-:math:`\ell` sketch :math:`B` (:math:`\ell\times D`) of the
exactly centred scatter, :math:`\sum_t (x_t-\bar x)(x_t-\bar x)^\top \approx B^\top B`, and when
the posterior is read runs batch factor analysis (the SVD algorithm of scikit-learn's
``FactorAnalysis``; Barber 2012, §21.2.2) on the sketch with the exact running variances
as the diagonal.

References
----------
D. Barber, *Bayesian Reasoning and Machine Learning*, Cambridge University Press, 2012, §21.2.2.
M. Brand, "Incremental singular value decomposition of uncertain data with missing values",
ECCV 2002 (the truncated incremental SVD). E. Liberty, "Simple and deterministic matrix
sketching", KDD 2013 (Frequent Directions, the shrinking variant measured and set aside).
B. P. Welford, "Note on a method for calculating corrected sums of squares and products",
Technometrics 4(3), 1962 (the rank-one update of the centred scatter).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import torch
from torch import Tensor

from pyro_fa.fa.fitters.base import FitContext, FitState, Fitter, register_fitter

__all__ = ["ScatterSketch", "SketchState"]


@dataclasses.dataclass
class SketchState(FitState):
    r"""The scatter sketch's state: ``F`` (D, K) and ``psi`` (D,) of the last refit, the ``sketch``
    (:math:`\ell+K`, D), ``sketch_sq`` (:math:`\ell+K`,) float64, the squared singular values of its
    orthogonal leading rows, ``sketch_used`` and ``sketch_ortho`` (row counts) and ``fit_at`` (the
    update count of the last refit; -1 before the first), the last four 0-d int64 tensors."""

    F: Tensor
    psi: Tensor
    sketch: Tensor
    sketch_sq: Tensor
    sketch_used: Tensor
    sketch_ortho: Tensor
    fit_at: Tensor

_MAX_ITER = 1000  # scikit-learn FactorAnalysis's defaults
_TOL = 1e-2
# and a gain below this fraction of |log-likelihood| also stops: at D = 10^6 the absolute rule alone took
# 769 iterations on a white-noise buffer; 1e-7 leaves the benchmark's SGD-stream fits unchanged to 0.001
_RTOL = 1e-7


@register_fitter("sketch")
class ScatterSketch(Fitter):
    r"""Batch FA on a truncated incremental SVD of the centred scatter, refitted when read.

    .. math::

        M_t = M_{t-1} + \tfrac{t-1}{t}\,\delta_t\delta_t^\top, \quad \delta_t = x_t - \bar x_{t-1},
        \qquad M_t \approx B_t^\top B_t,

    (Welford 1962): each update appends the row :math:`\sqrt{(t-1)/t}\,\delta_t` to a buffer of
    :math:`\ell + K` rows; when it is full the buffer is replaced by its top :math:`\ell` right
    singular directions scaled by their singular values (a truncated incremental SVD, Brand 2002),
    computed from the :math:`(\ell+K)\times(\ell+K)` Gram matrix. :math:`\ell = 2K`, or
    :math:`\ell = D` where :math:`D \le 4K` (then the sketch is the exact scatter).

    When :math:`(F, \psi)` are read after an update they are refitted: with :math:`S \approx
    B^\top B/t` off the diagonal and the exact running variances :math:`s_d` on it, iterate
    (Barber 2012, §21.2.2, as scikit-learn's ``FactorAnalysis``): the top :math:`K` eigenpairs
    :math:`(\lambda_k, u_k)` of :math:`Q = B\Psi^{-1}B^\top/t`, :math:`F^\top = C B` with
    :math:`C = \mathrm{diag}(\sqrt{\max(\lambda_k-1, 0)/\lambda_k})\,U_K^\top/\sqrt t`,
    :math:`\psi_d = s_d - \sum_k F_{dk}^2` (floored), until the log-likelihood gains less than
    0.01 (at most 1000 iterations, scikit-learn's defaults) or less than :math:`10^{-7}` of its
    magnitude. Every refit starts at :math:`\psi = s` (floored), so the fit depends on the stream
    only, not on when or how often it was read before. Until the vectors differ (identical ones
    have no scatter) the initial :math:`(F, \psi = 1)` stands, as for the other methods.

    State: :class:`SketchState` (the model's buffers ``_F``, ``_psi``, ``_sketch``, ``_sketch_sq``,
    ``_sketch_used``, ``_sketch_ortho``, ``_fit_at``).

    Notes
    -----
    Memory: :math:`(\ell + K + 1) D` numbers, :math:`4DK` for :math:`\ell = 2K` (online EM: 2DK).
    Cost per update: one copy of the vector, and every :math:`K` updates a compression of
    :math:`O(3K^2D)` (Gram of the new rows) plus :math:`O(6K^2D)` (the rotation), about
    :math:`9KD` multiply-adds per update (the compression is a compute-bound matrix product). A refit
    costs :math:`O((\ell+K)^2 D)` per iteration and is done only when the posterior is read; its
    iteration count follows scikit-learn's absolute stopping rule, so at large D read the posterior
    rarely. Measured cost: see ``benchmarks/results/measurements_from_docstrings.md``.
    Not shardable (the Gram matrices would need an all-reduce per compression):
    ``process_group`` is refused.

    Examples
    --------
    >>> import torch
    >>> from pyro_fa import OnlineFactorAnalysis
    >>> fa = OnlineFactorAnalysis(50, 2, method="sketch", seed=0, dtype=torch.float64)
    >>> for x in torch.randn(200, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0)):
    ...     fa.update(x)
    >>> fa.fit_state.sketch.shape, fa.cov_factor.shape
    (torch.Size([6, 50]), torch.Size([50, 2]))
    """

    finishes_warmup = True
    curvature_fit = "sketch"
    curvature_passes = 1

    def init(self, ctx: FitContext, F0: Tensor) -> SketchState:
        if ctx.sharded:
            raise ValueError(f"{ctx.owner}: method 'sketch' cannot be sharded, got a process_group; use "
                             "method='em' for a fit sharded over ranks.")
        D, K = F0.shape
        keep = D if D <= 4 * K else 2 * K
        rows = keep + K
        dev = F0.device
        return SketchState(
            F=F0, psi=torch.ones_like(F0[:, 0]), sketch=F0.new_zeros(rows, D),
            sketch_sq=torch.zeros(rows, dtype=torch.float64, device=dev),
            sketch_used=torch.zeros((), dtype=torch.int64, device=dev),
            sketch_ortho=torch.zeros((), dtype=torch.int64, device=dev),
            fit_at=torch.full((), -1, dtype=torch.int64, device=dev))

    # ------------------------------------------------------------------ reading
    def factors(self, state: SketchState, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        # identical vectors have no scatter to fit: the initial (F, psi = 1) stands, as for EM and SGA
        if int(state.sketch_used) > 0 and int(state.fit_at) != ctx.n_updates and ctx.has_spread():
            self._refit(state, ctx)
        return state.F, state.psi

    def noise(self, state: SketchState, ctx: FitContext) -> Tensor:
        return state.psi

    def noise_floor(self, state: SketchState, ctx: FitContext) -> float:
        # the update never divides by the noise: its products are squared deviations, which the
        # model's range check bounds with unit noise
        return 1.0

    def finish_warmup(self, state: SketchState, ctx: FitContext) -> SketchState:
        return state  # the sketch has no warm-up: the fit is refitted from it whenever it is read

    # ------------------------------------------------------------------ update
    def update(self, state: SketchState, ctx: FitContext, d: Tensor, n_old: int, B: int,
               first_spread: bool) -> SketchState:
        n = n_old + B
        if n_old == 0:
            if B == 1:
                return state  # one vector deviates from nothing
            new = d  # centred at its own mean: its scatter exactly
        elif B == 1:
            new = d * math.sqrt(n / n_old)  # sqrt((t-1)/t) (x - mean_old) = sqrt(t/(t-1)) (x - mean_new)
        else:
            # Chan et al.: sum_i d_i d_i^T + (sum_i d_i)(sum_i d_i)^T / n_old is the scatter's increment
            new = torch.cat([d, d.sum(0, keepdim=True) / math.sqrt(n_old)])
        sk = state.sketch
        i = 0
        while i < new.shape[0]:
            used = int(state.sketch_used)
            if used == sk.shape[0]:
                self._compress(state, ctx)
                used = int(state.sketch_used)
            j = min(new.shape[0], i + sk.shape[0] - used)
            sk[used:used + j - i].copy_(new[i:j])
            state.sketch_used.fill_(used + j - i)
            i = j
        return state

    def _col_blocks(self, state: SketchState, ctx: FitContext):
        rows = state.sketch.shape[0]
        step = max(1, (1 << 20) // (8 * rows))
        for lo in range(0, ctx.rows, step):
            yield lo, min(lo + step, ctx.rows)

    def _compress(self, state: SketchState, ctx: FitContext) -> None:
        r"""Replace the full buffer by its top :math:`\ell` right singular directions times their singular values.

        With :math:`B = U\Sigma V^\top`, :math:`U_\ell^\top B = \Sigma_\ell V_\ell^\top`; :math:`U` from the
        eigenvectors of the Gram :math:`BB^\top` (float64), whose leading block is the diagonal
        ``_sketch_sq`` once the leading rows are orthogonal. In column blocks, in place.
        """
        sk = state.sketch
        rows = sk.shape[0]
        keep = rows - ctx.rank
        o = int(state.sketch_ortho)
        G = torch.zeros(rows, rows, dtype=torch.float64, device=sk.device)
        for lo, hi in self._col_blocks(state, ctx):
            blk = sk[:, lo:hi].double()
            G[o:] += blk[o:] @ blk.T
        G[:o, o:] = G[o:, :o].T
        if o:
            G[:o, :o] = torch.diag(state.sketch_sq[:o])
        lam, U = torch.linalg.eigh(G)
        top = U[:, -keep:].flip(-1)  # (rows, keep), descending
        R = top.T  # (keep, rows)
        for lo, hi in self._col_blocks(state, ctx):
            blk = sk[:, lo:hi].double()
            sk[:keep, lo:hi].copy_(R @ blk)
        sk[keep:].zero_()
        state.sketch_sq[:keep] = lam[-keep:].flip(-1).clamp_min(0.0)
        state.sketch_sq[keep:] = 0.0
        state.sketch_used.fill_(keep)
        state.sketch_ortho.fill_(keep)

    # ------------------------------------------------------------------ refit
    @torch.no_grad()
    def _refit(self, state: SketchState, ctx: FitContext) -> None:
        r"""Batch FA (Barber 2012, §21.2.2, eqs. 21.2.29–21.2.33) on the sketch and the exact diagonal."""
        n = ctx.n_updates
        K = ctx.rank
        D = ctx.dim
        used = int(state.sketch_used)
        sk = state.sketch[:used]
        var = ctx.variance64(n)
        # EM's floor, in the state's dtype (float64's would round to 0 in a float32 state)
        floor = ctx.floor_values(ctx.variance).to(torch.float64)
        # every refit starts at the running variances, never at an earlier read's psi: the fit is a function
        # of the stream alone, the same whenever (and however often) the posterior is read
        psi = torch.maximum(var, floor)
        blocks = list(self._col_blocks(state, ctx))
        const = D * math.log(2 * math.pi) + K
        old_ll = -math.inf
        for _ in range(_MAX_ITER):
            Q = torch.zeros(used, used, dtype=torch.float64, device=sk.device)
            for lo, hi in blocks:
                blk = sk[:, lo:hi].double()
                Q += (blk / psi[lo:hi]) @ blk.T
            Q /= n
            lam, U = torch.linalg.eigh(Q)
            k = min(K, used)
            lam_k = lam[-k:].flip(-1).clamp_min(torch.finfo(torch.float64).tiny)
            C = torch.zeros(K, used, dtype=torch.float64, device=sk.device)
            C[:k] = ((lam_k - 1).clamp_min(0) / lam_k).sqrt().unsqueeze(-1) * U[:, -k:].flip(-1).T / math.sqrt(n)
            # the log-likelihood at the psi of this iteration (scikit-learn's, with the exact trace)
            ll = -0.5 * n * (const + float(lam_k.log().sum()) + float((var / psi).sum()) - float(lam_k.sum())
                             + float(psi.log().sum()))
            new_psi = torch.empty_like(psi)
            for lo, hi in blocks:
                W = C @ sk[:, lo:hi].double()  # (K, cols)
                torch.maximum(var[lo:hi] - (W * W).sum(0), floor[lo:hi], out=new_psi[lo:hi])
            psi = new_psi
            if ll - old_ll < max(_TOL, _RTOL * abs(ll)):
                break
            old_ll = ll
        F = state.F
        for lo, hi in blocks:
            F[lo:hi].copy_((C @ sk[:, lo:hi].double()).T)
        state.psi.copy_(psi)
        state.fit_at.fill_(n)
