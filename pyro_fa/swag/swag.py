r"""SWAG-style Gaussian posteriors fitted to the iterates of an ordinary optimizer.

Every (or every ``collect_every``-th) optimizer step yields the flattened
parameter vector :math:`\theta_t \in \mathbb{R}^D`; an online fit turns the
stream into :math:`q(\theta) = N(c, FF^\top + \Psi)` without storing it
(Brownlie 2021, §4.1–4.2 and Chapter 6). Classic SWAG (Maddox et al. 2019) is
the baseline in the same API.

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021.
W. Maddox, T. Garipov, P. Izmailov, D. Vetrov, A. G. Wilson, "A simple
baseline for Bayesian uncertainty in deep learning", NeurIPS 2019.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Type, Union

import torch
from torch import Tensor, nn

from pyro_fa.distributed import ShardedLowRankNormal
from pyro_fa.distributions import FactorNormal, PointMassNormal, StableLowRankMultivariateNormal
from pyro_fa.fa.fitters import Fitter, iterate_fitters
from pyro_fa.swag._classic import ClassicFit
from pyro_fa.swag._collect import IterateCollector
from pyro_fa.swag._fits import IterateFit, OnlineFit
from pyro_fa.swag._params import ParamSource as _ParamSource, positive_int as _positive_int
from pyro_fa.swag._prediction import SWAGPrediction
from pyro_fa.distributed.swag import ShardedSWAG
from pyro_fa.swag._state import SWAGState
from pyro_fa.swag.guide import FactorPosteriorGuide

__all__ = ["SWAG"]

_CLASSIC = "swag"  # classic SWAG's deviations (ClassicFit); every other method is a registered fitter's


def _methods():
    """The methods SWAG offers: the registered fitters that support iterates, and classic SWAG."""
    return (*iterate_fitters(), _CLASSIC)
_ON_NONFINITE = ("raise", "skip")


class SWAG(SWAGPrediction, IterateCollector, SWAGState, ShardedSWAG, nn.Module):
    r"""A Gaussian posterior over a model's weights, fitted online to optimizer iterates.

    .. math::

        q(\theta) = N(c, FF^\top + \Psi), \qquad \theta \in \mathbb{R}^D,\ F \in \mathbb{R}^{D\times K}.

    ``method="em"`` and ``"sga"`` feed each collected vector to an
    :class:`~pyro_fa.OnlineFactorAnalysis` (Brownlie 2021, Algorithms 2 and 1): :math:`c`
    is the running mean (SWA), :math:`F, \Psi` the factor-analysis fit.
    ``method="swag"`` is classic SWAG (Maddox et al. 2019, eq. 3 and Alg. 1):

    .. math::

        c = \bar\theta, \qquad \Sigma = \tfrac12\big(\Sigma_{\rm diag} + \tfrac{1}{K-1}\hat D\hat D^\top\big),

    with :math:`\Sigma_{\rm diag}` the running variances and :math:`\hat D` the
    last :math:`K` deviations :math:`\theta_i - \bar\theta_i` (mean after
    :math:`\theta_i`), i.e. :math:`F = \hat D/\sqrt{2(K-1)}`,
    :math:`\psi = \Sigma_{\rm diag}/2`.

    .. warning::

        ``method="sga"`` with its default Adam step is far from batch factor analysis
        at SWAG's stream lengths (a few hundred to a few thousand collected vectors;
        it warns when constructed): 38-514 times batch FA's covariance error on the
        MLP and yacht streams of the project's SGA-stream benchmark at the default
        ``lr=1e-3``, 26-2873 at 1e-2 (a diagonal alone: 39-623), 1.9-3.1 on the
        linear model. ``optimizer="natural"`` is the EM-preconditioned gradient step
        on the log-likelihood of the running moments (:mod:`pyro_fa.fa.fitters.sga_natural`;
        step size ``optimizer_kwargs={"step": eta}``, default 1, at which it takes
        online EM's PX M-step): 1.07-1.34 times batch FA on every stream of that
        benchmark, float32 and float64 (the exact scatter on the linear model, where
        :math:`D \le 3K`); step 0.5: 1.11-1.41, but 1.84 on the linear model at
        T = 6000. ``method="em"`` is as close on these streams.

    Parameters
    ----------
    module_or_params : torch.nn.Module or iterable of Tensors
        The weights to follow: a module's parameters that require grad, in
        ``named_parameters()`` order, or leaf tensors. All must share one dtype
        and device; the posterior's state lives there. See
        :meth:`from_param_store` for Pyro's param store.
    rank : int, default 20
        :math:`K`, ``1 <= rank < D``. For ``"swag"``: the number of deviations kept.
    method : {"em", "sga", "sketch", "swag"} or Fitter, default "em"
        A registered fitter's name (any with ``supports_iterates``, see :mod:`pyro_fa.fa.fitters`), a fitter
        object built with its own options (``method=OnlineEM(step_scale=1.0)``; then ``lr``, ``step_scale``
        and ``optimizer`` stay at their defaults), or ``"swag"``, classic SWAG's last K deviations.
        ``"sketch"``: batch FA refitted, when the posterior is read, from a sketch of the
        iterates' scatter (:class:`~pyro_fa.fa.fitters.sketch.ScatterSketch`): within 1.06 times
        batch FA's covariance error on the SGD-iterate streams of the project's benchmark, where
        ``"em"`` is 1.1–2.6 times off; 4 D·K numbers of state (``"em"``: 2), 1.4–1.5 times two
        D x K mat-vecs per collection at D = 10^6 (``"em"``: 2.1 in the same runs), and a refit
        when the posterior is read (19 s at D = 10^6 on noise-like iterates).
    start_after : int, default 0
        Optimizer steps to skip (pre-training) before collecting.
    collect_every : int, default 1
        Collect every this many optimizer steps (after ``start_after``).
    window : int, default 1
        Finite-window iterate averaging (Brownlie 2021, §6.1.2; Mandt et al. 2017): each
        vector handed to the fit is the mean of ``window`` consecutive collected
        iterates.
    warmup : int, optional
        EM / SGA: vectors that only update the running statistics (Brownlie 2021, §6.2.1);
        at least ``rank`` for EM. Default ``rank``, the shortest EM accepts: SWAG's recipe
        collects once per epoch for a few tens of epochs (see the recipe below and
        the project's example ``swag_recipe.py``), and ``pyro-fa classify`` uses it.
    lr, step_scale, init_scale, min_variance, optimizer
        Passed to :class:`~pyro_fa.OnlineFactorAnalysis` (``lr``: SGA learning rate;
        ``optimizer="natural"``: SGA's EM-preconditioned step, see the warning above).
        ``step_scale`` defaults to 1 here (2 in ``OnlineFactorAnalysis``): SWAG's
        posterior is the equally weighted moments of the collected iterates, its mean
        and diagonal are equally weighted, and so are EM's statistics with
        ``step_scale=1``. Weighting late iterates more (``2``) describes a different,
        wider distribution when the trajectory drifts, far from the iterates' own
        covariance (measured in the project's SWAG-stream benchmark).
    on_nonfinite : {"raise", "skip"}, default "raise"
        What a parameter vector that cannot be collected does (NaN / inf, or an update
        that would overflow the dtype): raise ``ValueError``, or be skipped with a
        ``RuntimeWarning``; the posterior is unchanged either way. (The divergence
        guard, ``max_deviation``, always skips with a warning.)
    max_deviation : float or None, default 10.0
        Divergence guard: once 10 vectors have been collected, a vector further from
        the running mean than ``max_deviation`` times the root of the summed running
        variances, :math:`\|\theta - c\| > r\sqrt{\mathrm{tr}\,S}`, is taken for a diverged
        run and not collected: it is skipped with a ``RuntimeWarning`` whatever
        ``on_nonfinite`` says (a heuristic never stops training; the non-finite vectors a
        diverged run soon gives follow ``on_nonfinite``). Iterates of a run that is sampling, drifting or
        random-walking sit at 1 to 3 such units (a Gaussian's expected value is about
        1); a run blowing up leaves by orders of magnitude at once, and the posterior
        collected before it is kept. A run that changed regime (a higher learning rate,
        a larger ``collect_every``) may leave the spread too; after 20 refusals in a row
        whose distances stopped growing (at most twice over the last 10), it is
        collected again, with a warning. ``None`` disables the guard.
    seed : int, optional
        Seed of the initial factor of EM / SGA.
    process_group : torch.distributed.ProcessGroup, optional
        Shard the posterior over the group's ranks (:mod:`pyro_fa.distributed`); default the
        process group of a ``DistributedDataParallel`` model, else none. The weights are
        replicated, so each rank collects only its rows of :math:`\theta` (once per step, memory
        :math:`O(DK/W)` per rank); ``loc``, ``cov_factor``, ``cov_diag`` are this rank's rows,
        :meth:`sample`, :meth:`predict` and :meth:`sampled_weights` assemble whole
        vectors (an all-gather) and agree on every rank. Collection and sampling are
        collective: every rank steps and predicts together (as DDP trains). The ranks must
        pass the same arguments and models (checked at construction: a mismatch raises on
        every rank).
    **fa_kwargs
        Further options of :class:`~pyro_fa.OnlineFactorAnalysis` (e.g. ``m_step_every``).

    Attributes
    ----------
    dim : int
        :math:`D`.
    loc, cov_factor, cov_diag : Tensors of shape (D,), (D, K), (D,)
    n_collected : int
        Vectors handed to the fit (after window averaging).
    n_steps : int
        Optimizer steps seen by :meth:`step` (and the hook of :meth:`attach`).

    Notes
    -----
    Memory (beyond the model): EM holds three :math:`D\times K` tensors and four
    of length :math:`D`; SGA the factor and Adam's two moments; classic SWAG one
    :math:`D\times K` deviation buffer and two of length :math:`D`; plus one
    vector of length :math:`D` for flattening (and one for the window). Time
    per collection: :math:`O(DK^2)` for EM / SGA, :math:`O(D)` for classic SWAG.
    No :math:`D\times D` matrix is formed, and sampling works on any device.
    The running moments are kept in float64 (two more vectors of length
    :math:`D`), so float32 weights are collected exactly.

    A collection recipe that gives a spread worth sampling (Maddox et al. 2019,
    Algorithm 1; the one ``pyro-fa classify`` and the calibration tutorial use):
    train to a good point, then hold the learning rate at a constant, fairly high
    value with ``torch.optim.swa_utils.SWALR`` and collect once per epoch
    (``start_after`` = pre-training steps, ``collect_every`` = steps per epoch); the default
    ``warmup`` (``rank``) fits such runs, and a run with fewer collections than a larger
    ``warmup`` ends its warm-up when the posterior is first used. Then choose :attr:`scale` with :meth:`tune_scale` on validation data,
    and the collection rate too where it is cheap::

        swag = SWAG(net, rank=10, start_after=75 * steps_per_epoch, collect_every=steps_per_epoch)
        swag.attach(opt)
        swa_sched = SWALR(opt, swa_lr=3e-3, anneal_epochs=1)   # from epoch 75 on, step it per batch
        ...                                                     # train
        swag.tune_scale(x_val, y_val)                           # logits; "regression" (noise_std=) for means
        with swag.sampled_weights(swag.loc):                    # SWA: the mean loaded into the model
            swa_logits = net(x_test)
        swag_log_proba = swag.predict_log_proba(x_test)         # SWAG: the model average

    The project's example ``swag_recipe.py`` runs it end to end (the SWAG page of the docs).

    In ``pyro-fa classify`` (results in the README) the tuned SWAG-EM improves on
    SWA's NLL and ECE on MNIST-1D, and gives SWA back on digits, where the
    validation log-likelihood is flat in the scale.

    References
    ----------
    W. Maddox, T. Garipov, P. Izmailov, D. Vetrov, A. G. Wilson, "A simple
    baseline for Bayesian uncertainty in deep learning", NeurIPS 2019.
    S. Mandt, M. Hoffman, D. Blei, "Stochastic gradient descent as approximate
    Bayesian inference", JMLR 18, 2017. S. Brownlie, *Extending the Bayesian Deep
    Learning Method MultiSWAG*, MSc thesis, University of Edinburgh, 2021,
    Chapters 4 and 6.

    Examples
    --------
    >>> net = torch.nn.Linear(3, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> swag = SWAG(net, rank=2, method="swag")
    >>> handle = swag.attach(opt)
    >>> for _ in range(5):
    ...     opt.zero_grad(); net(torch.randn(8, 3)).pow(2).mean().backward(); opt.step()
    >>> swag.n_collected, swag.sample(4).shape
    (5, torch.Size([4, 4]))
    """

    def __init__(
        self,
        module_or_params: Union[nn.Module, Iterable[Tensor]],
        rank: int = 20,
        method: str = "em",
        *,
        start_after: int = 0,
        collect_every: int = 1,
        window: int = 1,
        warmup: Optional[int] = None,
        lr: float = 1e-3,
        step_scale: float = 1.0,
        init_scale: float = 1.0,
        min_variance: float = 1e-4,
        optimizer=None,
        on_nonfinite: str = "raise",
        max_deviation: Optional[float] = 10.0,
        seed: Optional[int] = None,
        process_group=None,
        _source: Optional[_ParamSource] = None,
        **fa_kwargs,
    ):
        super().__init__()
        cls = type(self).__name__
        # sharded (a process_group, or a DistributedDataParallel model's): the ranks agree on every argument
        # before any is checked, so that a bad one raises alike on every rank (see pyro_fa.distributed)
        module_or_params, seed = self._agree_args(module_or_params, process_group, dict(
            rank=rank, method=method, start_after=start_after, collect_every=collect_every, window=window,
            warmup=warmup, lr=lr, step_scale=step_scale, init_scale=init_scale, min_variance=min_variance,
            optimizer=optimizer, on_nonfinite=on_nonfinite, max_deviation=max_deviation, seed=seed,
            fa_kwargs=fa_kwargs))
        if not (isinstance(method, Fitter) and method.supports_iterates) and method not in _methods():
            raise ValueError(f"{cls}: method must be one of {_methods()} or a fitter object, got {method!r}.")
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"{cls}: on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}.")
        self.rank = _positive_int(cls, "rank", rank)
        self.start_after = _positive_int(cls, "start_after", start_after, 0)
        self.collect_every = _positive_int(cls, "collect_every", collect_every)
        self.window = _positive_int(cls, "window", window)
        self._warmup = self.rank if warmup is None else _positive_int(cls, "warmup", warmup)
        self._fit = ClassicFit(method) if method == _CLASSIC else OnlineFit(method)  # dispatched here, once
        self._fit.check(cls, rank=self.rank, warmup=self._warmup, optimizer=optimizer)
        self.method = method.name if isinstance(method, Fitter) else method
        self.on_nonfinite = on_nonfinite
        if max_deviation is not None and not (
            isinstance(max_deviation, (int, float)) and not isinstance(max_deviation, bool)
            and math.isfinite(max_deviation) and max_deviation > 1
        ):
            raise ValueError(f"{cls}: max_deviation must be a finite number > 1 or None, got {max_deviation!r}.")
        self.max_deviation = None if max_deviation is None else float(max_deviation)
        self._n_refused = 0
        self._streak: List[float] = []  # distances of the guard's refusals in a row
        self._scale = 1.0
        self._fa_kwargs = dict(lr=lr, step_scale=step_scale, init_scale=init_scale, min_variance=min_variance,
                               optimizer=optimizer, seed=seed, **fa_kwargs)
        self.min_variance = float(min_variance)
        if _source is None:
            _source = self._source_from(module_or_params)
        object.__setattr__(self, "_source", _source)  # not a submodule: the model's weights stay out of state_dict
        self._n_steps = 0
        self._n = 0
        self._n_window = 0
        self._shapes: Optional[List[torch.Size]] = None
        self.dim: Optional[int] = None
        if not _source.from_param_store:
            self._setup(_source.named)

    # ------------------------------------------------------------- construction
    @classmethod
    def from_param_store(cls, rank: int = 20, method: str = "em", *, prefix: Optional[str] = "AutoDelta",
                         names: Optional[Sequence[str]] = None, **kwargs) -> "SWAG":
        r"""A SWAG posterior over (unconstrained) parameters of Pyro's param store.

        For a model trained by SVI with a MAP / ``AutoDelta`` guide and any
        ``pyro.optim`` optimizer; the training loop gains one line::

            swag = SWAG.from_param_store(rank=10, start_after=500)
            for step in range(1000):
                svi.step(x, y)
                swag.step()          # collects per start_after / collect_every

        The parameters are looked up at the first collection (after the first
        ``svi.step``), so the guide may create them lazily.

        Parameters
        ----------
        rank, method, **kwargs
            As for :class:`SWAG`.
        prefix : str or None, default "AutoDelta"
            Collect the store's parameters named ``prefix + "." + site``; the site
            names are what :meth:`to_guide` samples. ``None``: every parameter.
        names : sequence of str, optional
            Exact parameter names instead of ``prefix`` (used as site names).
        """
        return cls(None, rank, method, _source=_ParamSource(prefix=prefix, names=names), **kwargs)

    @property
    def _ref(self) -> Tensor:
        return self._fit.loc(self)

    @property
    def warmup(self) -> int:
        """Vectors before EM / SGA fit the factor: the fit's own (a short run may end it early, see
        :meth:`OnlineFactorAnalysis.finish_warmup`), the constructor's until the fit exists."""
        fa = self._modules.get("fa")
        return fa.warmup if fa is not None else self._warmup

    def _check_ready(self, what: str) -> None:
        cls = type(self).__name__
        if self._n == 0:
            raise RuntimeError(
                f"{cls}: {what} needs at least one collected parameter vector, got none. "
                "Call attach(optimizer) and train, or collect()."
            )
        self._fit.check_ready(self, what)

    @property
    def loc(self) -> Tensor:
        """The mean :math:`c` (the SWA solution), shape (D,)."""
        return self._ref

    @property
    def cov_factor(self) -> Tensor:
        r""":math:`F`, shape (D, K) (for ``"swag"``: :math:`\hat D/\sqrt{2(K'-1)}`, zero-padded columns)."""
        return self._fit.cov_factor(self)

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`\psi`, shape (D,) (for ``"swag"``: half the running variances, floored)."""
        return self._fit.cov_diag(self)

    def get_posterior(self) -> FactorNormal:
        r"""The posterior :math:`N(c, s(FF^\top + \Psi))` over the flattened parameters, :math:`s` = :attr:`scale`.

        Returns
        -------
        FactorNormal
            A :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` (the capacitance in float64: torch's
            float32 one fails when :math:`\psi` is tiny against :math:`F`); at scale 0 the point mass at
            :attr:`loc` (:class:`~pyro_fa.distributions.PointMassNormal`); under a ``process_group`` this rank's rows
            (:class:`~pyro_fa.distributed.ShardedLowRankNormal`, whose log_prob, entropy and sample are
            collective).

        Raises
        ------
        RuntimeError
            Before anything was collected.
        """
        self._check_ready("get_posterior()")
        s = self._scale
        if s == 0.0:
            return PointMassNormal(self.loc)
        if self._sharding is not None:  # this rank's rows; log_prob, entropy and sample are collective
            return ShardedLowRankNormal(self.loc, self.cov_factor * math.sqrt(s), self.cov_diag * s, self._sharding)
        if s == 1.0:
            return StableLowRankMultivariateNormal(self.loc, self.cov_factor, self.cov_diag)
        return StableLowRankMultivariateNormal(self.loc, self.cov_factor * math.sqrt(s), self.cov_diag * s)

    @property
    def scale(self) -> float:
        r"""The posterior scale :math:`s`: samples are :math:`c + \sqrt{s}\,(Fh + \Psi^{1/2}\varepsilon)`.

        The fitted :math:`F, \psi` describe the spread of the optimizer's iterates, which is
        set by its learning rate and batch size, not by the posterior (Mandt, Hoffman & Blei
        2017); Maddox et al. (2019) sample with a scale chosen on validation data.
        :meth:`tune_scale` chooses it by the validation log-likelihood; :meth:`get_posterior`
        and every sampling method use it. Default 1 (the iterates' own spread). Scale 0 is
        the mean (SWA): samples are :math:`c`, and :meth:`get_posterior` is the point mass at :math:`c`
        (:class:`~pyro_fa.distributions.PointMassNormal`).
        """
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{type(self).__name__}: scale must be a finite number >= 0, got {value!r}.")
        self._scale = float(value)

    @torch.no_grad()
    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        # unscaled draws F h + psi^(1/2) eps of shape (S, D)
        S = num_samples
        h, eps = self._draw_noise(S, generator)  # sharded: h shared by the ranks, eps (S, D_r) this rank's
        return eps.mul_(self.cov_diag.sqrt()).add_(self._fit.low_rank(self, h))

    @torch.no_grad()
    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draw flattened parameter vectors :math:`c + \sqrt{s}(Fh + \Psi^{1/2}\varepsilon)`, never forming a D×D matrix.

        :math:`s` is :attr:`scale` (at scale 0 every draw is :attr:`loc`); the same random numbers, in the same
        order, as ``get_posterior().sample((num_samples,), generator=generator)`` with a ``generator``, so the same
        draws up to rounding.

        Parameters
        ----------
        num_samples : int, optional
            ``None``: one vector of shape (D,); else shape (num_samples, D).
        generator : torch.Generator, optional
            On the posterior's device.
        """
        if num_samples is not None:
            _positive_int(type(self).__name__, "num_samples", num_samples)
        self._check_ready("sample()")
        S = 1 if num_samples is None else num_samples
        out = self._deviations(S, generator)
        if self._scale != 1.0:
            out.mul_(math.sqrt(self._scale))
        out.add_(self.loc)
        out = self._gather_full(out)  # sharded: whole vectors from every rank's rows
        return out[0] if num_samples is None else out

    def to_guide(self, model: Callable):
        """A Pyro guide drawing ``model``'s latent sites from this posterior.

        ``pyro.infer.Predictive(model, guide=swag.to_guide(model), num_samples=S)``
        then averages over sampled weights. Sites are matched by name: the
        module's parameter names (as in ``GaussianPrior.bayesianize(module)``), or
        the param-store names with ``prefix.`` removed (:meth:`from_param_store`,
        whose unconstrained values are mapped by ``biject_to(site support)``).
        Use ``Predictive(..., parallel=False)``.
        """
        return FactorPosteriorGuide(model, [self])

    def site_names(self) -> List[str]:
        """Names of the model sites that the posterior's pieces stand for, in flattening order."""
        self._named()
        return [self._source.site_name(n) for n in self._names]

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._flat = None
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, method={self.method!r}, start_after={self.start_after}, "
                f"collect_every={self.collect_every}, window={self.window}")
