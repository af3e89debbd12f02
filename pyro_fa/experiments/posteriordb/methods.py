"""The methods ``pyro-fa posteriordb`` scores: a registry of small fitting functions, one per method name.

A posterior object has ``name``, ``model`` (a zero-argument Pyro model), ``dim``, ``reference`` ((N, D) draws
in Pyro's unconstrained space, ``AutoContinuous``'s order) and ``log_density(z)`` (``z`` of shape (n, D) or (D,)).

A method is one function ``fit(run: Run) -> Fit`` registered under its name by :func:`register_method`; the
command finds it in :data:`METHODS` and never branches on the name. A :class:`Fit` is a curve: one
:class:`Point` per checkpoint (the SVI methods draw at ``Budget.checkpoints`` along one run; the others have one
point), each with ``num_draws`` draws in the posterior's space, their ``log q`` where the method has a density (for
k̂, and for the ELBO that chooses Adam's rate) and the cost so far: ``grad_evals`` counts evaluations of the
model's log density with its gradient (one per SVI step and particle, one per L-BFGS evaluation or leapfrog
step, D for a dense Hessian by reverse mode), ``density_evals`` evaluations without a gradient.

Adding a method is one registered function (``_bam`` and ``_bam_pathfinder`` below are examples).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Method:
    """A registered method: its name, the table's legend, the fitting function and its roles.

    ``peer``: one of Pyro's own guides (the baselines of the goals); ``ours``: a factor-analysis method of
    pyro_fa; ``guide``: our guide, compared with ``auto-lowrank`` at equal gradient evaluations (goal G2);
    ``tuned``: Adam's rate is chosen per posterior from a grid by the ELBO; ``version``: bumped when what the method
    computes changes (its older unit files are then not reused).
    """

    name: str
    description: str
    fit: Callable[["Run"], "Fit"]
    peer: bool = False
    ours: bool = False
    guide: bool = False
    tuned: bool = False
    version: int = 1


#: method name -> :class:`Method`, filled by :func:`register_method`
METHODS: Dict[str, Method] = {}


def register_method(name: str, description: str, *, peer: bool = False, ours: bool = False, guide: bool = False,
                    tuned: bool = False, version: int = 1):
    """Register ``fit(run) -> Fit`` as the method ``name`` (a decorator); registering a name again replaces it.

    Raises
    ------
    ValueError
        If ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_method: name must be a non-empty string, got {name!r}.")

    def decorate(fit):
        METHODS[name] = Method(name, description, fit, peer=peer, ours=ours, guide=guide, tuned=tuned,
                               version=version)
        return fit

    return decorate


@dataclass
class Budget:
    """What every method may spend: SVI steps and the checkpoints along them, the rank, draws scored, Pathfinder's
    paths, NUTS's warm-up, the simulated data sets of the factor Laplace."""

    steps: int = 2000
    checkpoints: Tuple[int, ...] = (100, 250, 500, 1000, 2000)
    rank: int = 10
    num_draws: int = 1000
    num_paths: int = 4
    nuts_warmup: int = 300
    laplace_samples: int = 256

    @classmethod
    def quick(cls) -> "Budget":
        return cls(steps=100, checkpoints=(25, 50, 100), num_draws=200, num_paths=2, nuts_warmup=100,
                   laplace_samples=64)

    def steps_to_score(self) -> List[int]:
        """The SVI steps at which a curve is scored: the checkpoints below ``steps``, and ``steps``."""
        return sorted({c for c in self.checkpoints if 0 < c < self.steps} | {self.steps})


@dataclass
class Point:
    """One checkpoint of a fit: SVI ``step`` (0 where there is none), cost so far, draws and their log q."""

    step: int
    grad_evals: int
    density_evals: int
    draws: torch.Tensor
    log_q: Optional[torch.Tensor]
    extra: dict = field(default_factory=dict)


@dataclass
class Fit:
    """A method's curve (:class:`Point` per checkpoint, in order) and what it reports; the last point is the
    result (``draws``, ``log_q``, ``grad_evals``, ``density_evals`` read it)."""

    points: List[Point]
    extra: dict = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    draws = property(lambda self: self.points[-1].draws)
    log_q = property(lambda self: self.points[-1].log_q)
    grad_evals = property(lambda self: self.points[-1].grad_evals)
    density_evals = property(lambda self: self.points[-1].density_evals)


@dataclass
class Run:
    """What a method function gets: the posterior, the budget, Adam's rate (``None`` for untuned methods), the
    seed's generator, the SVI steps to draw at, and helpers shared by the methods."""

    posterior: object
    budget: Budget
    seed: int
    lr: Optional[float]
    steps: List[int]
    gen: torch.Generator

    @property
    def model(self):
        return self.posterior.model

    @property
    def dim(self) -> int:
        return self.posterior.dim

    @property
    def n(self) -> int:
        return self.budget.num_draws

    @property
    def rank(self) -> int:
        return max(1, min(self.budget.rank, self.dim))

    @property
    def init(self):
        """The ports' init strategy where they define one (flat priors cannot be sampled), else Pyro's median."""
        try:
            from pyro_fa.experiments.posteriordb.loader import init_to_median_or_zero

            return init_to_median_or_zero
        except ImportError:
            from pyro.infer.autoguide.initialization import init_to_median

            return init_to_median

    def log_density(self, z: torch.Tensor) -> torch.Tensor:
        """log p of one unconstrained vector (D,), a scalar (Pathfinder's and NUTS's form)."""
        return self.posterior.log_density(z.unsqueeze(0))[0]

    def svi(self, guide, loss, draw: Callable, grad_offset: int = 0, density_offset: int = 0,
            start: Optional[Point] = None) -> List[Point]:
        """``max(steps)`` SVI steps with Adam at ``lr``; ``draw(guide) -> (z, log q)`` at each of ``steps``."""
        import pyro
        from pyro.infer import SVI

        svi = SVI(self.model, guide, pyro.optim.Adam({"lr": self.lr}), loss)
        points, done = ([start] if start is not None else []), 0
        for target in self.steps:
            for _ in range(target - done):
                svi.step()
            done = target
            z, lq = draw(guide)
            points.append(Point(target, grad_offset + target, density_offset, z, lq))
        return points

    def optimise(self, guide, loss) -> None:
        """``budget.steps`` SVI steps with Adam at ``lr``, no draws (a MAP)."""
        import pyro
        from pyro.infer import SVI

        svi = SVI(self.model, guide, pyro.optim.Adam({"lr": self.lr}), loss)
        for _ in range(self.budget.steps):
            svi.step()

    def sample(self, q) -> tuple:
        """``n`` draws of ``q`` and their log q, from this run's generator (the global one is left alone)."""
        with torch.no_grad():
            try:
                z = q.sample((self.n,), generator=self.gen)
            except TypeError:  # Pyro's own distributions take no generator: a global one seeded from ours
                with torch.random.fork_rng():
                    torch.manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.gen)))
                    z = q.sample((self.n,))
            return z, q.log_prob(z)

    def posterior_draws(self, guide) -> tuple:
        return self.sample(guide.get_posterior())


def fit_method(method: str, posterior, budget: Budget, seed: int, lr: Optional[float] = None,
               steps: Optional[List[int]] = None) -> Fit:
    """Fit ``method`` on ``posterior`` from ``seed`` (Adam at ``lr``) and return its curve and cost.

    ``steps``: the SVI steps to draw at (default ``budget.steps_to_score()``).

    Raises
    ------
    ValueError
        If ``method`` is not one of :data:`METHODS`, or a tuned method gets no ``lr``.
    """
    import pyro

    if method not in METHODS:
        raise ValueError(f"fit_method: method must be one of {sorted(METHODS)}, got {method!r}.")
    if METHODS[method].tuned and lr is None:
        raise ValueError(f"fit_method: lr must be a positive float for {method!r}, got None.")
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    run = Run(posterior, budget, seed, lr, list(steps or budget.steps_to_score()),
              torch.Generator().manual_seed(seed))
    t0, c0 = time.perf_counter(), time.process_time()
    fit = METHODS[method].fit(run)
    fit.seconds, fit.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    for p in fit.points:
        p.draws = p.draws.detach().to(torch.float64)
        p.log_q = None if p.log_q is None else p.log_q.detach().to(torch.float64)
    return fit


# ------------------------------------------------------------------ Pyro's guides (the peers)
def _auto_normal_draws(run: Run, guide) -> tuple:
    """Draws and log q of AutoNormal packed in the model's site order (AutoContinuous's)."""
    locs, scales = [], []
    for name, _ in guide.prototype_trace.iter_stochastic_nodes():
        loc, scale = guide._get_loc_and_scale(name)
        locs.append(loc.detach().reshape(-1))
        scales.append(scale.detach().reshape(-1))
    normal = torch.distributions.Normal(torch.cat(locs), torch.cat(scales))
    return run.sample(torch.distributions.Independent(normal, 1))


def _trace_elbo():
    from pyro.infer import Trace_ELBO

    return Trace_ELBO()


@register_method("auto-normal", "Pyro AutoNormal + Trace_ELBO (mean field)", peer=True, tuned=True)
def _auto_normal(run: Run) -> Fit:
    from pyro.infer import autoguide

    guide = autoguide.AutoNormal(run.model, init_loc_fn=run.init)
    return Fit(run.svi(guide, _trace_elbo(), lambda g: _auto_normal_draws(run, g)))


@register_method("auto-lowrank", "Pyro AutoLowRankMultivariateNormal + Trace_ELBO (rank K)", peer=True, tuned=True)
def _auto_lowrank(run: Run) -> Fit:
    from pyro.infer import autoguide

    guide = autoguide.AutoLowRankMultivariateNormal(run.model, init_loc_fn=run.init, rank=run.rank)
    return Fit(run.svi(guide, _trace_elbo(), run.posterior_draws))


@register_method("auto-mvn", "Pyro AutoMultivariateNormal + Trace_ELBO (dense)", peer=True, tuned=True)
def _auto_mvn(run: Run) -> Fit:
    from pyro.infer import autoguide

    guide = autoguide.AutoMultivariateNormal(run.model, init_loc_fn=run.init)
    return Fit(run.svi(guide, _trace_elbo(), run.posterior_draws))


@register_method("auto-laplace", "Pyro AutoLaplaceApproximation (MAP by Adam, then the Hessian: D gradient "
                 "evaluations)", peer=True, tuned=True)
def _auto_laplace(run: Run) -> Fit:
    from pyro.infer import autoguide

    guide = autoguide.AutoLaplaceApproximation(run.model, init_loc_fn=run.init)
    run.optimise(guide, _trace_elbo())
    z, lq = run.posterior_draws(guide.laplace_approximation())
    return Fit([Point(run.budget.steps, run.budget.steps + run.dim, 0, z, lq)])


# ------------------------------------------------------------------ pyro_fa's factor-analysis methods
@register_method("factor-guide", "pyro_fa AutoLowRankFactorGuide + FactorELBO (rank K)", ours=True, guide=True,
                 tuned=True)
def _factor_guide(run: Run) -> Fit:
    from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO

    guide = AutoLowRankFactorGuide(run.model, init_loc_fn=run.init, rank=run.rank)
    return Fit(run.svi(guide, FactorELBO(), run.posterior_draws))


@register_method("factor-guide-jit", "pyro_fa AutoLowRankFactorGuide + JitFactorELBO (rank K, compiled)",
                 ours=True, guide=True, tuned=True)
def _factor_guide_jit(run: Run) -> Fit:
    from pyro_fa.infer import AutoLowRankFactorGuide, JitFactorELBO

    guide = AutoLowRankFactorGuide(run.model, init_loc_fn=run.init, rank=run.rank)
    return Fit(run.svi(guide, JitFactorELBO(ignore_jit_warnings=True), run.posterior_draws))


def _pathfinder(run: Run, num_paths: int):
    from pyro_fa.infer import Pathfinder

    pf = Pathfinder(log_density=run.log_density, dim=run.dim, num_paths=num_paths,
                    num_draws_per_path=max(run.n, 100))
    pf.fit(generator=run.gen)
    extra = {"pathfinder_grad_evals": pf.num_grad_evals_, "pathfinder_density_evals": pf.num_density_evals_,
             "elbo": pf.elbo_, "clipped_eigenvalues": int(pf.clipped_.numel())}
    return pf, extra


@register_method("pathfinder", "pyro_fa Pathfinder, single path", ours=True, version=3)
def _pathfinder_single(run: Run) -> Fit:
    pf, extra = _pathfinder(run, 1)
    z = pf.best_.draw(run.n, run.gen)[0]  # the exact Pathfinder Gaussian, as the paper scores it
    return Fit([Point(0, pf.num_grad_evals_, pf.num_density_evals_, z, pf.best_.log_prob(z))], extra)


@register_method("pathfinder-multi", "pyro_fa Pathfinder, several paths, PSIS-resampled", ours=True, version=3)
def _pathfinder_multi(run: Run) -> Fit:
    pf, extra = _pathfinder(run, run.budget.num_paths)
    z = pf.sample(run.n, generator=run.gen)  # resampled: no density of its own; k-hat of its pooled proposal
    point = Point(0, pf.num_grad_evals_, pf.num_density_evals_, z, None, {"khat_resampling": pf.khat_})
    return Fit([point], extra)


def _guide_after(run: Run, fitted, extra: dict) -> Fit:
    """An AutoLowRankFactorGuide set to ``fitted.init_guide`` (its mean whitened by the fit's marginal s.d.),
    then FactorELBO: the curve starts at the initialisation (step 0, the fit's cost)."""
    from pyro_fa.infer import AutoLowRankFactorGuide, FactorELBO

    guide = AutoLowRankFactorGuide(run.model, init_loc_fn=run.init, rank=run.rank, loc_scale=1.0)
    guide()
    fitted.init_guide(guide)
    grad, dens = fitted.num_grad_evals_, getattr(fitted, "num_density_evals_", 0)
    start = Point(0, grad, dens, *run.posterior_draws(guide))
    return Fit(run.svi(guide, FactorELBO(), run.posterior_draws, grad, dens, start=start), extra)


@register_method("pathfinder-guide", "pyro_fa AutoLowRankFactorGuide initialised by Pathfinder, then FactorELBO",
                 ours=True, guide=True, tuned=True, version=5)
def _pathfinder_guide(run: Run) -> Fit:
    pf, extra = _pathfinder(run, 1)
    return _guide_after(run, pf, extra)


#: gradient evaluations BatchAndMatch may spend (50 iterations of 16 draws)
BAM_GRAD_EVALS = 800


@register_method("bam", "pyro_fa BatchAndMatch (factor-analysis patch, rank K) from N(0, I), 800 gradients",
                 ours=True)
def _bam(run: Run) -> Fit:
    from pyro_fa.infer import BatchAndMatch

    bam = BatchAndMatch(log_density=run.log_density, dim=run.dim, rank=run.rank, max_grad_evals=BAM_GRAD_EVALS)
    bam.fit(generator=run.gen)
    z = bam.sample(run.n, generator=run.gen)
    return Fit([Point(0, bam.num_grad_evals_, 0, z, bam.get_posterior().log_prob(z))],
               {"bam_skipped": int(getattr(bam, "num_skipped_", 0))})


@register_method("bam-pathfinder", "pyro_fa BatchAndMatch started at single-path Pathfinder's mean, 800 gradients",
                 ours=True, version=3)
def _bam_pathfinder(run: Run) -> Fit:
    from pyro_fa.infer import BatchAndMatch

    pf, extra = _pathfinder(run, 1)
    loc = pf.get_posterior().mean.detach().to(torch.float64)
    bam = BatchAndMatch(log_density=run.log_density, dim=run.dim, rank=run.rank, max_grad_evals=BAM_GRAD_EVALS,
                        init_loc=loc)
    bam.fit(generator=run.gen)
    z = bam.sample(run.n, generator=run.gen)
    extra["bam_skipped"] = int(getattr(bam, "num_skipped_", 0))
    return Fit([Point(0, pf.num_grad_evals_ + bam.num_grad_evals_, pf.num_density_evals_, z,
                      bam.get_posterior().log_prob(z))], extra)


@register_method("pyro-factor-laplace", "pyro_fa PyroFactorLaplace at AutoDelta's MAP (Adam), rank K",
                 ours=True, tuned=True)
def _pyro_factor_laplace(run: Run) -> Fit:
    from pyro.infer import autoguide

    from pyro_fa import PyroFactorLaplace

    guide = autoguide.AutoDelta(run.model, init_loc_fn=run.init)
    run.optimise(guide, _trace_elbo())
    lap = PyroFactorLaplace(run.model, rank=run.rank, num_samples=run.budget.laplace_samples, seed=run.seed).fit()
    z = lap.sample(run.n, generator=run.gen)
    # curvature: the prior's Hessian-vector products (2 gradients each) and a gradient per simulated data set and pass
    curvature = 2 * lap.fit_info["prior_hvps"] + lap.fit_info.get("passes", 1) * run.budget.laplace_samples
    return Fit([Point(run.budget.steps, run.budget.steps + curvature, 0, z, lap.get_posterior().log_prob(z))],
               {"curvature_grad_evals": curvature})


# ------------------------------------------------------------------ NUTS, for scale
@register_method("nuts", "Pyro NUTS, one chain (warm-up, then num_draws draws), for scale")
def _nuts(run: Run) -> Fit:
    from pyro.infer import MCMC, NUTS
    from pyro.infer.autoguide import AutoDiagonalNormal

    start = AutoDiagonalNormal(run.model, init_loc_fn=run.init)
    start()
    calls = [0]

    def potential(params):
        calls[0] += 1  # every call is a leapfrog step's gradient (or the step-size search's)
        return -run.log_density(params["z"])

    mcmc = MCMC(NUTS(potential_fn=potential), num_samples=run.n, warmup_steps=run.budget.nuts_warmup,
                initial_params={"z": start.loc.detach().clone()}, disable_progbar=True)
    mcmc.run()
    z = mcmc.get_samples()["z"].reshape(run.n, run.dim)
    return Fit([Point(0, calls[0], 0, z, None)], {"warmup": run.budget.nuts_warmup})
