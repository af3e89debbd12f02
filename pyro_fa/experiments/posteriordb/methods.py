"""The methods ``pyro-fa posteriordb`` scores, each fitted on a posterior object and returning its draws.

A posterior object has ``name``, ``model`` (a zero-argument Pyro model), ``dim``, ``reference`` ((N, D) draws
in Pyro's unconstrained space, ``AutoContinuous``'s order) and ``log_density(z)`` (``z`` of shape (n, D)).

Every method returns a :class:`Fit`: ``num_draws`` draws in the same space, their ``log q`` where the method has a
density (for k̂), and its cost: ``grad_evals`` counts evaluations of the model's log density with its gradient
(one per SVI step and particle, one per L-BFGS evaluation, D for a Hessian by reverse mode), ``density_evals``
evaluations without a gradient (Pathfinder's ELBO and importance draws).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

#: method name -> one-line description (the table's legend)
METHODS: Dict[str, str] = {
    "auto-normal": "Pyro AutoNormal + Trace_ELBO (mean field)",
    "auto-lowrank": "Pyro AutoLowRankMultivariateNormal + Trace_ELBO (rank K)",
    "auto-mvn": "Pyro AutoMultivariateNormal + Trace_ELBO (dense)",
    "auto-laplace": "Pyro AutoLaplaceApproximation (MAP by Adam, then the Hessian: D gradient evaluations)",
    "factor-guide": "pyro_fa AutoLowRankFactorGuide + FactorELBO (rank K)",
    "pathfinder": "pyro_fa Pathfinder, single path",
    "pathfinder-multi": "pyro_fa Pathfinder, 4 paths, PSIS-resampled",
    "pathfinder-guide": "pyro_fa AutoLowRankFactorGuide initialised by Pathfinder, then FactorELBO",
}


@dataclass
class Budget:
    """What every method may spend: SVI steps, Adam's rate, the rank, draws scored."""

    steps: int = 2000
    lr: float = 0.02
    rank: int = 10
    num_draws: int = 1000
    guide_steps_after_pathfinder: int = 200
    num_paths: int = 4

    @classmethod
    def quick(cls) -> "Budget":
        return cls(steps=200, num_draws=200, guide_steps_after_pathfinder=50, num_paths=2)


@dataclass
class Fit:
    draws: torch.Tensor
    log_q: Optional[torch.Tensor]
    grad_evals: int
    density_evals: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _init_loc_fn():
    """The ports' init strategy where they define one (flat priors cannot be sampled), else Pyro's median."""
    try:
        from pyro_fa.experiments.posteriordb.loader import init_to_median_or_zero

        return init_to_median_or_zero
    except ImportError:
        from pyro.infer.autoguide.initialization import init_to_median

        return init_to_median


def _svi(model, guide, steps: int, lr: float, loss=None) -> None:
    import pyro
    from pyro.infer import SVI, Trace_ELBO

    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss or Trace_ELBO())
    for _ in range(steps):
        svi.step()


def _continuous_fit(guide, n: int, generator) -> tuple:
    with torch.no_grad():
        q = guide.get_posterior()
        try:
            z = q.sample((n,), generator=generator)
        except TypeError:  # Pyro's own distributions take no generator: the global one (seeded)
            z = q.sample((n,))
        return z, q.log_prob(z)


def _auto_normal_fit(guide, n: int) -> tuple:
    """Draws and log q of AutoNormal packed in the model's site order (AutoContinuous's)."""
    locs, scales = [], []
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        loc, scale = guide._get_loc_and_scale(name)
        locs.append(loc.detach().reshape(-1))
        scales.append(scale.detach().reshape(-1))
    q = torch.distributions.Normal(torch.cat(locs), torch.cat(scales))
    z = q.sample((n,))
    return z, q.log_prob(z).sum(-1)


def fit_method(method: str, posterior, budget: Budget, seed: int) -> Fit:
    """Fit ``method`` on ``posterior`` from ``seed`` and return its draws and cost.

    Raises
    ------
    ValueError
        If ``method`` is not one of :data:`METHODS`.
    """
    import pyro
    from pyro.infer import autoguide

    from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO, Pathfinder

    if method not in METHODS:
        raise ValueError(f"fit_method: method must be one of {sorted(METHODS)}, got {method!r}.")
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, D, n = posterior.model, posterior.dim, budget.num_draws
    rank = max(1, min(budget.rank, D))
    init = _init_loc_fn()
    t0 = time.perf_counter()
    if method == "auto-normal":
        guide = autoguide.AutoNormal(model, init_loc_fn=init)
        _svi(model, guide, budget.steps, budget.lr)
        z, lq = _auto_normal_fit(guide, n)
        fit = Fit(z, lq, budget.steps)
    elif method in ("auto-lowrank", "auto-mvn"):
        guide = (autoguide.AutoLowRankMultivariateNormal(model, init_loc_fn=init, rank=rank)
                 if method == "auto-lowrank" else autoguide.AutoMultivariateNormal(model, init_loc_fn=init))
        _svi(model, guide, budget.steps, budget.lr)
        z, lq = _continuous_fit(guide, n, gen)
        fit = Fit(z, lq, budget.steps)
    elif method == "auto-laplace":
        guide = autoguide.AutoLaplaceApproximation(model, init_loc_fn=init)
        _svi(model, guide, budget.steps, budget.lr)
        laplace = guide.laplace_approximation()
        z, lq = _continuous_fit(laplace, n, gen)
        fit = Fit(z, lq, budget.steps + D)
    elif method == "factor-guide":
        guide = AutoLowRankFactorGuide(model, init_loc_fn=init, rank=rank)
        _svi(model, guide, budget.steps, budget.lr, FactorELBO())
        z, lq = _continuous_fit(guide, n, gen)
        fit = Fit(z, lq, budget.steps)
    else:  # the Pathfinder family
        paths = budget.num_paths if method == "pathfinder-multi" else 1
        pf = Pathfinder(log_density=_scalar_log_density(posterior), dim=D, num_paths=paths,
                        num_draws_per_path=max(n, 100))
        pf.fit(generator=gen)
        extra = {"pathfinder_grad_evals": pf.num_grad_evals_, "pathfinder_density_evals": pf.num_density_evals_,
                 "elbo": pf.elbo_, "clipped_eigenvalues": int(pf.clipped_.numel())}
        if method == "pathfinder":
            z = pf.sample(n, generator=gen)
            lq = pf.best_.log_prob(z)
            fit = Fit(z, lq, pf.num_grad_evals_, pf.num_density_evals_, extra=extra)
        elif method == "pathfinder-multi":
            z = pf.sample(n, generator=gen)  # resampled: no density of its own
            extra["khat_resampling"] = pf.khat_
            fit = Fit(z, None, pf.num_grad_evals_, pf.num_density_evals_, extra=extra)
        else:
            guide = AutoLowRankFactorGuide(model, init_loc_fn=init, rank=rank, loc_scale=1.0)
            guide()
            pf.init_guide(guide)  # loc_scale: Pathfinder's marginal s.d.
            _svi(model, guide, budget.guide_steps_after_pathfinder, budget.lr, FactorELBO())
            z, lq = _continuous_fit(guide, n, gen)
            fit = Fit(z, lq, pf.num_grad_evals_ + budget.guide_steps_after_pathfinder, pf.num_density_evals_,
                      extra=extra)
    fit.seconds = time.perf_counter() - t0
    fit.draws = fit.draws.detach().to(torch.float64)
    return fit


def _scalar_log_density(posterior) -> Callable:
    def log_density(z):
        return posterior.log_density(z.unsqueeze(0))[0]

    return log_density
