r"""Online stochastic gradient ascent on the factor-analysis log-likelihood (the ``"sga"`` method).

Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis, University of
Edinburgh, 2021, Algorithm 1 and eqs. 4.23–4.26: each vector's E-step gives the gradient of its
log-likelihood in :math:`F` and :math:`\log\psi`, which an optimizer (by default Adam, fused into
one pass over the rows of :math:`F`) ascends. The state and the E-step are those of
:class:`~pyro_fa.fa.online.OnlineFactorAnalysis`, which mixes this in.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import Tensor

__all__ = ["OnlineSGA", "cholesky"]


class OnlineSGA:
    """The SGA steps of :class:`~pyro_fa.fa.online.OnlineFactorAnalysis` (a mixin over its state)."""

    def _rescale_to_data(self) -> None:
        # The ascent runs in coordinates standardised by the running standard deviation,
        # F = diag(scale) F~, psi = scale^2 psi~, i.e. it fits the correlation structure; the
        # scale follows the exact running variances at every step (_sga_step calls this
        # again), so a stream whose spread grows, as SGD iterates that drift do, keeps
        # F~, psi~ near their optimum while the reported F, psi follow the data's scale.
        var = self.variance
        self._scale.copy_(self._floor(var, var).sqrt())
        if self._sga_steps > 0:
            return
        # end of the warm-up: start at psi~ = 1 and the rows of F~ scaled so that
        # diag(F~ F~^T) = 1/100 (a small factor part, away from the saddle F = 0)
        F = self._F.detach()
        row_sq = self._mean_over_dim(F.pow(2).sum(-1))  # over all D (collective when sharded)
        self._F.data.mul_((0.01 / row_sq).sqrt())
        self._log_psi.data.zero_()
        self._sga_cap = None
        if self.average:
            self._F_avg.copy_(self._F.detach())
            self._log_psi_avg.zero_()

    def _sga_capacitance(self) -> Tensor:
        r""":math:`I + \tilde F^\top \tilde\Psi^{-1} \tilde F` of the current iterate.

        Cached after each fused step (which forms it while it updates :math:`\tilde F`);
        recomputed in row blocks, never a :math:`D\times K` temporary, when the parameters
        changed otherwise (a user optimizer, ``load_state_dict``, ``.to()``).
        """
        F, lp = self._F.detach(), self._log_psi.detach()
        key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)
        if self._sga_cap is not None and self._sga_cap_key == key:
            return self._sga_cap
        rows = self._block_rows()
        cap = F.new_zeros(self.rank, self.rank)
        for lo in range(0, self._local_dim, rows):
            F_c = F[lo : lo + rows]
            cap.addmm_((F_c / lp[lo : lo + rows].exp().unsqueeze(-1)).T, F_c)
        self._cap_done(cap, sga=True)
        self._sga_cap, self._sga_cap_key = cap, key
        return cap

    def _sga_posterior(self, d: Tensor):
        # E-step (eq. 4.23) of the standardised model: one pass over F~
        F = self._F.detach()
        psi = self._log_psi.detach().exp()
        u = (d / psi) @ F  # (B, K)
        u, cap = self._sga_reduce(u, self._sga_capacitance())  # summed over the ranks when sharded
        L = cholesky(cap)
        m = torch.cholesky_solve(u.T, L).T
        return m, torch.cholesky_inverse(L)

    def _sga_set_lr(self) -> None:
        if self.lr_decay_after > 0 and self._sga_steps > self.lr_decay_after:
            # Robbins-Monro: a constant step leaves a noise floor; decay like t^(-1/2)
            factor = math.sqrt(self.lr_decay_after / self._sga_steps)
            for group in self._optimizer.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor

    def _sga_step(self, d: Tensor) -> None:
        if self._sga_steps > 0:
            self._rescale_to_data()  # follow the running scale (the first step's was just set)
        B = d.shape[0]
        d = d / self._scale  # standardised; gradients below are those of the standardised model
        self._sga_steps += 1
        self._sga_set_lr()
        if self._sga_fused:
            self._sga_fused_step(d)
            return
        F = self._F.detach()
        psi = self._log_psi.detach().exp()
        m, sigma_h = self._sga_posterior(d)  # (B, K), (K, K)
        # eq. 4.24 averaged over the batch: Psi^-1 (d m^T - F (Sigma + m m^T))
        E_hh = sigma_h + m.T @ m / B
        F_E = F @ E_hh
        dm = d.T @ m / B
        grad_F = (dm - F_E) / psi.unsqueeze(-1)
        # eq. 4.25-4.26, gradient in log psi
        e2 = d.pow(2).mean(0) - 2 * (dm * F).sum(-1) + (F_E * F).sum(-1)
        grad_log_psi = 0.5 * e2 / psi - 0.5
        # ascent: hand the negative gradient to a minimising optimizer
        self._F.grad = -grad_F
        self._log_psi.grad = -grad_log_psi
        self._optimizer.step()
        self._F.grad = None
        self._log_psi.grad = None
        # keep psi~ within the same relative floor as EM
        self._log_psi.data.clamp_min_(math.log(self.min_variance))
        if self.average:
            # Polyak-Ruppert averaging with weights proportional to the step count: the
            # transient of step i weighs (i/t)^2, the noise of a decaying step averages out
            rho = 2.0 / (self._sga_steps + 1)
            self._F_avg.lerp_(self._F.detach(), rho)
            self._log_psi_avg.lerp_(self._log_psi.detach(), rho)

    def _sga_adam_state(self, p: Tensor) -> Dict[str, Tensor]:
        # torch.optim.Adam's per-parameter state (same keys and layout), created as it would
        state = self._optimizer.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _sga_fused_step(self, d: Tensor) -> None:
        r"""One SGA step with the default Adam, fused into one pass over the rows of :math:`\tilde F`.

        The same arithmetic as ``torch.optim.Adam`` on the gradients of eqs. 4.24–4.26
        (the non-fused path), but block by block: the gradient rows, Adam's moments,
        :math:`\tilde F`, :math:`\log\tilde\psi`, the Polyak averages and the next E-step's
        capacitance are formed while a block of rows is in cache, so that no
        :math:`D\times K` temporary exists and each :math:`D\times K` array is read and
        written once. With the E-step's pass over :math:`\tilde F`, an update costs two passes.
        """
        B = d.shape[0]
        group = self._optimizer.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        F, lp = self._F.detach(), self._log_psi.detach()
        sF, slp = self._sga_adam_state(self._F), self._sga_adam_state(self._log_psi)
        m, sigma_h = self._sga_posterior(d)  # uses the capacitance of the current iterate
        sF["step"] += 1
        slp["step"] += 1
        t = float(sF["step"])
        step_size = lr / (1 - beta1**t)
        bc2_sqrt = math.sqrt(1 - beta2**t)
        E_hh = sigma_h + m.T @ m / B
        m_B = m / B
        dT = d.T  # (D, B)
        rho = 2.0 / (self._sga_steps + 1) if self.average else 0.0
        log_floor = math.log(self.min_variance)
        rows = self._block_rows()
        work = self._workspace(rows)
        cap = F.new_zeros(self.rank, self.rank)
        mF, vF = sF["exp_avg"], sF["exp_avg_sq"]
        mlp, vlp = slp["exp_avg"], slp["exp_avg_sq"]
        for lo in range(0, self._local_dim, rows):
            hi = min(lo + rows, self._local_dim)
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
            if self.average:
                self._F_avg[lo:hi].lerp_(F_c, rho)
                self._log_psi_avg[lo:hi].lerp_(lp_c, rho)
            # the next E-step's capacitance, while the new rows are in cache
            torch.div(F_c, lp_c.exp().unsqueeze(-1), out=tmp)
            cap.addmm_(tmp.T, F_c)
        self._cap_done(cap, sga=True)
        self._sga_cap = cap
        self._sga_cap_key = (F._version, lp._version, F.data_ptr(), lp.data_ptr(), F.dtype)


def cholesky(mat: Tensor) -> Tensor:
    """Cholesky factor of a symmetric positive-definite K x K matrix, with jitter as a fallback.

    The matrices factorised here (capacitances, E[h h^T]) are positive definite in exact
    arithmetic; in float32 rounding can make a badly conditioned one fail, and a diagonal
    jitter of a few ulps of its trace is then the smallest change that restores it.
    """
    L, info = torch.linalg.cholesky_ex(mat)
    if not bool(info):
        return L
    eye = torch.eye(mat.shape[-1], dtype=mat.dtype, device=mat.device)
    jitter = torch.finfo(mat.dtype).eps * mat.diagonal().abs().mean().clamp_min(1.0)
    for _ in range(8):
        jitter = jitter * 10
        L, info = torch.linalg.cholesky_ex(mat + jitter * eye)
        if not bool(info):
            return L
    raise RuntimeError(
        f"OnlineFactorAnalysis: a {mat.shape[-1]} x {mat.shape[-1]} matrix of the E-step is not positive "
        "definite even with jitter; the statistics hold non-finite values."
    )
