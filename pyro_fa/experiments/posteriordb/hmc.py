"""Batched Hamiltonian Monte Carlo in torch, for reference draws of posteriors past posteriordb's sizes.

Every chain moves at once: the log density and its gradient (autograd) are evaluated on the ``(chains, D)``
batch, so one leapfrog step costs one batched gradient. The sampler is static HMC (Neal 2011) with a fixed
number of leapfrog steps and a jittered step size, a step size tuned in warm-up by dual averaging to a target
acceptance rate (Hoffman & Gelman 2014, Section 3.2, Algorithm 5) and a diagonal inverse mass matrix set to
the pooled warm-up variances in Stan's doubling windows (Stan Reference Manual, "HMC algorithm parameters").
:func:`convergence` gives ArviZ's rank-normalised split R-hat and bulk ESS (Vehtari et al. 2021).

References
----------
Neal, R. M. (2011). MCMC using Hamiltonian dynamics. *Handbook of Markov Chain Monte Carlo*, ch. 5.
Hoffman, M. D. and Gelman, A. (2014). The No-U-Turn sampler. *JMLR* 15, 1593-1623.
Vehtari, A., Gelman, A., Simpson, D., Carpenter, B. and Bürkner, P.-C. (2021). Rank-normalization, folding, and
localization: an improved R-hat for assessing convergence of MCMC. *Bayesian Analysis* 16(2), 667-718.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["HMCResult", "hmc", "convergence", "mass_windows"]


@dataclass
class HMCResult:
    """The draws of :func:`hmc` and what it spent.

    Attributes
    ----------
    draws : Tensor
        ``(chains, num_kept, D)``: the kept draws, chain by chain.
    step_size : float
        the step size after warm-up.
    inv_mass : Tensor
        ``(D,)``: the diagonal inverse mass matrix after warm-up.
    accept_rate : float
        the mean acceptance probability over the sampling iterations and chains.
    grad_evals : int
        batched log-density-and-gradient evaluations (each one covers every chain).
    seconds : float
        wall-clock seconds.
    """

    draws: torch.Tensor
    step_size: float
    inv_mass: torch.Tensor
    accept_rate: float
    grad_evals: int
    seconds: float
    divergences: int = 0
    extra: dict = field(default_factory=dict)


def _value_and_grad(log_density: Callable, z: torch.Tensor):
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        logp = log_density(z)
        (grad,) = torch.autograd.grad(logp.sum(), z)
    return logp.detach(), grad.detach()


def _leapfrog(log_density, z, p, grad, eps, inv_mass, num_steps):
    """``num_steps`` leapfrog steps of size ``eps`` (a ``(chains, 1)`` column) from ``(z, p)``."""
    p = p + 0.5 * eps * grad
    for i in range(num_steps):
        z = z + eps * inv_mass * p
        logp, grad = _value_and_grad(log_density, z)
        p = p + (eps if i + 1 < num_steps else 0.5 * eps) * grad
    return z, p, logp, grad


class _DualAveraging:
    """Nesterov's dual averaging of the log step size (Hoffman & Gelman 2014, Algorithm 5, eq. 6)."""

    def __init__(self, step_size: float, target: float, gamma=0.05, t0=10.0, kappa=0.75):
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.restart(step_size)

    def restart(self, step_size: float) -> None:
        self.mu, self.t, self.h_bar, self.x_bar = math.log(10 * step_size), 0, 0.0, 0.0

    def update(self, accept: float) -> float:
        self.t += 1
        w = 1.0 / (self.t + self.t0)
        self.h_bar = (1 - w) * self.h_bar + w * (self.target - accept)
        x = self.mu - math.sqrt(self.t) / self.gamma * self.h_bar
        eta = self.t ** -self.kappa
        self.x_bar = eta * x + (1 - eta) * self.x_bar
        return math.exp(x)

    @property
    def final(self) -> float:
        return math.exp(self.x_bar)


def mass_windows(num_warmup: int) -> List[int]:
    """The warm-up iterations after which the inverse mass matrix is reset: Stan's schedule (an initial
    buffer of 15%, doubling windows from 25 iterations, a final buffer of 10%), scaled down for short
    warm-ups; empty below 20 iterations (step size only)."""
    if num_warmup < 20:
        return []
    init, term = max(1, int(0.15 * num_warmup)), max(1, int(0.1 * num_warmup))
    start, end, size, out = init, num_warmup - term, max(5, min(25, (num_warmup - init - term) // 4)), []
    while start < end:
        stop = start + size
        if stop + 2 * size > end:  # the last window runs to the end of the slow phase
            stop = end
        out.append(stop)
        start, size = stop, 2 * size
    return out


def _initial_step_size(log_density, z, logp, grad, inv_mass, generator) -> float:
    """Hoffman & Gelman's (2014, Algorithm 4) heuristic: halve or double from 1 until one leapfrog step's
    mean acceptance crosses one half."""
    eps, direction = 1.0, None
    for _ in range(60):
        p = torch.randn(z.shape, generator=generator, dtype=z.dtype) / inv_mass.sqrt()
        h0 = -logp + 0.5 * (p * p * inv_mass).sum(-1)
        z1, p1, logp1, _ = _leapfrog(log_density, z, p, grad, z.new_full((z.shape[0], 1), eps), inv_mass, 1)
        h1 = -logp1 + 0.5 * (p1 * p1 * inv_mass).sum(-1)
        log_acc = torch.nan_to_num(h0 - h1, nan=-math.inf).clamp(max=0.0)
        up = bool(log_acc.exp().mean() > 0.5)
        if direction is None:
            direction = up
        if up != direction:
            break
        eps = eps * 2.0 if up else eps / 2.0
    return eps


def hmc(log_density: Callable, init: torch.Tensor, *, num_warmup: int, num_samples: int, num_steps: int,
        thin: int = 1, target_accept: float = 0.8, jitter: float = 0.2, generator: Optional[torch.Generator] = None,
        progress: Optional[Callable[[int, Dict[str, float]], None]] = None, progress_every: int = 100) -> HMCResult:
    """Run ``init.shape[0]`` HMC chains at once on ``log_density``.

    Parameters
    ----------
    log_density : callable
        ``z`` of shape ``(chains, D)`` -> ``(chains,)`` unnormalised log density, differentiable.
    init : Tensor
        ``(chains, D)``: the initial points (overdispersed, for R-hat to mean something).
    num_warmup, num_samples : int
        warm-up iterations (step size and mass matrix tuned, draws dropped) and sampling iterations per chain.
    num_steps : int
        leapfrog steps per iteration.
    thin : int
        keep every ``thin``-th sampling iteration.
    target_accept : float
        the mean acceptance probability the step size is tuned to.
    jitter : float
        each iteration's step size is drawn uniformly within ``± jitter`` of the tuned one (against
        periodic trajectories).
    generator : torch.Generator, optional
        the source of momenta, jitter and accept/reject draws.
    progress : callable, optional
        called as ``progress(iteration, stats)`` every ``progress_every`` iterations.

    Returns
    -------
    HMCResult
    """
    if init.dim() != 2:
        raise ValueError(f"hmc: init must be of shape (chains, D), got {tuple(init.shape)!r}.")
    for name, value in (("num_steps", num_steps), ("thin", thin), ("num_samples", num_samples)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"hmc: {name} must be a positive integer, got {value!r}.")
    if not 0.0 < target_accept < 1.0:
        raise ValueError(f"hmc: target_accept must be in (0, 1), got {target_accept!r}.")
    t_start = time.perf_counter()
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    z = init.detach().clone()
    chains, dim = z.shape
    inv_mass = z.new_ones(dim)
    logp, grad = _value_and_grad(log_density, z)
    grad_evals = 1
    step = _initial_step_size(log_density, z, logp, grad, inv_mass, gen)
    adapt = _DualAveraging(step, target_accept)
    windows = set(mass_windows(num_warmup))
    w_sum, w_sq, w_n = z.new_zeros(dim), z.new_zeros(dim), 0
    kept, acc_sum, acc_n, divergences = [], 0.0, 0, 0
    for it in range(num_warmup + num_samples):
        u = torch.rand((chains, 1), generator=gen, dtype=z.dtype)
        eps = step * (1.0 + jitter * (2.0 * u - 1.0))
        p = torch.randn(z.shape, generator=gen, dtype=z.dtype) / inv_mass.sqrt()
        h0 = -logp + 0.5 * (p * p * inv_mass).sum(-1)
        z1, p1, logp1, grad1 = _leapfrog(log_density, z, p, grad, eps, inv_mass, num_steps)
        grad_evals += num_steps
        h1 = -logp1 + 0.5 * (p1 * p1 * inv_mass).sum(-1)
        delta = torch.nan_to_num(h0 - h1, nan=-math.inf)
        divergences += int((delta < -1000.0).sum())
        accept_prob = delta.clamp(max=0.0).exp()
        accept = torch.rand(chains, generator=gen, dtype=z.dtype) < accept_prob
        z = torch.where(accept[:, None], z1, z)
        logp = torch.where(accept, logp1, logp)
        grad = torch.where(accept[:, None], grad1, grad)
        mean_acc = float(accept_prob.mean())
        if it < num_warmup:
            step = adapt.update(mean_acc)
            if windows and it >= int(0.15 * num_warmup) and it < max(windows):
                w_sum, w_sq, w_n = w_sum + z.sum(0), w_sq + (z * z).sum(0), w_n + chains
            if it + 1 in windows:
                var = (w_sq - w_sum * w_sum / w_n) / (w_n - 1)
                # Stan's regularisation towards a small multiple of the identity
                inv_mass = (w_n / (w_n + 5.0)) * var + 1e-3 * (5.0 / (w_n + 5.0))
                w_sum, w_sq, w_n = z.new_zeros(dim), z.new_zeros(dim), 0
                logp, grad = _value_and_grad(log_density, z)
                step = _initial_step_size(log_density, z, logp, grad, inv_mass, gen)
                adapt.restart(step)
            if it + 1 == num_warmup:
                step = adapt.final
        else:
            acc_sum, acc_n = acc_sum + mean_acc, acc_n + 1
            if (it - num_warmup + 1) % thin == 0:
                kept.append(z.clone())
        if progress is not None and (it + 1) % progress_every == 0:
            progress(it + 1, {"step_size": step, "accept": mean_acc, "grad_evals": grad_evals,
                              "seconds": time.perf_counter() - t_start, "divergences": divergences})
    draws = torch.stack(kept, dim=1) if kept else z.new_zeros(chains, 0, dim)
    return HMCResult(draws=draws, step_size=step, inv_mass=inv_mass, accept_rate=acc_sum / max(acc_n, 1),
                     grad_evals=grad_evals, seconds=time.perf_counter() - t_start, divergences=divergences)


def convergence(draws) -> Dict[str, float]:
    """ArviZ's rank-normalised split R-hat (the largest over coordinates) and bulk and tail ESS (the
    smallest) of ``draws`` of shape ``(chains, draws, D)``."""
    import arviz
    import numpy as np

    x = np.asarray(torch.as_tensor(draws).detach().cpu().to(torch.float64))
    if x.ndim != 3 or x.shape[0] < 2 or x.shape[1] < 4:
        raise ValueError(f"convergence: draws must be of shape (chains >= 2, draws >= 4, D), got {x.shape!r}.")
    data = arviz.convert_to_dataset({"z": x})
    rhat = arviz.rhat(data, method="rank")["z"].values
    ess_bulk = arviz.ess(data, method="bulk")["z"].values
    ess_tail = arviz.ess(data, method="tail")["z"].values
    return {"rhat_max": float(np.max(rhat)), "ess_bulk_min": float(np.min(ess_bulk)),
            "ess_bulk_median": float(np.median(ess_bulk)), "ess_tail_min": float(np.min(ess_tail)),
            "num_draws": int(x.shape[0] * x.shape[1])}
