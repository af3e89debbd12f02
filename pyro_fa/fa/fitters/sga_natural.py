r"""The natural-gradient step of online SGA (``method="sga", optimizer="natural"``).

Gradient ascent on the Gaussian log-likelihood of the running moments, preconditioned by the
inverse Fisher information of the complete-data model (the EM preconditioner). With the E-step's
statistics :math:`\bar A \approx S\beta^\top` and :math:`\bar H \approx E[hh^\top]`
(:math:`\beta = F^\top C^{-1}`), the log-likelihood's gradient in :math:`F` is
:math:`\Psi^{-1}(\bar A - F\bar H)`; preconditioned by :math:`\Psi` on the left and
:math:`\bar H^{-1}` on the right it is :math:`\bar A\bar H^{-1} - F`, and a step of size
:math:`\eta` is

.. math::

    F \leftarrow F + \eta(\bar A\bar H^{-1} - F), \qquad
    \psi \leftarrow \psi + \eta(e - \psi), \qquad
    \Sigma = I + \eta(\bar H - I),

with :math:`e = \mathrm{diag}(S) - 2\,\mathrm{rowsum}(F\odot\bar A) + \mathrm{rowsum}(F\bar H\odot F)`
(the natural gradient of :math:`\psi`, whose Fisher information is :math:`1/2\psi^2`) and
:math:`\Sigma` the latent covariance of the parameter-expanded model (Liu, Rubin & Wu 1998), taken
back into :math:`F` by :math:`F \leftarrow FL_\Sigma`; the statistics move to the new latent
coordinates (:math:`\bar A \leftarrow \bar A L_\Sigma^{-\top}`,
:math:`\bar H \leftarrow L_\Sigma^{-1}\bar H L_\Sigma^{-\top}`). :math:`\eta = 1` is the M-step of
online EM (PX-EM); :math:`\eta < 1` damps it. Amari, "Natural gradient works efficiently in
learning", Neural Computation 10(2), 1998; Titterington, "Recursive parameter estimation using
incomplete data", JRSS B 46(2), 1984, for the EM preconditioner of a stochastic gradient.

Where :math:`D \le 3K` the exact :math:`D\times D` scatter fits the same memory as the statistics
(:math:`D^2 + DK \le 4DK`): then :math:`\bar A = S\beta^\top` and
:math:`\bar H = M^{-1} + \beta S\beta^\top` are exact at every step, and the step ascends the exact
log-likelihood of the running moments (no stale E-steps).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from pyro_fa.fa.fitters.base import FitContext, cholesky
from pyro_fa.fa.fitters.em import EMState, OnlineEM

__all__ = ["NaturalStep", "EXACT_RATIO"]

EXACT_RATIO = 3
"""The exact scatter is kept where ``dim <= EXACT_RATIO * rank`` (and the model is not sharded)."""


class NaturalStep(OnlineEM):
    r"""The EM-preconditioned gradient step of size ``eta`` (see the module's docstring).

    The E-step, the statistics and the warm-up are online EM's
    (:class:`~pyro_fa.fa.fitters.em.OnlineEM`, with its ``step_scale``, ``step_ramp`` and
    ``m_step_every``); the M-step is replaced by the gradient step, taken every ``m_step_every``-th
    update past the warm-up (every update up to :math:`D = 2\cdot 10^5`, every 10th at :math:`10^6`).
    State: online EM's :class:`~pyro_fa.fa.fitters.em.EMState`, where the exact scatter is kept with
    ``S`` (D, D) instead of ``A``. ``eta``: the step size; ``exact``: keep the exact scatter (decided by
    :meth:`exact_for`).

    Notes
    -----
    ``eta < 1`` costs five :math:`O(DK^2)` products per step against two.
    Measured error and cost: see ``benchmarks/results/measurements_from_docstrings.md``.
    """

    def __init__(self, eta: float = 1.0, step_scale: float = 2.0, step_ramp=None, m_step_every=None):
        super().__init__(step_scale=step_scale, expand=True, step_ramp=step_ramp, m_step_every=m_step_every)
        self.eta = float(eta)

    @staticmethod
    def exact_for(ctx: FitContext) -> bool:
        """Whether the exact scatter fits the memory of the statistics (and the model is not sharded)."""
        return ctx.dim <= EXACT_RATIO * ctx.rank and not ctx.sharded  # S needs every column

    def init(self, ctx: FitContext, F0: Tensor) -> EMState:
        state = super().init(ctx, F0)
        if self.exact_for(ctx):
            # the exact scatter replaces the statistic A (S beta^T is formed at each step)
            state.A = None
            state.S = F0.new_zeros(F0.shape[0], F0.shape[0])
        return state

    def update(self, state: EMState, ctx: FitContext, d: Tensor, n_old: int, B: int,
               first_spread: bool) -> EMState:
        if state.S is None:
            return super().update(state, ctx, d, n_old, B, first_spread)
        n = n_old + B
        self._warm_up(state, ctx, n, B, first_spread)
        # the centred scatter (Chan et al.'s merge): d holds the deviations from the new mean
        S = state.S
        S.addmm_(d.T, d)
        if n_old > 0 and B > 1:
            dbar = d.mean(0)
            S.addr_(dbar, dbar, alpha=B * B / n_old)
        elif n_old > 0:
            S.addmm_(d.T, d, alpha=1.0 / n_old)  # B = 1: S += d d^T n / n_old
        self._maybe_m_step(state, ctx, n)
        return state

    def _exact_statistics(self, state: EMState, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        r""":math:`\bar A = S\beta^\top` and :math:`\bar H = M^{-1} + \beta S\beta^\top` of the current factor."""
        F, psi = state.F, state.psi
        L = cholesky(state.cap)
        beta = torch.cholesky_solve((F / psi.unsqueeze(-1)).T, L)  # M^-1 F^T Psi^-1, (K, D)
        A = (state.S / ctx.n_updates) @ beta.T
        H = torch.cholesky_inverse(L) + beta @ A
        return A, 0.5 * (H + H.T)

    def _m_step(self, state: EMState, ctx: FitContext) -> None:
        eta = self.eta
        K = ctx.rank
        var = ctx.variance
        floor = ctx.floor_values(var)
        exact = state.S is not None
        if exact:
            A_full, H = self._exact_statistics(state, ctx)
            coef = 0.0
        else:
            H, coef = state.H, state.A_coef
        eye = torch.eye(K, dtype=H.dtype, device=H.device)
        Ls = cholesky(eye + eta * (H - eye))  # the latent covariance Sigma = L L^T after the step
        Ls_inv = torch.linalg.solve_triangular(Ls, eye, upper=False)
        # F' = (F + eta (A H^-1 - F)) Ls = F P + A Q;  A' = A Ls^-T;  H' = Ls^-1 H Ls^-T
        P = (1.0 - eta) * Ls
        Q = eta * torch.cholesky_solve(Ls, cholesky(H))
        H_new = Ls_inv @ H @ Ls_inv.T
        H_new = 0.5 * (H_new + H_new.T)
        unit = eta == 1.0  # PX-EM: H' = I and A' = F', held lazily as 1 * F (see OnlineEM._m_step)
        F, psi, cap = state.F, state.psi, state.cap
        A = A_full if exact else state.A
        cap.zero_()
        rows = ctx.block_rows(F.element_size())
        work, work_a = ctx.workspace(rows, F)
        for lo in range(0, ctx.rows, rows):
            hi = min(lo + rows, ctx.rows)
            F_c, A_c, w = F[lo:hi], A[lo:hi], work[: hi - lo]
            if coef != 0.0:
                A_c = torch.add(A_c, F_c, alpha=coef, out=work_a[: hi - lo])
            F_new = A_c @ Q if unit else torch.addmm(A_c @ Q, F_c, P)
            F_c.copy_(F_new)
            if unit:
                e = var[lo:hi] - torch.mul(F_c, F_c, out=w).sum(-1)
            else:
                A_new = torch.linalg.solve_triangular(Ls, A_c.T, upper=False).T  # A Ls^-T
                # e = diag(S) - rowsum(F' * (2 A' - F' H')), in the new coordinates
                e = var[lo:hi] - (F_c * (2.0 * A_new - F_c @ H_new)).sum(-1)
                if not exact:
                    A[lo:hi].copy_(A_new)
            psi_c = psi[lo:hi]
            psi_c.add_(e - psi_c, alpha=eta)
            torch.maximum(psi_c, floor[lo:hi], out=psi_c)
            torch.div(F_c, psi_c.unsqueeze(-1), out=w)
            cap.addmm_(w.T, F_c)
        ctx.cap_done(cap)
        if not exact:
            state.H.copy_(eye if unit else H_new)
            state.A_coef = 1.0 if unit else 0.0
