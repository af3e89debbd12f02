r"""Online factor analysis of a stream of vectors (online EM and online SGA).

A factor-analysis (FA) model :math:`\theta = Fh + c + \varepsilon`,
:math:`h \sim N(0, I_K)`, :math:`\varepsilon \sim N(0, \Psi)`, is fitted to
vectors :math:`\theta_1, \theta_2, \dots` seen one (or one batch) at a time,
without storing them: the state is :math:`O(DK)`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.fa import linalg
from pyro_fa._random import draw_seed
from pyro_fa.fa._online_checks import OnlineChecks, check_density_input, check_fitted
from pyro_fa.fa._online_options import check_arguments
from pyro_fa.fa._fit_binding import Workspace, bind_state, current_state
from pyro_fa.fa._online_warmup import end_warmup, fit_step, has_spread
from pyro_fa.fa.fitters import FitContext, FitState, Fitter, cholesky
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.distributions import StableLowRankMultivariateNormal, draw

__all__ = ["OnlineFactorAnalysis"]


class OnlineFactorAnalysis(OnlineChecks, nn.Module):
    r"""Factor analysis fitted online (one vector or one batch at a time), by a registered fitter.

    .. math::

        \theta_t \sim N(c, FF^\top + \Psi), \qquad F \in \mathbb{R}^{D\times K},
        \ \Psi = \mathrm{diag}(\psi).

    The mean :math:`c` and the coordinate variances are exact running moments; the factor
    :math:`(F, \psi)` is fitted by the ``method``: online EM (Brownlie 2021, Algorithm 2, in the
    stochastic-approximation form of Cappé & Moulines 2009, with the parameter-expanded M-step of
    Liu, Rubin & Wu 1998), online stochastic gradient ascent (Algorithm 1), or batch FA refitted
    from a sketch of the scatter. The state is :math:`O(DK)`; nothing :math:`D\times D` is formed.
    Feed vectors with :meth:`update`, read the fit with :meth:`get_posterior` (or :attr:`loc`,
    :attr:`cov_factor`, :attr:`cov_diag`); ``state_dict()`` / ``load_state_dict()`` checkpoint it
    (a load is checked whole before anything is written). Why online EM departs from the thesis
    (step, ramp, PX-EM) is in ``docs/online_fa.md``.

    Parameters
    ----------
    dim : int
        :math:`D`, the length of each observation, ``>= 2``.
    rank : int
        :math:`K`, the number of factors, ``1 <= rank < dim``.
    method : {"em", "sga", "sketch"} or Fitter, default "em"
        A fitter object built with its own options (``OnlineSGA(lr=0.01, optimizer="natural")``,
        ``OnlineEM(step_scale=1.0)``), or the name it is registered under in
        :data:`pyro_fa.fa.fitters.FITTERS`, built from the keyword options below that apply to it
        (beside a fitter object those must keep their defaults).
    warmup : int, optional
        Observations during which only the running moments are updated and :math:`F, \psi` keep
        their initial values (Brownlie 2021, §5.1); default ``max(100, rank)``; at least ``rank``
        for EM. :meth:`finish_warmup` ends it early.
    lr, optimizer, optimizer_kwargs, lr_decay_after, average
        Online SGA's options, see :class:`~pyro_fa.fa.fitters.sga.OnlineSGA` (``optimizer="natural"``: the
        EM-preconditioned step of :mod:`pyro_fa.fa.fitters.sga_natural`). Defaults 1e-2, Adam, None,
        ``2 * dim``, True.
    step_scale, expand, step_ramp, m_step_every
        Online EM's options, see :class:`~pyro_fa.fa.fitters.em.OnlineEM`: the step
        :math:`\gamma_t = a_t/(t+a_t-1)` ramps :math:`a_t` from 1 to ``step_scale`` over ``step_ramp``
        vectors (1: the thesis's :math:`1/t`); ``expand``: PX-EM. Defaults 2, True, ``2 * dim``,
        ``max(1, dim // 100_000)``.
    init_scale : float, default 1.0
        Norm of each orthogonal column of the initial :math:`F` (Brownlie 2021, §4.4); :math:`\psi`
        starts at one.
    min_variance : float, default 1e-4
        Relative floor of :math:`\psi`: at least ``min_variance`` times each coordinate's variance.
    seed : int, optional
        Seed of the initialisation; default one number drawn from torch's global generator.
    dtype, device : optional
        Of the state: torch.float32 or torch.float64 (default torch's default dtype), CPU by default.
    process_group : torch.distributed.ProcessGroup, optional
        Shard the fit by coordinates over the group's ranks: the object built is then a
        :class:`~pyro_fa.distributed.ShardedOnlineFactorAnalysis` (see its docstring and
        ``docs/distributed.md``).
    shard : (int, int), optional
        With ``process_group``: this rank's rows ``(lo, hi)``; default
        :func:`~pyro_fa.distributed.shard_bounds`.

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

    See Also
    --------
    pyro_fa.fa.fitters : the fitters and how to register one.
    pyro_fa.SWAG : online FA of SGD iterates.
    pyro_fa.distributed.ShardedOnlineFactorAnalysis : the fit sharded by coordinates.

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
        options = dict(lr=lr, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, step_scale=step_scale,
                       expand=expand, step_ramp=step_ramp, lr_decay_after=lr_decay_after, average=average,
                       m_step_every=m_step_every)
        fitter, warmup, dtype, device = check_arguments(name, dim, rank, method, warmup, options, init_scale,
                                                        min_variance, dtype, device)

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
        self._work = Workspace(rows, rank)
        self._bind_state(fitter.init(self._ctx, F0))
        self._cache = None

    # ------------------------------------------------------------------ the fitter's state
    @property
    def _ctx(self) -> FitContext:
        return FitContext(self)

    @property
    def fit_state(self) -> FitState:
        """The fitter's state (a :class:`~pyro_fa.fa.fitters.FitState`), its tensors this model's buffers."""
        return current_state(self)

    def _bind_state(self, state: FitState) -> None:
        bind_state(self, state)

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
        end_warmup(self)

    @property
    def variance(self) -> Tensor:
        """Running (maximum-likelihood) variance of each coordinate, shape (D,), in the state's dtype."""
        return self._moments.variance(self._n).to(self.loc.dtype)

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
        check_fitted(type(self).__name__, what, self._n)

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
        check_density_input(type(self).__name__, x, self.loc.dtype)
        return self.get_posterior().log_prob(x)

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws from the fitted Gaussian: shape (num_samples, D), or (D,) when ``num_samples`` is None."""
        return draw(type(self).__name__, self.get_posterior(), num_samples, generator)

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
            d = torch.mul(t, n_old / n, out=self._work.vector("d", self.loc.dtype, self.loc.device)).unsqueeze(0)
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
        return has_spread(self)

    def _fit_step(self, d: Tensor, n_old: int, B: int, spread_before: bool) -> None:
        fit_step(self, d, n_old, B, spread_before)

    def _noise_now(self) -> Tensor:
        # the noise variances the next step divides by (1 before the first M-step or the warm-up's end)
        return self.fitter.noise(self.fit_state, self._ctx)

    def _noise_floor_now(self) -> float:
        return self.fitter.noise_floor(self.fit_state, self._ctx)
