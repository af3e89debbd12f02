r"""Online stochastic gradient ascent on the factor-analysis log-likelihood (``method="sga"``).

Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis, University of
Edinburgh, 2021, Algorithm 1 and eqs. 4.23–4.26: each vector's E-step gives the gradient of its
log-likelihood in :math:`F` and :math:`\log\psi`, which a step ascends. :class:`OnlineSGA` holds the
options and hands every call to its step: the optimizer step of
:mod:`pyro_fa.fa.fitters.sga_optimizer` for a ``torch.optim`` optimizer (by default Adam, fused into one
pass over the rows of :math:`F`), or the step :data:`NAMED_STEPS` registers under the name given as
``optimizer`` (``"natural"``: the EM-preconditioned step of :mod:`pyro_fa.fa.fitters.sga_natural`). The
state lives in the :class:`~pyro_fa.OnlineFactorAnalysis` that holds this fitter.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch import Tensor

from pyro_fa.fa.fitters.base import FitContext, Fitter, check_positive, check_step_options, register_fitter
from pyro_fa.fa.fitters.sga_natural import NaturalStep
from pyro_fa.fa.fitters.sga_optimizer import OptimizerStep, SGAState

__all__ = ["OnlineSGA", "SGAState", "NAMED_STEPS"]


def _natural_step(sga: "OnlineSGA", owner: str, *, rank: int, warmup: int) -> NaturalStep:
    """``optimizer="natural"``: the EM-preconditioned step, of size ``optimizer_kwargs["step"]`` (default 1)."""
    kwargs = dict(sga.optimizer_kwargs or {})
    eta = kwargs.pop("step", 1.0)
    if kwargs:
        raise ValueError(f"{owner}: optimizer_kwargs of optimizer='natural' takes only 'step', got "
                         f"{sorted(kwargs)}.")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta <= 1:
        raise ValueError(f"{owner}: optimizer_kwargs['step'] of optimizer='natural' must be a number in (0, 1], "
                         f"got {eta!r}.")
    if warmup < rank:
        raise ValueError(f"{owner}: warmup must be >= rank={rank} for optimizer='natural', got {warmup}: "
                         "its first step from fewer vectors than factors is degenerate.")
    return NaturalStep(eta, step_scale=sga.step_scale, step_ramp=sga.step_ramp, m_step_every=sga.m_step_every)


#: The steps :class:`OnlineSGA` takes for a name given as ``optimizer``: name -> builder
#: ``(fitter, owner, *, rank, warmup) -> Fitter`` (which checks the options that apply to it).
NAMED_STEPS: Dict[str, Callable[..., Fitter]] = {"natural": _natural_step}


@register_fitter("sga")
class OnlineSGA(Fitter):
    r"""Online SGA: one step per batch on the gradients of eqs. 4.24–4.26 (Brownlie 2021, Algorithm 1).

    With a ``torch.optim`` optimizer the ascent runs in coordinates standardised by the running
    standard deviations (:class:`~pyro_fa.fa.fitters.sga_optimizer.OptimizerStep`); at the end of the
    warm-up :math:`\psi` and the scale of :math:`F` are set from the running variances, and the
    reported factors are the Polyak–Ruppert average of the iterates or the last one. With
    ``optimizer="natural"`` the step is the EM-preconditioned one of
    :class:`~pyro_fa.fa.fitters.sga_natural.NaturalStep`. Use it as
    ``OnlineFactorAnalysis(dim, rank, method=OnlineSGA(lr=0.01))`` or ``method="sga"`` with the same
    keyword options.

    Parameters
    ----------
    lr : float, default 1e-2
        Learning rate of the optimizer, in the standardised coordinates of the ascent. The thesis's
        1e-3 (§5.1) moves the factor too little to leave its start on stationary synthetic FA streams
        (measured: see ``benchmarks/results/measurements_from_docstrings.md``).
    optimizer : type, callable or str, optional
        A ``torch.optim.Optimizer`` class, or a callable taking the parameter list and returning an
        optimizer; default ``torch.optim.Adam``, run fused (same arithmetic as ``torch.optim.Adam``, no
        :math:`D\times K` temporary). A name picks a step of :data:`NAMED_STEPS`: ``"natural"``.
    optimizer_kwargs : dict, optional
        Extra keyword arguments of ``optimizer`` (besides ``lr``); for ``"natural"`` only ``step``, the
        step size :math:`\eta \in (0, 1]` (default 1).
    lr_decay_after : int, optional
        After this many ascent steps the learning rate decays like :math:`\mathrm{lr}\sqrt{t_0/t}` (a
        constant step leaves a noise floor, Robbins & Monro 1951); default ``2 * dim``; ``0`` keeps it
        constant (the thesis's setting).
    average : bool, default True
        Report the Polyak–Ruppert average of the iterates :math:`(F, \log\psi)`, with weights
        proportional to the step count, instead of the last iterate (one more :math:`D\times K` buffer).
    step_scale, step_ramp, m_step_every
        For ``optimizer="natural"``: online EM's options (:class:`~pyro_fa.fa.fitters.em.OnlineEM`).

    Notes
    -----
    Where it works and where not: on stationary FA streams the default ``lr=1e-2`` ends within a small
    multiple of scikit-learn's batch covariance error; on the drifting SGD iterates that SWAG collects it
    is no better than a diagonal at any ``lr`` from 1e-3 to 1e-2 (measured: see
    ``benchmarks/results/measurements_from_docstrings.md``). A step :math:`\gamma_t \propto 1/t` in the
    parameters makes about :math:`\log T` EM iterations' worth of progress, and the few dominant
    directions of drift need many; online EM (``method="em"``), whose statistics take a full step per
    vector, the natural step, or the scatter sketch (``method="sketch"``) are the methods for those
    streams. ``lr``, ``lr_decay_after`` and ``average`` do not apply to the natural step.

    See Also
    --------
    pyro_fa.fa.fitters.em.OnlineEM, pyro_fa.fa.fitters.sketch.ScatterSketch
    """

    def __init__(self, lr: float = 1e-2, optimizer=None, optimizer_kwargs: Optional[Dict[str, Any]] = None,
                 lr_decay_after: Optional[int] = None, average: bool = True, step_scale: float = 2.0,
                 step_ramp: Optional[int] = None, m_step_every: Optional[int] = None):
        self.lr = lr
        self.optimizer = optimizer
        self.optimizer_kwargs = optimizer_kwargs
        self.lr_decay_after = lr_decay_after
        self.average = average
        self.step_scale = step_scale
        self.step_ramp = step_ramp
        self.m_step_every = m_step_every
        self._step: Optional[Fitter] = None  # built by check() (or at the first call)

    @classmethod
    def from_options(cls, *, lr=1e-2, optimizer=None, optimizer_kwargs=None, lr_decay_after=None, average=True,
                     step_scale=2.0, step_ramp=None, m_step_every=None, **_):
        return cls(lr=lr, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, lr_decay_after=lr_decay_after,
                   average=average, step_scale=step_scale, step_ramp=step_ramp, m_step_every=m_step_every)

    def options(self):
        return dict(lr=self.lr, optimizer=self.optimizer, optimizer_kwargs=self.optimizer_kwargs,
                    lr_decay_after=self.lr_decay_after, average=self.average, step_scale=self.step_scale,
                    step_ramp=self.step_ramp, m_step_every=self.m_step_every)

    @property
    def natural(self) -> bool:
        """Whether a named step (``optimizer="natural"``) replaces the optimizer."""
        return isinstance(self.optimizer, str)

    @property
    def iterate_caveat(self) -> Optional[str]:  # SGA's natural step is within 1.5x of batch FA
        if self.natural:
            return None
        return ("method 'sga' (online stochastic gradient ascent) with its default Adam step is far from batch "
                "factor analysis on a few hundred to a few thousand collected iterates; optimizer='natural' (the "
                "EM-preconditioned step) or method 'em' is much closer. See help(SWAG).")

    def check(self, owner: str, *, rank: int, warmup: int) -> None:
        check_positive(owner, "lr", self.lr)
        check_step_options(owner, self.step_scale, self.step_ramp, self.m_step_every)
        lda = self.lr_decay_after
        if lda is not None and (isinstance(lda, bool) or not isinstance(lda, int) or lda < 0):
            raise ValueError(f"{owner}: lr_decay_after must be a non-negative integer or None, got {lda!r}.")
        self._step = self._build_step(owner, rank=rank, warmup=warmup)

    def _build_step(self, owner: str, *, rank: int, warmup: int) -> Fitter:
        if not self.natural:
            return OptimizerStep(lr=self.lr, optimizer=self.optimizer, optimizer_kwargs=self.optimizer_kwargs,
                                 lr_decay_after=self.lr_decay_after, average=self.average)
        build = NAMED_STEPS.get(self.optimizer)
        if build is None:
            raise ValueError(f"{owner}: optimizer must be a torch optimizer class, a callable returning one, or "
                             f"one of {tuple(NAMED_STEPS)} (the EM-preconditioned step), got {self.optimizer!r}.")
        return build(self, owner, rank=rank, warmup=warmup)

    def step_for(self, ctx: FitContext) -> Fitter:
        """The step this fitter takes (built from its options for the model of ``ctx``)."""
        if self._step is None:
            self._step = self._build_step(ctx.owner, rank=ctx.rank, warmup=ctx.warmup)
        return self._step

    def finish_warmup(self, state, ctx: FitContext):
        raise RuntimeError(f"{ctx.owner}: finish_warmup() needs method 'em', got {self.name!r}: the ascent "
                           f"only starts after warmup={ctx.warmup} observations. Pass a smaller warmup.")

    # every other call is the step's
    def init(self, ctx: FitContext, F0: Tensor):
        return self.step_for(ctx).init(ctx, F0)

    def update(self, state, ctx: FitContext, d: Tensor, n_old: int, B: int, first_spread: bool):
        return self.step_for(ctx).update(state, ctx, d, n_old, B, first_spread)

    def factors(self, state, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        return self.step_for(ctx).factors(state, ctx)

    def noise(self, state, ctx: FitContext) -> Tensor:
        return self.step_for(ctx).noise(state, ctx)

    def noise_floor(self, state, ctx: FitContext) -> float:
        return self.step_for(ctx).noise_floor(state, ctx)

    def range_scale(self, state, ctx: FitContext) -> Optional[Tensor]:
        return self.step_for(ctx).range_scale(state, ctx)

    def state_extra(self, state) -> Optional[dict]:
        return self._step.state_extra(state)  # built with the state (init)

    def check_optimizer_state(self, state, ctx: FitContext, saved) -> None:
        self.step_for(ctx).check_optimizer_state(state, ctx, saved)

    def loaded(self, state, ctx: FitContext, extra: Optional[dict]):
        return self.step_for(ctx).loaded(state, ctx, extra)

    def moved(self, state, ctx: FitContext, fn):
        return self.step_for(ctx).moved(state, ctx, fn)

    def shard_sums(self, state, ctx: FitContext, d, n_old: int, B: int):
        return self.step_for(ctx).shard_sums(state, ctx, d, n_old, B)

    def shard_reduced(self, state, ctx: FitContext, sums, n: int, context) -> None:
        self.step_for(ctx).shard_reduced(state, ctx, sums, n, context)
