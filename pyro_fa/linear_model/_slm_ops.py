r"""The computations of :class:`~pyro_fa.linear_model.StandardLinearModel` (private): the log evidence, the exact
posterior, a jittered Cholesky factor and the table of optimisers that maximise the evidence."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch
from torch import Tensor

from pyro_fa.linear_model._glm_ops import progress_bar

_LOG_2PI = math.log(2 * math.pi)


def jittered_cholesky(cls: str, M: Tensor, what: str) -> Tensor:
    """Cholesky factor of ``M``, retried with a growing diagonal jitter (1e-12 ... 1e-8 of its mean diagonal)."""
    L, info = torch.linalg.cholesky_ex(M)
    if not bool(info.any()):
        return L
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    scale = torch.diagonal(M).mean().detach()
    for exponent in (-12, -11, -10, -9, -8):
        L, info = torch.linalg.cholesky_ex(M + (10.0 ** exponent) * scale * eye)
        if not bool(info.any()):
            return L
    raise RuntimeError(
        f"{cls}: the {what} is not numerically positive definite, even with jitter "
        f"(dtype {M.dtype}); use float64, or raise min_noise_variance / the initial prior_precision."
    )


def log_evidence(cls: str, Phi: Tensor, y: Tensor, log_lam: Tensor, log_beta: Tensor) -> Tensor:
    r""":math:`\log N(y; 0, \beta^{-1} I + \lambda^{-1}\Phi\Phi^\top)` (Steinberg et al. 2016, eq. 14; Bishop 2006,
    eq. 3.86), by a Cholesky factor of the :math:`D\times D` posterior precision when :math:`D \le N`, of the
    :math:`N\times N` marginal covariance otherwise."""
    N, D = Phi.shape
    lam = log_lam.exp()
    beta = log_beta.exp()
    if D <= N:  # primal: Cholesky of the D x D posterior precision A
        A = beta * (Phi.T @ Phi) + lam * torch.eye(D, dtype=Phi.dtype, device=Phi.device)
        L = jittered_cholesky(cls, A, "posterior precision")
        m = torch.cholesky_solve((beta * (Phi.T @ y)).unsqueeze(-1), L).squeeze(-1)
        fit_term = 0.5 * beta * (y - Phi @ m).pow(2).sum() + 0.5 * lam * m.pow(2).sum()
        return (
            0.5 * D * log_lam + 0.5 * N * log_beta - fit_term
            - torch.diagonal(L).log().sum() - 0.5 * N * _LOG_2PI
        )
    # dual: Cholesky of the N x N marginal covariance sigma^2 I + Phi Phi^T / lambda
    C = (Phi @ Phi.T) / lam + (-log_beta).exp() * torch.eye(N, dtype=Phi.dtype, device=Phi.device)
    L = jittered_cholesky(cls, C, "marginal covariance of y")
    z = torch.linalg.solve_triangular(L, y.unsqueeze(-1), upper=False).squeeze(-1)
    return -0.5 * z.pow(2).sum() - torch.diagonal(L).log().sum() - 0.5 * N * _LOG_2PI


def posterior(cls: str, Phi: Tensor, y: Tensor, lam: Tensor, beta: Tensor) -> Tuple[Tensor, Tensor]:
    """Brownlie (2021) eq. 2.13: the mean m = A^{-1} b and the lower Cholesky factor of A (eq. 2.11 on the
    features), A = beta Phi^T Phi + lam I, b = beta Phi^T y."""
    D = Phi.shape[1]
    A = beta * (Phi.T @ Phi) + lam * torch.eye(D, dtype=Phi.dtype, device=Phi.device)
    L = jittered_cholesky(cls, A, "posterior precision")
    return torch.cholesky_solve((beta * (Phi.T @ y)).unsqueeze(-1), L).squeeze(-1), L


# ---------------------------------------------------------------- optimisers of the log evidence
def _lbfgs(objective: Callable[[], Tensor], params: List[Tensor], n_iter: int, lr: float, bar) -> int:
    opt = torch.optim.LBFGS(
        params, lr=lr, max_iter=n_iter, line_search_fn="strong_wolfe",
        tolerance_grad=1e-9, tolerance_change=1e-12, history_size=20,
    )

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        if bar is not None:
            bar.set_postfix(log_evidence_per_point=-float(loss.detach()))
        return loss

    opt.step(closure)
    done = int(opt.state[params[0]].get("n_iter", 0))
    if bar is not None:
        bar.update(done)
    return done


def _adam(objective: Callable[[], Tensor], params: List[Tensor], n_iter: int, lr: float, bar) -> int:
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(n_iter):
        opt.zero_grad()
        loss = objective()
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(log_evidence_per_point=-float(loss.detach()))
    return n_iter


class Optimiser(NamedTuple):
    """``run(objective, params, n_iter, lr, bar) -> iterations done`` minimises ``objective`` in place."""

    run: Callable[..., int]
    default_lr: float


#: The optimisers of ``StandardLinearModel.fit``: L-BFGS with a strong-Wolfe line search (the deterministic,
#: smooth objective) and Adam (very noisy or badly scaled problems).
OPTIMIZERS: Dict[str, Optimiser] = {"lbfgs": Optimiser(_lbfgs, 1.0), "adam": Optimiser(_adam, 0.05)}


def minimise(objective, params: List[Tensor], n_iter: int, lr: float, optimizer: str, progress: bool,
             desc: str) -> int:
    """Minimise ``objective`` over ``params`` in place with ``OPTIMIZERS[optimizer]``; the iterations done."""
    if n_iter == 0 or not params:
        return 0
    bar = progress_bar(progress, n_iter, desc)
    done = OPTIMIZERS[optimizer].run(objective, params, n_iter, lr, bar)
    if bar is not None:
        bar.close()
    return done

