r"""Online EM for factor analysis (``method="em"``), with the parameter-expanded M-step.

Brownlie (2021), Algorithm 2, in the stochastic-approximation form of Cappé & Moulines (2009),
with the M-step of PX-EM (Liu, Rubin & Wu 1998); see :class:`~pyro_fa.OnlineFactorAnalysis`
for the update and its options (``step_scale``, ``step_ramp``, ``expand``, ``m_step_every``).

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis, University of
Edinburgh, 2021, Algorithm 2, eqs. 4.23 and 4.32–4.36. O. Cappé and E. Moulines, "On-line
expectation-maximization algorithm for latent data models", JRSS B 71(3), 2009. C. Liu,
D. B. Rubin and Y. N. Wu, "Parameter expansion to accelerate EM: the PX-EM algorithm",
Biometrika 85(4), 1998.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.fa.fitters.base import (FitContext, FitState, Fitter, check_step_options, cholesky as _cholesky,
                                register_fitter, scalar)

__all__ = ["OnlineEM", "EMState"]

_M_STEP_DIM = 100_000  # default m_step_every = max(1, dim // _M_STEP_DIM)


@dataclasses.dataclass
class EMState(FitState):
    r"""Online EM's state: the factor ``F`` (D, K), ``psi`` (D,), the statistics ``A`` (D, K) and ``H``
    (K, K), the capacitance ``cap`` :math:`I + F^\top\Psi^{-1}F` of the current factor; the exact scatter
    ``S`` (D, D) instead of ``A`` for the natural step of :mod:`~pyro_fa.fa.fitters.sga_natural` at small D.

    ``A_coef``: the statistic :math:`\bar A` is held as ``A_coef * F + A`` (an expanded M-step makes it
    :math:`F` itself, coefficient exactly 1, ``A`` stale, instead of writing :math:`F` into ``A``);
    ``since_m_step``: updates since the last M-step.
    """

    F: Tensor
    psi: Tensor
    A: Optional[Tensor]
    H: Tensor
    cap: Tensor
    S: Optional[Tensor] = None
    A_coef: float = scalar(0.0)
    since_m_step: int = scalar(0)

    extra = {"A_coef": "A_coef", "since_m_step": "since_m_step"}


@register_fitter("em")
class OnlineEM(Fitter):
    r"""Online EM: running statistics :math:`\bar A, \bar H` and an M-step after each update.

    .. math::

        \bar A_t = \bar A_{t-1} + \gamma_t (d_t m_t^\top - \bar A_{t-1}), \qquad
        \bar H_t = \bar H_{t-1} + \gamma_t (\Sigma_h + m_t m_t^\top - \bar H_{t-1}),

    :math:`\gamma_t = a_t / (t + a_t - 1)`, then :math:`F = \bar A_t L^{-\top}`
    (:math:`\bar H_t = LL^\top`, PX-EM) or :math:`F = \bar A_t \bar H_t^{-1}`, and
    :math:`\psi = \mathrm{diag}(S_t) - \mathrm{diag}(F \bar A_t^\top)` (Brownlie 2021, eqs. 4.33–4.35).

    Use it as ``OnlineFactorAnalysis(dim, rank, method=OnlineEM(step_scale=1.0))`` or ``method="em"`` with
    the same keyword options. State: :class:`EMState` (the model's buffers ``_F``, ``_psi``, ``_A``,
    ``_H``, ``_cap``).

    Parameters
    ----------
    step_scale : float, default 2.0
        :math:`a \ge 1` in the step :math:`\gamma_t = a/(t+a-1)` (:math:`t` counts observations). The
        statistics weigh observation :math:`i` in proportion to :math:`i^{a-1}`: early E-steps, made with
        a poor :math:`F`, fade like :math:`(i/t)^a`, at the price of an effective sample size
        :math:`t(2a-1)/a^2` (0.75 t for the default). ``1`` is the thesis's :math:`1/t`.
    expand : bool, default True
        The parameter-expanded M-step (PX-EM): it estimates the latent covariance as well and absorbs it
        into :math:`F`, which sets the scale of :math:`F` in one step where plain EM crawls (see Notes); one
        :math:`K\times K` triangular inverse per M-step. ``False`` is the thesis's M-step.
    step_ramp : int, optional
        Observations over which :math:`a_t` grows linearly from 1 to ``step_scale``; default ``2 * dim``.
        The :math:`D\times K` statistic :math:`\bar A` needs of the order of D observations before its
        M-step is better than noise; until then plain averaging (:math:`a = 1`) is the stable,
        minimum-variance choice, and forgetting the early E-steps pays only after.
    m_step_every : int, optional
        Run the M-step (the :math:`O(DK^2)` part of an update) after every ``m_step_every``-th update
        past the warm-up; the statistics are updated at every update, and E-steps in between use the last
        :math:`F, \psi`. Default ``max(1, dim // 100_000)``: every update up to :math:`D = 2\cdot 10^5`,
        every 10th at :math:`D = 10^6`, where an update then costs about one pass over :math:`\bar A` and
        one over :math:`F` plus a tenth of an M-step; the stale factor of a few updates is negligible
        beside the :math:`1/t` weight of each new observation.

    Notes
    -----
    Cost per update: one pass over :math:`F` (the E-step's projection), one over :math:`\bar A`,
    and every ``m_step_every`` updates the :math:`O(DK^2)` M-step in cache-sized row blocks.

    Why the expanded M-step: plain EM's factor update is the regression of the
    observations on the E-step's posterior means, :math:`F = \bar A \bar H^{-1}`. Along
    a direction :math:`u` of the data with variance :math:`\lambda` (noise 1) and a
    current factor :math:`s u`, the posterior mean shrinks by :math:`s/(1+s^2)` and
    the regression returns :math:`F \approx (s + 1/s) u`: :math:`s^2` grows by about 2 per
    EM iteration towards its fixed point :math:`\lambda - 1`, and the contraction rate
    near it is about :math:`1 - 2/\lambda`, slowest where the signal is strongest.
    PX-EM (Liu, Rubin & Wu 1998; Rubin & Thayer's FA is their example) lets
    :math:`h \sim N(0, \Sigma)` during the M-step, estimates :math:`\Sigma = \bar H`, and
    maps back with :math:`F = \bar A \bar H^{-1} L`: the covariance part becomes
    :math:`\bar A \bar H^{-1} \bar A^\top`, which has the right scale after one step. The
    statistics are re-expressed in the new latent coordinates so that later E-steps
    and the running averages agree.

    Why not :math:`\gamma_t = 1/t`: online EM with step :math:`\gamma_t` follows the
    ODE :math:`\dot s = \bar s(\theta(s)) - s` in time :math:`\tau = \sum_t \gamma_t`
    (Cappé & Moulines 2009). With :math:`1/t`, :math:`\tau = \log t`: the
    statistics computed under the random initial :math:`F` keep the weight
    :math:`t_0/t` and the error of the transient decays only like
    :math:`t^{-(1-\lambda)}`, where :math:`\lambda` is the contraction rate of
    batch EM, close to one when the noise is large and heteroscedastic
    (spectrum [1, 1000] in Brownlie 2021, §5.2, where the thesis's online EM stalls
    at 2–3 times the batch error). With :math:`a/(t+a-1)`, :math:`\tau = a\log t`
    and the transient fades like :math:`t^{-a(1-\lambda)}`. Larger :math:`a`
    forgets faster but is noisier; :math:`a = 2` is the choice on the models of
    Brownlie (2021, ch. 5) (``pyro-fa online-fa``).
    """

    finishes_warmup = True
    curvature_fit = "online"
    curvature_passes = 4

    def __init__(self, step_scale: float = 2.0, expand: bool = True, step_ramp: Optional[int] = None,
                 m_step_every: Optional[int] = None):
        self.step_scale = step_scale
        self.expand = expand
        self.step_ramp = step_ramp
        self.m_step_every = m_step_every

    @classmethod
    def from_options(cls, *, step_scale=2.0, expand=True, step_ramp=None, m_step_every=None, **_):
        return cls(step_scale=step_scale, expand=expand, step_ramp=step_ramp, m_step_every=m_step_every)

    def options(self):
        return dict(step_scale=self.step_scale, expand=self.expand, step_ramp=self.step_ramp,
                    m_step_every=self.m_step_every)

    def _ramp(self, ctx: FitContext) -> int:
        return 2 * ctx.dim if self.step_ramp is None else self.step_ramp

    def m_step_interval(self, dim: int) -> int:
        """Updates between M-steps at dimension ``dim``: ``m_step_every``, by default ``max(1, dim // 100_000)``."""
        return max(1, dim // _M_STEP_DIM) if self.m_step_every is None else self.m_step_every

    def _every(self, ctx: FitContext) -> int:
        return self.m_step_interval(ctx.dim)

    def check(self, owner: str, *, rank: int, warmup: int) -> None:
        check_step_options(owner, self.step_scale, self.step_ramp, self.m_step_every)
        if not isinstance(self.expand, bool):
            raise TypeError(f"{owner}: expand must be True or False, got {self.expand!r}.")
        self._check_warmup(owner, rank=rank, warmup=warmup)

    def _check_warmup(self, owner: str, *, rank: int, warmup: int) -> None:
        if warmup < rank:
            raise ValueError(
                f"{owner}: warmup must be >= rank={rank} for method 'em', got {warmup!r}: an M-step from fewer "
                "vectors than factors is degenerate (psi collapses and the capacitance loses positive-definiteness "
                "in float32)."
            )

    def init(self, ctx: FitContext, F0: Tensor) -> EMState:
        K = F0.shape[1]
        # capacitance I + F^T Psi^-1 F of the current (F, psi), kept for the next E-step
        cap0 = F0.T @ F0
        ctx.cap_done(cap0)
        return EMState(F=F0, psi=torch.ones_like(F0[:, 0]), A=torch.zeros_like(F0), H=F0.new_zeros(K, K), cap=cap0)

    def factors(self, state: EMState, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        return state.F, state.psi

    def noise(self, state: EMState, ctx: FitContext) -> Tensor:
        return state.psi

    def noise_floor(self, state: EMState, ctx: FitContext) -> float:
        return float(state.psi.amin())

    def finish_warmup(self, state: EMState, ctx: FitContext) -> EMState:
        self._m_step(state, ctx)
        state.since_m_step = 0
        return state

    def shard_sums(self, state: EMState, ctx: FitContext, d, n_old: int, B: int):
        # the E-step's projection F^T Psi^-1 d (one vector, with the current F, psi) and the capacitance
        # that the last M-step left as this rank's partial sum ride on the update's all-reduce
        n = n_old + B
        rescale = 2 <= n <= ctx.warmup and n.bit_length() > n_old.bit_length()
        u = state.F.T @ (d / state.psi).T if d is not None and B == 1 and not rescale else None  # (K, 1)
        sums = [u if u is not None else state.F.new_zeros(ctx.rank, 1)]
        if ctx.cap_pending:
            sums.append(state.cap)
        return sums, u is not None

    def shard_reduced(self, state: EMState, ctx: FitContext, sums, n: int, projected: bool) -> None:
        if ctx.cap_pending:
            ctx.commit_cap(state.cap, sums[1])
        ctx.stash_projection(n, sums[0] if projected else None)

    def update(self, state: EMState, ctx: FitContext, d: Tensor, n_old: int, B: int,
               first_spread: bool) -> EMState:
        n = n_old + B
        K = ctx.rank
        self._warm_up(state, ctx, n, B, first_spread)
        # E-step (eq. 4.23): the capacitance I + F^T Psi^-1 F of the current F, psi was
        # formed by the previous M-step; only F^T Psi^-1 d is new (one pass over F)
        L, u = ctx.e_step_inputs(d, state.F, state.psi, state.cap)  # (K, B) F^T Psi^-1 d^T, summed over the ranks
        m = torch.cholesky_solve(u, L)
        eye = torch.eye(K, dtype=d.dtype, device=d.device)
        sigma_h = torch.cholesky_solve(eye, L)
        # statistics (eqs. 4.32, 4.36) with step gamma, A updated in place (one pass)
        step_scale = float(self.step_scale)
        a = 1.0 + (step_scale - 1.0) * min(1.0, n / self._ramp(ctx))
        gamma = min(1.0, a * B / (n + (a - 1) * B))
        # the statistic is A = A_coef * F + A (see _m_step). The coefficient is exactly 1
        # only right after an expanded M-step (every update past the warm-up scales it by
        # 1 - gamma < 1): A is stale then, and the update writes it without reading it
        state.A.addmm_(d.T, m.T, beta=0.0 if state.A_coef == 1.0 else 1 - gamma, alpha=gamma / B)
        state.A_coef *= 1 - gamma
        state.H.mul_(1 - gamma).add_(sigma_h + m @ m.T / B, alpha=gamma)
        self._maybe_m_step(state, ctx, n)
        return state

    def _warm_up(self, state: EMState, ctx: FitContext, n: int, B: int, first_spread: bool) -> None:
        # warm-up: each time n passes a power of two, and at the first vector that differs from the
        # earlier ones, the fixed initial factor is put in the units of the data seen so far (see
        # _scale_to_variance); identical vectors have no units to put it in
        if 2 <= n <= ctx.warmup and (first_spread or (n.bit_length() > (n - B).bit_length() and ctx.has_spread())):
            self._scale_to_variance(state, ctx)

    def _maybe_m_step(self, state: EMState, ctx: FitContext, n: int) -> None:
        # past the warm-up, the M-step every m_step_every updates
        if n <= ctx.warmup:
            return
        state.since_m_step += 1
        if state.since_m_step >= self._every(ctx):
            self._m_step(state, ctx)
            state.since_m_step = 0

    def _scale_to_variance(self, state: EMState, ctx: FitContext) -> None:
        r"""Warm-up: rescale the initial factor and :math:`\psi` to the running variances.

        The rows of :math:`F` keep their directions and get the norm
        :math:`\sqrt{s_d/2}`, :math:`\psi_d = s_d/2` (floored), where :math:`s_d` is the
        running variance of coordinate d; the capacitance is recomputed. The warm-up's
        E-steps, which stay in the statistics, are then projections onto random
        directions in the units of the data (one power iteration at the first
        M-step) rather than posteriors under a unit-scale model: with the unit
        initial :math:`F, \psi` and weight variances of 1e-3, the warm-up's
        :math:`\Sigma_h \approx I/2` dominated :math:`\bar H` and shrank the factor
        (on short streams of SGD iterates the rescaling roughly halves the covariance
        error). Called at :math:`n = 2, 4, 8, \dots` up to the
        warm-up's end: :math:`O(DK^2)` each, in row blocks.
        """
        var = ctx.variance
        floor = ctx.floor_values(var)
        F, psi, cap = state.F, state.psi, state.cap
        cap.zero_()
        rows = ctx.block_rows(F.element_size())
        work = ctx.workspace(rows, F)[0]
        for lo in range(0, ctx.rows, rows):
            hi = min(lo + rows, ctx.rows)
            F_c, w, v, psi_c = F[lo:hi], work[: hi - lo], var[lo:hi], psi[lo:hi]
            # in float64: a row that an earlier rescale left tiny (a coordinate that had barely moved, its
            # variance then a float32 denormal) has a squared norm that underflows float32 to a denormal,
            # and 0.5 v / norm^2 overflows to inf once the coordinate moves. A row that has been zeroed (a
            # coordinate that had not moved) stays zero
            F64 = F_c.to(torch.float64)
            norm = F64.norm(dim=-1)
            scale = torch.where(norm > 0, (0.5 * v.to(torch.float64)).sqrt() / norm.clamp_min(1e-300),
                                torch.zeros_like(norm))
            F_c.copy_(F64.mul_(scale.unsqueeze(-1)))
            torch.maximum(0.5 * v, floor[lo:hi], out=psi_c)
            torch.div(F_c, psi_c.unsqueeze(-1), out=w)
            cap.addmm_(w.T, F_c)
        ctx.cap_done(cap)

    def _m_step(self, state: EMState, ctx: FitContext) -> None:
        r"""M-step (eqs. 4.33, 4.35) fused with the next E-step's capacitance.

        One pass over :math:`\bar A` in row blocks small enough to stay in cache:
        :math:`F = \bar A \bar H^{-1}` (or, expanded, :math:`\bar A \leftarrow \bar A L^{-\top}`,
        :math:`F = \bar A`), :math:`\psi = \mathrm{diag}(S) - \mathrm{rowsum}(F \odot \bar A)`
        (floored) and :math:`I + F^\top \Psi^{-1} F`, without a D x K temporary.
        """
        var = ctx.variance
        floor = ctx.floor_values(var)
        L = _cholesky(state.H)
        expand = self.expand
        if expand:
            # PX-EM: the working latent covariance H is absorbed into the factor,
            # F = A H^-1 L = A L^-T, and the statistics move to the new latent
            # coordinates h' = L^-1 h: A <- A L^-T, H <- L^-1 H L^-T = I
            eye = torch.eye(ctx.rank, dtype=L.dtype, device=L.device)
            M = torch.linalg.solve_triangular(L, eye, upper=False).T
            state.H.copy_(eye)
        else:
            M = torch.cholesky_inverse(L)
        A, F, psi = state.A, state.F, state.psi
        cap = state.cap
        cap.zero_()
        rows = ctx.block_rows(F.element_size())
        work, work_a = ctx.workspace(rows, F)
        coef = state.A_coef
        for lo in range(0, ctx.rows, rows):
            hi = min(lo + rows, ctx.rows)
            A_c, F_c, w = A[lo:hi], F[lo:hi], work[: hi - lo]
            if coef != 0.0:
                # the statistic's rows, A = coef * F + _A, formed in cache
                A_c = torch.add(A_c, F_c, alpha=coef, out=work_a[: hi - lo])
            torch.mm(A_c, M, out=F_c)
            psi_c = psi[lo:hi]
            # diag(A H^-1 A^T): rowsum(F * A) for F = A H^-1, rowsum(F * F) for F = A L^-T
            torch.sub(var[lo:hi], torch.mul(F_c, F_c if expand else A_c, out=w).sum(-1), out=psi_c)
            torch.maximum(psi_c, floor[lo:hi], out=psi_c)
            torch.div(F_c, psi_c.unsqueeze(-1), out=w)
            cap.addmm_(w.T, F_c)
        ctx.cap_done(cap)
        # expanded: the statistic in the new coordinates, A L^-T, is F itself; rather than
        # writing it into A (one more pass over D x K memory) hold it as 1 * F + stale A
        state.A_coef = 1.0 if expand else 0.0
