r"""Online stochastic gradient ascent on the factor-analysis log-likelihood (``method="sga"``).

Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis, University of
Edinburgh, 2021, Algorithm 1 and eqs. 4.23–4.26: each vector's E-step gives the gradient of its
log-likelihood in :math:`F` and :math:`\log\psi`, which an optimizer (by default Adam, fused into
one pass over the rows of :math:`F`) ascends. The state lives in the
:class:`~pyro_fa.OnlineFactorAnalysis` that holds this fitter.
"""
from __future__ import annotations

import copy
import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from pyro_fa._state import check_optimizer_state
from pyro_fa.fa.fitters import Fitter, cholesky, register_fitter
from pyro_fa.fa.fitters.sga_natural import EXACT_RATIO, NaturalStep

__all__ = ["OnlineSGA"]


@register_fitter("sga")
class OnlineSGA(Fitter):
    r"""Online SGA: one optimizer step per batch on the gradients of eqs. 4.24–4.26.

    The ascent runs in coordinates standardised by the running standard deviations,
    :math:`F = \mathrm{diag}(s)\tilde F`, :math:`\psi = s^2\tilde\psi`; the reported factors
    are the Polyak–Ruppert averages of :math:`(\tilde F, \log\tilde\psi)` (``average=True``)
    or the last iterate, scaled back.

    State (of the model): the parameters ``_F`` (D, K) and ``_log_psi`` (D,) of
    :math:`\tilde F, \log\tilde\psi`, the buffers ``_scale`` (D,) and, when averaging,
    ``_F_avg``, ``_log_psi_avg``; the optimizer ``_optimizer``, whose state is saved under
    ``_optimizer_state``.

    Notes
    -----
    Cost per update with the default Adam: two passes over the :math:`D\times K` arrays (the
    E-step's projection and the fused step), no :math:`D\times K` temporary, and two
    :math:`O(DK^2)` products per row block (the gradient's :math:`\tilde F\,E[hh^\top]` and the
    next capacitance): 14.2 times two :math:`D\times K` mat-vecs at :math:`D = 10^6`, :math:`K = 20`,
    float32, one thread (the project's online-EM benchmark).

    Where it works and where not (measured, see the project's benchmark docs, "Online SGA"): on
    stationary FA streams the default ``lr=1e-2`` ends at about twice scikit-learn's batch
    covariance error (0.024 against 0.011 at :math:`D = 10`, :math:`K = 2`, 20 000 vectors); on the
    drifting SGD iterates that SWAG collects it is no better than a diagonal (26-2873 times batch
    FA's error at any ``lr`` from 1e-3 to 1e-2). A step :math:`\gamma_t \propto 1/t` in the
    parameters makes about :math:`\log T` EM iterations' worth of progress, and the few dominant
    directions of drift need many; online EM (``method="em"``), whose statistics take a full step
    per vector, the natural step below, or the scatter sketch (``method="sketch"``) are the methods for those
    streams.

    ``optimizer="natural"`` replaces the optimizer by the EM-preconditioned gradient step of
    :class:`~pyro_fa.fa.fitters.sga_natural.NaturalStep` (size ``optimizer_kwargs={"step": eta}``, eta in
    (0, 1], default 1): within 1.07–1.34 times batch FA's error on those streams, at 1.89 times two
    mat-vecs per update; ``lr``, ``lr_decay_after`` and ``average`` do not apply to it.
    """

    def init(self, fa, F0: Tensor, *, optimizer=None, optimizer_kwargs=None) -> None:
        fa._sga_natural = isinstance(optimizer, str)
        if fa._sga_natural:
            self._init_natural(fa, F0, optimizer, optimizer_kwargs)
            return
        # the ascent runs in coordinates standardised by the running standard deviation
        # at the end of the warm-up (F = diag(scale) F~, psi = scale^2 psi~), so that the
        # optimizer's step size means the same whatever the scale of the data
        zeros = torch.zeros_like(F0[:, 0])
        fa.register_buffer("_scale", torch.ones_like(F0[:, 0]))
        fa._F = nn.Parameter(F0, requires_grad=False)
        fa._log_psi = nn.Parameter(zeros, requires_grad=False)
        if fa.average:
            fa.register_buffer("_F_avg", F0.clone())
            fa.register_buffer("_log_psi_avg", zeros.clone())
        opt = optimizer if optimizer is not None else torch.optim.Adam
        kwargs = dict(optimizer_kwargs or {})
        kwargs.setdefault("lr", fa.lr)
        fa._optimizer = opt([fa._F, fa._log_psi], **kwargs)
        # the default Adam runs fused (_fused_step): its state lives in the optimizer's
        # state dict as torch's Adam keeps it, so the two paths are interchangeable
        group = fa._optimizer.param_groups[0]
        fa._sga_fused = optimizer is None and not (
            group.get("weight_decay", 0) or group.get("amsgrad", False) or group.get("maximize", False)
            or group.get("differentiable", False) or group.get("decoupled_weight_decay", False)
        )
        fa._sga_cap = None  # I + F~^T Psi~^-1 F~ of the current iterate, and its key
        fa._sga_cap_key = None

    def step(self, fa, d: Tensor, n_old: int, B: int, first_spread: bool) -> None:
        if fa._sga_natural:
            return _NATURAL.step(fa, d, n_old, B, first_spread)
        if n_old + B <= fa.warmup:
            return
        if n_old <= fa.warmup:
            self._rescale_to_data(fa)
        self._sga_step(fa, d)

    def factors(self, fa) -> Tuple[Tensor, Tensor]:
        if fa._sga_natural:
            return _NATURAL.factors(fa)
        scale = fa._scale
        F, log_psi = (fa._F_avg, fa._log_psi_avg) if fa.average else (fa._F.detach(), fa._log_psi.detach())
        return F * scale.unsqueeze(-1), log_psi.exp() * scale.pow(2)

    def noise(self, fa) -> Tensor:
        if fa._sga_natural:
            return _NATURAL.noise(fa)
        return fa._log_psi.detach().exp() * fa._scale.pow(2)

    def noise_floor(self, fa) -> float:
        if fa._sga_natural:
            return _NATURAL.noise_floor(fa)
        return fa.min_variance * float(fa._scale.amin()) ** 2

    def range_scale(self, fa) -> Optional[Tensor]:
        if fa._sga_natural:
            return None
        return fa._scale

    def finish_warmup(self, fa) -> None:
        raise RuntimeError(f"{type(fa).__name__}: finish_warmup() needs method 'em', got {fa.method!r}: the ascent "
                           f"only starts after warmup={fa.warmup} observations. Pass a smaller warmup.")

    def state_extra(self, fa) -> Optional[dict]:
        if fa._sga_natural:
            return None
        return fa._optimizer.state_dict()

    def check_optimizer_state(self, fa, state) -> None:
        if fa._sga_natural:
            return
        check_optimizer_state(type(fa).__name__, fa._optimizer, state)

    def loaded(self, fa, extra: Optional[dict]) -> None:
        if fa._sga_natural:
            return
        if extra is not None:
            # a copy: torch's Optimizer.load_state_dict keeps the given tensors (Adam's step and moments) when
            # dtype and device match, so a state loaded from a live model's state_dict() would share them with
            # it, and each model's in-place steps would move the other's (as the model's own buffers, the
            # loaded values must be this model's)
            fa._optimizer.load_state_dict(copy.deepcopy(extra))
        fa._sga_cap = None

    def moved(self, fa, fn) -> None:
        if fa._sga_natural:
            return
        fa._sga_cap = None
        self._repoint_optimizer(fa, fn)

    def shard_sums(self, fa, d, n_old: int, B: int):
        if fa._sga_natural:  # online EM's E-step: its projection and capacitance ride on the update's all-reduce
            return _NATURAL.shard_sums(fa, d, n_old, B)
        return super().shard_sums(fa, d, n_old, B)

    def shard_reduced(self, fa, sums, n: int, context) -> None:
        if fa._sga_natural:
            _NATURAL.shard_reduced(fa, sums, n, context)

    def _init_natural(self, fa, F0: Tensor, optimizer: str, optimizer_kwargs) -> None:
        owner = type(fa).__name__
        if optimizer != "natural":
            raise ValueError(f"{owner}: optimizer must be a torch optimizer class, a callable returning one, or "
                             f"'natural' (the EM-preconditioned step), got {optimizer!r}.")
        kwargs = dict(optimizer_kwargs or {})
        eta = kwargs.pop("step", 1.0)
        if kwargs:
            raise ValueError(f"{owner}: optimizer_kwargs of optimizer='natural' takes only 'step', got "
                             f"{sorted(kwargs)}.")
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta <= 1:
            raise ValueError(f"{owner}: optimizer_kwargs['step'] of optimizer='natural' must be a number in (0, 1], "
                             f"got {eta!r}.")
        if fa.warmup < fa.rank:
            raise ValueError(f"{owner}: warmup must be >= rank={fa.rank} for optimizer='natural', got {fa.warmup}: "
                             "its first step from fewer vectors than factors is degenerate.")
        fa._sga_eta = float(eta)
        fa._sga_exact = fa.dim <= EXACT_RATIO * fa.rank and fa._sharding is None  # S needs every column
        _NATURAL.init(fa, F0)

    def _repoint_optimizer(self, fa, fn) -> None:
        """Point the SGA optimizer at the current ``_F`` / ``_log_psi`` after :meth:`_apply`.

        ``.to()`` may replace the Parameter objects (e.g. under
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)``); the
        optimizer would then keep stepping the old tensors. Its param groups and
        state keys are moved to the new objects, and its state to their device
        and dtype.
        """
        opt = fa._optimizer
        new_params = [fa._F, fa._log_psi]
        old_params = [p for group in opt.param_groups for p in group["params"]]
        if len(old_params) != len(new_params):  # pragma: no cover - the optimizer is built on exactly these two
            raise RuntimeError(f"{type(fa).__name__}: the SGA optimizer holds {len(old_params)} parameters, "
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

    def _rescale_to_data(self, fa) -> None:
        # The ascent runs in coordinates standardised by the running standard deviation,
        # F = diag(scale) F~, psi = scale^2 psi~, i.e. it fits the correlation structure; the
        # scale follows the exact running variances at every step (_sga_step calls this
        # again), so a stream whose spread grows, as SGD iterates that drift do, keeps
        # F~, psi~ near their optimum while the reported F, psi follow the data's scale.
        var = fa.variance
        fa._scale.copy_(fa._floor(var, var).sqrt())
        if fa._sga_steps > 0:
            return
        # end of the warm-up: start at psi~ = 1 and the rows of F~ scaled so that
        # diag(F~ F~^T) = 1/100 (a small factor part, away from the saddle F = 0)
        F = fa._F.detach()
        row_sq = fa._mean_over_dim(F.pow(2).sum(-1))  # over all D (collective when sharded)
        fa._F.data.mul_((0.01 / row_sq).sqrt())
        fa._log_psi.data.zero_()
        fa._sga_cap = None
        if fa.average:
            fa._F_avg.copy_(fa._F.detach())
            fa._log_psi_avg.zero_()

    def _sga_capacitance(self, fa) -> Tensor:
        r""":math:`I + \tilde F^\top \tilde\Psi^{-1} \tilde F` of the current iterate.

        Cached after each fused step (which forms it while it updates :math:`\tilde F`);
        recomputed in row blocks, never a :math:`D\times K` temporary, when the parameters
        changed otherwise (a user optimizer, ``load_state_dict``, ``.to()``).
        """
        F, lp = fa._F.detach(), fa._log_psi.detach()
        key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)
        if fa._sga_cap is not None and fa._sga_cap_key == key:
            return fa._sga_cap
        rows = fa._block_rows()
        cap = F.new_zeros(fa.rank, fa.rank)
        for lo in range(0, fa._local_dim, rows):
            F_c = F[lo : lo + rows]
            cap.addmm_((F_c / lp[lo : lo + rows].exp().unsqueeze(-1)).T, F_c)
        fa._cap_done(cap, sga=True)
        fa._sga_cap, fa._sga_cap_key = cap, key
        return cap

    def _sga_posterior(self, fa, d: Tensor):
        # E-step (eq. 4.23) of the standardised model: one pass over F~
        F = fa._F.detach()
        psi = fa._log_psi.detach().exp()
        u = (d / psi) @ F  # (B, K)
        u, cap = fa._sga_reduce(u, self._sga_capacitance(fa))  # summed over the ranks when sharded
        L = cholesky(cap)
        m = torch.cholesky_solve(u.T, L).T
        return m, torch.cholesky_inverse(L)

    def _sga_set_lr(self, fa) -> None:
        if fa.lr_decay_after > 0 and fa._sga_steps > fa.lr_decay_after:
            # Robbins-Monro: a constant step leaves a noise floor; decay like t^(-1/2)
            factor = math.sqrt(fa.lr_decay_after / fa._sga_steps)
            for group in fa._optimizer.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor

    def _sga_step(self, fa, d: Tensor) -> None:
        if fa._sga_steps > 0:
            self._rescale_to_data(fa)  # follow the running scale (the first step's was just set)
        B = d.shape[0]
        d = d / fa._scale  # standardised; gradients below are those of the standardised model
        fa._sga_steps += 1
        self._sga_set_lr(fa)
        if fa._sga_fused:
            self._sga_fused_step(fa, d)
            return
        F = fa._F.detach()
        psi = fa._log_psi.detach().exp()
        m, sigma_h = self._sga_posterior(fa, d)  # (B, K), (K, K)
        # eq. 4.24 averaged over the batch: Psi^-1 (d m^T - F (Sigma + m m^T))
        E_hh = sigma_h + m.T @ m / B
        F_E = F @ E_hh
        dm = d.T @ m / B
        grad_F = (dm - F_E) / psi.unsqueeze(-1)
        # eq. 4.25-4.26, gradient in log psi
        e2 = d.pow(2).mean(0) - 2 * (dm * F).sum(-1) + (F_E * F).sum(-1)
        grad_log_psi = 0.5 * e2 / psi - 0.5
        # ascent: hand the negative gradient to a minimising optimizer
        fa._F.grad = -grad_F
        fa._log_psi.grad = -grad_log_psi
        fa._optimizer.step()
        fa._F.grad = None
        fa._log_psi.grad = None
        # keep psi~ within the same relative floor as EM
        fa._log_psi.data.clamp_min_(math.log(fa.min_variance))
        if fa.average:
            # Polyak-Ruppert averaging with weights proportional to the step count: the
            # transient of step i weighs (i/t)^2, the noise of a decaying step averages out
            rho = 2.0 / (fa._sga_steps + 1)
            fa._F_avg.lerp_(fa._F.detach(), rho)
            fa._log_psi_avg.lerp_(fa._log_psi.detach(), rho)

    def _sga_adam_state(self, fa, p: Tensor) -> Dict[str, Tensor]:
        # torch.optim.Adam's per-parameter state (same keys and layout), created as it would
        state = fa._optimizer.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _sga_fused_step(self, fa, d: Tensor) -> None:
        r"""One SGA step with the default Adam, fused into one pass over the rows of :math:`\tilde F`.

        The same arithmetic as ``torch.optim.Adam`` on the gradients of eqs. 4.24–4.26
        (the non-fused path), but block by block: the gradient rows, Adam's moments,
        :math:`\tilde F`, :math:`\log\tilde\psi`, the Polyak averages and the next E-step's
        capacitance are formed while a block of rows is in cache, so that no
        :math:`D\times K` temporary exists and each :math:`D\times K` array is read and
        written once. With the E-step's pass over :math:`\tilde F`, an update costs two passes.
        """
        B = d.shape[0]
        group = fa._optimizer.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        F, lp = fa._F.detach(), fa._log_psi.detach()
        sF, slp = self._sga_adam_state(fa, fa._F), self._sga_adam_state(fa, fa._log_psi)
        m, sigma_h = self._sga_posterior(fa, d)  # uses the capacitance of the current iterate
        sF["step"] += 1
        slp["step"] += 1
        t = float(sF["step"])
        step_size = lr / (1 - beta1**t)
        bc2_sqrt = math.sqrt(1 - beta2**t)
        E_hh = sigma_h + m.T @ m / B
        m_B = m / B
        dT = d.T  # (D, B)
        rho = 2.0 / (fa._sga_steps + 1) if fa.average else 0.0
        log_floor = math.log(fa.min_variance)
        rows = fa._block_rows()
        work = fa._workspace(rows)
        cap = F.new_zeros(fa.rank, fa.rank)
        mF, vF = sF["exp_avg"], sF["exp_avg_sq"]
        mlp, vlp = slp["exp_avg"], slp["exp_avg_sq"]
        for lo in range(0, fa._local_dim, rows):
            hi = min(lo + rows, fa._local_dim)
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
            if fa.average:
                fa._F_avg[lo:hi].lerp_(F_c, rho)
                fa._log_psi_avg[lo:hi].lerp_(lp_c, rho)
            # the next E-step's capacitance, while the new rows are in cache
            torch.div(F_c, lp_c.exp().unsqueeze(-1), out=tmp)
            cap.addmm_(tmp.T, F_c)
        fa._cap_done(cap, sga=True)
        fa._sga_cap = cap
        fa._sga_cap_key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)


_NATURAL = NaturalStep()
