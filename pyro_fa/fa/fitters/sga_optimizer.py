r"""The optimizer step of online SGA: an optimizer ascends each batch's log-likelihood gradient.

Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis, University of
Edinburgh, 2021, Algorithm 1 and eqs. 4.23–4.26: each vector's E-step gives the gradient of its
log-likelihood in :math:`F` and :math:`\log\psi`, which a ``torch.optim`` optimizer (by default Adam,
fused into one pass over the rows of :math:`F`) ascends, in coordinates standardised by the running
standard deviations. :class:`~pyro_fa.fa.fitters.sga.OnlineSGA` (``method="sga"``) takes this step
for an optimizer class or factory, and a named step (``optimizer="natural"``) otherwise.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from pyro_fa._state import check_optimizer_state
from pyro_fa.fa.fitters.base import FitContext, FitState, Fitter, cholesky, scalar

__all__ = ["OptimizerStep", "SGAState"]


@dataclasses.dataclass
class SGAState(FitState):
    r"""Online SGA's state: the parameters ``F`` (D, K) and ``log_psi`` (D,) of :math:`\tilde F,
    \log\tilde\psi` (``nn.Parameter`` s, stepped by ``optimizer``), the coordinate scales ``scale`` (D,),
    and, when averaging, ``F_avg`` and ``log_psi_avg``; ``steps`` (ascent steps taken), ``fused`` (the
    default Adam runs fused), and ``cap`` / ``cap_key``, the cached capacitance of the current iterate.
    """

    F: nn.Parameter
    log_psi: nn.Parameter
    scale: Tensor
    F_avg: Optional[Tensor]
    log_psi_avg: Optional[Tensor]
    optimizer: Any = scalar(None)
    fused: bool = scalar(False)
    steps: int = scalar(0)
    cap: Optional[Tensor] = scalar(None)  # I + F~^T Psi~^-1 F~ of the current iterate, and its key
    cap_key: Any = scalar(None)

    parameters = ("F", "log_psi")
    extra = {"steps": "sga_steps"}



class OptimizerStep(Fitter):
    r"""Online SGA's optimizer step: one step of ``optimizer`` per batch on the gradients of eqs. 4.24–4.26.

    The ascent runs in coordinates standardised by the running standard deviations,
    :math:`F = \mathrm{diag}(s)\tilde F`, :math:`\psi = s^2\tilde\psi`; the reported factors
    are the Polyak–Ruppert averages of :math:`(\tilde F, \log\tilde\psi)` (``average=True``)
    or the last iterate, scaled back. Built by :class:`~pyro_fa.fa.fitters.sga.OnlineSGA`, whose
    options it takes (``lr``, ``optimizer``, ``optimizer_kwargs``, ``lr_decay_after``, ``average``);
    state: :class:`SGAState`.

    Notes
    -----
    Cost per update with the default Adam: two passes over the :math:`D\times K` arrays (the
    E-step's projection and the fused step), no :math:`D\times K` temporary, and two
    :math:`O(DK^2)` products per row block (the gradient's :math:`\tilde F\,E[hh^\top]` and the
    next capacitance).
    """

    def __init__(self, lr: float = 1e-2, optimizer=None, optimizer_kwargs: Optional[Dict[str, Any]] = None,
                 lr_decay_after: Optional[int] = None, average: bool = True):
        self.lr = lr
        self.optimizer = optimizer
        self.optimizer_kwargs = optimizer_kwargs
        self.lr_decay_after = lr_decay_after
        self.average = average

    def _decay_after(self, ctx: FitContext) -> int:
        return 2 * ctx.dim if self.lr_decay_after is None else self.lr_decay_after

    def init(self, ctx: FitContext, F0: Tensor):
        # the ascent runs in coordinates standardised by the running standard deviation
        # at the end of the warm-up (F = diag(scale) F~, psi = scale^2 psi~), so that the
        # optimizer's step size means the same whatever the scale of the data
        zeros = torch.zeros_like(F0[:, 0])
        scale = torch.ones_like(F0[:, 0])
        F = nn.Parameter(F0, requires_grad=False)
        log_psi = nn.Parameter(zeros, requires_grad=False)
        average = bool(self.average)
        F_avg = F0.clone() if average else None
        log_psi_avg = zeros.clone() if average else None
        opt = self.optimizer if self.optimizer is not None else torch.optim.Adam
        kwargs = dict(self.optimizer_kwargs or {})
        kwargs.setdefault("lr", float(self.lr))
        optimizer = opt([F, log_psi], **kwargs)
        # the default Adam runs fused (_fused_step): its state lives in the optimizer's
        # state dict as torch's Adam keeps it, so the two paths are interchangeable
        group = optimizer.param_groups[0]
        fused = self.optimizer is None and not (
            group.get("weight_decay", 0) or group.get("amsgrad", False) or group.get("maximize", False)
            or group.get("differentiable", False) or group.get("decoupled_weight_decay", False)
        )
        return SGAState(F=F, log_psi=log_psi, scale=scale, F_avg=F_avg, log_psi_avg=log_psi_avg,
                        optimizer=optimizer, fused=fused)

    def update(self, state, ctx: FitContext, d: Tensor, n_old: int, B: int, first_spread: bool):
        if n_old + B <= ctx.warmup:
            return state
        if n_old <= ctx.warmup:
            self._rescale_to_data(state, ctx)
        self._sga_step(state, ctx, d)
        return state

    def factors(self, state, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        scale = state.scale
        F, log_psi = (state.F_avg, state.log_psi_avg) if state.F_avg is not None else (
            state.F.detach(), state.log_psi.detach())
        return F * scale.unsqueeze(-1), log_psi.exp() * scale.pow(2)

    def noise(self, state, ctx: FitContext) -> Tensor:
        return state.log_psi.detach().exp() * state.scale.pow(2)

    def noise_floor(self, state, ctx: FitContext) -> float:
        return ctx.min_variance * float(state.scale.amin()) ** 2

    def range_scale(self, state, ctx: FitContext) -> Optional[Tensor]:
        return state.scale

    def state_extra(self, state) -> Optional[dict]:
        return state.optimizer.state_dict()

    def check_optimizer_state(self, state, ctx: FitContext, saved) -> None:
        check_optimizer_state(ctx.owner, state.optimizer, saved)

    def loaded(self, state, ctx: FitContext, extra: Optional[dict]):
        if extra is not None:
            # a copy: torch's Optimizer.load_state_dict keeps the given tensors (Adam's step and moments) when
            # dtype and device match, so a state loaded from a live model's state_dict() would share them with
            # it, and each model's in-place steps would move the other's (as the model's own buffers, the
            # loaded values must be this model's)
            state.optimizer.load_state_dict(copy.deepcopy(extra))
        state.cap = None
        return state

    def moved(self, state, ctx: FitContext, fn):
        state.cap = None
        self._repoint_optimizer(state, ctx, fn)
        return state

    def _repoint_optimizer(self, state: SGAState, ctx: FitContext, fn) -> None:
        """Point the SGA optimizer at the current ``_F`` / ``_log_psi`` after :meth:`_apply`.

        ``.to()`` may replace the Parameter objects (e.g. under
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)``); the
        optimizer would then keep stepping the old tensors. Its param groups and
        state keys are moved to the new objects, and its state to their device
        and dtype.
        """
        opt = state.optimizer
        new_params = [state.F, state.log_psi]
        old_params = [p for group in opt.param_groups for p in group["params"]]
        if len(old_params) != len(new_params):  # pragma: no cover - the optimizer is built on exactly these two
            raise RuntimeError(f"{ctx.owner}: the SGA optimizer holds {len(old_params)} parameters, "
                               f"expected {len(new_params)}.")
        moved = {id(old): new for old, new in zip(old_params, new_params)}
        for group in opt.param_groups:
            group["params"] = [moved[id(p)] for p in group["params"]]
        state = {}
        for p, s in opt.state.items():
            # keep the optimizer's state on the parameters' device and dtype
            state[moved.get(id(p), p)] = {
                k: fn(v) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in s.items()
            }
        opt.state.clear()
        opt.state.update(state)

    def _rescale_to_data(self, state: SGAState, ctx: FitContext) -> None:
        # The ascent runs in coordinates standardised by the running standard deviation,
        # F = diag(scale) F~, psi = scale^2 psi~, i.e. it fits the correlation structure; the
        # scale follows the exact running variances at every step (_sga_step calls this
        # again), so a stream whose spread grows, as SGD iterates that drift do, keeps
        # F~, psi~ near their optimum while the reported F, psi follow the data's scale.
        var = ctx.variance
        state.scale.copy_(ctx.floor(var, var).sqrt())
        if state.steps > 0:
            return
        # end of the warm-up: start at psi~ = 1 and the rows of F~ scaled so that
        # diag(F~ F~^T) = 1/100 (a small factor part, away from the saddle F = 0)
        F = state.F.detach()
        row_sq = ctx.mean_over_dim(F.pow(2).sum(-1))  # over all D (collective when sharded)
        state.F.data.mul_((0.01 / row_sq).sqrt())
        state.log_psi.data.zero_()
        state.cap = None
        if (state.F_avg is not None):
            state.F_avg.copy_(state.F.detach())
            state.log_psi_avg.zero_()

    def _sga_capacitance(self, state: SGAState, ctx: FitContext) -> Tensor:
        r""":math:`I + \tilde F^\top \tilde\Psi^{-1} \tilde F` of the current iterate.

        Cached after each fused step (which forms it while it updates :math:`\tilde F`);
        recomputed in row blocks, never a :math:`D\times K` temporary, when the parameters
        changed otherwise (a user optimizer, ``load_state_dict``, ``.to()``).
        """
        F, lp = state.F.detach(), state.log_psi.detach()
        key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)
        if state.cap is not None and state.cap_key == key:
            return state.cap
        rows = ctx.block_rows(state.F.element_size())
        cap = F.new_zeros(ctx.rank, ctx.rank)
        for lo in range(0, ctx.rows, rows):
            F_c = F[lo : lo + rows]
            cap.addmm_((F_c / lp[lo : lo + rows].exp().unsqueeze(-1)).T, F_c)
        ctx.cap_done(cap, sga=True)
        state.cap, state.cap_key = cap, key
        return cap

    def _sga_posterior(self, state: SGAState, ctx: FitContext, d: Tensor):
        # E-step (eq. 4.23) of the standardised model: one pass over F~
        F = state.F.detach()
        psi = state.log_psi.detach().exp()
        u = (d / psi) @ F  # (B, K)
        cap = self._sga_capacitance(state, ctx)
        u, total = ctx.sga_reduce(u, cap)  # summed over the ranks when sharded
        if total is not cap:
            state.cap = cap = total  # the cache (same key) now holds the whole capacitance
        L = cholesky(cap)
        m = torch.cholesky_solve(u.T, L).T
        return m, torch.cholesky_inverse(L)

    def _sga_set_lr(self, state: SGAState, ctx: FitContext) -> None:
        if self._decay_after(ctx) > 0 and state.steps > self._decay_after(ctx):
            # Robbins-Monro: a constant step leaves a noise floor; decay like t^(-1/2)
            factor = math.sqrt(self._decay_after(ctx) / state.steps)
            for group in state.optimizer.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor

    def _sga_step(self, state: SGAState, ctx: FitContext, d: Tensor) -> None:
        if state.steps > 0:
            self._rescale_to_data(state, ctx)  # follow the running scale (the first step's was just set)
        B = d.shape[0]
        d = d / state.scale  # standardised; gradients below are those of the standardised model
        state.steps += 1
        self._sga_set_lr(state, ctx)
        if state.fused:
            self._sga_fused_step(state, ctx, d)
            return
        F = state.F.detach()
        psi = state.log_psi.detach().exp()
        m, sigma_h = self._sga_posterior(state, ctx, d)  # (B, K), (K, K)
        # eq. 4.24 averaged over the batch: Psi^-1 (d m^T - F (Sigma + m m^T))
        E_hh = sigma_h + m.T @ m / B
        F_E = F @ E_hh
        dm = d.T @ m / B
        grad_F = (dm - F_E) / psi.unsqueeze(-1)
        # eq. 4.25-4.26, gradient in log psi
        e2 = d.pow(2).mean(0) - 2 * (dm * F).sum(-1) + (F_E * F).sum(-1)
        grad_log_psi = 0.5 * e2 / psi - 0.5
        # ascent: hand the negative gradient to a minimising optimizer
        state.F.grad = -grad_F
        state.log_psi.grad = -grad_log_psi
        state.optimizer.step()
        state.F.grad = None
        state.log_psi.grad = None
        # keep psi~ within the same relative floor as EM
        state.log_psi.data.clamp_min_(math.log(ctx.min_variance))
        if (state.F_avg is not None):
            # Polyak-Ruppert averaging with weights proportional to the step count: the
            # transient of step i weighs (i/t)^2, the noise of a decaying step averages out
            rho = 2.0 / (state.steps + 1)
            state.F_avg.lerp_(state.F.detach(), rho)
            state.log_psi_avg.lerp_(state.log_psi.detach(), rho)

    def _sga_adam_state(self, state: SGAState, ctx: FitContext, p: Tensor) -> Dict[str, Tensor]:
        # torch.optim.Adam's per-parameter state (same keys and layout), created as it would
        state = state.optimizer.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _sga_fused_step(self, state: SGAState, ctx: FitContext, d: Tensor) -> None:
        r"""One SGA step with the default Adam, fused into one pass over the rows of :math:`\tilde F`.

        The same arithmetic as ``torch.optim.Adam`` on the gradients of eqs. 4.24–4.26
        (the non-fused path), but block by block: the gradient rows, Adam's moments,
        :math:`\tilde F`, :math:`\log\tilde\psi`, the Polyak averages and the next E-step's
        capacitance are formed while a block of rows is in cache, so that no
        :math:`D\times K` temporary exists and each :math:`D\times K` array is read and
        written once. With the E-step's pass over :math:`\tilde F`, an update costs two passes.
        """
        B = d.shape[0]
        group = state.optimizer.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        F, lp = state.F.detach(), state.log_psi.detach()
        sF, slp = self._sga_adam_state(state, ctx, state.F), self._sga_adam_state(state, ctx, state.log_psi)
        m, sigma_h = self._sga_posterior(state, ctx, d)  # uses the capacitance of the current iterate
        sF["step"] += 1
        slp["step"] += 1
        t = float(sF["step"])
        step_size = lr / (1 - beta1**t)
        bc2_sqrt = math.sqrt(1 - beta2**t)
        E_hh = sigma_h + m.T @ m / B
        m_B = m / B
        dT = d.T  # (D, B)
        rho = 2.0 / (state.steps + 1) if (state.F_avg is not None) else 0.0
        log_floor = math.log(ctx.min_variance)
        rows = ctx.block_rows(state.F.element_size())
        work = ctx.workspace(rows, state.F)
        cap = F.new_zeros(ctx.rank, ctx.rank)
        mF, vF = sF["exp_avg"], sF["exp_avg_sq"]
        mlp, vlp = slp["exp_avg"], slp["exp_avg_sq"]
        for lo in range(0, ctx.rows, rows):
            hi = min(lo + rows, ctx.rows)
            r = hi - lo
            F_c, d_c, lp_c = F[lo:hi], dT[lo:hi], lp[lo:hi]
            g, tmp = work[0, :r], work[1, :r]
            inv_psi = lp_c.neg().exp_()
            # ascent direction times psi: d m^T / B - F (Sigma + m m^T / B)   (eq. 4.24)
            torch.mm(F_c, E_hh, out=g)
            g.addmm_(d_c, m_B, beta=-1.0)
            # e2 = mean d^2 - 2 rowsum(F * d m^T/B) + rowsum(F * F E)
            #    = mean d^2 - rowsum(F * d m^T/B) - rowsum(F * g)          (eqs. 4.25-4.26)
            Fdm = (d_c * (F_c @ m_B.T)).sum(-1)
            e2 = d_c.pow(2).mean(-1).sub_(Fdm).sub_(torch.mul(F_c, g, out=tmp).sum(-1))
            # gradients of the negative log-likelihood (Adam minimises)
            g_lp = e2.mul_(inv_psi).mul_(-0.5).add_(0.5)
            g.mul_(inv_psi.neg_().unsqueeze(-1))
            # Adam (torch.optim.Adam's single-tensor arithmetic) on the rows of F~ ...
            m_c, v_c = mF[lo:hi], vF[lo:hi]
            m_c.lerp_(g, 1 - beta1)
            v_c.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            # lr m^ / (sqrt(v^) + eps) with the bias corrections folded into the scalars
            torch.sqrt(v_c, out=tmp).add_(eps * bc2_sqrt)
            F_c.addcdiv_(m_c, tmp, value=-step_size * bc2_sqrt)
            # ... and on log psi~, floored like EM's psi
            ml_c, vl_c = mlp[lo:hi], vlp[lo:hi]
            ml_c.lerp_(g_lp, 1 - beta1)
            vl_c.mul_(beta2).addcmul_(g_lp, g_lp, value=1 - beta2)
            lp_c.addcdiv_(ml_c, vl_c.sqrt().add_(eps * bc2_sqrt), value=-step_size * bc2_sqrt)
            lp_c.clamp_min_(log_floor)
            if (state.F_avg is not None):
                state.F_avg[lo:hi].lerp_(F_c, rho)
                state.log_psi_avg[lo:hi].lerp_(lp_c, rho)
            # the next E-step's capacitance, while the new rows are in cache
            torch.div(F_c, lp_c.exp().unsqueeze(-1), out=tmp)
            cap.addmm_(tmp.T, F_c)
        ctx.cap_done(cap, sga=True)
        state.cap = cap
        state.cap_key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)


