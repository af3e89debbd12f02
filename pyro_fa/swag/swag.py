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

import contextlib
import math
import warnings
import weakref
from collections.abc import Mapping
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa._state import check_count
from pyro_fa.fa.moments import RunningMoments
from pyro_fa.fa.normal import StableLowRankMultivariateNormal
from pyro_fa.fa.online import OnlineFactorAnalysis
from pyro_fa.predictive import SampledPredictive, bma_log_likelihood, log_mean_exp, tune_scale
from pyro_fa.swag._params import ParamSource as _ParamSource, positive_int as _positive_int
from pyro_fa.swag._sharded import ShardedSWAG, flatten_slice
from pyro_fa.swag.guide import FactorPosteriorGuide
from pyro_fa.fa._sharding import ShardedLowRankNormal

__all__ = ["SWAG"]

_METHODS = ("em", "sga", "swag")
_ON_NONFINITE = ("raise", "skip")
_GUARD_AFTER = 10  # collected vectors before the divergence guard trusts the spread
_GUARD_PATIENCE = 20  # refusals in a row after which a run that stopped moving away is collected again


class SWAG(ShardedSWAG, nn.Module):
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

        ``method="sga"`` is far from batch factor analysis at SWAG's stream lengths
        (a few hundred to a few thousand collected vectors; it warns when
        constructed). ``method="em"`` is much closer to batch FA on the same
        streams; prefer it. See the benchmark ``benchmarks/bench_swag_streams.py``.

    Parameters
    ----------
    module_or_params : torch.nn.Module or iterable of Tensors
        The weights to follow: a module's parameters that require grad, in
        ``named_parameters()`` order, or leaf tensors. All must share one dtype
        and device; the posterior's state lives there. See
        :meth:`from_param_store` for Pyro's param store.
    rank : int, default 20
        :math:`K`, ``1 <= rank < D``. For ``"swag"``: the number of deviations kept.
    method : {"em", "sga", "swag"}, default "em"
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
        ``examples/swag_recipe.py``), and ``pyro-fa classify`` uses it.
    lr, step_scale, init_scale, min_variance, optimizer
        Passed to :class:`~pyro_fa.OnlineFactorAnalysis` (``lr``: SGA learning rate).
        ``step_scale`` defaults to 1 here (2 in ``OnlineFactorAnalysis``): SWAG's
        posterior is the equally weighted moments of the collected iterates, its mean
        and diagonal are equally weighted, and so are EM's statistics with
        ``step_scale=1``. Weighting late iterates more (``2``) describes a different,
        wider distribution when the trajectory drifts, far from the iterates' own
        covariance (see ``benchmarks/bench_swag_streams.py``).
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
        :meth:`sample_parameters`, :meth:`predict` and :meth:`sampled_weights` assemble whole
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
        swag.tune_scale(x_val, y_val)                           # logits; "gaussian" for regression
        with swag.sampled_weights(swag.loc):                    # SWA: the mean loaded into the model
            swa_logits = net(x_test)
        swag_log_proba = swag.predict_log_proba(x_test)         # SWAG: the model average

    ``examples/swag_recipe.py`` runs it end to end (``docs/swag.md``).

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
    >>> swag.n_collected, swag.sample_parameters(4).shape
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
        if method not in _METHODS:
            raise ValueError(f"{cls}: method must be one of {_METHODS}, got {method!r}.")
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"{cls}: on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}.")
        self.rank = _positive_int(cls, "rank", rank)
        self.start_after = _positive_int(cls, "start_after", start_after, 0)
        self.collect_every = _positive_int(cls, "collect_every", collect_every)
        self.window = _positive_int(cls, "window", window)
        self._warmup = self.rank if warmup is None else _positive_int(cls, "warmup", warmup)
        if method == "em" and self._warmup < self.rank:
            raise ValueError(
                f"{cls}: warmup must be >= rank={self.rank} for method 'em', got {warmup!r}: an M-step from fewer "
                "vectors than factors is degenerate (psi collapses and the capacitance loses positive-definiteness "
                "in float32)."
            )
        self.method = method
        self.on_nonfinite = on_nonfinite
        if method == "sga":
            warnings.warn(
                f"{cls}: method 'sga' (online stochastic gradient ascent) is far from batch factor analysis on "
                "a few hundred to a few thousand collected iterates; method 'em' is much closer. "
                "See help(SWAG).",
                UserWarning,
                stacklevel=2,
            )
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
    def _source_from(self, obj) -> _ParamSource:
        cls = type(self).__name__
        if isinstance(obj, nn.Module):
            named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
            module = obj
        elif torch.is_tensor(obj):
            raise TypeError(
                f"{cls}: module_or_params must be an nn.Module or an iterable of tensors, got a single Tensor. "
                "Wrap it in a list."
            )
        else:
            try:
                named = [(str(i), p) for i, p in enumerate(obj)]
            except TypeError:
                raise TypeError(
                    f"{cls}: module_or_params must be an nn.Module or an iterable of tensors, got {obj!r}."
                ) from None
            module = None
            seen = {}
            for name, p in named:
                if not torch.is_tensor(p):
                    raise TypeError(f"{cls}: module_or_params must hold only tensors, got {p!r}.")
                # the same tensor twice (or two views of one storage) would count its weights twice in D
                key = id(p) if p.is_meta or p.numel() == 0 else (p.device, p.untyped_storage().data_ptr())
                if key in seen or id(p) in seen:
                    raise ValueError(f"{cls}: module_or_params must hold each tensor once, got tensor {name} "
                                     f"sharing its storage with tensor {seen.get(key, seen.get(id(p)))} (its "
                                     "weights would be counted twice). Pass each parameter once.")
                seen[key] = seen[id(p)] = name
        if not named:
            raise ValueError(f"{cls}: module_or_params must hold at least one trainable tensor, got none.")
        return _ParamSource(named=named, module=module)

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

    def _setup(self, named: List[Tuple[str, Tensor]]) -> None:
        cls = type(self).__name__
        self._agree_params(named)
        tensors = [p for _, p in named]
        for name, p in named:
            if not p.is_leaf:
                raise ValueError(
                    f"{cls}: parameters must be leaf tensors (what an optimizer updates), got a non-leaf "
                    f"tensor {name!r} produced by {type(p.grad_fn).__name__}. Pass the tensors the optimizer holds."
                )
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"{cls}: parameters must be float32 or float64, got {name!r} of dtype {p.dtype}. "
                                "For a half-precision model, follow float32 master weights (e.g. those of "
                                "torch.autocast training) instead.")
        for name, p in named:
            if p.is_meta:
                raise ValueError(f"{cls}: parameters must hold data, got {name!r} on the meta device (shapes "
                                 "without values). Materialise the model first, e.g. module.to_empty(device='cpu') "
                                 "and initialise it.")
        dtypes = {p.dtype for p in tensors}
        devices = {p.device for p in tensors}
        if len(dtypes) > 1:
            raise TypeError(f"{cls}: parameters must share one dtype, got {sorted(map(str, dtypes))!r}.")
        if len(devices) > 1:
            raise ValueError(f"{cls}: parameters must share one device, got {sorted(map(str, devices))!r}.")
        D = sum(p.numel() for p in tensors)
        if self.rank >= D:
            raise ValueError(f"{cls}: rank must be < the number of parameters D={D}, got {self.rank!r}.")
        dtype, device = tensors[0].dtype, tensors[0].device
        self.dim = D
        rows = self._shard_rows(D)  # this rank's coordinates: all D without a process group
        self._shapes = [p.shape for p in tensors]
        self._names = [n for n, _ in named]
        if self.method == "swag":
            # exact moments in float64 (see pyro_fa.fa.moments); _mean is the mean rounded to the state's dtype
            self._moments = RunningMoments(rows, device)
            self.register_buffer("_mean", torch.zeros(rows, dtype=dtype, device=device))
            self.register_buffer("_dev", torch.zeros(self.rank, rows, dtype=dtype, device=device))
        else:
            self.fa = OnlineFactorAnalysis(D, self.rank, self.method, self._warmup, dtype=dtype, device=device,
                                           process_group=self._sharding, **self._fa_kwargs)
        if self.window > 1:
            self.register_buffer("_window_sum", torch.zeros(rows, dtype=dtype, device=device))

    @property
    def _ref(self) -> Tensor:
        return self._mean if self.method == "swag" else self.fa.loc

    # ------------------------------------------------------------------- collect
    def _named(self) -> List[Tuple[str, Tensor]]:
        named = self._source.resolve(type(self).__name__)
        if self.dim is None:
            self._setup(named)
        return named

    def _vector(self) -> Tensor:
        cls = type(self).__name__
        named = self._named()
        shapes = [p.shape for _, p in named]
        if shapes != self._shapes:
            raise ValueError(
                f"{cls}: parameter shapes must stay {[tuple(s) for s in self._shapes]!r} between collections, "
                f"got {[tuple(s) for s in shapes]!r}; nothing was collected. Build a new SWAG for the new model."
            )
        ref = self._ref
        for name, p in named:
            if p.dtype != ref.dtype or p.device != ref.device:
                raise ValueError(
                    f"{cls}: parameters must be on {ref.device} with dtype {ref.dtype} like the posterior, got "
                    f"{name!r} on {p.device} with dtype {p.dtype}. Call swag.to(...) after moving the model."
                )
        flat = getattr(self, "_flat", None)
        if flat is None or flat.dtype != ref.dtype or flat.device != ref.device:
            flat = self._flat = torch.empty_like(ref)
        lo, hi = (0, self.dim) if self._sharding is None else (self._sharding.lo, self._sharding.hi)
        return flatten_slice([p for _, p in named], lo, hi, flat)  # this rank's coordinates

    @torch.no_grad()
    def collect(self) -> bool:
        """Collect the current parameter vector now (whatever the step schedule).

        Returns
        -------
        bool
            Whether a vector reached the fit (``False`` while a window fills, or
            when a non-finite vector was skipped).

        Raises
        ------
        ValueError
            If the parameter shapes changed, the parameters moved to another
            device or dtype, or the vector holds NaN / inf (with
            ``on_nonfinite="raise"``); the state is unchanged.
        """
        theta = self._vector()
        reason, diverged = self._refusal(theta)
        if diverged and self._relocated():
            warnings.warn(
                f"{type(self).__name__}: the last {len(self._streak)} vectors lay beyond max_deviation="
                f"{self.max_deviation:g} times the collected spread without moving further away (a run that "
                "changed regime, e.g. a new learning rate or collect_every, not one that diverged): collecting "
                "again.", RuntimeWarning, stacklevel=3)
            reason, diverged = None, False
        if reason is None:
            self._streak.clear()
        if diverged:
            # the divergence guard is a heuristic: it skips with a warning and never stops training
            # (a diverged run soon gives non-finite vectors, which on_nonfinite="raise" raises on)
            self._n_refused += 1
            warnings.warn(f"{type(self).__name__}: {reason} It was not collected and the posterior is unchanged "
                          f"({self._n} vectors collected).", RuntimeWarning, stacklevel=3)
            return False
        if reason is None and self.window > 1:
            if self._n_window + 1 < self.window:
                self._window_sum.add_(theta)
                self._n_window += 1
                return False
            theta = (self._window_sum + theta) / self.window
        if reason is None:
            try:
                self._update(theta)
            except ValueError as err:  # the online fit refused an update that would overflow its dtype
                reason = str(err).split(": ", 1)[-1]
        if reason is not None:
            self._n_refused += 1
            msg = (f"{type(self).__name__}: {reason} It was not collected and the posterior is unchanged "
                   f"({self._n} vectors collected).")
            if self.on_nonfinite == "skip":
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                return False
            raise ValueError(msg + " Pass on_nonfinite='skip' to skip such vectors with a warning.")
        if self.window > 1:
            self._window_sum.zero_()
            self._n_window = 0
        return True

    def _relocated(self) -> bool:
        # the guard's escape: _GUARD_PATIENCE refusals in a row whose distances stopped growing
        # (at most x2 over the last half: a diverging run grows geometrically and goes on growing)
        if len(self._streak) < _GUARD_PATIENCE:
            return False
        last = self._streak[-(_GUARD_PATIENCE // 2):]
        return max(last) <= 2.0 * min(last)

    def _refusal(self, theta: Tensor) -> Tuple[Optional[str], bool]:
        """Why ``theta`` must not be collected, or None; and whether the reason is the divergence guard."""
        guard = self.max_deviation is not None and self._n >= _GUARD_AFTER
        if self._sharding is not None:
            dist2, spread2, bad = self._sharded_distance(theta, guard)  # summed over the ranks
            count_bad = lambda: bad  # noqa: E731
        else:
            dist2 = spread2 = 0.0
            if guard:
                # the distance in the state's dtype (the mean rounded once is close enough for a guard);
                # a non-finite distance sends us to the finiteness check below
                dist2 = float(torch.linalg.vector_norm(theta - self.loc)) ** 2
                moments = self._moments if self.method == "swag" else self.fa._moments
                spread2 = float(moments.sq_dev.sum()) / self._n
            count_bad = lambda: int((~torch.isfinite(theta)).sum())  # noqa: E731
        # no spread yet (identical vectors, e.g. after a schedule that ended at rate 0): no judgement
        if guard and math.isfinite(dist2) and (spread2 == 0.0 or dist2 <= self.max_deviation ** 2 * spread2):
            return None, False
        bad = count_bad()
        if bad:
            self._streak.clear()
            return f"the parameter vector must be finite, got NaN or inf in {bad} entries.", False
        if not guard:
            return None, False
        self._streak.append(math.sqrt(dist2))
        return (f"the parameter vector must lie within max_deviation={self.max_deviation:g} times the collected "
                f"spread of the running mean, got a distance of {math.sqrt(dist2):.3g} against a spread of "
                f"{math.sqrt(spread2):.3g} (the run looks diverged; if it only changed regime, pass a larger "
                "max_deviation, or None)."), True

    def _update(self, theta: Tensor) -> None:
        if self.method != "swag":
            self.fa.update(theta)
            self._n = self.fa.n_updates
            return
        if self._sharding is not None:
            return self._sharded_classic_update(theta)
        # running mean / squared deviations, then the deviation from the new mean (Maddox et al. Alg. 1),
        # formed in float64 and rounded once
        moments = self._moments
        t, tmax = moments.deviation(theta)  # in place, no temporaries: O(D) per collection
        tmax = tmax if self._n else 0.0
        if not tmax * tmax <= torch.finfo(self._dev.dtype).max / 8:
            raise ValueError(f"{type(self).__name__}: the parameter vector must keep the running variances within "
                             f"{self._dev.dtype}, got one at {tmax:.3g} from the mean whose update would overflow them.")
        n_old, n = self._n, self._n + 1
        moments.add_deviation(t, n_old)
        torch.mul(t, n_old / n, out=self._dev[n_old % self.rank])  # theta - mean_new, rounded once
        self._mean.copy_(moments.mean)
        self._n = n

    def step(self) -> bool:
        """Count one optimizer step and collect if the schedule says so.

        Step :math:`t` (counted from one) is collected when ``t > start_after`` and
        ``(t - start_after) % collect_every == 0``. This is what the hook of
        :meth:`attach` calls; Pyro users call it after each ``svi.step``.

        Returns
        -------
        bool
            Whether a vector reached the fit.
        """
        self._n_steps += 1
        t = self._n_steps - self.start_after
        if t > 0 and t % self.collect_every == 0:
            return self.collect()
        return False

    def attach(self, optimizer: torch.optim.Optimizer):
        """Collect after the steps of ``optimizer`` (per ``start_after`` / ``collect_every``).

        Parameters
        ----------
        optimizer : torch.optim.Optimizer

        Returns
        -------
        torch.utils.hooks.RemovableHandle
            ``handle.remove()`` detaches.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "With pyro.optim, call swag.step() after each svi.step(...)."
            )
        attached = self.__dict__.setdefault("_attached", {})
        live = attached.get(id(optimizer))
        if live is not None and live[1].id in getattr(optimizer, "_optimizer_step_post_hooks", {}):
            raise ValueError(
                f"{type(self).__name__}: optimizer must not be attached twice (every step would be collected twice), "
                "got one that is attached already. Call handle.remove() on the first handle to attach again."
            )
        handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())
        # the optimizer is held weakly: optimizer -> hook -> SWAG -> optimizer would be a reference cycle,
        # freed only by the garbage collector (under DDP possibly at exit, after the process group is gone)
        attached[id(optimizer)] = (weakref.ref(optimizer), handle)
        return handle

    # ---------------------------------------------------------------- posterior
    @property
    def n_collected(self) -> int:
        return self._n

    @property
    def n_steps(self) -> int:
        return self._n_steps

    @property
    def n_refused(self) -> int:
        """Vectors not collected: non-finite, overflowing, or from a diverged run (see ``max_deviation``)."""
        return self._n_refused

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
        if self.method == "em" and self.rank < self._n <= self.warmup:
            # a shorter run than the warm-up planned for (e.g. one collection per epoch): end it here
            warnings.warn(
                f"{cls}: {self._n} vectors collected, not more than warmup={self.warmup}: the warm-up ends here and "
                f"the factor is fitted to them (pass warmup < {self._n} to choose this).",
                UserWarning,
                stacklevel=3,
            )
            self.fa.finish_warmup()
        if self.method != "swag" and self._n <= self.warmup:
            raise RuntimeError(
                f"{cls}: {what} needs more than warmup={self.warmup} collected vectors for method="
                f"{self.method!r}, got {self._n}"
                + (f" (more than rank={self.rank} to end the warm-up early)" if self.method == "em" else "")
                + ". Collect more, or pass a smaller warmup."
            )

    @property
    def loc(self) -> Tensor:
        """The mean :math:`c` (the SWA solution), shape (D,)."""
        return self._ref

    @property
    def cov_factor(self) -> Tensor:
        r""":math:`F`, shape (D, K) (for ``"swag"``: :math:`\hat D/\sqrt{2(K'-1)}`, zero-padded columns)."""
        if self.method != "swag":
            return self.fa.cov_factor
        k = min(self._n, self.rank)
        return self._dev.T / math.sqrt(2 * max(k - 1, 1))

    @property
    def cov_diag(self) -> Tensor:
        r""":math:`\psi`, shape (D,) (for ``"swag"``: half the running variances, floored)."""
        if self.method != "swag":
            return self.fa.cov_diag
        var = self._moments.variance(self._n).to(self._mean.dtype)
        floor = self.min_variance * self._mean_variance(var).clamp_min(torch.finfo(var.dtype).tiny)
        return 0.5 * var.clamp_min(floor)

    def distribution(self) -> LowRankMultivariateNormal:
        r"""The posterior :math:`N(c, s(FF^\top + \Psi))` over the flattened parameters, :math:`s` = :attr:`scale`."""
        self._check_ready("distribution()")
        if self._sharding is not None:  # this rank's rows; log_prob, entropy and sample are collective
            s = self._scale
            return ShardedLowRankNormal(self.loc, self.cov_factor * math.sqrt(s), self.cov_diag * s, self._sharding)
        # the capacitance in float64: torch's float32 one fails when psi is tiny against F (large D)
        if self._scale == 1.0:
            return StableLowRankMultivariateNormal(self.loc, self.cov_factor, self.cov_diag)
        return StableLowRankMultivariateNormal(self.loc, self.cov_factor * math.sqrt(self._scale),
                                               self.cov_diag * self._scale)

    @property
    def scale(self) -> float:
        r"""The posterior scale :math:`s`: samples are :math:`c + \sqrt{s}\,(Fh + \Psi^{1/2}\varepsilon)`.

        The fitted :math:`F, \psi` describe the spread of the optimizer's iterates, which is
        set by its learning rate and batch size, not by the posterior (Mandt, Hoffman & Blei
        2017); Maddox et al. (2019) sample with a scale chosen on validation data.
        :meth:`tune_scale` chooses it by the validation log-likelihood; :meth:`distribution`
        and every sampling method use it. Default 1 (the iterates' own spread).
        """
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{type(self).__name__}: scale must be a positive finite number, got {value!r}.")
        self._scale = float(value)

    def tune_scale(self, inputs, targets, likelihood="categorical", *, scales=None, num_samples: int = 30,
                   noise_std=None, seed: int = 0):
        """Choose :attr:`scale` by the validation log-likelihood of the Bayesian model average.

        See :func:`pyro_fa.predictive.tune_scale` (this calls it with ``self``); the chosen
        scale is set on the posterior.

        Returns
        -------
        ScaleSearch
        """
        return tune_scale(self, inputs, targets, likelihood, scales=scales, num_samples=num_samples,
                          noise_std=noise_std, seed=seed)

    @torch.no_grad()
    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        # unscaled draws F h + psi^(1/2) eps of shape (S, D)
        S = num_samples
        h, eps = self._draw_noise(S, generator)  # sharded: h shared by the ranks, eps (S, D_r) this rank's
        if self.method == "swag":
            k = min(self._n, self.rank)
            low = (h @ self._dev).mul_(1.0 / math.sqrt(2 * max(k - 1, 1)))
        else:
            low = h @ self.fa.cov_factor.T
        return eps.mul_(self.cov_diag.sqrt()).add_(low)

    @torch.no_grad()
    def sample_parameters(self, num_samples: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draw flattened parameter vectors :math:`c + \sqrt{s}(Fh + \Psi^{1/2}\varepsilon)`, never forming a D×D matrix.

        :math:`s` is :attr:`scale`.

        Parameters
        ----------
        num_samples : int, optional
            ``None``: one vector of shape (D,); else shape (num_samples, D).
        generator : torch.Generator, optional
            On the posterior's device.
        """
        if num_samples is not None:
            _positive_int(type(self).__name__, "num_samples", num_samples)
        self._check_ready("sample_parameters()")
        S = 1 if num_samples is None else num_samples
        out = self._deviations(S, generator)
        if self._scale != 1.0:
            out.mul_(math.sqrt(self._scale))
        out.add_(self.loc)
        out = self._gather_full(out)  # sharded: whole vectors from every rank's rows
        return out[0] if num_samples is None else out

    def _split(self, theta: Tensor) -> List[Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            out.append(theta[..., offset:offset + n].reshape(theta.shape[:-1] + shape))
            offset += n
        return out

    @contextlib.contextmanager
    def sampled_weights(self, theta: Optional[Tensor] = None, loader=None, generator: Optional[torch.Generator] = None):
        """Load sampled weights into the model for the ``with`` block, then restore the originals.

        Parameters
        ----------
        theta : Tensor of shape (D,), optional
            The weights to load; default one draw of :meth:`sample_parameters`.
        loader : iterable, optional
            Training batches: batch-norm statistics are recomputed for the
            sampled weights by ``torch.optim.swa_utils.update_bn`` (module only).
        generator : torch.Generator, optional

        Yields
        ------
        Tensor of shape (D,)
            The loaded vector. Parameters and buffers are restored on exit, also
            after an exception.
        """
        cls = type(self).__name__
        theta = self._full_theta(theta)  # sharded: this rank's rows (e.g. swag.loc) are gathered
        if theta is None:
            theta = self.sample_parameters(generator=generator)
        elif not torch.is_tensor(theta) or theta.shape != (self.dim,):
            raise ValueError(f"{cls}: theta must be a tensor of shape ({self.dim},), got {theta!r}.")
        module = self._source.module
        if loader is not None and module is None:
            raise ValueError(f"{cls}: loader needs a SWAG built from an nn.Module, got parameters only.")
        tensors = [p for _, p in self._named()]
        with torch.no_grad():
            saved = [p.detach().clone() for p in tensors]
            buffers = {k: b.clone() for k, b in module.named_buffers()} if loader is not None else {}
        try:
            with torch.no_grad():
                for p, v in zip(tensors, self._split(theta)):
                    p.copy_(v)
            if loader is not None:
                from torch.optim.swa_utils import update_bn

                update_bn(loader, module)
            yield theta
        finally:
            with torch.no_grad():
                for p, v in zip(tensors, saved):
                    p.copy_(v)
                if buffers:
                    current = dict(module.named_buffers())
                    for k, v in buffers.items():
                        current[k].copy_(v)

    def predictive(self, loader=None) -> SampledPredictive:
        r"""This posterior's predictive by sampled networks: draws of :meth:`sample_parameters` run in the module.

        Parameters
        ----------
        loader : iterable, optional
            Batch-norm refresh per draw (see :meth:`sampled_weights`).

        Returns
        -------
        SampledPredictive
            With ``loc`` :math:`c` and unscaled ``deviations`` :math:`Fh + \Psi^{1/2}\varepsilon`, for
            :func:`~pyro_fa.predictive.tune_scale`; ``module`` is ``None`` for a posterior over
            parameters only.

        Raises
        ------
        RuntimeError
            If nothing has been collected yet.
        """
        if self._n == 0:
            self._check_ready("predictive()")
        module = self._source.module

        @contextlib.contextmanager
        def network(theta):
            with self.sampled_weights(theta, loader=loader):
                yield module

        return SampledPredictive(lambda S, generator: self.sample_parameters(S, generator=generator), network,
                                 module=module, loc=self.loc, deviations=self._scale_search_deviations)

    def _scale_search_deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        self._check_ready("tune_scale()")
        return self._deviations(num_samples, generator)

    @torch.no_grad()
    def predict(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None, loader=None,
                generator: Optional[torch.Generator] = None, **kwargs) -> Tensor:
        """Bayesian model average: the mean of ``fn(module(*args))`` over sampled weights.

        Parameters
        ----------
        *args, **kwargs
            The module's inputs (e.g. ``x`` of shape (N, ...)).
        num_samples : int, default 30
        fn : callable, optional
            Applied to each output before averaging, e.g. ``lambda z: z.softmax(-1)``
            to average predictive probabilities; default the identity.
        loader : iterable, optional
            Batch-norm refresh per sample (see :meth:`sampled_weights`).
        """
        cls = type(self).__name__
        _positive_int(cls, "num_samples", num_samples)
        module = self._source.module
        if module is None:
            raise RuntimeError(f"{cls}: predict() needs a SWAG built from an nn.Module; use to_guide() with "
                               "pyro.infer.Predictive for Pyro models.")
        thetas = self.sample_parameters(num_samples, generator=generator)
        return self.predictive(loader).average(thetas, *args, fn=fn, **kwargs)

    @torch.no_grad()
    def predictive_samples(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None,
                           generator: Optional[torch.Generator] = None, **kwargs) -> Tensor:
        """The module's outputs under ``num_samples`` sampled weights, stacked: shape (S, ...).

        ``fn`` is applied to each output (e.g. ``lambda z: z.softmax(-1)``); the
        result is what :mod:`pyro_fa.metrics` takes as predictive samples.
        """
        cls = type(self).__name__
        _positive_int(cls, "num_samples", num_samples)
        if self._source.module is None:
            raise RuntimeError(f"{cls}: predictive_samples() needs a SWAG built from an nn.Module; use to_guide() "
                               "with pyro.infer.Predictive for Pyro models.")
        thetas = self.sample_parameters(num_samples, generator=generator)
        return self.predictive().outputs(thetas, *args, fn=fn, **kwargs)

    def predict_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                      **kwargs) -> Tensor:
        """Class probabilities of the Bayesian model average for a module that returns logits (..., C)."""
        return self.predict(*args, num_samples=num_samples, fn=lambda z: z.softmax(-1), generator=generator,
                            **kwargs)

    def predict_log_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                          **kwargs) -> Tensor:
        r"""Log class probabilities of the Bayesian model average for a module that returns logits (..., C).

        .. math::

            \log \frac1S \sum_{s=1}^S \mathrm{softmax}(z_s) = \mathrm{logsumexp}_s\,
            \mathrm{log\_softmax}(z_s) - \log S,

        computed in that form, so that a class every draw gives a probability below the
        dtype's smallest number keeps a finite log-probability (``predict_proba(...).log()``
        would give ``-inf``).

        Returns
        -------
        Tensor of shape (..., C)
        """
        logp = self.predictive_samples(*args, num_samples=num_samples, fn=lambda z: z.log_softmax(-1),
                                       generator=generator, **kwargs)
        return log_mean_exp(logp)

    def log_likelihood(self, inputs, targets, likelihood="categorical", *, num_samples: int = 30,
                       noise_std=None, seed: int = 0) -> float:
        """Test log-likelihood per point of the Bayesian model average at the current :attr:`scale`.

        ``likelihood`` is ``"categorical"`` (logits), ``"gaussian"`` (means, with
        ``noise_std``) or a callable, as in :meth:`tune_scale`.
        """
        return bma_log_likelihood(self, inputs, targets, likelihood, num_samples=num_samples,
                                  noise_std=noise_std, seed=seed)

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

    # ------------------------------------------------------------------ state
    def get_extra_state(self):
        state = {"n_steps": self._n_steps, "n": self._n, "n_window": self._n_window, "n_refused": self._n_refused,
                 "scale": self._scale, "shapes": [tuple(s) for s in self._shapes] if self._shapes is not None else None}
        if self._sharding is not None:
            state["shard"] = self._sharding.descriptor()
        return state

    def _check_extra_state(self, state) -> None:
        cls = type(self).__name__
        if not isinstance(state, dict) or not {"n_steps", "n", "n_window", "shapes"} <= set(state):
            raise ValueError(f"{cls}: the saved state's extra state must be a dict with 'n_steps', 'n', 'n_window' "
                             f"and 'shapes', got {state!r:.200}; nothing was loaded.")
        for key in ("n_steps", "n", "n_window", "n_refused"):
            check_count(cls, state, key, 0)
        shapes = [torch.Size(s) for s in state["shapes"]] if state["shapes"] is not None else None
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(
                f"{cls}: state_dict must come from parameters of shapes "
                f"{[tuple(s) for s in self._shapes]!r}, got {state['shapes']!r}; nothing was loaded."
            )
        scale = state.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{cls}: the saved state's 'scale' must be a positive finite number, got {scale!r}; "
                             "nothing was loaded.")
        if state["n_window"] >= self.window:
            raise ValueError(f"{cls}: the saved state's 'n_window' must be < window={self.window}, got "
                             f"{state['n_window']!r}; nothing was loaded.")
        self._check_shard_state(state)

    def set_extra_state(self, state):
        self._check_extra_state(state)
        self._n_steps, self._n, self._n_window = int(state["n_steps"]), int(state["n"]), int(state["n_window"])
        self._n_refused = int(state.get("n_refused", 0))
        self._scale = float(state.get("scale", 1.0))

    def _check_state(self, state_dict, strict: bool, prefix: str = ""):
        """Check a whole saved state (keys relative to this module, its fit's included) before any is written.

        Collective when sharded (every rank must call it). Returns the sharded running total of
        squared deviations (else None) and the submodules to mark as checked, ``[(module, mark)]``,
        once the whole load is.
        """
        if self.dim is None:  # param-store source not yet resolved: resolve now to build the buffers
            self._named()
        total = self._check_loadable(state_dict, strict)  # keys, shapes, finiteness, extra and optimizer states
        error = None
        try:
            self._check_state_values(state_dict, prefix)
        except ValueError as exc:
            error = exc
        if self._sharding is not None:
            from pyro_fa.fa._sharding import agree

            agree(self._sharding.group, type(self).__name__, {}, error=error)  # a refusal stops every rank
        elif error is not None:
            raise error
        return total, ([] if self.method == "swag" else [(self.fa, (total,))])

    def _check_state_values(self, state_dict, prefix: str) -> None:
        cls = type(self).__name__
        if self.method == "swag":
            v = state_dict.get("_moments.sq_dev")
            if torch.is_tensor(v) and not bool((v >= 0).all()):
                raise ValueError(f"{cls}: state_dict[{prefix + '_moments.sq_dev'!r}] must be >= 0 (running squared "
                                 f"deviations), got {int((v < 0).sum())} negative entries; nothing was loaded.")
            return
        self.fa._check_values({k[3:]: v for k, v in state_dict.items() if k.startswith("fa.")}, prefix + "fa.", cls)
        mine, fit = state_dict.get("_extra_state"), state_dict.get("fa._extra_state")
        if isinstance(mine, dict) and isinstance(fit, dict) and mine.get("n") != fit.get("n_updates"):
            raise ValueError(f"{cls}: the saved state's count of collected vectors must agree with its fit's, got "
                             f"n={mine.get('n')!r} against the fit's n_updates={fit.get('n_updates')!r}; nothing "
                             "was loaded.")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # runs for a direct load_state_dict and for a parent module's (MultiSWAG, a user's model) alike: the
        # whole state of this posterior, its fit's included, is checked before any of it is written
        checked = self.__dict__.pop("_load_checked", None)
        hint = self.__dict__.get("_load_strict")
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        total = None
        if checked is not None:  # checked whole by a parent (MultiSWAG) with its other members
            total = checked[0]
        elif mine or hint is not None:
            try:
                total, marks = self._check_state(mine, True if hint is None else hint, prefix)
            except (TypeError, ValueError) as exc:
                if not prefix:
                    raise
                raise type(exc)(f"{exc} (the entries under {prefix!r})") from exc
            for module, mark in marks:
                module.__dict__["_load_checked"] = mark
        elif self.method != "swag":  # a parent's non-strict load without our entries: nothing to load
            self.fa.__dict__.pop("_load_checked", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._loaded_total(total)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict`, checked whole first: on error nothing is loaded.

        The same checks run when a parent module (:class:`~pyro_fa.MultiSWAG`, a model
        holding this posterior) loads its state.

        Raises
        ------
        ValueError, TypeError
            If an entry is missing or unexpected (``strict``), has another shape
            (other parameters, ``rank`` or ``window``), holds NaN / inf, a noise
            variance :math:`\\psi \\le 0` or a capacitance that is not positive definite,
            or the extra or optimizer state does not fit; the posterior is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{type(self).__name__}: state_dict must be a mapping from names to tensors, got "
                            f"{type(state_dict).__name__}.")
        self.__dict__.pop("_load_checked", None)  # a mark left by a parent's load that stopped midway
        self.__dict__["_load_strict"] = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_load_strict", None)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._flat = None
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, method={self.method!r}, start_after={self.start_after}, "
                f"collect_every={self.collect_every}, window={self.window}")
