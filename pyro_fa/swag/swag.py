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

from pyro_fa.distributed.sharding import flatten_slice
from pyro_fa.distributed.swag import swag_rows
from pyro_fa.distributions import FactorNormal, PointMassNormal
from pyro_fa.fa.fitters import Fitter, iterate_fitters
from pyro_fa.predictive.glm import check_pred_type
from pyro_fa.predictive.registry import build_predictive
from pyro_fa.predictive.posterior import Posterior
from pyro_fa.predictive.sampled import SampledPredictive
from pyro_fa.swag import _prediction, _state
from pyro_fa.swag._classic import ClassicFit
from pyro_fa.swag._collect import IterateCollector
from pyro_fa.swag._fits import IterateFit, OnlineFit
from pyro_fa.swag._params import (ParamSource as _ParamSource, check_followed, check_params, loaded_weights,
                                  positive_int as _positive_int, split)
from pyro_fa.swag.guide import FactorPosteriorGuide
from pyro_fa._validation import check_scale

__all__ = ["SWAG"]

_CLASSIC = "swag"  # classic SWAG's deviations (ClassicFit); every other method is a registered fitter's


def _methods():
    """The methods SWAG offers: the registered fitters that support iterates, and classic SWAG."""
    return (*iterate_fitters(), _CLASSIC)


class SWAG(Posterior, nn.Module):
    r"""A Gaussian posterior over a model's weights, fitted online to optimizer iterates.

    .. math::

        q(\theta) = N(c, FF^\top + \Psi), \qquad \theta \in \mathbb{R}^D,\ F \in \mathbb{R}^{D\times K}.

    SWAG is three parts: a collector (:class:`~pyro_fa.swag.IterateCollector`: the optimizer hook, the
    schedule, the divergence guard), a fit chosen by ``method`` and the posterior's state (the fit's
    tensors and the counts), saved by ``state_dict()``. ``method="em"`` and ``"sga"`` feed each
    collected vector to an :class:`~pyro_fa.OnlineFactorAnalysis` (Brownlie 2021, Algorithms 2 and 1):
    :math:`c` is the running mean (SWA), :math:`F, \Psi` the factor-analysis fit. ``method="swag"`` is
    classic SWAG (Maddox et al. 2019, eq. 3 and Alg. 1): :math:`F = \hat D/\sqrt{2(K-1)}` from the
    last :math:`K` deviations :math:`\hat D`, :math:`\psi` half the running variances. ``method="sga"``
    with its default Adam step is far from batch factor analysis at SWAG's stream lengths (it warns);
    ``optimizer="natural"`` or ``method="em"`` is much closer (the SWAG page of the docs has the figures).

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
        iterates' scatter (:class:`~pyro_fa.fa.fitters.sketch.ScatterSketch`).
    warmup : int, optional
        EM / SGA: vectors that only update the running statistics (Brownlie 2021, §6.2.1);
        at least ``rank`` for EM. Default ``rank``, the shortest EM accepts (SWAG's recipe
        collects once per epoch for a few tens of epochs).
    lr, step_scale, init_scale, min_variance, optimizer
        Passed to :class:`~pyro_fa.OnlineFactorAnalysis` (``lr``: SGA learning rate;
        ``optimizer="natural"``: SGA's EM-preconditioned step). ``step_scale`` defaults to 1
        here (2 in ``OnlineFactorAnalysis``): the collected iterates are weighted equally, as
        SWAG's mean and diagonal are.
    start_after, collect_every, window, on_nonfinite, max_deviation
        The collector's settings (:class:`~pyro_fa.swag.IterateCollector`, where they are described):
        skip ``start_after`` optimizer steps, then collect every ``collect_every``-th; hand the fit
        the mean of ``window`` consecutive collected vectors; a non-finite vector raises or is
        skipped (``on_nonfinite``); the divergence guard skips, with a warning, a vector further
        from the running mean than ``max_deviation`` times the collected spread (``None``: off).
    collector : IterateCollector, optional
        The collector instead of the one these settings build (then leave them at their defaults):
        a subclass with another schedule (docs/architecture.md, "Add a collector").
    seed : int, optional
        Seed of the initial factor of EM / SGA.
    process_group : torch.distributed.ProcessGroup, optional
        Shard the posterior over the group's ranks (:mod:`pyro_fa.distributed`); default the
        process group of a ``DistributedDataParallel`` model, else none. Each rank collects its
        rows of :math:`\theta` (memory :math:`O(DK/W)` per rank): ``loc``, ``cov_factor``, ``cov_diag``
        are this rank's rows; :meth:`sample`, :meth:`predict` and :meth:`sampled_weights` assemble
        whole vectors. Collection and sampling are collective; the ranks must pass the same arguments.
    **fa_kwargs
        Further options of :class:`~pyro_fa.OnlineFactorAnalysis` (e.g. ``m_step_every``).

    Attributes
    ----------
    dim : int
        :math:`D`.
    loc, cov_factor, cov_diag : Tensors of shape (D,), (D, K), (D,)
    collector : IterateCollector
        When and what this posterior collects; ``start_after``, ``collect_every``, ``window``,
        ``on_nonfinite`` and ``max_deviation`` read its settings.
    n_collected : int
        Vectors handed to the fit (after window averaging).
    n_steps : int
        Optimizer steps seen by :meth:`step` (and the hook of :meth:`attach`).

    Notes
    -----
    Memory :math:`O(DK)`, time per collection :math:`O(DK^2)` for EM / SGA, :math:`O(D)` for classic SWAG;
    no :math:`D\times D` matrix is formed; the running moments are float64, so float32 weights are
    collected exactly. The collection recipe (Maddox et al. 2019, Algorithm 1: ``SWALR``, one collection
    per epoch, then :meth:`tune_scale`) is on the SWAG page of the docs and in ``swag_recipe.py``.

    References
    ----------
    W. Maddox, T. Garipov, P. Izmailov, D. Vetrov, A. G. Wilson, "A simple baseline for Bayesian uncertainty
    in deep learning", NeurIPS 2019. S. Mandt, M. Hoffman, D. Blei, "Stochastic gradient descent as approximate
    Bayesian inference", JMLR 18, 2017. S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*,
    MSc thesis, University of Edinburgh, 2021, Chapters 4 and 6.

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

    def __init__(self, module_or_params: Union[nn.Module, Iterable[Tensor]], rank: int = 20, method: str = "em", *,
                 start_after: int = 0, collect_every: int = 1, window: int = 1, warmup: Optional[int] = None,
                 lr: float = 1e-3, step_scale: float = 1.0, init_scale: float = 1.0, min_variance: float = 1e-4,
                 optimizer=None, on_nonfinite: str = "raise", max_deviation: Optional[float] = 10.0,
                 collector: Optional[IterateCollector] = None, seed: Optional[int] = None, process_group=None,
                 _source: Optional[_ParamSource] = None, **fa_kwargs):
        super().__init__()
        cls = type(self).__name__
        collection = dict(start_after=start_after, collect_every=collect_every, window=window,
                          on_nonfinite=on_nonfinite, max_deviation=max_deviation)
        # sharded (a process_group, or a DistributedDataParallel model's): the ranks agree on every argument
        # before any is checked, so that a bad one raises alike on every rank (see pyro_fa.distributed)
        module_or_params, seed, self._rows = swag_rows(module_or_params, process_group, cls, dict(
            collection, rank=rank, method=method, warmup=warmup, lr=lr, step_scale=step_scale, init_scale=init_scale,
            min_variance=min_variance, optimizer=optimizer, seed=seed, fa_kwargs=fa_kwargs,
            collector=None if collector is None else type(collector).__name__))
        if not (isinstance(method, Fitter) and method.supports_iterates) and method not in _methods():
            raise ValueError(f"{cls}: method must be one of {_methods()} or a fitter object, got {method!r}.")
        self.collector = IterateCollector.chosen(cls, collector, collection)
        self.rank = _positive_int(cls, "rank", rank)
        self._warmup = self.rank if warmup is None else _positive_int(cls, "warmup", warmup)
        self._fit = ClassicFit(method) if method == _CLASSIC else OnlineFit(method)  # dispatched here, once
        self._fit.check(cls, rank=self.rank, warmup=self._warmup, optimizer=optimizer)
        self.method = method.name if isinstance(method, Fitter) else method
        self._scale = 1.0
        self._fa_kwargs = dict(lr=lr, step_scale=step_scale, init_scale=init_scale, min_variance=min_variance,
                               optimizer=optimizer, seed=seed, **fa_kwargs)
        self.min_variance = float(min_variance)
        if _source is None:
            _source = _ParamSource.of(cls, module_or_params)
        object.__setattr__(self, "_source", _source)  # not a submodule: the model's weights stay out of state_dict
        self._n = 0
        self._sq_dev_total = 0.0  # sharded: the sum over all D of the running squared deviations
        self._shapes: Optional[List[torch.Size]] = None
        self.dim: Optional[int] = None
        if not _source.from_param_store:
            self._setup(_source.named)

    @classmethod
    def from_param_store(cls, rank: int = 20, method: str = "em", *, prefix: Optional[str] = "AutoDelta",
                         names: Optional[Sequence[str]] = None, **kwargs) -> "SWAG":
        r"""A SWAG posterior over (unconstrained) parameters of Pyro's param store.

        For SVI with a MAP / ``AutoDelta`` guide and any ``pyro.optim`` optimizer: call ``swag.step()`` after each
        ``svi.step(...)``. The parameters are looked up at the first collection, so the guide may create them
        lazily: those named ``prefix + "." + site`` (the sites :meth:`to_guide` samples; ``prefix=None``: every
        parameter), or exactly ``names`` (used as site names). ``rank``, ``method``, ``**kwargs``: as for SWAG.
        """
        return cls(None, rank, method, _source=_ParamSource(prefix=prefix, names=names), **kwargs)

    # ------------------------------------------------------------- the followed weights
    def _setup(self, named: List[Tuple[str, Tensor]]) -> None:
        cls = type(self).__name__
        self._rows.agree_params(cls, named, self._source.from_param_store)
        D, dtype, device = check_params(cls, named, self.rank)
        self.dim = D
        self._lo, self._hi = self._rows.rows(cls, D, self._fa_kwargs["seed"])  # all D without a process group
        self._shapes = [p.shape for _, p in named]
        self._names = [n for n, _ in named]
        self._fit.setup(self, D, self._hi - self._lo, dtype, device)
        self.collector.setup(self, self._hi - self._lo, dtype, device)

    def _named(self) -> List[Tuple[str, Tensor]]:
        named = self._source.resolve(type(self).__name__)
        if self.dim is None:
            self._setup(named)
        return named

    def _split(self, theta: Tensor) -> List[Tensor]:
        return split(self._shapes, theta)

    # ------------------------------------------------------------- collecting (the collector's)
    @torch.no_grad()
    def collect(self) -> bool:
        """Collect the current parameter vector now (whatever the schedule); whether it reached the fit
        (``False`` while a window fills, or for a skipped vector). Raises ``ValueError``, the state unchanged,
        if the parameters changed shape, device or dtype, or the vector holds NaN / inf (``on_nonfinite="raise"``).
        """
        named = self._named()
        ref = self._fit.loc(self)
        check_followed(type(self).__name__, named, self._shapes, ref)
        flat = getattr(self, "_flat", None)
        if flat is None or flat.dtype != ref.dtype or flat.device != ref.device:
            flat = self._flat = torch.empty_like(ref)
        theta = flatten_slice([p for _, p in named], self._lo, self._hi, flat)  # this rank's coordinates
        return self.collector.collect(self, theta)

    def step(self) -> bool:
        """Count one optimizer step and collect if the collector's schedule says so (by default step
        :math:`t`, counted from one, when ``t > start_after`` and ``(t - start_after) % collect_every == 0``).
        This is what the hook of :meth:`attach` calls; Pyro users call it after each ``svi.step``.
        Returns whether a vector reached the fit."""
        return self.collector.step(self)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Collect after the steps of ``optimizer`` (per the collector's schedule); ``handle.remove()`` on the
        returned handle detaches."""
        return self.collector.attach(self, optimizer)

    @property
    def n_collected(self) -> int:
        return self._n

    @property
    def n_steps(self) -> int:
        return self.collector.n_steps

    @property
    def n_refused(self) -> int:
        """Vectors not collected: non-finite, overflowing, or from a diverged run (see ``max_deviation``)."""
        return self.collector.n_refused

    @property
    def sharding(self):
        """The :class:`~pyro_fa.distributed.Sharding` of the collected coordinates, or None."""
        return self._rows.sharding

    _sharding = sharding  # what the fits read

    # ------------------------------------------------------------- the posterior
    @property
    def warmup(self) -> int:
        """Vectors before EM / SGA fit the factor: the fit's own (a short run may end it early, see
        :meth:`OnlineFactorAnalysis.finish_warmup`), the constructor's until the fit exists."""
        fa = self._modules.get("fa")
        return fa.warmup if fa is not None else self._warmup

    def _check_ready(self, what: str) -> None:
        if self._n == 0:
            raise RuntimeError(
                f"{type(self).__name__}: {what} needs at least one collected parameter vector, got none. "
                "Call attach(optimizer) and train, or collect()."
            )
        self._fit.check_ready(self, what)

    @property
    def loc(self) -> Tensor:
        """The mean :math:`c` (the SWA solution), shape (D,)."""
        return self._fit.loc(self)

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

        A :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` (the capacitance in float64); at scale 0
        the point mass at :attr:`loc` (:class:`~pyro_fa.distributions.PointMassNormal`); under a ``process_group``
        this rank's rows (:class:`~pyro_fa.distributed.ShardedLowRankNormal`, collective). ``RuntimeError`` before
        anything was collected.
        """
        self._check_ready("get_posterior()")
        if self._scale == 0.0:
            return PointMassNormal(self.loc)
        return self._rows.normal(self.loc, self.cov_factor, self.cov_diag, self._scale)

    @property
    def scale(self) -> float:
        r"""The posterior scale :math:`s`: samples are :math:`c + \sqrt{s}\,(Fh + \Psi^{1/2}\varepsilon)`.

        The iterates' spread is set by the optimizer's learning rate and batch size, not by the posterior
        (Mandt, Hoffman & Blei 2017); :meth:`tune_scale` chooses :math:`s` on validation data (Maddox et al.
        2019). Default 1; 0 is the mean (SWA), and :meth:`get_posterior` the point mass at :math:`c`.
        """
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = check_scale(type(self).__name__, value)
        self._scale = value

    @torch.no_grad()
    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        # unscaled draws F h + psi^(1/2) eps of shape (S, D); sharded: h shared by the ranks, eps this rank's rows
        h, eps = self._rows.draw_noise(type(self).__name__, num_samples, self.rank, generator, self.loc)
        return eps.mul_(self.cov_diag.sqrt()).add_(self._fit.low_rank(self, h))

    @torch.no_grad()
    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draw flattened parameter vectors :math:`c + \sqrt{s}(Fh + \Psi^{1/2}\varepsilon)`, never forming a D×D matrix.

        :math:`s` is :attr:`scale` (at scale 0 every draw is :attr:`loc`); the same random numbers, in the same
        order, as ``get_posterior().sample((num_samples,), generator=generator)`` with a ``generator``.

        ``num_samples`` None: one vector of shape (D,), else shape (num_samples, D); ``generator`` on the
        posterior's device.
        """
        if num_samples is not None:
            _positive_int(type(self).__name__, "num_samples", num_samples)
        self._check_ready("sample()")
        out = self._deviations(1 if num_samples is None else num_samples, generator)
        if self._scale != 1.0:
            out.mul_(math.sqrt(self._scale))
        out = self._rows.gather(out.add_(self.loc))  # sharded: whole vectors from every rank's rows
        return out[0] if num_samples is None else out

    @contextlib.contextmanager
    def sampled_weights(self, theta: Optional[Tensor] = None, loader=None, generator: Optional[torch.Generator] = None):
        """Load ``theta`` (shape (D,); default one draw of :meth:`sample`) into the model for the ``with`` block,
        yield it, then restore the parameters and buffers (also after an exception). With ``loader`` (training
        batches; a module only), batch-norm statistics are recomputed by ``torch.optim.swa_utils.update_bn``.
        """
        theta = self._rows.full_theta(theta, self.dim)  # sharded: this rank's rows (e.g. swag.loc) are gathered
        theta = self.sample(generator=generator) if theta is None else theta
        with loaded_weights(type(self).__name__, [p for _, p in self._named()], theta, self._source.module, loader):
            yield theta

    # ------------------------------------------------------------- predictions (pyro_fa.swag._prediction)
    def predictive(self, pred_type: str = "nn", *, loader=None) -> SampledPredictive:
        r"""This posterior's predictive: draws of :meth:`sample` run in the module, or in its linearisation.

        ``pred_type="nn"``: the network at each draw :math:`\theta`; ``"glm"``: the network linearised at the
        mean, :math:`f(x; c) + J_x(\theta - c)` (Immer, Korzepa & Bauer 2021, §3). ``loader``: batch-norm refresh
        per draw (see :meth:`sampled_weights`; for ``"glm"`` the statistics of :math:`c`). The
        :class:`~pyro_fa.predictive.SampledPredictive` has ``loc`` :math:`c` and unscaled ``deviations``
        :math:`Fh + \Psi^{1/2}\varepsilon` (for :func:`~pyro_fa.predictive.tune_scale`). Raises ``RuntimeError``
        before any collection, or for ``"glm"`` over parameters only; ``ValueError`` for an unknown ``pred_type``.
        """
        check_pred_type(type(self).__name__, pred_type)
        if self._n == 0:
            self._check_ready("predictive()")
        return build_predictive(pred_type, _prediction.SWAGSource(self), loader)

    def linearized_moments(self, *args, chunk_size: Optional[int] = None,
                           diagonal: bool = False) -> Tuple[Tensor, Tensor]:
        r"""Mean and covariance of the linearised network's outputs, :math:`f(x; c)` and :math:`s\,J_x(FF^\top + \Psi)J_x^\top`.

        :func:`pyro_fa.predictive.linearized_moments` at this posterior, for inputs ``args`` of shape (N, ...):
        ``mean`` (N, C), ``cov`` (N, C, C), or the variances (N, C) with ``diagonal=True``. ``RuntimeError``
        before any collection, over parameters only, or sharded over a process group.
        """
        return _prediction.linearized_moments(self, args, chunk_size=chunk_size, diagonal=diagonal)

    def _linearized_marginals(self, inputs, chunk_size):
        return _prediction.linearized_marginals(self, inputs, chunk_size)

    def to_guide(self, model: Callable):
        """A Pyro guide drawing ``model``'s latent sites from this posterior, for
        ``pyro.infer.Predictive(model, guide=swag.to_guide(model), num_samples=S, parallel=False)``. Sites are
        matched by name: the module's parameter names (as ``GaussianPrior.bayesianize(module)`` names them), or
        the param-store names with ``prefix.`` removed (their unconstrained values mapped by ``biject_to``).
        """
        return FactorPosteriorGuide(model, [self])

    def site_names(self) -> List[str]:
        """Names of the model sites that the posterior's pieces stand for, in flattening order."""
        self._named()
        return [self._source.site_name(n) for n in self._names]

    # ------------------------------------------------------------- state (pyro_fa.swag._state)
    def get_extra_state(self):
        return _state.extra_state(self)

    def set_extra_state(self, state):
        _state.load_extra_state(self, state)

    def _check_extra_state(self, state):  # what pyro_fa._state.check_state_dict asks before a load
        _state.check_extra_state(self, state)

    def _check_state(self, state_dict, strict: bool, prefix: str = ""):
        return _state.check_state(self, state_dict, strict, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a direct load_state_dict and a parent module's (MultiSWAG, a user's model) alike: the whole state of
        # this posterior, its fit's included, is checked before any of it is written
        total = _state.load_from_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if total is not None:
            self._fit.set_sq_dev_total(self, total)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict`, checked whole first (also when a parent module loads it):
        ``ValueError`` / ``TypeError`` for a missing or unexpected entry (``strict``), another shape, NaN / inf, a
        noise variance :math:`\\psi \\le 0`, or extra or optimizer state that does not fit; then nothing is loaded.
        """
        return _state.load_state_dict(self, super().load_state_dict, state_dict, strict, assign)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._flat = None
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, method={self.method!r}, start_after={self.start_after}, "
                f"collect_every={self.collect_every}, window={self.window}")


for _name in ("start_after", "collect_every", "window", "on_nonfinite", "max_deviation"):  # the collector's
    setattr(SWAG, _name, property(lambda self, _name=_name: getattr(self.collector, _name),
                                  lambda self, value, _name=_name: setattr(self.collector, _name, value),
                                  doc=f"The collector's ``{_name}``."))
