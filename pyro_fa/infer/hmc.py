r"""Full-batch Hamiltonian Monte Carlo in torch, vectorised over chains: the reference sampler.

A log density of a batch of points, ``log_prob(theta)`` with ``theta`` of shape (C, D) returning (C,), is
sampled by C independent chains at once: one gradient (autograd of the summed log density) per leapfrog
step serves every chain. Each chain has its own step size, adapted during warm-up by dual averaging to a
target acceptance rate (Hoffman & Gelman 2014, Algorithm 5), and its own mass matrix, estimated from its
warm-up draws in Stan's doubling windows (Stan Reference Manual, "HMC algorithm parameters": a fast window for
the step size, slow windows of doubling length for the mass matrix, a final fast window): diagonal (the inverse
mass is the draws' variances) or dense (their covariance matrix, :data:`MASS_MATRICES`), regularised as Stan
does. Every random number comes from the ``generator`` given, so a run is
reproducible; ``progress`` sees every iteration, and the result counts the (batched) gradient evaluations.
:func:`chain_diagnostics` gives the split R-hat and the bulk and tail ESS of any collected quantity through
ArviZ (Vehtari, Gelman, Simpson, Carpenter & Bürkner 2021).

.. math::

    H(\theta, p) = -\log \pi(\theta) + \tfrac12 p^\top M^{-1} p, \qquad p \sim N(0, M),

    p_{1/2} = p + \tfrac{\epsilon}{2}\nabla\log\pi(\theta), \quad \theta' = \theta + \epsilon M^{-1} p_{1/2},
    \quad p' = p_{1/2} + \tfrac{\epsilon}{2}\nabla\log\pi(\theta'),

accepted with probability :math:`\min(1, e^{H(\theta, p) - H(\theta', p')})` after L leapfrog steps.

References
----------
R. M. Neal (2011), *MCMC using Hamiltonian dynamics*, Handbook of Markov Chain Monte Carlo, ch. 5.
M. D. Hoffman & A. Gelman (2014), *The No-U-Turn sampler*, JMLR 15, Algorithms 4 and 5 (the initial step size
heuristic, dual averaging).
P. Izmailov, S. Vikram, M. D. Hoffman & A. G. Wilson (2021), *What are Bayesian neural network posteriors
really like?*, ICML (full-batch HMC as the reference for networks).
A. Vehtari, A. Gelman, D. Simpson, B. Carpenter & P.-C. Bürkner (2021), *Rank-normalization, folding, and
localization: an improved R-hat*, Bayesian Analysis 16(2).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["HMCResult", "MASS_MATRICES", "RHAT_LIMIT", "hmc", "chain_diagnostics", "warmup_windows"]

#: the split R-hat a reference's test predictive must stay below to count as converged (Vehtari et al. 2021
#: recommend 1.01 for draws; the predictive references of Izmailov et al. 2021 are judged at 1.05)
RHAT_LIMIT = 1.05

LogProb = Callable[[Tensor], Tensor]


@dataclass
class HMCResult:
    """What :func:`hmc` returns.

    Attributes
    ----------
    draws : Tensor of shape (C, S, ...)
        ``collect(theta)`` at every kept iteration (``theta`` itself by default: (C, S, D)).
    log_prob : Tensor of shape (C, S)
        The log density at the kept states.
    accept_rate : Tensor of shape (C,)
        Mean acceptance probability over the sampling iterations.
    step_size : Tensor of shape (C,)
        The adapted step size of each chain.
    inv_mass : Tensor of shape (C, D) or (C, D, D)
        The adapted inverse mass matrix of each chain: its diagonal (the warm-up variances, ``mass="diag"``)
        or the whole matrix (the warm-up covariance, ``mass="dense"``).
    divergences : Tensor of shape (C,)
        Sampling iterations whose energy error exceeded 1000 (or was not finite).
    last : Tensor of shape (C, D)
        The final state (to continue a run).
    seconds : float
        Wall-clock time of the run.
    warmup_accept : Tensor of shape (C,)
        Mean acceptance probability over the warm-up iterations (what the dual averaging aimed at its target).
    grad_evals : int
        Evaluations of ``log_prob`` with its gradient, each on the whole (C, D) batch: the initial point, the
        step-size searches and ``num_steps`` per iteration.
    """

    draws: Tensor
    log_prob: Tensor
    accept_rate: Tensor
    step_size: Tensor
    inv_mass: Tensor
    divergences: Tensor
    last: Tensor
    seconds: float = 0.0
    warmup_accept: Optional[Tensor] = field(default=None)
    grad_evals: int = 0


class _Counted:
    """``log_prob`` with a count of its calls (each one a batched value and gradient)."""

    def __init__(self, log_prob: LogProb):
        self.log_prob, self.calls = log_prob, 0

    def __call__(self, theta: Tensor) -> Tensor:
        self.calls += 1
        return self.log_prob(theta)


def _value_and_grad(log_prob: LogProb, theta: Tensor):
    theta = theta.detach().requires_grad_(True)
    with torch.enable_grad():
        lp = log_prob(theta)
        if lp.shape != theta.shape[:1]:
            raise ValueError(f"hmc: log_prob must return shape ({theta.shape[0]},) for theta of shape "
                             f"{tuple(theta.shape)}, got {tuple(lp.shape)}.")
        (grad,) = torch.autograd.grad(lp.sum(), theta)
    return lp.detach(), grad.detach()


def _finite_or(value: Tensor, fill: float) -> Tensor:
    return torch.where(torch.isfinite(value), value, torch.full_like(value, fill))


class _DiagonalMass:
    """A diagonal mass matrix per chain, ``inv_mass`` (C, D) the inverse's diagonal; adapted to the variances of
    the draws it observes (Welford's running variance), regularised as Stan does."""

    def __init__(self, theta: Tensor):
        self.inv_mass = torch.ones_like(theta)
        self._reset(theta)

    def _reset(self, theta: Tensor) -> None:
        self.count, self.mean, self.m2 = 0, torch.zeros_like(theta), torch.zeros_like(theta)

    def momentum(self, z: Tensor) -> Tensor:
        """``p ~ N(0, M)`` from standard normal ``z`` (C, D)."""
        return z / self.inv_mass.sqrt()

    def move(self, eps: Tensor, p: Tensor) -> Tensor:
        """The position step ``eps M^{-1} p`` of the leapfrog, ``eps`` (C, 1)."""
        return eps * self.inv_mass * p

    def kinetic(self, p: Tensor) -> Tensor:
        return 0.5 * (p * p * self.inv_mass).sum(-1)

    def _spread(self, d: Tensor, e: Tensor) -> Tensor:
        return d * e

    def _regularised(self, var: Tensor, n: int) -> Tensor:
        return (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))

    def observe(self, theta: Tensor) -> None:
        """Add a warm-up draw (C, D) to the current window."""
        self.count += 1
        d = theta - self.mean
        self.mean = self.mean + d / self.count
        self.m2 = self.m2 + self._spread(d, theta - self.mean)

    def adapt(self, theta: Tensor) -> None:
        """Close the window: the inverse mass becomes Stan's regularised estimate from its draws."""
        n = self.count
        self.inv_mass = self._regularised(self.m2 / max(n - 1, 1), n)
        self._reset(theta)


class _DenseMass(_DiagonalMass):
    """A dense mass matrix per chain, ``inv_mass`` (C, D, D): the covariance of the window's draws,
    ``n / (n + 5) cov + 1e-3 (5 / (n + 5)) I`` (Stan); momenta drawn with the Cholesky factor of ``M``."""

    def __init__(self, theta: Tensor):
        c, d = theta.shape
        self.inv_mass = torch.eye(d, dtype=theta.dtype, device=theta.device).expand(c, d, d).clone()
        self.chol_mass = self.inv_mass.clone()
        self._reset(theta)

    def _reset(self, theta: Tensor) -> None:
        c, d = theta.shape
        self.count, self.mean, self.m2 = 0, torch.zeros_like(theta), theta.new_zeros(c, d, d)

    def momentum(self, z: Tensor) -> Tensor:
        return (self.chol_mass @ z.unsqueeze(-1)).squeeze(-1)

    def move(self, eps: Tensor, p: Tensor) -> Tensor:
        return eps * (self.inv_mass @ p.unsqueeze(-1)).squeeze(-1)

    def kinetic(self, p: Tensor) -> Tensor:
        return 0.5 * (p * (self.inv_mass @ p.unsqueeze(-1)).squeeze(-1)).sum(-1)

    def _spread(self, d: Tensor, e: Tensor) -> Tensor:
        return d.unsqueeze(-1) * e.unsqueeze(-2)

    def _regularised(self, cov: Tensor, n: int) -> Tensor:
        cov = 0.5 * (cov + cov.transpose(-1, -2))
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return (n / (n + 5.0)) * cov + 1e-3 * (5.0 / (n + 5.0)) * eye

    def adapt(self, theta: Tensor) -> None:
        super().adapt(theta)
        mass = torch.cholesky_inverse(torch.linalg.cholesky(self.inv_mass))
        self.chol_mass = torch.linalg.cholesky(0.5 * (mass + mass.transpose(-1, -2)))


#: The mass matrices of :func:`hmc` (its ``mass`` argument): name -> implementation.
MASS_MATRICES = {"diag": _DiagonalMass, "dense": _DenseMass}


def _leapfrog(log_prob: LogProb, theta, p, grad, eps, mass, num_steps: int):
    """``num_steps`` leapfrog steps of size ``eps`` (C, 1) from (theta, p); the new state, log density, gradient."""
    lp = None
    for _ in range(num_steps):
        p = p + 0.5 * eps * grad
        theta = theta + mass.move(eps, p)
        lp, grad = _value_and_grad(log_prob, theta)
        p = p + 0.5 * eps * grad
    return theta, p, lp, grad


def _transition(log_prob, theta, lp, grad, eps, mass, num_steps, noise):
    """One HMC transition of every chain: new (theta, lp, grad), acceptance probability and energy error."""
    p = mass.momentum(noise.randn(theta))
    h0 = -lp + mass.kinetic(p)
    theta1, p1, lp1, grad1 = _leapfrog(log_prob, theta, p, grad, eps.unsqueeze(-1), mass, num_steps)
    h1 = -lp1 + mass.kinetic(p1)
    delta = _finite_or(h1 - h0, math.inf)
    accept_prob = torch.exp(torch.clamp(-delta, max=0.0))
    u = noise.rand(lp)
    ok = (u < accept_prob) & torch.isfinite(lp1) & torch.isfinite(grad1).all(-1)
    theta = torch.where(ok.unsqueeze(-1), theta1, theta)
    lp = torch.where(ok, lp1, lp)
    grad = torch.where(ok.unsqueeze(-1), grad1, grad)
    return theta, lp, grad, accept_prob, delta


def _initial_step_size(log_prob, theta, lp, grad, mass, noise, eps0: float = 0.1) -> Tensor:
    """Hoffman & Gelman (2014), Algorithm 4, per chain: halve or double until one leapfrog step's acceptance
    ratio crosses 1/2."""
    eps = theta.new_full(theta.shape[:1], eps0)
    p = mass.momentum(noise.randn(theta))
    h0 = -lp + mass.kinetic(p)

    def log_ratio(e):
        _, p1, lp1, _ = _leapfrog(log_prob, theta, p, grad, e.unsqueeze(-1), mass, 1)
        return _finite_or(h0 - (-lp1 + mass.kinetic(p1)), -math.inf)

    direction = torch.where(log_ratio(eps) > math.log(0.5), 1.0, -1.0).to(theta.dtype)
    active = torch.ones_like(eps, dtype=torch.bool)
    for _ in range(60):
        trial = eps * 2.0 ** direction
        crossed = direction * log_ratio(trial) <= direction * math.log(0.5)
        eps = torch.where(active & ~crossed, trial, eps)
        active = active & ~crossed
        if not bool(active.any()):
            break
    return eps


class _Noise:
    """The run's random numbers: from one generator for all chains, or from one generator per chain (then a
    chain's draws do not depend on which chains run beside it)."""

    def __init__(self, generator, chains: int):
        if isinstance(generator, (list, tuple)):
            if len(generator) != chains or not all(isinstance(g, torch.Generator) for g in generator):
                raise ValueError(f"hmc: generator must be a torch.Generator or a sequence of {chains} (one per "
                                 f"chain), got {len(generator)} entries of types "
                                 f"{sorted({type(g).__name__ for g in generator})}.")
            self.per_chain = list(generator)
        else:
            self.per_chain, self.generator = None, generator

    def _draw(self, fn, like: Tensor) -> Tensor:
        if self.per_chain is None:
            return fn(like.shape, generator=self.generator, dtype=like.dtype, device=like.device)
        return torch.stack([fn(like.shape[1:], generator=g, dtype=like.dtype, device=like.device)
                            for g in self.per_chain])

    def randn(self, like: Tensor) -> Tensor:
        return self._draw(torch.randn, like)

    def rand(self, like: Tensor) -> Tensor:
        return self._draw(torch.rand, like)


class _DualAveraging:
    """Hoffman & Gelman (2014), Algorithm 5 (gamma 0.05, t0 10, kappa 0.75), one state per chain."""

    def __init__(self, eps: Tensor, target: float):
        self.target = target
        self.restart(eps)

    def restart(self, eps: Tensor) -> None:
        self.mu = torch.log(10 * eps)
        self.h_bar = torch.zeros_like(eps)
        self.log_eps_bar = torch.zeros_like(eps)
        self.m = 0

    def update(self, accept_prob: Tensor) -> Tensor:
        self.m += 1
        m, t0 = self.m, 10.0
        self.h_bar = (1 - 1 / (m + t0)) * self.h_bar + (self.target - accept_prob) / (m + t0)
        log_eps = self.mu - math.sqrt(m) / 0.05 * self.h_bar
        w = m ** -0.75
        self.log_eps_bar = w * log_eps + (1 - w) * self.log_eps_bar
        return log_eps.exp()

    def final(self) -> Tensor:
        return self.log_eps_bar.exp()


def warmup_windows(num_warmup: int, init_buffer: int = 75, term_buffer: int = 50,
                   base_window: int = 25) -> List[Tuple[int, int]]:
    """The slow windows of the warm-up, ``(first, last)`` iterations (counted from 0, inclusive): the mass matrix
    is the variances of the draws of a window, set at its last iteration.

    Stan's schedule: ``init_buffer`` iterations adapt the step size only, then windows of ``base_window``,
    doubling, the last one stretched to end ``term_buffer`` iterations before the end of warm-up; scaled down to
    15 % / 10 % / 75 % of ``num_warmup`` when it is shorter than the three buffers together.
    """
    if num_warmup < 20:
        return []
    if init_buffer + term_buffer + base_window > num_warmup:
        init_buffer, term_buffer = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base_window = num_warmup - init_buffer - term_buffer
    ends, start, size = [], init_buffer, base_window
    last = num_warmup - term_buffer
    while start < last:
        end = start + size
        if end + 2 * size > last:  # the next window would not fit: stretch this one to the end
            end = last
        ends.append((start, end - 1))
        start, size = end, 2 * size
    return ends


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"hmc: {name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def hmc(log_prob: LogProb, init: Tensor, *, num_samples: int, num_warmup: int, num_steps: int = 10,
        step_size: Optional[float] = None, target_accept: float = 0.8, adapt_mass: bool = True,
        mass: str = "diag", thin: int = 1, jitter: float = 0.2, collect: Optional[Callable[[Tensor], Tensor]] = None,
        generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
        progress: Optional[Callable[[int, Dict[str, object]], None]] = None) -> HMCResult:
    """Sample ``log_prob`` by full-batch HMC, C chains at once.

    Parameters
    ----------
    log_prob : callable
        ``log_prob(theta)`` with ``theta`` of shape (C, D) returns the log density of each row, shape (C,);
        differentiable by autograd (non-finite values are rejected proposals).
    init : Tensor of shape (C, D)
        One starting point per chain (draw them apart: R-hat compares the chains). dtype and device of the run.
    num_samples : int
        Kept iterations per chain (after thinning: ``num_samples`` draws per chain are returned).
    num_warmup : int
        Adaptation iterations (discarded).
    num_steps : int, default 10
        Leapfrog steps per iteration.
    step_size : float, optional
        Initial step size; default by Hoffman & Gelman's Algorithm 4 per chain.
    target_accept : float, default 0.8
        Target of the dual averaging, in (0, 1).
    adapt_mass : bool, default True
        Estimate the mass matrix in the warm-up windows (:func:`warmup_windows`); else the identity.
    mass : {"diag", "dense"}, default "diag"
        The mass matrix (a key of :data:`MASS_MATRICES`): ``"diag"``, the inverse mass the warm-up variances
        (O(D) per leapfrog step); ``"dense"``, the warm-up covariance matrix (O(D^2) per step, O(D^3) per
        window), which also undoes correlations between coordinates: a posterior narrow along directions
        that are not coordinate axes is then sampled with a larger step size.
    thin : int, default 1
        Keep one iteration in ``thin``.
    jitter : float, default 0.2
        After warm-up, each iteration's step size is the adapted one times U(1 - jitter, 1 + jitter), drawn per
        chain: a fixed trajectory length can be a period of the dynamics (Neal 2011, section 5.4.2.2), and then
        the chain stands still. In [0, 1).
    collect : callable, optional
        ``collect(theta)`` (C, D) -> (C, ...), what is stored of each kept state (e.g. a network's test
        predictions instead of its weights); default the state itself.
    generator : torch.Generator or sequence of C of them, optional
        The source of every momentum, acceptance and jitter draw (on the device of ``init``); one per chain
        makes each chain's draws independent of the chains run beside it.
    progress : callable, optional
        Called after every iteration as ``progress(iteration, stats)``, ``iteration`` counting from 1 over the
        ``num_warmup + num_samples * thin`` iterations, ``stats`` a dict: ``warmup`` (bool), ``step_size`` (C,)
        (the adapted step size after the iteration), ``accept`` (C,) (its acceptance probability),
        ``grad_evals`` (int, so far), ``seconds`` (float, so far) and ``divergences`` (C,) (so far, warm-up
        included). It does not touch the random numbers: a run is the same with or without it.

    Returns
    -------
    HMCResult

    Raises
    ------
    ValueError
        On a malformed ``init``, counts, ``target_accept``, ``step_size`` or ``mass``, and when the log density is not
        finite at ``init`` or returns the wrong shape.

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> res = hmc(lambda x: -0.5 * (x ** 2).sum(-1), torch.randn(2, 3, generator=g, dtype=torch.float64),
    ...           num_samples=200, num_warmup=100, generator=g)
    >>> res.draws.shape
    torch.Size([2, 200, 3])
    """
    import time

    if not isinstance(init, Tensor) or init.dim() != 2 or init.shape[0] < 1 or init.shape[1] < 1:
        got = tuple(init.shape) if isinstance(init, Tensor) else type(init).__name__
        raise ValueError(f"hmc: init must be a Tensor of shape (C, D), got {got!r}.")
    if not init.is_floating_point() or not bool(torch.isfinite(init).all()):
        raise ValueError("hmc: init must be a finite floating-point Tensor, got non-finite entries or an integer "
                         "dtype.")
    num_samples, num_warmup = _check_int(num_samples, "num_samples", 1), _check_int(num_warmup, "num_warmup", 0)
    num_steps, thin = _check_int(num_steps, "num_steps", 1), _check_int(thin, "thin", 1)
    if isinstance(target_accept, bool) or not isinstance(target_accept, numbers.Real) \
            or not 0 < target_accept < 1:
        raise ValueError(f"hmc: target_accept must be a number in (0, 1), got {target_accept!r}.")
    if step_size is not None and (isinstance(step_size, bool) or not isinstance(step_size, numbers.Real)
                                  or not 0 < step_size < math.inf):
        raise ValueError(f"hmc: step_size must be a positive finite number, got {step_size!r}.")
    if isinstance(jitter, bool) or not isinstance(jitter, numbers.Real) or not 0 <= jitter < 1:
        raise ValueError(f"hmc: jitter must be a number in [0, 1), got {jitter!r}.")
    if not isinstance(mass, str) or mass not in MASS_MATRICES:
        raise ValueError(f"hmc: mass must be one of {sorted(MASS_MATRICES)}, got {mass!r}.")
    if progress is not None and not callable(progress):
        raise ValueError(f"hmc: progress must be a callable or None, got {progress!r}.")
    noise = _Noise(generator, init.shape[0])
    start = time.perf_counter()
    log_prob = _Counted(log_prob)
    collect = collect or (lambda t: t)
    theta = init.detach().clone()
    lp, grad = _value_and_grad(log_prob, theta)
    if not bool(torch.isfinite(lp).all()) or not bool(torch.isfinite(grad).all()):
        raise ValueError("hmc: log_prob must be finite with a finite gradient at init, got non-finite values in "
                         f"chains {torch.nonzero(~torch.isfinite(lp)).flatten().tolist()}.")
    metric = MASS_MATRICES[mass](theta)
    if step_size is None:
        eps = _initial_step_size(log_prob, theta, lp, grad, metric, noise)
    else:
        eps = theta.new_full(theta.shape[:1], float(step_size))
    adapt = _DualAveraging(eps, float(target_accept))
    windows = warmup_windows(num_warmup) if adapt_mass else []
    in_window = {it for first, last in windows for it in range(first, last + 1)}
    closes = {last for _, last in windows}
    warm_acc, all_div = torch.zeros_like(eps), torch.zeros_like(eps)

    def report(it: int, acc: Tensor, delta: Tensor, step: Tensor) -> None:
        all_div.add_((delta > 1000).to(all_div.dtype))
        if progress is not None:
            progress(it + 1, {"warmup": it < num_warmup, "step_size": step, "accept": acc,
                              "grad_evals": log_prob.calls, "seconds": time.perf_counter() - start,
                              "divergences": all_div.clone()})

    for it in range(num_warmup):
        theta, lp, grad, acc, delta = _transition(log_prob, theta, lp, grad, eps, metric, num_steps, noise)
        warm_acc += acc
        eps = adapt.update(acc)
        if it in in_window:
            metric.observe(theta)  # Welford's running (co)variance over the current slow window
        if it in closes:
            metric.adapt(theta)
            eps = _initial_step_size(log_prob, theta, lp, grad, metric, noise, eps0=1.0) \
                if step_size is None else eps
            adapt.restart(eps)
        if it + 1 == num_warmup:
            eps = adapt.final()
        report(it, acc, delta, eps)
    draws, lps = [], []
    acc_sum, div = torch.zeros_like(eps), torch.zeros_like(eps)
    for it in range(num_samples * thin):
        scale = 1 + jitter * (2 * noise.rand(eps) - 1)
        theta, lp, grad, acc, delta = _transition(log_prob, theta, lp, grad, eps * scale, metric, num_steps,
                                                  noise)
        acc_sum += acc
        div += (delta > 1000).to(div.dtype)
        if (it + 1) % thin == 0:
            with torch.no_grad():
                draws.append(collect(theta))
            lps.append(lp)
        report(num_warmup + it, acc, delta, eps)
    return HMCResult(draws=torch.stack(draws, 1), log_prob=torch.stack(lps, 1),
                     accept_rate=acc_sum / (num_samples * thin), step_size=eps, inv_mass=metric.inv_mass,
                     divergences=div, last=theta, seconds=time.perf_counter() - start,
                     warmup_accept=warm_acc / max(num_warmup, 1), grad_evals=log_prob.calls)


def chain_diagnostics(draws: Tensor) -> Dict[str, float]:
    """Split R-hat (rank-normalised), bulk ESS and tail ESS of a collected quantity, through ArviZ.

    Parameters
    ----------
    draws : Tensor of shape (C, S, ...)
        C chains of S draws of any shape (e.g. (C, S, N_test) test predictions); C >= 2 for R-hat.

    Returns
    -------
    dict
        ``rhat_max`` (the largest R-hat over the quantity's entries), ``rhat_mean``, ``ess_min`` (the smallest
        bulk ESS), ``ess_mean``, ``ess_median``, ``ess_tail_min`` (the smallest tail ESS: the 5 % and 95 %
        quantiles' ESS, the smaller of the two); entries that are constant in every draw (no R-hat) are left
        out.

    Raises
    ------
    ValueError
        When ``draws`` has fewer than 2 chains or fewer than 4 draws per chain.
    """
    import arviz as az
    import numpy as np

    if not isinstance(draws, Tensor) or draws.dim() < 2 or draws.shape[0] < 2 or draws.shape[1] < 4:
        got = tuple(draws.shape) if isinstance(draws, Tensor) else type(draws).__name__
        raise ValueError(f"chain_diagnostics: draws must have shape (C, S, ...) with C >= 2 chains and S >= 4 "
                         f"draws, got {got!r}.")
    x = draws.detach().cpu().double().reshape(draws.shape[0], draws.shape[1], -1).numpy()
    ds = az.convert_to_dataset({"q": x})
    with np.errstate(divide="ignore", invalid="ignore"):  # a constant entry (a dead unit) has no R-hat: NaN
        rhat = np.asarray(az.rhat(ds, method="rank")["q"])
        ess = np.asarray(az.ess(ds, method="bulk")["q"])
        tail = np.asarray(az.ess(ds, method="tail")["q"])
    return {"rhat_max": float(np.nanmax(rhat)), "rhat_mean": float(np.nanmean(rhat)),
            "ess_min": float(np.nanmin(ess)), "ess_mean": float(np.nanmean(ess)),
            "ess_median": float(np.nanmedian(ess)), "ess_tail_min": float(np.nanmin(tail))}
