r"""Online factor analysis of a stream of vectors (online EM and online SGA).

A factor-analysis (FA) model :math:`\theta = Fh + c + \varepsilon`,
:math:`h \sim N(0, I_K)`, :math:`\varepsilon \sim N(0, \Psi)`, is fitted to
vectors :math:`\theta_1, \theta_2, \dots` seen one (or one batch) at a time,
without storing them: the state is :math:`O(DK)`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.fa import linalg
from pyro_fa._random import draw_seed
from pyro_fa.fa._online_checks import OnlineChecks
from pyro_fa.fa.fitters import FitContext, FitState, Fitter, cholesky, resolve_fitter
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.distributions import StableLowRankMultivariateNormal

__all__ = ["OnlineFactorAnalysis"]

_DEFAULT_WARMUP = 100  # warmup=None: max(_DEFAULT_WARMUP, rank)
# the keyword options of the built-in fitters that the constructor still takes with method=<name> (each fitter
# takes those that apply to it: Fitter.from_options); with a fitter object they must keep these defaults
_FITTER_OPTIONS = dict(lr=1e-2, optimizer=None, optimizer_kwargs=None, step_scale=2.0, expand=True, step_ramp=None,
                       lr_decay_after=None, average=True, m_step_every=None)


class OnlineFactorAnalysis(OnlineChecks, nn.Module):
    r"""Factor analysis fitted online, by EM or by stochastic gradient ascent.

    .. math::

        \theta_t \sim N(c, FF^\top + \Psi), \qquad F \in \mathbb{R}^{D\times K},
        \ \Psi = \mathrm{diag}(\psi).

    The mean :math:`c` and the coordinate variances :math:`\mathrm{diag}(S_t)` are
    exact running moments. ``method="em"`` is online EM (Brownlie 2021, Algorithm 2)
    in the stochastic-approximation form of Cappé & Moulines (2009): each
    observation's E-step (eq. 4.23) is computed once, the sufficient statistics

    .. math::

        \bar A_t = \bar A_{t-1} + \gamma_t (d_t m_t^\top - \bar A_{t-1}), \qquad
        \bar H_t = \bar H_{t-1} + \gamma_t (\Sigma_h + m_t m_t^\top - \bar H_{t-1})

    are updated with step :math:`\gamma_t = a_t / (t + a_t - 1)`, where :math:`a_t`
    ramps from 1 to ``step_scale`` over the first ``step_ramp`` observations, and the M-step
    :math:`\psi = \mathrm{diag}(S_t) - \mathrm{diag}(\bar A_t \bar H_t^{-1} \bar A_t^\top)`
    (eqs. 4.33–4.35) follows, with the factor of parameter-expanded EM (PX-EM, Liu,
    Rubin & Wu 1998): :math:`F = \bar A_t L^{-\top}`, :math:`\bar H_t = LL^\top`, after
    which the statistics are moved to the new latent coordinates
    (:math:`\bar A_t \leftarrow \bar A_t L^{-\top}`, :math:`\bar H_t \leftarrow I`).
    With ``expand=False`` the factor is the plain EM one, :math:`F = \bar A_t \bar H_t^{-1}`,
    and with ``step_scale=1`` as well this is exactly the thesis's Algorithm 2
    (:math:`\gamma_t = 1/t`), which forgets the statistics gathered under its
    random initialisation too slowly and adjusts the scale of :math:`F` too slowly
    (see Notes).
    ``method="sga"`` is Algorithm 1: the gradients of eqs. 4.24 and 4.26 of
    :math:`\log N(\theta_t; c, FF^\top+\Psi)` in :math:`(F, \log\psi)` are
    handed to a torch optimizer (Adam by default, learning rate ``lr``); at the
    end of the warm-up :math:`\psi` and the scale of :math:`F` are set from the
    running variances, so that the ascent starts at the scale of the data; the ascent
    runs in coordinates standardised by the running standard deviations, which are
    followed at every step (a stream whose spread grows keeps its fitted correlation
    structure). The default Adam runs fused, one pass over the rows of :math:`F`
    (same arithmetic as ``torch.optim.Adam``, no :math:`D\times K` temporary); any other
    optimizer gets the gradients through ``.grad``.

    .. warning::

        SGA needs long streams. On SGD iterates (a few hundred to a few thousand
        vectors) one Adam step per vector cannot follow the equally weighted
        moments of a drifting trajectory, and its covariance stays far from batch
        FA's. Use ``optimizer="natural"`` or ``method="em"`` there, which are much closer to batch FA on the
        same streams (measured on recorded SGD iterates in the project's SWAG-stream benchmark).

    Parameters
    ----------
    dim : int
        :math:`D`, the length of each observation.
    rank : int
        :math:`K`, the number of factors, ``1 <= rank < dim``.
    method : {"em", "sga", "sketch"} or Fitter, default "em"
        The fitting method: a fitter object built with its own options
        (``OnlineSGA(lr=0.01, optimizer="natural")``, ``OnlineEM(step_scale=1.0)``, see
        :mod:`pyro_fa.fa.fitters`), or the name it is registered under in
        :data:`pyro_fa.fa.fitters.FITTERS`, built from the keyword options below that apply to it
        (``lr`` ... ``m_step_every``, kept for the names; beside a fitter object they must keep their
        defaults). ``"sketch"`` (:class:`~pyro_fa.fa.fitters.sketch.ScatterSketch`) refits batch FA, when
        the posterior is read, from a rank-2K sketch of the centred scatter: batch FA's quality
        on SGD iterates at 4 D·K numbers of state; EM's options do not apply to it.
    warmup : int, optional
        Number of observations during which only the running statistics are
        updated and :math:`F, \psi` stay at their initial values (Brownlie 2021, §5.1);
        default ``max(100, rank)``. At least ``rank`` for EM (an M-step from fewer
        observations than factors is degenerate), as in :class:`~pyro_fa.SWAG`.
    lr : float, default 1e-2
        Learning rate of the SGA optimizer, in the standardised coordinates of the ascent.
        Ignored by EM. The thesis's 1e-3 (Brownlie 2021, §5.1), decayed after ``lr_decay_after``
        steps, moves the factor too little to leave its start on stationary synthetic FA streams
        (measured: see ``benchmarks/results/measurements_from_docstrings.md``).
    optimizer : type, callable or "natural", optional
        For SGA: a ``torch.optim.Optimizer`` class, or a callable taking the
        parameter list and returning an optimizer. Default ``torch.optim.Adam``. ``"natural"``: the
        EM-preconditioned gradient step of :mod:`pyro_fa.fa.fitters.sga_natural` (size ``optimizer_kwargs["step"]``).
    optimizer_kwargs : dict, optional
        Extra keyword arguments for ``optimizer`` (besides ``lr``).
    step_scale : float, default 2.0
        :math:`a \ge 1` in the EM step :math:`\gamma_t = a/(t+a-1)` (:math:`t` counts
        observations). The statistics weigh observation :math:`i` in proportion to
        :math:`i^{a-1}`: early E-steps, made with a poor :math:`F`, fade like
        :math:`(i/t)^a`, at the price of an effective sample size
        :math:`t(2a-1)/a^2` (0.75 t for the default). ``1`` is the thesis's
        :math:`1/t`.
    lr_decay_after : int, optional
        SGA only: after this many ascent steps (updates past the warm-up) the learning
        rate decays like :math:`\mathrm{lr}\sqrt{t_0/t}` (a constant step leaves a noise floor, Robbins &
        Monro 1951); default ``2 * dim``; ``0`` keeps it constant (the thesis's setting).
    average : bool, default True
        SGA only: report the Polyak–Ruppert average of the iterates :math:`(F, \log\psi)`
        with weights proportional to the step count, instead of the last iterate
        (one more :math:`D\times K` buffer); on the synthetic models of Brownlie (2021,
        ch. 5) it roughly halves the covariance error of the last iterate.
    expand : bool, default True
        EM only: the parameter-expanded M-step (PX-EM). Plain EM changes the scale of
        :math:`F` by a factor of about :math:`1 + \psi/(s^2+\psi)` per EM iteration along a
        direction of signal variance :math:`s^2`: where the noise is small against the
        signal it crawls (see Notes). PX-EM estimates the latent covariance as well and absorbs it into
        :math:`F`, which sets the scale in one step; it costs one :math:`K\times K`
        triangular inverse per M-step. ``False`` is the thesis's M-step.
    step_ramp : int, optional
        Number of observations over which :math:`a_t` grows linearly from 1 to
        ``step_scale``; default ``2 * dim``. The :math:`D\times K` statistic
        :math:`\bar A` needs of the order of D observations before its M-step is
        better than noise; until then plain averaging (:math:`a = 1`) is the stable,
        minimum-variance choice, and forgetting the early E-steps pays only after.
    m_step_every : int, optional
        EM only: run the M-step (the :math:`O(DK^2)` part of an update) after every
        ``m_step_every``-th update past the warm-up; the statistics are updated at every
        update, and E-steps in between use the last :math:`F, \psi`. Default
        ``max(1, dim // 100_000)``: every update up to :math:`D = 2\cdot 10^5`, every
        10th at :math:`D = 10^6`, where an update then costs about one pass over
        :math:`\bar A` and one over :math:`F` plus a tenth of an M-step (as the
        project's online-EM benchmark measures); the stale factor of a few updates is
        negligible beside the :math:`1/t` weight of each new observation.
    init_scale : float, default 1.0
        Norm of each orthogonal column of the initial :math:`F` (Brownlie 2021, §4.4);
        :math:`\psi` starts at one.
    min_variance : float, default 1e-4
        Relative floor of :math:`\psi`: :math:`\psi_d \ge` ``min_variance`` times the
        observed variance of coordinate d (a Heywood case cannot drive the capacitance
        :math:`I + F^\top\Psi^{-1}F` past what float32 can factorise).
    seed : int, optional
        Seed of the generator used for the initialisation; default one number drawn from
        torch's global generator, so that ``torch.manual_seed`` makes a fit repeatable.
    dtype, device : optional
        Of the state; default torch's default dtype, CPU.
    process_group : torch.distributed.ProcessGroup, optional
        Shard the fit by coordinates over the group's ranks: the object built is then a
        :class:`~pyro_fa.distributed.ShardedOnlineFactorAnalysis` (:mod:`pyro_fa.distributed`). This
        rank holds rows ``[lo, hi)`` of every length-D and D x K array (memory
        :math:`O(DK/W)`), is fed the same rows of each observation (``update(x[..., lo:hi])``),
        and the fit equals the single-process fit on the whole vectors to rounding, with one
        all-reduce of :math:`K + K^2` numbers (and a few per rank) per EM update. The ranks must
        pass the same arguments (checked at construction: a mismatch raises on every rank) and
        call ``update``, ``log_prob``, ``sample`` and ``load_state_dict`` together;
        ``cov_factor``, ``cov_diag``, ``loc`` are this rank's rows, :meth:`get_posterior` a
        :class:`~pyro_fa.distributed.ShardedLowRankNormal`.
    shard : (int, int), optional
        With ``process_group``: this rank's rows ``(lo, hi)``, which must tile ``[0, dim)`` in
        rank order; default :func:`~pyro_fa.distributed.shard_bounds`.

    Attributes
    ----------
    loc : Tensor of shape (D,)
        The running mean :math:`c`.
    cov_factor : Tensor of shape (D, K)
        :math:`F`.
    cov_diag : Tensor of shape (D,)
        :math:`\psi`.
    n_updates : int
        Number of observations seen.
    fitter : Fitter
        The fitting method (its options).
    fit_state : FitState
        The fitter's state, its tensors this model's buffers.

    Notes
    -----
    Memory: two :math:`D\times K` tensors for EM (the statistic :math:`\bar A` and
    the factor) plus the transient products of one update; the factor, its
    gradient and Adam's two moments for SGA. Time per update: two
    :math:`D\times K\times K` products and a few passes over :math:`D\times K`
    memory; nothing :math:`D\times D` is formed.

    Why the expanded M-step and why not :math:`\gamma_t = 1/t`: see the Notes of
    :class:`~pyro_fa.fa.fitters.em.OnlineEM`. The fitting methods are registered
    :class:`~pyro_fa.fa.fitters.Fitter` classes (:mod:`pyro_fa.fa.fitters`): this class keeps
    the running moments, the refusal of bad input, checkpoints and sharding, the fitter its
    factor.

    References
    ----------
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
    University of Edinburgh, 2021, Algorithms 1 and 2. O. Cappé and E. Moulines, "On-line
    expectation-maximization algorithm for latent data models", JRSS B 71(3), 2009.
    C. Liu, D. B. Rubin and Y. N. Wu, "Parameter expansion to accelerate EM: the
    PX-EM algorithm", Biometrika 85(4), 1998.
    D. Barber, *Bayesian Reasoning and Machine Learning*, 2012, ch. 21.

    Examples
    --------
    >>> fa = OnlineFactorAnalysis(dim=5, rank=2, warmup=10, seed=0, dtype=torch.float64)
    >>> fa.update(torch.randn(200, 5, dtype=torch.float64))
    >>> fa.cov_factor.shape, fa.n_updates
    (torch.Size([5, 2]), 200)
    >>> fa.get_posterior().event_shape
    torch.Size([5])
    """

    #: The class ``process_group=`` / ``shard=`` build: :class:`pyro_fa.distributed.ShardedOnlineFactorAnalysis`,
    #: which registers itself here when :mod:`pyro_fa.distributed` is imported (``import pyro_fa`` imports it).
    sharded_class: Optional[type] = None
    _sharding = None  # this class holds every row; the sharded subclass holds a Sharding of its rows

    def __new__(cls, *args, process_group=None, shard=None, **kwargs):
        if (process_group is not None or shard is not None) and cls is OnlineFactorAnalysis \
                and cls.sharded_class is not None:
            cls = cls.sharded_class  # Python then runs its __init__ with the same arguments
        return super().__new__(cls)

    def __init__(
        self,
        dim: int,
        rank: int,
        method: Union[str, Fitter] = "em",
        warmup: Optional[int] = None,
        *,
        lr: float = 1e-2,
        optimizer: Optional[Union[type, Callable[..., torch.optim.Optimizer]]] = None,
        optimizer_kwargs: Optional[Dict[str, Any]] = None,
        step_scale: float = 2.0,
        expand: bool = True,
        step_ramp: Optional[int] = None,
        lr_decay_after: Optional[int] = None,
        average: bool = True,
        m_step_every: Optional[int] = None,
        init_scale: float = 1.0,
        min_variance: float = 1e-4,
        seed: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        process_group=None,
        shard: Optional[Tuple[int, int]] = None,
    ):
        super().__init__()
        name = type(self).__name__
        if process_group is not None or shard is not None:  # __new__ builds the sharded subclass instead
            raise ValueError(f"{name}: process_group and shard need pyro_fa.distributed's "
                             f"ShardedOnlineFactorAnalysis, got them on {name}.")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"{name}: dim must be an integer >= 2, got {dim!r}.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < dim:
            raise ValueError(f"{name}: rank must be an integer in [1, dim) = [1, {dim}), got {rank!r}.")
        options = dict(lr=lr, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, step_scale=step_scale,
                       expand=expand, step_ramp=step_ramp, lr_decay_after=lr_decay_after, average=average,
                       m_step_every=m_step_every)
        if isinstance(method, Fitter):
            changed = sorted(k for k, v in options.items() if v is not _FITTER_OPTIONS[k] and v != _FITTER_OPTIONS[k])
            if changed:
                raise ValueError(f"{name}: {', '.join(changed)} must be given to the fitter object with method="
                                 f"{type(method).__name__}(...), got them beside it.")
        # a name is checked here and built with the options that apply to it; dispatched once
        fitter = resolve_fitter(method, name, **options)
        if warmup is None:
            warmup = max(_DEFAULT_WARMUP, rank)  # rank is checked above
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"{name}: warmup must be a positive integer, got {warmup!r}.")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"{name}: lr must be a positive finite number, got {lr!r}.")
        if not (isinstance(step_scale, (int, float)) and math.isfinite(step_scale) and step_scale >= 1):
            raise ValueError(f"{name}: step_scale must be a finite number >= 1, got {step_scale!r}.")
        if not isinstance(expand, bool):
            raise TypeError(f"{name}: expand must be True or False, got {expand!r}.")
        if step_ramp is not None and (isinstance(step_ramp, bool) or not isinstance(step_ramp, int) or step_ramp < 1):
            raise ValueError(f"{name}: step_ramp must be a positive integer or None, got {step_ramp!r}.")
        if lr_decay_after is not None and (
            isinstance(lr_decay_after, bool) or not isinstance(lr_decay_after, int) or lr_decay_after < 0
        ):
            raise ValueError(f"{name}: lr_decay_after must be a non-negative integer or None, got {lr_decay_after!r}.")
        if m_step_every is not None and (
            isinstance(m_step_every, bool) or not isinstance(m_step_every, int) or m_step_every < 1
        ):
            raise ValueError(f"{name}: m_step_every must be a positive integer or None, got {m_step_every!r}.")
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"{name}: init_scale must be a positive finite number, got {init_scale!r}.")
        if not (isinstance(min_variance, (int, float)) and 0 < min_variance < 1):
            raise ValueError(f"{name}: min_variance must be in (0, 1), got {min_variance!r}.")
        fitter.check(name, rank=rank, warmup=warmup)  # the fitter's options (a fitter object's too)
        dtype = dtype or torch.get_default_dtype()
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"{name}: dtype must be torch.float32 or torch.float64, got {dtype!r}. Half precision cannot hold "
                "the factor's statistics (nor factorise them on the CPU): fit a float32 copy of the vectors."
            )
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "meta":
            raise ValueError(f"{name}: device must hold data (e.g. 'cpu' or 'cuda'), got {device!r}: a fit on the "
                             "meta device has no values to update.")

        self.dim = dim
        rows = self._local_dim = self._rows(dim)
        self.rank = rank
        self.method = fitter.name
        self.fitter = fitter
        self.warmup = warmup
        self.init_scale = float(init_scale)
        self.min_variance = float(min_variance)
        self.seed = seed

        # no seed: one draw from torch's global generator (as torch's DataLoader seeds its workers), so that
        # torch.manual_seed makes the fit repeatable and the global stream moves by one number only
        gen = torch.Generator()
        gen.manual_seed(draw_seed() if seed is None else seed)
        F0 = self._initial_factor(rank, init_scale, gen, dtype, device)

        # exact running moments (Chan et al.), accumulated in float64 whatever the state's dtype:
        # late SGD iterates move by 1e-4 around weights of 1, below float32's resolution of the sum
        self._moments = RunningMoments(rows, device)
        self.register_buffer("loc", torch.zeros(rows, dtype=dtype, device=device))  # the mean rounded once to the state's dtype
        self._n = 0  # observations seen (saved through get_extra_state)
        self._bind_state(fitter.init(self._ctx, F0))
        self._cache = None

    # ------------------------------------------------------------------ the fitter's state
    @property
    def _ctx(self) -> FitContext:
        return FitContext(self)

    @property
    def fit_state(self) -> FitState:
        """The fitter's state (a :class:`~pyro_fa.fa.fitters.FitState`), its tensors this model's buffers."""
        state = self.__dict__["_fit_state"]
        params, buffers = self._parameters, self._buffers
        for field, key in state.tensor_fields().items():  # buffers that .to() or a load replaced
            t = params.get(key) if key in params else buffers.get(key)
            if getattr(state, field) is not t:
                setattr(state, field, t)
        return state

    def _bind_state(self, state: FitState) -> None:
        """Hold ``state``: its tensor fields become this model's buffers (parameters) under their keys."""
        for field, key in state.tensor_fields().items():
            t = getattr(state, field)
            if field in state.parameters:
                if self._parameters.get(key) is not t:
                    self.register_parameter(key, t)
            elif t is None:
                self._buffers.pop(key, None)
            elif key in self._buffers:
                self._buffers[key] = t
            else:
                self.register_buffer(key, t)
        self.__dict__["_fit_state"] = state

    # ------------------------------------------------------------------ state
    @property
    def n_updates(self) -> int:
        """Number of observations seen."""
        return self._n

    @torch.no_grad()
    def finish_warmup(self) -> None:
        r"""End the warm-up now, at the vectors seen so far (EM: an M-step on the statistics gathered).

        For streams shorter than planned, e.g. one collection per epoch for fewer
        epochs than ``warmup``: :attr:`warmup` becomes ``n_updates - 1``, EM fits
        :math:`F, \psi` to its statistics at once and later updates go on as after any
        warm-up. Needs more observations than ``rank`` (an M-step from fewer vectors than
        factors is degenerate). Does nothing once the warm-up is over.

        Raises
        ------
        RuntimeError
            With ``n_updates <= rank``, or for ``method="sga"``, whose ascent has not
            started during the warm-up (there is nothing to end it with).
        """
        if self._n > self.warmup:
            return
        cls = type(self).__name__
        if not self.fitter.finishes_warmup:
            self.fitter.finish_warmup(self.fit_state, self._ctx)  # raises: this method cannot end its warm-up early
        if self._n <= self.rank:
            raise RuntimeError(f"{cls}: finish_warmup() needs more than rank={self.rank} observations, got {self._n}.")
        if not self._has_spread():
            raise RuntimeError(f"{cls}: finish_warmup() needs observations that differ, got {self._n} identical ones "
                               "(no spread to fit a factor to). Update with more.")
        self.warmup = self._n - 1  # as if planned: the first M-step follows update warmup + 1
        self._bind_state(self.fitter.finish_warmup(self.fit_state, self._ctx))
        self._cache = None

    @property
    def variance(self) -> Tensor:
        """Running (maximum-likelihood) variance of each coordinate, shape (D,), in the state's dtype."""
        return self._moments.variance(self._n).to(self.loc.dtype)

    def _floor(self, psi: Tensor, var: Tensor) -> Tensor:
        return torch.maximum(psi, self._floor_values(var))

    def _floor_values(self, var: Tensor) -> Tensor:
        # relative to each coordinate's variance; a coordinate that never moved gets a tiny floor
        # relative to the others' (its row of F is zero, so it does not enter the capacitance), never
        # below the smallest normal number (a denormal psi is 0 under torch.set_flush_denormal(True))
        info = torch.finfo(var.dtype)
        tiny = (info.eps * self._var_mean(var)).clamp_min(info.tiny)
        return (self.min_variance * var).clamp_min(tiny)

    def _estimate(self):
        if self._cache is not None:
            return self._cache
        out = self.fitter.factors(self.fit_state, self._ctx)
        self._cache = out
        return out

    @property
    def cov_factor(self) -> Tensor:
        r""":math:`F`, a tensor of shape (D, K)."""
        return self._estimate()[0]

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`\psi`, a tensor of shape (D,)."""
        return self._estimate()[1]

    def _check_fitted(self, what: str):
        if self._n == 0:
            raise RuntimeError(
                f"{type(self).__name__}: {what} needs at least one update, got none. Call update(x) first."
            )

    def get_posterior(self) -> LowRankMultivariateNormal:
        r"""The fitted Gaussian :math:`N(c, FF^\top + \Psi)`.

        Returns
        -------
        torch.distributions.LowRankMultivariateNormal
            A :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal`, whose capacitance is
            formed in float64 (torch's float32 one fails when :math:`\psi` is tiny against :math:`F`).
        """
        self._check_fitted("get_posterior()")
        F, psi = self._estimate()
        return StableLowRankMultivariateNormal(self.loc, F, psi)

    def log_prob(self, x: Tensor) -> Tensor:
        """Log-density of ``x`` (shape (..., D)) under the fitted Gaussian.

        Raises
        ------
        TypeError
            If ``x`` is not a tensor of the model's dtype (torch distributions do not convert).
        """
        if not torch.is_tensor(x):
            raise TypeError(f"{type(self).__name__}: x must be a torch.Tensor of shape (..., D), got "
                            f"{type(x).__name__}.")
        if x.dtype != self.loc.dtype:
            raise TypeError(f"{type(self).__name__}: x must have dtype {self.loc.dtype} like the model state, got "
                            f"{x.dtype}. Convert x (x.to({self.loc.dtype})) or call .to({x.dtype}) on the model.")
        return self.get_posterior().log_prob(x)

    def sample(self, n: int = 1) -> Tensor:
        """Draw ``n`` vectors from the fitted Gaussian, a tensor of shape (n, D)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{type(self).__name__}: n must be a positive integer, got {n!r}.")
        return self.get_posterior().sample((n,))

    def covariance(self) -> Tensor:
        r"""The dense :math:`D\times D` covariance :math:`FF^\top+\Psi` (small D only)."""
        linalg.check_dense_dim(type(self).__name__, "covariance()", self.dim, self.loc.dtype,
                               "Use get_posterior() (a LowRankMultivariateNormal) instead.", argument="dim")
        self._check_fitted("covariance()")
        F, psi = self._estimate()
        return linalg.dense_covariance(F, psi)

    # ------------------------------------------------------- single-process hooks
    # What the fit does with its sums over D. ShardedOnlineFactorAnalysis (pyro_fa.distributed) overrides each
    # with its collective form (the sums all-reduced over the ranks' rows).
    def _rows(self, dim: int) -> int:
        """The number of coordinates this object holds."""
        return dim

    def _initial_factor(self, rank: int, init_scale: float, generator: torch.Generator, dtype: torch.dtype,
                        device: torch.device) -> Tensor:
        return linalg.orthogonal_init(self.dim, rank, scale=init_scale, generator=generator, dtype=dtype).to(device)

    def _sq_dev_sum(self) -> float:
        """The running squared deviations summed over all D."""
        return float(self._moments.sq_dev.sum())

    def _cap_done(self, cap: Tensor, sga: bool = False) -> None:
        """A capacitance summed over the rows: add the identity."""
        cap.diagonal().add_(1.0)

    def _commit_cap(self, cap: Tensor, total: Tensor) -> None:
        """A capacitance's sum over the ranks arrived (sharded only)."""
        cap.copy_(total)
        cap.diagonal().add_(1.0)

    def _stash_projection(self, n: int, u: Optional[Tensor]) -> None:
        """A projection reduced with the update's checks (sharded only): nothing to keep here."""

    def _var_mean(self, var: Tensor) -> Tensor:
        """Mean over all D of the running variances (the relative noise floor's scale)."""
        return var.mean()

    def _mean_over_dim(self, v: Tensor) -> Tensor:
        """Mean over all D of a per-row quantity."""
        return v.mean()

    def _e_step_inputs(self, d: Tensor, F: Tensor, psi: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        r"""EM's E-step inputs: the capacitance's Cholesky factor and :math:`F^\top\Psi^{-1}d^\top` (K, B)."""
        return cholesky(cap), F.T @ (d / psi).T

    def _sga_reduce(self, u: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        """SGA's E-step inputs, the projection (B, K) and the capacitance, summed over all D."""
        return u, cap

    def _range_terms(self, t: Tensor) -> Tuple[Tensor, float]:
        r"""Per vector :math:`\sum_d t_{bd}^2/\psi_d` over the rows held, and :math:`\max|t/s|`."""
        rows = (t.square() / self._noise_now()).sum(-1).reshape(-1)
        scale = self.fitter.range_scale(self.fit_state, self._ctx)
        return rows, float((t / (scale if scale is not None else 1.0)).abs().max())

    def _exact_range(self, t: Tensor) -> Tuple[float, float]:
        r"""The exact range bounds: :math:`4\max_b \sum_d t_{bd}^2/\psi_d` and :math:`4\max|t/s|^2`."""
        rows, tm = self._range_terms(t)
        return float(rows.max()) * 4.0, 4.0 * tm ** 2

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._cache = None
        self._bind_state(self.fitter.moved(self.fit_state, self._ctx, fn))
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rank={self.rank}, method={self.method!r}, warmup={self.warmup}"

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        r"""Update the fit with one observation or a batch.

        Parameters
        ----------
        x : Tensor of shape (D,) or (B, D)
            On the model's device and of its dtype; must be finite (a non-finite
            input raises and leaves the state untouched).

        Notes
        -----
        A batch is one step of the algorithm: one E-step with the current
        :math:`F, \psi`, statistics averaged over the batch.
        """
        x = self._validate(x)
        B = x.shape[0]
        n_old = self._n
        n = n_old + B
        moments = self._moments
        spread_before = self._has_spread()
        # exact running mean and squared deviations (Chan et al. merge) in float64; x is checked on
        # its deviations from the old mean before anything changes
        if B == 1:
            # one vector, in place and without temporaries (D-length passes are a good part of an update)
            t, tmax = moments.deviation(x[0])
            # the first vector becomes the mean: it deviates from nothing (but must be finite)
            self._check_range(x, tmax if n_old else tmax * 0.0, B, t if n_old else None)
            moments.add_deviation(t, n_old)
            # centred with the new mean (Alg. 2, line 6): x - mean_new = t (n - 1) / n, rounded once
            d = torch.mul(t, n_old / n, out=self._scratch("_d", self.loc.dtype)).unsqueeze(0)
            self.loc.copy_(moments.mean)
        else:
            xw = x.to(moments.mean.dtype)
            t = xw - (moments.mean if n_old else xw[0])
            self._check_range(x, float(t.abs().max()), B, t)
            mean, sq_dev, xw = moments.propose(xw, n_old)
            moments.commit(mean, sq_dev)
            self.loc.copy_(mean)
            d = (xw - mean).to(self.loc.dtype)
        self._n = n
        self._cache = None
        self._fit_step(d, n_old, B, spread_before)

    def _has_spread(self) -> bool:
        r"""Whether the vectors seen so far have spread apart (a fit has something to fit).

        True when the mean running variance times the dtype's epsilon (the relative floor of
        :math:`\psi`) is a normal number of the state's dtype. Identical vectors, e.g. the
        iterates of a learning-rate warm-up that starts at 0 or of frozen first steps, have
        none. Remembered once true (the squared deviations only grow); O(D) until then.
        """
        if self.__dict__.get("_spread_seen", False):
            return True
        total = self._sq_dev_sum()
        info = torch.finfo(self.loc.dtype)
        spread = info.eps * total / (max(self._n, 1) * self.dim) >= info.tiny
        self.__dict__["_spread_seen"] = spread
        return spread

    def _fit_step(self, d: Tensor, n_old: int, B: int, spread_before: bool) -> None:
        r"""The step of the fit after the running moments took a batch of B vectors (centred ``d``).

        While the vectors have not spread apart (all equal so far) there is no scale to fit:
        the warm-up waits, counting them as one vector (:attr:`warmup` grows by the repeats),
        and :math:`F, \psi` keep their initial values; EM then rescales at the first vector
        that differs, and the M-step (or the ascent) starts ``warmup`` vectors after the first.
        """
        n = self._n
        spread = spread_before or self._has_spread()
        if not spread:
            self.warmup += n - max(n_old, 1)
        self._bind_state(self.fitter.update(self.fit_state, self._ctx, d, n_old, B, spread and not spread_before))

    def _scratch(self, name: str, dtype: torch.dtype) -> Tensor:
        # a persistent length-D work vector (allocating 8 MB per update costs page faults at D = 10^6)
        buf = self.__dict__.get(name)
        if buf is None or buf.dtype != dtype or buf.device != self.loc.device:
            buf = torch.empty(self._local_dim, dtype=dtype, device=self.loc.device)
            self.__dict__[name] = buf
        return buf

    def _noise_now(self) -> Tensor:
        # the noise variances the next step divides by (1 before the first M-step or the warm-up's end)
        return self.fitter.noise(self.fit_state, self._ctx)

    def _noise_floor_now(self) -> float:
        return self.fitter.noise_floor(self.fit_state, self._ctx)

    def _block_rows(self, element_size: int) -> int:
        # about 1 MB of rows per block (EM's M-step, SGA's fused pass): a few (rows, K) arrays stay in cache
        return max(1, min(self._local_dim, (1 << 20) // (self.rank * element_size)))

    def _workspace(self, rows: int, like: Tensor) -> Tensor:
        # two (rows, K) blocks: EM's M-step products and statistic rows; SGA's gradient rows and a temporary
        w = self.__dict__.get("_work")
        if w is None or w.shape[1] < rows or w.dtype != like.dtype or w.device != like.device:
            w = self.__dict__["_work"] = like.new_empty(2, rows, self.rank)
        return w
