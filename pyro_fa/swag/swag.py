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
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.fa._sharded_normal import ShardedLowRankNormal
from pyro_fa.fa.normal import StableLowRankMultivariateNormal
from pyro_fa.predictive import (SampledPredictive, bma_log_likelihood, check_pred_type, linearized_moments,
                                 linearized_network, log_mean_exp, probit_proba, tune_scale)
from pyro_fa.swag._classic import ClassicFit
from pyro_fa.swag._collect import IterateCollector
from pyro_fa.swag._fits import IterateFit, OnlineFit
from pyro_fa.swag._params import ParamSource as _ParamSource, positive_int as _positive_int
from pyro_fa.swag._sharded import ShardedSWAG
from pyro_fa.swag._state import SWAGState
from pyro_fa.swag.guide import FactorPosteriorGuide

__all__ = ["SWAG"]

_FITS: Dict[str, Type[IterateFit]] = {  # by method
    "em": OnlineFit, "sga": OnlineFit, "sketch": OnlineFit, "swag": ClassicFit}
_METHODS = tuple(_FITS)
_ON_NONFINITE = ("raise", "skip")


class SWAG(IterateCollector, SWAGState, ShardedSWAG, nn.Module):
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
        streams; prefer it (measured in the project's SWAG-stream benchmark).
        Measured limits (the project's SGA-stream benchmark, covariance error as a
        multiple of batch FA's): 38-514 on the MLP and yacht streams at the default
        ``lr=1e-3``, 26-2873 at 1e-2 and more at larger rates (a diagonal alone:
        39-623), 1.9-3.1 on the linear model;
        no gradient variant tried (a natural-gradient step per vector, Adam on the
        likelihood of the running moments, an online-EM warm start) reached the
        bar of 1.5: a step of size :math:`\gamma_t \propto 1/t` in the parameters
        performs about :math:`\sum_t\gamma_t \approx \log T` EM iterations'
        worth of progress, where online EM's statistics take a full step per vector.

    Parameters
    ----------
    module_or_params : torch.nn.Module or iterable of Tensors
        The weights to follow: a module's parameters that require grad, in
        ``named_parameters()`` order, or leaf tensors. All must share one dtype
        and device; the posterior's state lives there. See
        :meth:`from_param_store` for Pyro's param store.
    rank : int, default 20
        :math:`K`, ``1 <= rank < D``. For ``"swag"``: the number of deviations kept.
    method : {"em", "sga", "sketch", "swag"}, default "em"
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
        Passed to :class:`~pyro_fa.OnlineFactorAnalysis` (``lr``: SGA learning rate).
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
        self._fit = _FITS[method](method)  # the method is dispatched here, once
        self._fit.check(cls, rank=self.rank, warmup=self._warmup)
        self.method = method
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

    def distribution(self) -> LowRankMultivariateNormal:
        r"""The posterior :math:`N(c, s(FF^\top + \Psi))` over the flattened parameters, :math:`s` = :attr:`scale`."""
        self._check_ready("distribution()")
        if self._scale == 0.0:
            raise RuntimeError(f"{type(self).__name__}: distribution() at scale 0 is a point mass at loc, which "
                               "LowRankMultivariateNormal cannot represent; use loc (sample_parameters returns it "
                               "at scale 0) or set scale > 0.")
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
        and every sampling method use it. Default 1 (the iterates' own spread). Scale 0 is
        the mean (SWA): samples are :math:`c`, and :meth:`distribution` raises (a point mass).
        """
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{type(self).__name__}: scale must be a finite number >= 0, got {value!r}.")
        self._scale = float(value)

    def tune_scale(self, inputs, targets, likelihood="categorical", *, scales=None, num_samples: int = 30,
                   noise_std=None, seed: int = 0, rule: str = "one_se", fraction: float = 0.7, num_se: float = 1.5,
                   widen: int = 3,
                   pred_type: str = "nn"):
        """Choose :attr:`scale` on validation data, never worse there than the mean (scale 0).

        See :func:`pyro_fa.predictive.tune_scale` (this calls it with ``self``) for the candidates
        (scale 0, the mean, among them) and the ``rule``; the chosen scale is set on the posterior.

        Returns
        -------
        ScaleSearch
        """
        return tune_scale(self, inputs, targets, likelihood, scales=scales, num_samples=num_samples,
                          noise_std=noise_std, seed=seed, rule=rule, fraction=fraction, num_se=num_se, widen=widen,
                          pred_type=pred_type)

    @torch.no_grad()
    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        # unscaled draws F h + psi^(1/2) eps of shape (S, D)
        S = num_samples
        h, eps = self._draw_noise(S, generator)  # sharded: h shared by the ranks, eps (S, D_r) this rank's
        return eps.mul_(self.cov_diag.sqrt()).add_(self._fit.low_rank(self, h))

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

    def predictive(self, loader=None, pred_type: str = "nn") -> SampledPredictive:
        r"""This posterior's predictive: draws of :meth:`sample_parameters` run in the module, or in its linearisation.

        Parameters
        ----------
        loader : iterable, optional
            Batch-norm refresh per draw (see :meth:`sampled_weights`); for ``"glm"`` the statistics
            are those of the mean :math:`c`, where the network is linearised.
        pred_type : {"nn", "glm"}, default "nn"
            ``"nn"``: the network at each draw :math:`\theta`. ``"glm"``: the network linearised at
            the mean, :math:`f(x; c) + J_x(\theta - c)` (Immer, Korzepa & Bauer 2021, §3), one
            forward-mode product per draw (:func:`~pyro_fa.predictive.linearized_network`).

        Returns
        -------
        SampledPredictive
            With ``loc`` :math:`c` and unscaled ``deviations`` :math:`Fh + \Psi^{1/2}\varepsilon`, for
            :func:`~pyro_fa.predictive.tune_scale`; ``module`` is ``None`` for a posterior over
            parameters only.

        Raises
        ------
        RuntimeError
            If nothing has been collected yet, or ``"glm"`` for a posterior over parameters only.
        ValueError
            An unknown ``pred_type``.
        """
        check_pred_type(type(self).__name__, pred_type)
        if self._n == 0:
            self._check_ready("predictive()")
        module = self._source.module
        if pred_type == "glm":
            return self._glm_predictive(module, loader)

        @contextlib.contextmanager
        def network(theta):
            with self.sampled_weights(theta, loader=loader):
                yield module

        return SampledPredictive(lambda S, generator: self.sample_parameters(S, generator=generator), network,
                                 module=module, loc=self.loc, deviations=self._scale_search_deviations)

    def _glm_params(self, what: str):
        """The module and its collected parameters, for linearising (a posterior built from an nn.Module)."""
        module = self._source.module
        if module is None:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a SWAG built from an nn.Module (the network "
                               "is linearised in its weights), got parameters only. Use pred_type='nn'.")
        return module, [p for _, p in self._named()]

    def _glm_predictive(self, module, loader) -> SampledPredictive:
        module, params = self._glm_params("pred_type='glm'")
        loc = self._full_theta(self.loc)  # sharded: the whole mean, as every draw is whole

        @contextlib.contextmanager
        def network(theta):
            if loader is None:
                yield linearized_network(module, loc, theta, params)
            else:  # batch-norm statistics of the mean, the linearisation point
                with self.sampled_weights(loc, loader=loader):
                    yield linearized_network(module, loc, theta, params)

        return SampledPredictive(lambda S, generator: self.sample_parameters(S, generator=generator), network,
                                 module=module, loc=self.loc, deviations=self._scale_search_deviations)

    def linearized_moments(self, *args, chunk_size: Optional[int] = None,
                           diagonal: bool = False) -> Tuple[Tensor, Tensor]:
        r"""Mean and covariance of the linearised network's outputs, :math:`f(x; c)` and :math:`s\,J_x(FF^\top + \Psi)J_x^\top`.

        See :func:`pyro_fa.predictive.linearized_moments` (called with :attr:`loc`, :attr:`cov_factor`,
        :attr:`cov_diag` and :attr:`scale`).

        Parameters
        ----------
        *args
            The module's inputs, each of shape (N, ...).
        chunk_size : int, optional
            Examples per chunk of per-example Jacobians.
        diagonal : bool, default False
            Only the variances (the contraction :math:`C` times cheaper; the Jacobians cost the same).

        Returns
        -------
        mean : Tensor of shape (N, C)
        cov : Tensor of shape (N, C, C), or (N, C) with ``diagonal=True``

        Raises
        ------
        RuntimeError
            Nothing collected, a posterior over parameters only, or one sharded over a process group.
        """
        cls = type(self).__name__
        self._check_ready("linearized_moments()")
        module, params = self._glm_params("linearized_moments()")
        if self._sharding is not None:
            raise RuntimeError(f"{cls}: linearized_moments() needs the whole factor, got a SWAG sharded as "
                               f"{self.sharding!r}; use pred_type='glm' with link_approx='mc' (sampled, collective).")
        return linearized_moments(module, self.loc, args, cov_diag=self.cov_diag, cov_factor=self.cov_factor,
                                  scale=self._scale, chunk_size=chunk_size, params=params, diagonal=diagonal)

    def _scale_search_deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        self._check_ready("tune_scale()")
        return self._deviations(num_samples, generator)

    @torch.no_grad()
    def predict(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None, loader=None,
                generator: Optional[torch.Generator] = None, pred_type: str = "nn", noise_std=None,
                chunk_size: Optional[int] = None, **kwargs):
        r"""Bayesian model average: the mean of ``fn(module(*args))`` over sampled weights; or the GLM's mean and variance.

        Parameters
        ----------
        *args, **kwargs
            The module's inputs (e.g. ``x`` of shape (N, ...)).
        num_samples : int, default 30
            Draws (``pred_type="nn"``).
        fn : callable, optional
            Applied to each output before averaging, e.g. ``lambda z: z.softmax(-1)``
            to average predictive probabilities; default the identity (``"nn"`` only).
        loader : iterable, optional
            Batch-norm refresh per sample (see :meth:`sampled_weights`; ``"nn"`` only).
        generator : torch.Generator, optional
        pred_type : {"nn", "glm"}, default "nn"
            ``"glm"``: the linearised network's Gaussian outputs in closed form (regression),
            :math:`f(x; c)` and :math:`\mathrm{diag}(s\,J_x\Sigma J_x^\top) + \sigma^2`
            (:meth:`linearized_moments`).
        noise_std : float or Tensor, optional
            ``"glm"``: the observation noise :math:`\sigma` added to the variance; default none (the
            variance of the mean function).
        chunk_size : int, optional
            ``"glm"``: examples per chunk of per-example Jacobians.

        Returns
        -------
        Tensor
            ``"nn"``: the average, of the module's output shape.
        (mean, variance) : Tensors of the module's output shape (N, C) or (N,)
            ``"glm"``: per output, the marginal variances.

        Raises
        ------
        ValueError
            An unknown ``pred_type``; ``fn``, ``loader`` or module keyword inputs with ``"glm"``;
            ``noise_std`` not positive and finite.
        """
        cls = type(self).__name__
        check_pred_type(cls, pred_type)
        if pred_type == "glm":
            if fn is not None or loader is not None or kwargs:
                raise ValueError(f"{cls}: predict(pred_type='glm') gives the linearised outputs' mean and variance "
                                 "for positional inputs, so fn, loader and keyword inputs must not be given, got "
                                 f"fn={fn!r}, loader={loader!r}, keywords {sorted(kwargs)!r}. Use "
                                 "predictive(pred_type='glm').average(...) to average a function of sampled "
                                 "linearised outputs.")
            if noise_std is not None:  # refused before the Jacobians are computed
                noise = torch.as_tensor(noise_std)
                if not bool(torch.isfinite(noise).all()) or bool((noise <= 0).any()):
                    raise ValueError(f"{cls}: noise_std must be positive and finite, got {noise_std!r}.")
            mean, var = self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True)
            return _glm_mean_variance(self._source.module, args, mean, var, noise_std)
        _positive_int(cls, "num_samples", num_samples)
        module = self._source.module
        if module is None:
            raise RuntimeError(f"{cls}: predict() needs a SWAG built from an nn.Module; use to_guide() with "
                               "pyro.infer.Predictive for Pyro models.")
        thetas = self.sample_parameters(num_samples, generator=generator)
        return self.predictive(loader).average(thetas, *args, fn=fn, **kwargs)

    @torch.no_grad()
    def predictive_samples(self, *args, num_samples: int = 30, fn: Optional[Callable[[Tensor], Tensor]] = None,
                           generator: Optional[torch.Generator] = None, pred_type: str = "nn", **kwargs) -> Tensor:
        """The module's (``pred_type="glm"``: the linearised module's) outputs under ``num_samples`` sampled weights, stacked: shape (S, ...).

        ``fn`` is applied to each output (e.g. ``lambda z: z.softmax(-1)``); the
        result is what :mod:`pyro_fa.metrics` takes as predictive samples.
        """
        cls = type(self).__name__
        check_pred_type(cls, pred_type)
        _positive_int(cls, "num_samples", num_samples)
        if self._source.module is None:
            raise RuntimeError(f"{cls}: predictive_samples() needs a SWAG built from an nn.Module; use to_guide() "
                               "with pyro.infer.Predictive for Pyro models.")
        thetas = self.sample_parameters(num_samples, generator=generator)
        return self.predictive(pred_type=pred_type).outputs(thetas, *args, fn=fn, **kwargs)

    def predict_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                      pred_type: str = "nn", link_approx: str = "mc", chunk_size: Optional[int] = None,
                      **kwargs) -> Tensor:
        r"""Class probabilities of the Bayesian model average for a module that returns logits (N, C).

        Parameters
        ----------
        *args, **kwargs
            The module's inputs.
        num_samples : int, default 30
            Draws (``link_approx="mc"``).
        generator : torch.Generator, optional
        pred_type : {"nn", "glm"}, default "nn"
            Sampled networks, or the network linearised at the mean (:meth:`predictive`).
        link_approx : {"mc", "probit"}, default "mc"
            ``"mc"``: the average of the softmax over draws. ``"probit"`` (``pred_type="glm"`` only):
            :func:`~pyro_fa.predictive.probit_proba` of the linearised logits' mean and covariance
            (:meth:`linearized_moments`), no sampling (Daxberger et al. 2021, §2).
        chunk_size : int, optional
            ``"probit"``: examples per chunk of per-example Jacobians.

        Returns
        -------
        Tensor of shape (N, C)

        Raises
        ------
        ValueError
            An unknown ``pred_type`` or ``link_approx``, or ``"probit"`` with ``"nn"``.
        """
        check_pred_type(type(self).__name__, pred_type, link_approx)
        if link_approx == "probit":
            if kwargs:
                raise ValueError(f"{type(self).__name__}: link_approx='probit' takes positional inputs only, got "
                                 f"keywords {sorted(kwargs)!r}.")
            return probit_proba(*self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True))
        if pred_type == "glm":
            _positive_int(type(self).__name__, "num_samples", num_samples)
            thetas = self.sample_parameters(num_samples, generator=generator)
            return self.predictive(pred_type="glm").average(thetas, *args, fn=lambda z: z.softmax(-1), **kwargs)
        return self.predict(*args, num_samples=num_samples, fn=lambda z: z.softmax(-1), generator=generator,
                            **kwargs)

    def predict_log_proba(self, *args, num_samples: int = 30, generator: Optional[torch.Generator] = None,
                          pred_type: str = "nn", link_approx: str = "mc", chunk_size: Optional[int] = None,
                          **kwargs) -> Tensor:
        r"""Log class probabilities of the Bayesian model average for a module that returns logits (..., C).

        .. math::

            \log \frac1S \sum_{s=1}^S \mathrm{softmax}(z_s) = \mathrm{logsumexp}_s\,
            \mathrm{log\_softmax}(z_s) - \log S,

        computed in that form, so that a class every draw gives a probability below the
        dtype's smallest number keeps a finite log-probability (``predict_proba(...).log()``
        would give ``-inf``). ``pred_type`` and ``link_approx`` as in :meth:`predict_proba`
        (``"probit"``: the log-softmax of the moderated logits).

        Returns
        -------
        Tensor of shape (..., C)
        """
        check_pred_type(type(self).__name__, pred_type, link_approx)
        if link_approx == "probit":
            if kwargs:  # as predict_proba: keyword inputs would be dropped
                raise ValueError(f"{type(self).__name__}: link_approx='probit' takes positional inputs only, got "
                                 f"keywords {sorted(kwargs)!r}.")
            mean, var = self.linearized_moments(*args, chunk_size=chunk_size, diagonal=True)
            return probit_proba(mean, var, log=True)
        logp = self.predictive_samples(*args, num_samples=num_samples, fn=lambda z: z.log_softmax(-1),
                                       generator=generator, pred_type=pred_type, **kwargs)
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

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._flat = None
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, method={self.method!r}, start_after={self.start_after}, "
                f"collect_every={self.collect_every}, window={self.window}")


def _glm_mean_variance(module, args, mean: Tensor, var: Tensor, noise_std):
    """The GLM's (mean, marginal variance) in the module's output shape, the noise variance (checked) added if given."""
    if noise_std is not None:
        noise = torch.as_tensor(noise_std, dtype=var.dtype, device=var.device)
        var = var + (noise.unsqueeze(-1) if noise.dim() == 1 else noise).square()  # (N,) noise: one per example
    with torch.no_grad():  # the module's own output shape: (N,) or (N, C)
        squeeze = module(*(x[:1] for x in args)).dim() == 1
    return (mean.squeeze(-1), var.squeeze(-1)) if squeeze else (mean, var)
