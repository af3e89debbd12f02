r"""Our two models in ``pyro-fa revrand``: how their hyperparameters are started and chosen.

Both follow Steinberg et al., *revrand: technical report*, §2: random starts of the hyperparameters,
scored on the training data alone, then optimisation from the best.

* SLM (:class:`~pyro_fa.linear_model.StandardLinearModel`): ``n_starts`` random draws of (length scale,
  prior precision λ, noise variance σ²), each scored by its log evidence (one Cholesky factor, no
  gradient), then L-BFGS on the log evidence from the best draw (the report: 100 starts).
* GLM (:class:`~pyro_fa.linear_model.GeneralizedLinearModel`, factor-analysis guide with
  :class:`~pyro_fa.FactorELBO`): the library learns σ and the length scales with the ELBO but keeps
  the prior precision fixed, so one SVI fit per prior precision of a small grid and the fit with the
  highest ELBO (the mean of its last 10 % of steps) is kept — a type-II maximum likelihood choice
  on the evidence lower bound, as the report's learned regulariser.

The random Fourier bases start from the median heuristic, ℓ₀ = the median distance between
training inputs (at most 2 000 of them), for every dimension.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence, Tuple

import pyro
import torch
from torch import Tensor

from pyro_fa import GaussianPrior
from pyro_fa.basis import LinearBasis, RandomFourierBasis
from pyro_fa.linear_model import GeneralizedLinearModel, StandardLinearModel

#: ranges of the SLM's random starts (log-uniform), in standardised units
SLM_START_RANGES = {"lengthscale_factor": (0.25, 4.0), "prior_precision": (1e-2, 1e2), "noise_variance": (1e-2, 1.0)}


def median_distance(x: Tensor, max_points: int = 2000, seed: int = 0) -> float:
    """The median Euclidean distance between distinct rows of ``x`` (of a random subset of ``max_points``)."""
    if x.shape[0] > max_points:
        g = torch.Generator().manual_seed(seed)
        x = x[torch.randperm(x.shape[0], generator=g)[:max_points].to(x.device)]
    d = torch.cdist(x, x)
    i, j = torch.triu_indices(x.shape[0], x.shape[0], 1, device=x.device)
    return float(d[i, j].median())


def make_basis(d: int, n_components: int, lengthscale: float, *, ard: bool, linear: bool, seed: int,
               like: Tensor, learn: bool = True):
    """``RandomFourierBasis(d, n_components)`` (RBF) [+ ``LinearBasis(d)``], on the dtype and device of ``like``."""
    basis = RandomFourierBasis(d, n_components, "rbf", lengthscale=lengthscale, ard=ard, learn_lengthscale=learn,
                               seed=seed, dtype=like.dtype, device=like.device)
    return basis + LinearBasis(d) if linear else basis


def fit_slm(x: Tensor, y: Tensor, *, n_components: int, n_starts: int, n_iter: int, seed: int,
            ard: bool = True, linear: bool = True) -> Tuple[StandardLinearModel, dict]:
    """The SLM with random starts scored by log evidence, then L-BFGS from the best; returns (model, info)."""
    g = torch.Generator().manual_seed(seed)
    ell0 = median_distance(x, seed=seed)

    def draw(lo, hi) -> float:
        return math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(torch.rand((), generator=g)))

    best, best_ev = None, -math.inf
    for s in range(max(n_starts, 1)):
        start = {k: draw(*r) for k, r in SLM_START_RANGES.items()} if s else \
            {"lengthscale_factor": 1.0, "prior_precision": 1.0, "noise_variance": 0.1}
        basis = make_basis(x.shape[1], n_components, ell0 * start["lengthscale_factor"], ard=ard, linear=linear,
                           seed=seed, like=x)
        model = StandardLinearModel(basis, start["prior_precision"], start["noise_variance"])
        with torch.no_grad():
            try:
                ev = float(model.log_evidence(x, y))
            except RuntimeError:  # a start whose covariance is not numerically positive definite
                continue
        if ev > best_ev:
            best, best_ev, best_start = model, ev, start
    best.fit(x, y, n_iter=n_iter)
    info = {"start": best_start, "start_log_evidence_per_point": best_ev / x.shape[0],
            "log_evidence_per_point": best.log_evidence_ / x.shape[0], "iterations": best.n_iter_,
            "prior_precision": float(best.prior_precision), "noise_variance": float(best.noise_variance),
            "lengthscale": _lengthscale(best.basis)}
    return best, info


def _lengthscale(basis):
    rff = basis.bases[0] if hasattr(basis, "bases") else basis
    return [round(v, 4) for v in rff.lengthscale.detach().cpu().reshape(-1).tolist()]


def fit_glm(x: Tensor, y: Tensor, likelihood: str, *, n_components: int, priors: Sequence[float], rank: int,
            n_steps: int, lr: float, batch_size: Optional[int], seed: int, ard: bool, linear: bool,
            particles: int = 1, tick: Optional[Callable[[], None]] = None) -> Tuple[GeneralizedLinearModel, dict]:
    """One GLM fit per prior precision in ``priors``; keeps the one with the highest final ELBO; (model, info).

    The model lives on the dtype and device of ``x``.
    """
    ell0 = median_distance(x, seed=seed)
    best, best_elbo, scores = None, -math.inf, {}
    for precision in priors:
        pyro.set_rng_seed(seed)
        basis = make_basis(x.shape[1], n_components, ell0, ard=ard, linear=linear, seed=seed, like=x)
        model = GeneralizedLinearModel(basis, likelihood, rank=rank, prior=GaussianPrior(precision),
                                       num_particles=particles)
        model.fit(x, y, n_steps=n_steps, batch_size=batch_size, lr=lr)
        tail = model.losses_[-max(n_steps // 10, 1):]
        elbo = -sum(tail) / len(tail) / x.shape[0]
        scores[str(precision)] = elbo
        if elbo > best_elbo:
            best, best_elbo, best_prec = model, elbo, precision
        if tick is not None:
            tick()
    info = {"prior_precision": best_prec, "elbo_per_point": scores, "initial_lengthscale": ell0,
            "lengthscale": _lengthscale(best.basis)}
    if likelihood == "gaussian":
        info["noise_scale"] = float(best.noise_scale)
    return best, info


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
