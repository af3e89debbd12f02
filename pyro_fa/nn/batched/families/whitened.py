r"""``WhitenedLowRankFamily``: the low-rank families, :math:`q = N(c, S(GG^\top + I)S)`, and their fast ELBO.

:class:`~pyro_fa.AutoLowRankFactorGuide` has this form by construction (``"fa"``,
``"ppca"``) and Pyro's ``AutoLowRankMultivariateNormal`` with its ``cov_factor`` as
:math:`G` (``"lowrank"``); a subclass only says where ``(loc, G, s)`` come from.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.nn.batched.families.base import GuideFamily

__all__ = ["WhitenedLowRankFamily"]


class WhitenedLowRankFamily(GuideFamily):
    r"""A family :math:`q = N(c, S(GG^\top + I)S)`, :math:`S = \mathrm{diag}(s)`, with the ELBO of O(DK²).

    Subclasses implement :meth:`whitened` (and :meth:`init`); :meth:`distribution` and
    :meth:`loss` follow. The FactorELBO never forms ``LowRankMultivariateNormal``: the
    capacitance is :math:`I + G^\top G` (:math:`O(DK^2)` per replica), and the gradient of
    :math:`G` comes from one fused backward.

    References
    ----------
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
    University of Edinburgh, 2021, §4.3–4.4 (VIFA).
    """

    uses_rank = True

    def whitened(self, vi, p: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        r"""``(loc, G, s)``: shapes (R, D), (R, D, K), and (R, D) or (R, 1) for one isotropic scale."""
        raise NotImplementedError(f"{type(self).__name__} must implement whitened(vi, p).")

    def distribution(self, vi, p: Dict[str, Tensor]) -> LowRankMultivariateNormal:
        loc, G, s = self.whitened(vi, p)
        s = s.expand_as(loc)
        return LowRankMultivariateNormal(loc, G * s.unsqueeze(-1), s * s, validate_args=False)

    def loss(self, vi, p: Dict[str, Tensor], x: Tensor, y: Tensor, dataset_size: int, particles: int) -> Tensor:
        r"""Negative ELBO of every replica without forming ``LowRankMultivariateNormal``.

        With :math:`q = N(c, S(GG^\top + I)S)` the capacitance :math:`I + W^\top D^{-1} W` of
        torch's class is :math:`I + G^\top G`: the log-determinant, the marginal variances and
        :math:`\log q(\theta)` need no division by :math:`s^2` over the :math:`D \times K`
        factor. The draw is :math:`c + s \odot (G\varepsilon_K + \varepsilon_D)`, the same noise
        in the same order as ``LowRankMultivariateNormal.rsample``.
        """
        loc, G, s = self.whitened(vi, p)
        R, D, K = G.shape
        eps_k = torch.randn((particles, R, K), dtype=loc.dtype, device=loc.device)
        eps_d = torch.randn((particles, R, D), dtype=loc.dtype, device=loc.device)
        estimate = _ESTIMATES[vi.estimator]
        G_eps, gram, row_sq = estimate.factor_terms(G, eps_k)
        theta = loc + s * (G_eps + eps_d)  # (S, R, D)
        loglik = vi._loglik(p, theta, x, y, dataset_size)
        cap = torch.eye(K, dtype=G.dtype, device=G.device) + gram
        L = torch.linalg.cholesky(cap)
        half_logdet = L.diagonal(dim1=-2, dim2=-1).log().sum(-1) + s.log().sum(-1) * (D / s.shape[-1])
        return -estimate.elbo(vi, loc, G, s, theta, L, half_logdet, row_sq, loglik)


class _FactorTerms(torch.autograd.Function):
    r"""What the FactorELBO of :math:`q = N(c, S(GG^\top + I)S)` needs of the factor, with one fused backward.

    ``G`` (R, D, K) and the draw's noise ``eps`` (S, R, K) give :math:`G\varepsilon` (S, R, D), the Gram
    matrix :math:`G^\top G` (R, K, K) and the row sums of squares :math:`\sum_k G_{dk}^2` (R, D). Autograd
    would build the gradient of ``G`` from five passes over the D × K factor and three temporaries (one
    product per side of the Gram matrix, the outer product of the draw, the square's derivative, their
    sums); here it is one multiply-add and one ``baddbmm``:
    :math:`\bar G = \sum_s \bar g_s \varepsilon_s^\top + 2\,\bar r \odot G + G(\bar A + \bar A^\top)`.
    """

    @staticmethod
    def forward(ctx, G: Tensor, eps: Tensor):
        ctx.save_for_backward(G, eps)
        return torch.einsum("rdk,srk->srd", G, eps), G.transpose(-1, -2) @ G, G.square().sum(-1)

    @staticmethod
    def backward(ctx, g_eps: Tensor, g_gram: Tensor, g_row: Tensor):
        G, eps = ctx.saved_tensors
        grad_G = grad_eps = None
        if ctx.needs_input_grad[0]:
            if eps.shape[0] == 1:  # one particle: the outer product as a broadcast multiply (no batched k=1 bmm)
                grad_G = g_eps[0].unsqueeze(-1) * eps[0].unsqueeze(-2)
            else:
                grad_G = torch.einsum("srd,srk->rdk", g_eps, eps)
            grad_G.addcmul_(G, g_row.unsqueeze(-1), value=2)
            grad_G = torch.baddbmm(grad_G, G, g_gram + g_gram.transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            grad_eps = torch.einsum("rdk,srd->srk", G, g_eps)
        return grad_G, grad_eps


class _TraceEstimate:
    r"""Trace_ELBO: :math:`\log p(y, \theta) - \log q(\theta)` at the draw."""

    @staticmethod
    def factor_terms(G: Tensor, eps: Tensor):
        return torch.einsum("rdk,srk->srd", G, eps), G.transpose(-1, -2) @ G, None

    @staticmethod
    def elbo(vi, loc, G, s, theta, L, half_logdet, row_sq, loglik) -> Tensor:
        D = loc.shape[-1]
        z = (theta - loc) / s  # the whitened residual, differentiable in theta as torch's log_prob is
        Gz = torch.einsum("rdk,srd->srk", G, z).unsqueeze(-1)  # (S, R, K, 1)
        Gz = torch.linalg.solve_triangular(L.expand(Gz.shape[0], -1, -1, -1), Gz, upper=False)
        maha = z.pow(2).sum(-1) - Gz.squeeze(-1).pow(2).sum(-1)  # (S, R)
        log_q = -0.5 * (maha + D * math.log(2 * math.pi)) - half_logdet
        return (loglik + vi._prior_log_prob(theta) - log_q).mean(0)


class _FactorEstimate:
    """FactorELBO: the closed-form entropy and expected log-prior, the factor's terms from one fused backward."""

    factor_terms = staticmethod(_FactorTerms.apply)

    @staticmethod
    def elbo(vi, loc, G, s, theta, L, half_logdet, row_sq, loglik) -> Tensor:
        D = loc.shape[-1]
        var = s.pow(2) * (1 + row_sq)  # diag(S (GG^T + I) S)
        entropy = 0.5 * D * (1 + math.log(2 * math.pi)) + half_logdet
        return loglik.mean(0) + vi._expected_prior(loc, var) + entropy


#: estimator name -> how the whitened low-rank ELBO is estimated
_ESTIMATES = {"trace": _TraceEstimate, "factor": _FactorEstimate}
