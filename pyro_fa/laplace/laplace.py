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
NeurIPS 2021): ``fit``, ``log_marginal_likelihood``, ``optimize_prior_precision``, ``predict_proba`` /
``predict`` (the GLM predictive of Immer, Korzepa & Bauer, *Improving predictions of Bayesian neural nets via
local linearization*, AISTATS 2021, shared with every posterior in :mod:`pyro_fa.predictive.glm`).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from pyro_fa.laplace._blocks import assemble as _assemble_blocks, block_ranks as _block_ranks, fit_blocks
from pyro_fa.laplace._fitted_state import FittedState
from pyro_fa.laplace.curvature import CURVATURES, curvature_vectors, flat_network, select_parameters
from pyro_fa.fa.fitters import Fitter
from pyro_fa.laplace.moment import fit_second_moment, moment_fits
from pyro_fa.laplace._prior import PriorPrecisionSelection, positive_int as _positive_int, show as _show
from pyro_fa.distributions import BlockLowRankPrecisionNormal, LowRankPrecisionNormal
from pyro_fa.distributed import ShardedLowRankPrecisionNormal, make_laplace_sharding
from pyro_fa.laplace._sharded_glm import sharded_glm_moments
from pyro_fa.predictive.glm import check_eval_mode, check_pred_type, linearized_moments, probit_proba

__all__ = ["FactorLaplace", "LIKELIHOODS"]

#: the likelihoods of a Laplace approximation, by laplace-torch's names
LIKELIHOODS = ("classification", "regression")



class FactorLaplace(PriorPrecisionSelection, FittedState, nn.Module):
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
        ``sigma_noise``.
    rank : int, list of int, dict or "auto", default 20
        :math:`K \ge 1`; ``rank >= D`` keeps the curvature exactly (small D). Time and memory grow with K.
        Where the predictive's spread matters (OOD detection, a small prior precision), take K larger
        than the default: a small K under-states the dense GGN Laplace's spread there, while at a large prior
        precision it already matches it (``benchmarks/bench_laplace_rank_ood.py`` measures both).
        Per layer (block): a list with one rank per module owning parameters of the subset, in the subset's
        order (``rank=[400, 100, 100]``), or a dict from those modules' names in ``model.named_modules()``
        (``{"linear1": 400, ...}``): each block's curvature fitted on its own (one pass over the data for all),
        block diagonal, each block's :math:`F_b` (D_b, K_b) held on its own (:attr:`block_factors`), the
        posterior a :class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal`: memory
        :math:`O(\sum_b D_bK_b)` and :math:`O(\sum_b D_bK_b^2)` time instead of the total rank's; ``"auto"``:
        ``rank_budget`` columns allocated over the blocks by the fitted spectrum (each fitted at ``rank_max``
        first). See :mod:`pyro_fa.laplace._blocks`; attribute ``block_ranks``. Not with a ``process_group``.
    subset : {"all", "last_layer"} or iterable of Tensors, default "all"
        The weights the approximation is over (see :func:`~pyro_fa.laplace.curvature.select_parameters`);
        the others stay at their values.
    prior_precision : float or Tensor of shape (1,) or (L,), default 1.0
        :math:`\delta`: one value, or one per parameter tensor of the subset (L of them), positive.
    sigma_noise : float, default 1.0
        :math:`\sigma` of the Gaussian likelihood; must be 1 for classification.
    curvature : {"ggn", "mc"}, default "ggn"
        Exact GGN factors (C vectors per example) or the Monte Carlo Fisher (``mc_samples`` per example).
    curvature_fit : {"auto", "scatter", "online", "sketch", "randomized"} or Fitter, default "auto"
        How the factor-analysis core fits the curvature (:func:`~pyro_fa.laplace.moment.fit_second_moment`):
        the exact scatter and batch FA to convergence (:math:`O(D^2)` memory), or in :math:`O(DK)` memory
        online EM (``num_passes``, shardable), the core's scatter sketch refitted by batch FA (one pass), or
        a randomized range finder and Nyström approximation of the uncentred moment refitted by batch FA
        (``"randomized"``, ``num_passes`` passes, shardable; see :mod:`pyro_fa.laplace.moment`).
        ``"auto"``: ``"scatter"`` for D <= 2048, else ``"randomized"``. ``"online"`` and ``"sketch"`` are the
        registered fitters whose ``curvature_fit`` names them (:mod:`pyro_fa.fa.fitters`); a fitter object with
        a ``curvature_fit`` name (e.g. ``OnlineEM(step_scale=1.0)``) fits with its own options.
    rank_budget, rank_max : int, optional
        Only with ``rank="auto"``: the total rank, and the rank each block is fitted at before the allocation
        (default ``rank_budget``: any block may take it all; smaller costs less, warned where it binds).
    mc_samples : int, default 1
    num_passes : int, optional
        Passes over the data: default 4 for ``"online"``, 1 for ``"sketch"``, 2 for ``"randomized"``.
    chunk_size : int, default 32
        Examples per ``torch.func`` block: the largest tensor held is (chunk_size, C, D).
    seed : int, default 0
        Seeds the sampled labels of ``"mc"`` and the factor-analysis initialisation.
    process_group : torch.distributed process group, optional
        Data-parallel fit, sharded state: every rank holds the same model and passes its own part of the
        data to :meth:`fit`; the counts and losses are all-reduced and the curvature is fitted from all
        ranks' vectors (``"scatter"``: the D x D sums all-reduced, equal to one process on all the data;
        ``"online"``: sharded by coordinates over the ranks, as ``OnlineFactorAnalysis(process_group=...)``;
        ``"randomized"``: its D x 3K matrices held by rows, sums of 3K numbers per vector all-reduced).
        Rank r of W then holds only its rows ``[lo, hi)`` (:func:`~pyro_fa.distributed.shard_bounds`, about
        D/W) of :attr:`loc`, :attr:`cov_factor` and :attr:`cov_diag`, and its own :meth:`state_dict`; the
        posterior is a :class:`~pyro_fa.distributed.ShardedLowRankPrecisionNormal` and every method
        below is collective (all ranks call it with the same arguments): see :mod:`pyro_fa.distributed.laplace`.

    Attributes
    ----------
    loc : Tensor of shape (D,), or (D_r,) when sharded
        :math:`\theta_*` (this rank's rows when sharded, as the two below).
    cov_factor : Tensor of shape (D, K) or (D_r, K)
        :math:`F` (curvature per example, :math:`\sigma = 1`). With a rank per block, the dense
        :math:`\mathrm{blockdiag}(F_b)`, (D, sum of the ranks), formed on each access (not held).
    block_factors : list of (int, int, Tensor), only with a rank per block
        ``(lo, hi, F_b)``, :math:`F_b` of shape (hi - lo, K_b): the buffers ``block_factor_0``, ... that the
        state holds instead of ``cov_factor``.
    cov_diag : Tensor of shape (D,) or (D_r,)
        :math:`\psi`, non-negative.
    shard : Tensor of shape (5,), int64, only when sharded
        ``(D, world_size, rank, lo, hi)``: which rows this rank holds (checked by :meth:`load_state_dict`).
    prior_precision : Tensor of shape (1,) or (L,)
    sigma_noise : Tensor of shape ()
    n_data : Tensor of shape (), int64
        :math:`N` (0 before :meth:`fit`).
    loss : Tensor of shape ()
        At :math:`\theta_*`: the summed cross-entropy (classification) or the sum of squared errors
        (regression).
    loss_grad : Tensor of shape (D,) or (D_r,)
        The gradient of :attr:`loss` at :math:`\theta_*` (for ``log_marginal_likelihood(mode="linearized")``).
    fitted_temperature : Tensor of shape ()
        :attr:`temperature`, 0 for None.

    Notes
    -----
    :meth:`fit` costs :math:`C` reverse-mode products per example (``"ggn"``) or ``mc_samples`` gradients
    (``"mc"``), then :math:`O(D^2)` memory and :math:`O(D^2K)` per batch-FA iteration (``"scatter"``) or
    :math:`O(DK)` memory and :math:`O(DK)` per vector (``"online"``). The posterior costs :math:`O(DK^2)`.

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

    def __init__(self, model: nn.Module, likelihood: str, rank: Union[int, Sequence[int], Dict[str, int], str] = 20,
                 subset: Union[str, Iterable[Tensor]] = "all", prior_precision=1.0, sigma_noise: float = 1.0, *,
                 curvature: str = "ggn", curvature_fit: str = "auto", mc_samples: int = 1,
                 num_passes: Optional[int] = None,
                 chunk_size: int = 32, seed: int = 0, process_group=None, rank_budget: Optional[int] = None,
                 rank_max: Optional[int] = None):
        super().__init__()
        name = type(self).__name__
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name}: model must be a torch.nn.Module, got {type(model).__name__}.")
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"{name}: likelihood must be one of {LIKELIHOODS}, got {likelihood!r}.")
        if curvature not in CURVATURES:
            raise ValueError(f"{name}: curvature must be one of {CURVATURES}, got {curvature!r}.")
        if not (isinstance(curvature_fit, Fitter) and curvature_fit.curvature_fit) and curvature_fit not in moment_fits():
            raise ValueError(f"{name}: curvature_fit must be one of {moment_fits()}, got {curvature_fit!r}.")
        self.rank = _positive_int(name, "rank", rank) if isinstance(rank, int) else rank
        self.mc_samples = _positive_int(name, "mc_samples", mc_samples)
        self.num_passes = None if num_passes is None else _positive_int(name, "num_passes", num_passes)
        self.chunk_size = _positive_int(name, "chunk_size", chunk_size)
        self.seed = _positive_int(name, "seed", seed, minimum=0)
        self.process_group = process_group
        named = select_parameters(model, subset, name)
        self._blocks = _block_ranks(name, rank, rank_budget, named, curvature_fit, process_group, rank_max)
        if self._blocks is not None:  # per-block ranks: F is (D, the total), block diagonal
            self.rank = self._blocks.width
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
        if self._blocks is None:
            self.register_buffer("cov_factor", torch.zeros(hi - lo, min(self.rank, D), **dd))
        else:  # each block's factor (D_b, K_b) on its own (K_b = 0 before a fit with rank="auto")
            for key, (a, e), k in zip(self._blocks.factor_names, self._blocks.bounds, self._blocks.initial):
                self.register_buffer(key, torch.zeros(e - a, k, **dd))
        self.register_buffer("cov_diag", torch.zeros(hi - lo, **dd))
        if self._sharding is not None:
            sh = self._sharding
            self.register_buffer("shard", torch.tensor([D, sh.world_size, sh.rank, lo, hi], device=ref.device))
        self.register_buffer("prior_precision", self._check_prior_precision(prior_precision, ref))
        self.register_buffer("sigma_noise", self._check_sigma(sigma_noise, ref))
        self.register_buffer("n_data", torch.zeros((), dtype=torch.int64, device=ref.device))
        self.register_buffer("loss", torch.zeros((), **dd))
        self.register_buffer("loss_grad", torch.zeros(hi - lo, **dd))
        self.register_buffer("fitted_temperature", torch.zeros((), **dd))
        self.register_buffer("n_outputs", torch.zeros((), dtype=torch.int64, device=ref.device))
        if self._blocks is not None:
            self.register_buffer("block_ranks", torch.tensor(self._blocks.initial, device=ref.device))
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

    def _check_prior_precision(self, value, ref: Tensor, differentiable: bool = False) -> Tensor:
        """``value`` as a Tensor of shape (1,) or (L,), checked (positive, finite); a detached copy unless
        ``differentiable`` and ``value`` requires grad (then reshaped only, its graph kept)."""
        name = type(self).__name__
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or torch.is_tensor(value)):
            raise TypeError(f"{name}: prior_precision must be a positive float or a Tensor of shape (1,) or "
                            f"({self.n_layers},), got {type(value).__name__}.")
        keep = differentiable and torch.is_tensor(value) and value.requires_grad
        t = value.reshape(-1) if keep else torch.as_tensor(value, dtype=ref.dtype).to(ref.device).detach().reshape(-1).clone()
        if t.numel() not in (1, self.n_layers):
            raise ValueError(f"{name}: prior_precision must be a scalar or have one value per parameter tensor "
                             f"(shape (1,) or ({self.n_layers},)), got shape {tuple(torch.as_tensor(value).shape)!r}.")
        if not bool(torch.isfinite(t.detach()).all() and (t.detach() > 0).all()):
            raise ValueError(f"{name}: prior_precision must be positive and finite, got {_show(value)}.")
        return t

    def _check_sigma(self, value, ref: Tensor, differentiable: bool = False) -> Tensor:
        """``value`` as a Tensor of shape (), checked (positive, finite, 1 for classification); a detached copy
        unless ``differentiable`` and ``value`` requires grad."""
        name = type(self).__name__
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or torch.is_tensor(value)):
            raise TypeError(f"{name}: sigma_noise must be a positive float, got {type(value).__name__}.")
        keep = differentiable and torch.is_tensor(value) and value.requires_grad
        t = value if keep else torch.as_tensor(value, dtype=ref.dtype).to(ref.device).detach().clone()
        if t.numel() != 1 or not bool(torch.isfinite(t.detach()).all() and (t.detach() > 0).all()):
            raise ValueError(f"{name}: sigma_noise must be a positive finite scalar, got {_show(value)}.")
        if self.likelihood == "classification" and float(t.detach()) != 1.0:
            raise ValueError(f"{name}: sigma_noise must be 1 for likelihood='classification', got {_show(value)}.")
        return t.reshape(())

    def _check_fitted(self, what: str) -> None:
        if int(self.n_data) == 0:
            raise RuntimeError(f"{type(self).__name__}: {what} needs a fitted Laplace approximation; call "
                               "fit(train_loader) first (or load_state_dict).")

    def _batch(self, batch, what: str):
        name = type(self).__name__
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"{name}: {what} must yield (inputs, targets) pairs, got "
                             f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}.")
        x, y = batch
        ref = self.loc
        x = x.to(ref.device, ref.dtype) if x.is_floating_point() else x.to(ref.device)
        y = y.to(ref.device)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{name}: inputs and targets of a batch must have the same length, got "
                             f"{x.shape[0]} and {y.shape[0]}.")
        return x, y

    def _batch_loss(self, out: Tensor, y: Tensor) -> Tensor:
        name = type(self).__name__
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        C = out.shape[-1]
        if self.likelihood == "regression":
            y = y.to(out.dtype)
            y = y.unsqueeze(-1) if y.dim() == 1 else y
            if y.shape != out.shape:
                raise ValueError(f"{name}: regression targets must have the outputs' shape {tuple(out.shape)!r} "
                                 f"(or ({out.shape[0]},) for one output), got {tuple(y.shape)!r}.")
            return (y - out).pow(2).sum()
        if y.is_floating_point() and bool((y != y.round()).any()):
            raise ValueError(f"{name}: classification targets must be integer class labels, got non-integer values.")
        y = y.long().reshape(-1)
        hi = 2 if C == 1 else C
        if y.numel() != out.shape[0] or bool(((y < 0) | (y >= hi)).any()):
            raise ValueError(f"{name}: classification targets must be labels in [0, {hi}) of shape "
                             f"({out.shape[0]},), got values in [{int(y.min())}, {int(y.max())}].")
        if C == 1:
            return nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y.to(out.dtype), reduction="sum")
        return nn.functional.cross_entropy(out, y, reduction="sum")

    # ------------------------------------------------------------------ fit
    def _theta(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def fit(self, train_loader: Iterable) -> "FactorLaplace":
        """One pass over the data at the current (MAP) weights: the curvature, fitted by factor analysis.

        Parameters
        ----------
        train_loader : iterable of (Tensor, Tensor)
            Batches of inputs (B, ...) and targets: labels (B,) for classification, values (B,) or (B, C)
            for regression (a ``torch.utils.data.DataLoader`` or a list).

        Returns
        -------
        self

        Raises
        ------
        ValueError
            Malformed batches, targets, non-finite weights or curvature, an empty loader, a dropout or
            batch-norm layer in train mode (nothing changed).
        """
        name = type(self).__name__
        check_eval_mode(name, self.model, "model")  # before any forward pass: its buffers stay as they are
        theta = self._theta()
        if not bool(torch.isfinite(theta).all()):
            raise ValueError(f"{name}: the model's weights must be finite to fit a Laplace approximation, got "
                             "NaN or inf.")
        generator = torch.Generator(device=theta.device).manual_seed(self.seed)
        totals = {"n": 0, "loss": theta.new_zeros(()), "grad": torch.zeros_like(theta), "outputs": 0, "first": True}
        leaf = theta.clone().requires_grad_(True)

        def passes():
            count, totals["first"] = totals["first"], False
            for batch in train_loader:
                x, y = self._batch(batch, "train_loader")
                for lo in range(0, x.shape[0], self.chunk_size):
                    xc, yc = x[lo:lo + self.chunk_size], y[lo:lo + self.chunk_size]
                    if count:  # the loss and its gradient at theta (the linearised evidence's g)
                        with torch.enable_grad():
                            out = self._f(leaf, xc)
                            loss = self._batch_loss(out, yc)
                            totals["grad"] += torch.autograd.grad(loss, leaf)[0]
                        totals["loss"] += loss.detach()
                        out = out.detach()
                        totals["n"] += xc.shape[0]
                        totals["outputs"] = 1 if out.dim() == 1 else out.shape[-1]
                    yield curvature_vectors(self._f, theta, xc, self.likelihood, self.curvature,
                                            num_samples=self.mc_samples, generator=generator)

        if self._blocks is not None:  # every block's fitter fed from the one stream
            F, psi, info = fit_blocks(passes, self._blocks, num_passes=self.num_passes, seed=self.seed,
                                      dtype=theta.dtype, device=theta.device, owner=name)
        else:
            F, psi, info = fit_second_moment(passes, self.dim, self.rank, method=self.curvature_fit,
                                             num_passes=self.num_passes, seed=self.seed, dtype=theta.dtype,
                                             device=theta.device, owner=name, process_group=self.process_group)
        if self.process_group is not None:
            import torch.distributed as dist

            sums = torch.stack([totals["loss"].to(torch.float64), torch.tensor(float(totals["n"]), dtype=torch.float64,
                                device=theta.device), torch.tensor(float(totals["outputs"]), dtype=torch.float64,
                                device=theta.device)])
            outputs = sums[2].clone()
            dist.all_reduce(sums, group=self.process_group)
            dist.all_reduce(outputs, op=dist.ReduceOp.MAX, group=self.process_group)
            totals["loss"], totals["n"], totals["outputs"] = sums[0].to(theta.dtype), int(sums[1]), int(outputs)
            dist.all_reduce(totals["grad"], group=self.process_group)
        n_data = totals["n"]
        if n_data == 0:
            raise ValueError(f"{name}: train_loader must yield at least one example, got none.")
        if not bool(torch.isfinite(totals["loss"])):
            raise ValueError(f"{name}: the loss at the MAP must be finite, got {float(totals['loss'])!r}.")
        if not bool(torch.isfinite(totals["grad"]).all()):
            raise ValueError(f"{name}: the gradient of the loss at the MAP must be finite, got NaN or inf.")
        ratio = info["n_vectors"] / n_data  # F F^T + psi fits G / V: rescale to G / N
        factor = {}
        if self._blocks is None:
            factor["cov_factor"] = F * ratio ** 0.5
        else:  # each block's factor kept on its own (allocated first for rank="auto"), rescaled
            F, psi, ranks, info["values"] = _assemble_blocks(self._blocks, F, psi, ratio, self._prior_diag(
                self.prior_precision), n_data / float(self.sigma_noise) ** 2)
            ratio = 1.0
            self._replace(block_ranks=ranks)
            self._replace_block_factors(F)
        lo, hi = self._rows
        self._replace(loc=theta[lo:hi], **factor, cov_diag=psi * ratio, loss=totals["loss"],
                      loss_grad=totals["grad"][lo:hi], n_data=torch.tensor(n_data),
                      n_outputs=torch.tensor(totals["outputs"]))
        self.fit_info = info
        return self

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

    def _posterior(self, prior_precision=None, sigma_noise=None) -> LowRankPrecisionNormal:
        pp, sg = self._resolve(prior_precision, sigma_noise)
        scale = self.n_data.to(self.loc.dtype) / sg.pow(2)
        prec_diag = self._prior_diag(pp) + scale * self.cov_diag
        # its own storage: neither a later fit() nor an in-place change of the posterior reaches the other
        if self._blocks is not None:
            blocks = [(a, e, F * scale.sqrt()) for a, e, F in self.block_factors]
            return BlockLowRankPrecisionNormal(self.loc.clone(), blocks, prec_diag)
        prec_factor = self.cov_factor * scale.sqrt()
        if self._sharding is not None:
            return ShardedLowRankPrecisionNormal(self.loc.clone(), prec_factor, prec_diag, self._sharding)
        return LowRankPrecisionNormal(self.loc.clone(), prec_factor, prec_diag)

    def get_posterior(self) -> Union[LowRankPrecisionNormal, BlockLowRankPrecisionNormal, ShardedLowRankPrecisionNormal]:
        r"""The Laplace approximation :math:`N(\theta_*, P^{-1})` at the current prior precision and noise.

        A snapshot: its tensors share no storage with this object's buffers, so a later :meth:`fit`,
        :meth:`optimize_prior_precision` or :meth:`load_state_dict` leaves a posterior already taken as it was.

        Returns
        -------
        FactorNormal
            A :class:`~pyro_fa.distributions.LowRankPrecisionNormal`; with a rank per layer a
            :class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal`; under a ``process_group`` this rank's rows
            (:class:`~pyro_fa.laplace.ShardedLowRankPrecisionNormal`).

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fitted("get_posterior()")
        return self._posterior()

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal variances of the weights, shape (D,) (this rank's (D_r,) when sharded; collective)."""
        return self.get_posterior().variance

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
    def _glm_moments(self, x: Tensor):
        if self._sharding is not None:  # refused before any collective, as linearized_moments refuses it
            check_eval_mode(type(self).__name__, self.model, "model")
        post = self.get_posterior()
        if self._sharding is not None:
            # the whole linearisation point (D numbers, gathered) and each rank's rows of the posterior
            return sharded_glm_moments(self._f, self._sharding.all_gather(self.loc), x, post, self.chunk_size)
        factor = post.cov_factor if self._blocks is None else post.cov_factors  # blocks: never densified
        return linearized_moments(self.model, self.loc, x, cov_diag=post.cov_diag, cov_factor=factor,
                                  factor_sign=-1.0, chunk_size=self.chunk_size, params=self._params)

    def _sampled_outputs(self, x: Tensor, n_samples: int) -> Tensor:
        thetas = self.get_posterior().rsample((n_samples,))
        with torch.no_grad():  # sharded: one whole weight vector at a time gathered from the ranks' rows
            gather = (lambda t: t) if self._sharding is None else self._sharding.all_gather
            outs = [self._f(gather(t), x) for t in thetas]
        outs = torch.stack(outs)
        return outs.unsqueeze(-1) if outs.dim() == 2 else outs  # (S, N, C)

    def predict_proba(self, x: Tensor, pred_type: str = "glm", link_approx: str = "probit",
                      n_samples: int = 100) -> Tensor:
        r"""Class probabilities of the Laplace approximation's predictive.

        Parameters
        ----------
        x : Tensor of shape (N, ...)
        pred_type : {"glm", "nn"}, default "glm"
            The linearised network (Immer et al. 2021) or sampled networks.
        link_approx : {"probit", "mc"}, default "probit"
            For ``"glm"``: the probit approximation of the softmax of Gaussian logits, or ``n_samples`` draws of
            them. ``"nn"`` always samples.
        n_samples : int, default 100

        Returns
        -------
        Tensor of shape (N, C)
            (N, 2) for a single Bernoulli logit.
        """
        name = type(self).__name__
        if self.likelihood != "classification":
            raise ValueError(f"{name}: predict_proba needs likelihood='classification', got {self.likelihood!r}; "
                             "use predict(x).")
        check_pred_type(name, pred_type, link_approx if pred_type == "glm" else None)
        _positive_int(name, "n_samples", n_samples)
        self._check_fitted("predict_proba()")
        x = x.to(self.loc.device, self.loc.dtype) if x.is_floating_point() else x.to(self.loc.device)
        if pred_type == "nn":
            return self._link(self._sampled_outputs(x, n_samples)).mean(0)
        mean, cov = self._glm_moments(x)
        if link_approx == "probit":
            if mean.shape[-1] == 1:
                p1 = torch.sigmoid(mean / torch.sqrt(1 + math.pi / 8 * cov[..., 0]))
                return torch.cat([1 - p1, p1], -1)
            return probit_proba(mean, cov)
        eye = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
        chol = torch.linalg.cholesky(cov + 1e-10 * cov.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1e-30)[:, None, None] * eye)
        z = mean + (torch.randn((n_samples,) + mean.shape, dtype=mean.dtype, device=mean.device).unsqueeze(-2)
                    @ chol.transpose(-1, -2)).squeeze(-2)
        probs = self._link(z).mean(0)
        if self._sharding is not None:  # rank 0's draws: every rank returns the same probabilities
            probs = self._sharding.broadcast(probs.to(torch.float64).to(self._sharding.device)).to(mean)
        return probs

    @staticmethod
    def _link(z: Tensor) -> Tensor:
        if z.shape[-1] == 1:
            p1 = torch.sigmoid(z)
            return torch.cat([1 - p1, p1], -1)
        return z.softmax(-1)

    def predict(self, x: Tensor, pred_type: str = "glm", n_samples: int = 100):
        r"""Predictive mean and variance of a regression, each of shape (N, C).

        ``"glm"``: :math:`f(x; \theta_*)` and :math:`\mathrm{diag}(J\Sigma J^\top) + \sigma^2`; ``"nn"``: the
        mean and variance of ``n_samples`` sampled networks' outputs, plus :math:`\sigma^2`.
        """
        name = type(self).__name__
        if self.likelihood != "regression":
            raise ValueError(f"{name}: predict needs likelihood='regression', got {self.likelihood!r}; "
                             "use predict_proba(x).")
        check_pred_type(name, pred_type)
        _positive_int(name, "n_samples", n_samples)
        self._check_fitted("predict()")
        x = x.to(self.loc.device, self.loc.dtype) if x.is_floating_point() else x.to(self.loc.device)
        noise = self.sigma_noise.pow(2)
        if pred_type == "glm":
            mean, cov = self._glm_moments(x)
            return mean, cov.diagonal(dim1=-2, dim2=-1) + noise
        outs = self._sampled_outputs(x, n_samples)
        return outs.mean(0), outs.var(0, unbiased=False) + noise

    def forward(self, x: Tensor, pred_type: str = "glm", link_approx: str = "probit", n_samples: int = 100):
        """laplace-torch's ``la(x, ...)``: :meth:`predict_proba` for classification, :meth:`predict` for regression."""
        if self.likelihood == "classification":
            return self.predict_proba(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)
        return self.predict(x, pred_type=pred_type, n_samples=n_samples)

    def extra_repr(self) -> str:
        return (f"likelihood={self.likelihood!r}, dim={self.dim}, rank={self.rank}, curvature={self.curvature!r}, "
                f"curvature_fit={self.curvature_fit!r}" + (f", rows={self._rows}" if self._sharding else "")
                + ("" if self._blocks is None else f", blocks={dict(zip(self._blocks.names, self.block_ranks.tolist()))}"))
