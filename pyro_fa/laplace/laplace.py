r"""``FactorLaplace``: a post-hoc Laplace approximation whose curvature is fitted by factor analysis.

At the trained (MAP) weights :math:`\theta_*` of a network, one pass over the data gives per-example
curvature vectors (:mod:`pyro_fa.laplace.curvature`); their uncentred second moment is fitted by the
factor-analysis core (:mod:`pyro_fa.laplace.moment`), :math:`\mathrm{GGN} \approx N(FF^\top + \Psi)`, so that
the Laplace approximation is

.. math::

    p(\theta \mid \mathcal D) \approx N(\theta_*, P^{-1}), \qquad
    P = \mathrm{diag}(\delta) + \frac{N}{\sigma^2}(FF^\top + \Psi),

with :math:`\delta` the prior precision (a scalar, or one per parameter tensor) and :math:`\sigma` the
noise of a Gaussian likelihood (:math:`\sigma = 1` for classification). The posterior is a
:class:`~pyro_fa.distributions.LowRankPrecisionNormal` (a
:class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal` with a rank per layer): :math:`O(DK)` memory and
no :math:`D\times D` tensor. The verbs are laplace-torch's (Daxberger et al., *Laplace Redux — effortless Bayesian deep learning*,
NeurIPS 2021): ``fit``, ``log_marginal_likelihood``, ``optimize_prior_precision``; the predictions are every
posterior's (:class:`~pyro_fa.predictive.Posterior`: ``predict``, ``predict_proba``, ``predict_log_proba``,
``predictive``, ``log_likelihood``, ``tune_scale``), sampled networks by default (``pred_type="nn"``) or the GLM
predictive of Immer, Korzepa & Bauer, *Improving predictions of Bayesian neural nets via local linearization*,
AISTATS 2021 (``pred_type="glm"``, :mod:`pyro_fa.predictive.glm`).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from pyro_fa.laplace import _fit as fitting, _fitted_state as state, _prior as evidence
from pyro_fa.laplace._fitted_state import layout_tensor, replace
from pyro_fa.laplace._laplace_torch import dense_covariance, dense_precision, shaped_prior, translate as _translate
from pyro_fa.laplace._loaders import batch_loss, check_batch, check_inputs, slice_inputs
from pyro_fa.laplace.curvature import flat_network, select_parameters
from pyro_fa.laplace.structures import get_structure
from pyro_fa.laplace._prior import (check_options, check_prior_precision, check_sigma, method,
                                    positive_int as _positive_int, with_grad)
from pyro_fa.distributions import BlockLowRankPrecisionNormal, LowRankPrecisionNormal, PointMassNormal
from pyro_fa.distributed import ShardedLowRankPrecisionNormal, make_laplace_sharding
from pyro_fa.laplace._predictive import FORWARD, NOISE_STD, LaplaceSource
from pyro_fa.predictive.glm import check_eval_mode, check_pred_type
from pyro_fa.predictive.registry import build_predictive
from pyro_fa.predictive.likelihood import LIKELIHOODS, normalize_likelihood
from pyro_fa.predictive.posterior import Posterior
from pyro_fa.predictive.sampled import SampledPredictive

__all__ = ["FactorLaplace", "LIKELIHOODS"]


class FactorLaplace(Posterior, nn.Module):
    r"""Laplace approximation :math:`N(\theta_*, P^{-1})` with a factor-analysis (low-rank plus diagonal) curvature.

    .. math::

        P = \mathrm{diag}(\delta) + \frac{N}{\sigma^2}\,(FF^\top + \Psi), \qquad
        \frac{1}{N}\sum_{n} J_n^\top \Lambda_n J_n \approx FF^\top + \Psi \quad (\text{at } \sigma = 1).

    Not to be confused with :class:`pyro_fa.LaplacePrior`, the Laplace (double-exponential) prior
    distribution.

    Parameters
    ----------
    model : nn.Module
        The trained network, at its MAP weights; ``model(x)`` gives outputs of shape (B, C) (logits or means)
        or (B,). Call ``model.eval()`` first if it has dropout or batch norm. It is not copied: the
        posterior's mean is the weights at :meth:`fit`.
    likelihood : {"classification", "regression"}
        Categorical on the softmax of C >= 2 logits (Bernoulli for one logit), or Gaussian with noise
        ``sigma_noise`` (aliases ``"categorical"``, ``"gaussian"``: :func:`~pyro_fa.predictive.normalize_likelihood`).
    subset : {"all", "last_layer"} or iterable of Tensors, default "all"
        The weights the approximation is over (see :func:`~pyro_fa.laplace.curvature.select_parameters`);
        the others stay at their values. The third positional argument, as laplace-torch's
        ``subset_of_weights`` (whose default is ``"last_layer"``; ours is every weight). Every argument after it
        is keyword-only.
    rank : int, list of int, dict or "auto", default 20
        :math:`K \ge 1`, the columns of :math:`F`; ``rank >= D`` keeps the curvature exactly (small D). A larger K
        widens the predictive where its spread matters (OOD, a small prior precision;
        ``benchmarks/bench_laplace_rank_ood.py``). A rank per layer: a list (one per module owning parameters of
        the subset, in order), a dict from those modules' names, or ``"auto"`` (``rank_budget`` allocated by the
        fitted spectrum): the ``"blocks"`` structure (:mod:`pyro_fa.laplace.structures.blocks`,
        :attr:`block_factors`, ``block_ranks``), not with a ``process_group``.
    prior_precision : float or Tensor of shape (1,) or (L,), default 1.0
        :math:`\delta`: one value, or one per parameter tensor of the subset (L of them), positive.
    sigma_noise : float, default 1.0
        :math:`\sigma` of the Gaussian likelihood; must be 1 for classification.
    curvature : {"ggn", "mc"}, default "ggn"
        Exact GGN factors (C vectors per example) or the Monte Carlo Fisher (``mc_samples`` per example).
    curvature_fit : {"auto", "exact", "scatter", "online", "sketch", "randomized"} or Fitter, default "auto"
        How the factor-analysis core fits the curvature (:func:`~pyro_fa.laplace.moment.fit_second_moment`, where
        each is described): ``"exact"`` (:math:`O(D^2)` memory, one :math:`O(D^3)` eigendecomposition) and
        ``"scatter"`` form the :math:`D\times D` curvature; ``"online"``, ``"sketch"`` and ``"randomized"`` hold
        :math:`O(DK)`. ``"auto"``: ``"exact"`` for D <= 1024, else ``"randomized"``. ``"sketch"`` is not
        shardable. ``"online"`` and ``"sketch"`` are the registered fitters whose ``curvature_fit`` names them
        (:mod:`pyro_fa.fa.fitters`); a fitter object with a ``curvature_fit`` name (e.g.
        ``OnlineEM(step_scale=1.0)``) fits with its own options.
    rank_budget, rank_max : int, optional
        Only with ``rank="auto"``: the total rank, and the rank each block is fitted at first (default
        ``rank_budget``).
    structure : str, optional
        A curvature structure registered by name (:func:`~pyro_fa.laplace.structures.register_structure`); by
        default ``"dense"`` for an int ``rank`` and ``"blocks"`` for a rank per layer.
    mc_samples : int, default 1
    num_passes : int, optional
        Passes over the data: default 4 for ``"online"``, 1 for ``"sketch"``, 2 for ``"randomized"``.
    chunk_size : int, default 32
        Examples per ``torch.func`` block: the largest tensor held is (chunk_size, C, D).
    seed : int, default 0
        Seeds the sampled labels of ``"mc"`` and the factor-analysis initialisation.
    process_group : torch.distributed process group, optional
        Data-parallel fit, sharded state (:mod:`pyro_fa.distributed.laplace`): every rank passes its own part of
        the data to :meth:`fit` and then holds only its rows ``[lo, hi)`` of :attr:`loc`, :attr:`cov_factor` and
        :attr:`cov_diag` (:func:`~pyro_fa.distributed.shard_bounds`) and its own :meth:`state_dict`; the posterior
        is a :class:`~pyro_fa.distributed.ShardedLowRankPrecisionNormal` and every method is collective.
    subset_of_weights, hessian_structure, prior_structure : str, optional
        laplace-torch's names, mapped to ours or refused naming ours (the table of
        :mod:`pyro_fa.laplace._laplace_torch`): ``hessian_structure="lowrank"`` is ``rank=K``, ``"full"`` is
        ``rank=D``; ``prior_structure="layerwise"`` gives :attr:`prior_precision` the shape (L,). Likewise
        :attr:`posterior_precision` / :attr:`posterior_covariance` (dense, small D).

    Attributes
    ----------
    loc : Tensor of shape (D,), or (D_r,) when sharded
        :math:`\theta_*` (this rank's rows when sharded, as the two below).
    cov_factor : Tensor of shape (D, K) or (D_r, K)
        :math:`F` (curvature per example, :math:`\sigma = 1`); with a rank per layer the dense
        :math:`\mathrm{blockdiag}(F_b)`, formed on each access (:attr:`block_factors` holds the blocks).
    cov_diag : Tensor of shape (D,) or (D_r,)
        :math:`\psi`, non-negative.
    shard : Tensor of shape (5,), int64, only when sharded
        ``(D, world_size, rank, lo, hi)``: which rows this rank holds (checked by :meth:`load_state_dict`).
    prior_precision : Tensor of shape (1,) or (L,)
    sigma_noise : Tensor of shape ()
    n_data : Tensor of shape (), int64
        :math:`N` (0 before :meth:`fit`).
    loss, loss_grad : Tensor of shape () and (D,) or (D_r,)
        At :math:`\theta_*`: the summed cross-entropy (or sum of squared errors) and its gradient.
    fitted_temperature : Tensor of shape ()
        :attr:`temperature`, 0 for None.
    predictive_scale : Tensor of shape ()
        :attr:`scale` (a state saved without it loads with the scale left as it is).
    parameter_layout : Tensor of shape (L, 2 + the largest ndim), int64
        The subset's parameter names (CRC-32) and shapes: :meth:`load_state_dict` refuses another network's state.

    Notes
    -----
    Predictions (:class:`~pyro_fa.predictive.Posterior`) default to sampled networks, ``pred_type="nn"`` with
    ``num_samples=30``, as on every posterior (laplace-torch's default, and this class's before, was the GLM
    predictive: pass ``pred_type="glm"``, whose ``link_approx`` defaults to ``"probit"``). ``predict(x)`` is the
    predictive mean; ``predict(x, return_var=True)`` and ``la(x)`` for a regression give (mean, variance) with
    :math:`\sigma^2` added. :attr:`scale` multiplies the predictive's covariance (:meth:`tune_scale`).

    :meth:`fit` costs :math:`C` reverse-mode products per example (``"ggn"``) or ``mc_samples`` gradients
    (``"mc"``), then the structure's fit (:mod:`pyro_fa.laplace.moment`); the posterior :math:`O(DK^2)`.

    References
    ----------
    Daxberger et al., *Laplace Redux — effortless Bayesian deep learning*, NeurIPS 2021, §2 (the
    approximation, its marginal likelihood and the verbs); Immer, Korzepa & Bauer, AISTATS 2021, §3 (the
    GLM predictive); MacKay, *A practical Bayesian framework for backpropagation networks*, Neural
    Computation 1992, §4 (the evidence); Kunstner, Hennig & Balles, NeurIPS 2019, §3 (MC Fisher vs the
    empirical Fisher).

    Examples
    --------
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> net = torch.nn.Linear(3, 2)
    >>> data = [(torch.randn(20, 3), torch.randint(2, (20,)))]
    >>> la = FactorLaplace(net, "classification", rank=2).fit(data)
    >>> la.predict_proba(torch.randn(4, 3)).shape
    torch.Size([4, 2])
    """

    def __init__(self, model: nn.Module, likelihood: str, subset: Union[str, Iterable[Tensor]] = "all", *,
                 rank: Union[int, Sequence[int], Dict[str, int], str, None] = None, prior_precision=1.0,
                 sigma_noise: float = 1.0, curvature: str = "ggn", curvature_fit: str = "auto", mc_samples: int = 1,
                 num_passes: Optional[int] = None,
                 chunk_size: int = 32, seed: int = 0, process_group=None, rank_budget: Optional[int] = None,
                 rank_max: Optional[int] = None, structure: Optional[str] = None,
                 subset_of_weights: Optional[str] = None,
                 hessian_structure: Optional[str] = None, prior_structure: Optional[str] = None, **laplace_torch):
        super().__init__()
        name = type(self).__name__
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name}: model must be a torch.nn.Module, got {type(model).__name__}.")
        likelihood = normalize_likelihood(name, likelihood)
        subset, full, layerwise = _translate(name, subset, subset_of_weights, hessian_structure, prior_structure,
                                             laplace_torch)
        rank = check_options(name, rank, full, curvature, curvature_fit, process_group)
        self.rank = rank
        self.mc_samples = _positive_int(name, "mc_samples", mc_samples)
        self.num_passes = None if num_passes is None else _positive_int(name, "num_passes", num_passes)
        self.chunk_size = _positive_int(name, "chunk_size", chunk_size)
        self.seed = _positive_int(name, "seed", seed, minimum=0)
        self.process_group = process_group
        named = select_parameters(model, subset, name)
        if full:
            rank = self.rank = sum(p.numel() for _, p in named)
        self._structure = get_structure(name, structure, rank).build(
            name, rank, named, curvature_fit=curvature_fit, process_group=process_group, rank_budget=rank_budget,
            rank_max=rank_max)
        self.rank = self._structure.width  # the columns of the whole factor F
        object.__setattr__(self, "model", model)  # not a submodule: the network's weights stay out of state_dict
        self.likelihood, self.curvature, self.curvature_fit = likelihood, curvature, curvature_fit
        self._named = named
        self._params = [p for _, p in named]
        self._sizes = [p.numel() for _, p in named]
        ref = named[0][1]
        D = sum(self._sizes)
        self.dim = D
        dd = dict(dtype=ref.dtype, device=ref.device)
        self._sharding = None if process_group is None else make_laplace_sharding(process_group, D, name)
        lo, hi = self._rows
        self.register_buffer("loc", torch.zeros(hi - lo, **dd))
        self._structure.register_factor(self, hi - lo, self.loc)
        self.register_buffer("cov_diag", torch.zeros(hi - lo, **dd))
        if self._sharding is not None:
            sh = self._sharding
            self.register_buffer("shard", torch.tensor([D, sh.world_size, sh.rank, lo, hi], device=ref.device))
        prior_precision = self._check_prior_precision(prior_precision, ref)
        self.register_buffer("prior_precision", shaped_prior(name, prior_precision, layerwise, self.n_layers))
        self.register_buffer("sigma_noise", self._check_sigma(sigma_noise, ref))
        self.register_buffer("n_data", torch.zeros((), dtype=torch.int64, device=ref.device))
        self.register_buffer("loss", torch.zeros((), **dd))
        self.register_buffer("loss_grad", torch.zeros(hi - lo, **dd))
        self.register_buffer("fitted_temperature", torch.zeros((), **dd))
        self.register_buffer("predictive_scale", torch.ones((), **dd))
        self.register_buffer("n_outputs", torch.zeros((), dtype=torch.int64, device=ref.device))
        self.register_buffer("parameter_layout", layout_tensor(self, ref.device))
        self._structure.register_extra(self, self.loc)
        self._f = flat_network(model, named)

    # ------------------------------------------------------------------ checks
    @property
    def _rows(self):
        """This rank's rows ``(lo, hi)`` of the weights; ``(0, D)`` without sharding."""
        return (0, self.dim) if self._sharding is None else (self._sharding.lo, self._sharding.hi)

    @property
    def n_layers(self) -> int:
        """L, the number of parameter tensors in the subset."""
        return len(self._named)

    _check_prior_precision, _check_sigma = method(check_prior_precision), method(check_sigma)

    _replace = method(replace)
    load_state_dict = method(state.load_state_dict)

    @property
    def cov_factor(self) -> Tensor:
        """:math:`F`, shape (D, K), as its structure holds it (with a rank per block the dense (D, sum of the ranks),
        formed on each access: writing into it changes nothing)."""
        structure = self.__dict__.get("_structure")
        if structure is None:  # while __init__ registers the buffers
            raise AttributeError("cov_factor")
        return structure.cov_factor(self.__dict__["_buffers"], self.loc)

    @property
    def block_factors(self) -> List[Tuple[int, int, Tensor]]:
        """With a rank per block: ``(lo, hi, F_b)`` per block, :math:`F_b` of shape (hi - lo, K_b), the buffer
        ``block_factor_b`` (what the posterior and the state hold); ``ValueError`` with an int ``rank``."""
        return self._structure.block_factors(type(self).__name__, self._buffers, self.rank)

    temperature = state.temperature

    def _check_fitted(self, what: str) -> None:
        if int(self.n_data) == 0:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a fitted Laplace approximation; call "
                               "fit(train_loader) first (or load_state_dict).")

    _batch, _batch_loss = method(check_batch), method(batch_loss)

    # ------------------------------------------------------------------ fit
    fit = method(with_grad(fitting.fit))

    # ------------------------------------------------------------------ the evidence and the prior precision
    train_log_likelihood = method(evidence.train_log_likelihood)
    log_marginal_likelihood = method(evidence.log_marginal_likelihood)
    optimize_prior_precision = method(evidence.optimize_prior_precision)

    # ------------------------------------------------------------------ the posterior
    def _prior_diag(self, prior_precision: Tensor) -> Tensor:
        """The prior precision of each of this rank's weights, shape (D,) or (D_r,) (differentiable)."""
        lo, hi = self._rows
        if prior_precision.numel() == 1:
            return prior_precision.reshape(()).expand(hi - lo)
        bounds = torch.tensor([0] + self._sizes, device=prior_precision.device).cumsum(0)
        counts = (bounds[1:].clamp(lo, hi) - bounds[:-1].clamp(lo, hi))  # each tensor's weights in [lo, hi)
        return torch.repeat_interleave(prior_precision, counts)

    def _resolve(self, prior_precision, sigma_noise):
        """The hyperparameters to use, checked (shape, positive, finite) even when they carry a graph."""
        pp = self.prior_precision if prior_precision is None else self._check_prior_precision(
            prior_precision, self.loc, differentiable=True)
        sg = self.sigma_noise if sigma_noise is None else self._check_sigma(sigma_noise, self.loc, differentiable=True)
        return pp.reshape(-1), sg.reshape(())

    def _posterior(self, prior_precision=None, sigma_noise=None, cov_scale: float = 1.0) -> LowRankPrecisionNormal:
        """N(theta_*, cov_scale P^{-1}) (``cov_scale`` > 0): the precision P / cov_scale."""
        pp, sg = self._resolve(prior_precision, sigma_noise)
        scale = self.n_data.to(self.loc.dtype) / sg.pow(2)
        prec_diag = self._prior_diag(pp) + scale * self.cov_diag
        if cov_scale != 1.0:
            prec_diag, scale = prec_diag / cov_scale, scale / cov_scale
        # its own storage: neither a later fit() nor an in-place change of the posterior reaches the other
        return self._structure.posterior(self._buffers, self.loc.clone(), prec_diag, scale, self._sharding)

    def get_posterior(self) -> Union[LowRankPrecisionNormal, BlockLowRankPrecisionNormal, ShardedLowRankPrecisionNormal]:
        r"""The Laplace approximation at :attr:`scale` :math:`s`, :math:`N(\theta_*, s P^{-1})`, at the current prior
        precision and noise (:math:`s = 1`, the default, is the Laplace approximation itself; at :math:`s = 0` a
        :class:`~pyro_fa.distributions.PointMassNormal` at :math:`\theta_*`).

        A snapshot (no storage shared with this object's buffers), a
        :class:`~pyro_fa.distributions.FactorNormal` of the structure's form: a
        :class:`~pyro_fa.distributions.LowRankPrecisionNormal` (sharded: this rank's rows,
        :class:`~pyro_fa.distributed.ShardedLowRankPrecisionNormal`), with a rank per layer a
        :class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal`. ``RuntimeError`` before :meth:`fit`.
        """
        self._check_fitted("get_posterior()")
        if self.scale == 0.0:
            return PointMassNormal(self.loc.clone())
        return self._posterior(cov_scale=self.scale)

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal variances of the weights, shape (D,) (this rank's (D_r,) when sharded; collective)."""
        return self.get_posterior().variance

    posterior_precision = property(method(dense_precision))
    posterior_covariance = property(method(dense_covariance))

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Weight vectors drawn from the Laplace approximation, shape (num_samples, D), or (D,) for ``None``.

        ``get_posterior().rsample``: ``generator`` (on any device) gives the draws, the global generator is untouched;
        without one the global generator's. Sharded: this rank's rows of the draws, (num_samples, D_r), one draw of
        the whole vector over the ranks (collective; ``generator`` is rank 0's).
        """
        if num_samples is not None:
            _positive_int(type(self).__name__, "num_samples", num_samples)
        self._check_fitted("sample()")
        shape = (1,) if num_samples is None else (num_samples,)
        out = self.get_posterior().rsample(shape, generator=generator)
        return out[0] if num_samples is None else out

    # ------------------------------------------------------------------ predictives
    scale = state.scale

    def _check_sampling_mode(self) -> None:
        """Refuse, before any forward pass, a model whose dropout or batch norm is in train mode: sampled networks
        would each see other random masks or batch statistics and move the running means (as :meth:`fit` and
        the GLM predictive refuse it)."""
        check_eval_mode(type(self).__name__, self.model, "model")

    def _inputs(self, x):
        """Prediction inputs as the network's positional arguments: a tuple of Tensors on the fit's device and
        dtype (from a Tensor or a tuple of Tensors; refused otherwise)."""
        x = check_inputs(type(self).__name__, x, self.loc)
        return x if isinstance(x, tuple) else (x,)

    def _default_noise_std(self):
        return NOISE_STD[self.likelihood](self)

    def _whole(self, theta: Tensor) -> Tensor:
        """The whole weight vector (sharded: gathered from the ranks' rows, collective)."""
        return theta if self._sharding is None else self._sharding.all_gather(theta)

    def _deviations(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Unscaled draws :math:`\theta - \theta_*`, :math:`\theta \sim N(\theta_*, P^{-1})`, shape (S, D)."""
        return self._posterior().rsample((num_samples,), generator=generator) - self.loc

    def _draws(self, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
        if self.scale == 1.0:
            return self.sample(num_samples, generator=generator)
        return torch.add(self.loc, self._deviations(num_samples, generator), alpha=math.sqrt(self.scale))

    def predictive(self, pred_type: str = "nn", *, loader=None) -> SampledPredictive:
        r"""The predictive (:class:`~pyro_fa.predictive.SampledPredictive`, with ``loc`` :math:`\theta_*` and unscaled
        ``deviations``): draws at :attr:`scale` run in the network (``pred_type="nn"``) or in its linearisation at
        :math:`\theta_*`, :math:`f(x; \theta_*) + J_x(\theta - \theta_*)` (``"glm"``, Immer, Korzepa & Bauer 2021,
        §3). ``loader`` must be None (the model is in eval mode). ``RuntimeError`` before :meth:`fit`."""
        name = type(self).__name__
        check_pred_type(name, pred_type)
        if loader is not None:
            raise ValueError(f"{name}: loader must be None (the model is in eval mode, its batch-norm statistics "
                             f"fixed), got {type(loader).__name__}.")
        self._check_fitted("predictive()")
        self._check_sampling_mode()
        return build_predictive(pred_type, LaplaceSource(self), loader)

    def _glm_moments(self, x: Tensor):
        # the posterior unscaled (the callers apply the scale)
        return self._structure.glm_moments(self._posterior, x, owner=type(self).__name__, model=self.model, f=self._f,
                                           loc=self.loc, params=self._params, chunk_size=self.chunk_size,
                                           sharding=self._sharding)

    def _linearized_marginals(self, inputs, chunk_size):
        r""":math:`f(x; \theta_*)` and :math:`s\,\mathrm{diag}(J_x P^{-1} J_x^\top)`, in the model output's shape."""
        self._check_fitted("the GLM predictive")
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        mean, cov = self._glm_moments(x)
        var = cov.diagonal(dim1=-2, dim2=-1) * self.scale
        with torch.no_grad():  # the model's own output shape: (N,) or (N, C)
            one = self._f(self._whole(self.loc), slice_inputs(x, 0, 1)).dim() == 1
        return [(mean.squeeze(-1), var.squeeze(-1)) if one else (mean, var)]

    def forward(self, x: Tensor, *, pred_type: str = "nn", link_approx: Optional[str] = None, num_samples: int = 30,
                generator: Optional[torch.Generator] = None):
        r"""laplace-torch's ``la(x, ...)``: :meth:`predict_proba` for classification, ``predict(x, return_var=True)``
        (the mean and variance, :math:`\sigma^2` added) for regression."""
        kw = dict(pred_type=pred_type, link_approx=link_approx, num_samples=num_samples, generator=generator)
        return FORWARD[self.likelihood](self, x, kw)

    def extra_repr(self) -> str:
        return (f"likelihood={self.likelihood!r}, dim={self.dim}, rank={self.rank}, curvature={self.curvature!r}, "
                f"curvature_fit={self.curvature_fit!r}" + (f", rows={self._rows}" if self._sharding else "")
                + self._structure.describe(self._buffers))
