r"""SWAG over ``torch.distributed`` ranks: each rank collects one coordinate shard of the replicated weights.

Under data parallelism (``DistributedDataParallel``) every rank holds the same
:math:`\theta \in \mathbb{R}^D` after each step. Collecting it on every rank would store
the posterior :math:`W` times; instead rank :math:`r` collects rows :math:`[lo_r, hi_r)`
(:func:`~pyro_fa.distributed.shard_bounds`) and fits them with a sharded
:class:`~pyro_fa.OnlineFactorAnalysis` (or keeps its rows of classic SWAG's deviations),
so the posterior's memory per rank is :math:`O(DK/W)`. Sampled weights are assembled by
an all-gather, so every rank runs the same sampled network.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn
from pyro_fa import _random

from pyro_fa.distributed.normal import ShardedLowRankNormal
from pyro_fa.distributed.sharding import (agree, check_loadable, check_shard_state, checksum, draw_seed,
                                          flatten_slice, make_sharding, raise_agreed, resolve_group, weak_group)
from pyro_fa.distributions import StableLowRankMultivariateNormal

__all__ = ["LocalRows", "ShardedRows", "swag_rows", "unwrap_ddp", "flatten_slice"]


def unwrap_ddp(obj) -> Tuple[Any, Any]:
    """``(module, process_group)`` of a ``DistributedDataParallel`` wrapper; anything else as is, with None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return obj, None
    if isinstance(obj, DistributedDataParallel):
        return obj.module, obj.process_group
    return obj, None


def _param_descriptor(obj) -> Any:
    """What the ranks' parameters must share (sizes, shapes, dtypes, device kinds), or why it cannot be read."""
    if obj is None:
        return None  # Pyro's param store: read at the first collection (see ShardedRows.agree_params)
    try:
        if isinstance(obj, nn.Module):
            named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
        else:
            named = [(str(i), p) for i, p in enumerate(obj)]
        return describe_parameters(named)
    except Exception as exc:  # the local checks of SWAG raise it alike on every rank
        return f"unreadable ({type(exc).__name__})"


def describe_parameters(named) -> Dict[str, Any]:
    """What every rank must agree on about ``named`` ((name, tensor) pairs): D, a checksum of the names and
    shapes, the dtypes, the devices and whether the tensors are leaves (compared across ranks by ``agree``)."""
    tensors = [p for _, p in named if torch.is_tensor(p)]
    return {
        "D": sum(p.numel() for p in tensors),
        "shapes": checksum([(n, tuple(p.shape) if torch.is_tensor(p) else type(p).__name__) for n, p in named]),
        "dtypes": sorted({str(p.dtype) for p in tensors}),
        "devices": (len({p.device for p in tensors}), sorted({p.device.type for p in tensors})),
        "leaves": all(p.is_leaf for p in tensors),
    }


def swag_rows(obj, process_group, cls: str, fields: Dict[str, Any]):
    """Detect DDP and choose a SWAG's rows: :class:`LocalRows`, or :class:`ShardedRows` over a process group.

    Sharded, the ranks first agree on every argument (collective), so that a bad one raises alike on
    every rank. Returns ``(module_or_params, seed, rows)``: the unwrapped module (a list for an iterable
    of tensors, read once), the seed the ranks share (rank 0's when ``seed`` is None) and the rows.
    """
    obj, ddp_group = unwrap_ddp(obj)
    group = process_group if process_group is not None else ddp_group
    if group is None:
        return obj, fields["seed"], LocalRows()
    group = weak_group(resolve_group(group, cls))
    if obj is not None and not isinstance(obj, nn.Module) and not torch.is_tensor(obj):
        try:
            obj = list(obj)
        except TypeError:
            pass  # not iterable: SWAG raises on every rank alike
    # seed=None: rank 0's draw from torch's global generator (see draw_seed) is every rank's seed
    owns = agree(group, cls, dict(fields, params=_param_descriptor(obj)),
                 own={"seed": draw_seed() if fields["seed"] is None else None})
    return obj, fields["seed"] if fields["seed"] is not None else owns[0]["seed"], ShardedRows(group)


class LocalRows:
    """The rows of a :class:`~pyro_fa.SWAG` in one process: all D coordinates, nothing to communicate."""

    distributed = False  # built with a process group (or a DDP model's)
    sharding = None  # the Sharding of the collected coordinates, set by rows()

    def agree_params(self, cls: str, named, from_param_store: bool) -> None:
        """Param-store sources, read at the first collection: the ranks must hold the same parameters."""

    def rows(self, cls: str, dim: int, seed) -> Tuple[int, int]:
        """This process's coordinates ``[lo, hi)`` of the ``dim``."""
        return 0, dim

    def distance(self, theta: Tensor, loc: Tensor, guard: bool, spread2: Callable[[bool], float]):
        """The divergence guard's squared distance of ``theta`` from ``loc`` and squared spread, and a count of
        non-finite entries (a callable); ``spread2(over_all_ranks)`` is the collected spread."""
        dist2 = spread = 0.0
        if guard:
            # the distance in the state's dtype (the mean rounded once is close enough for a guard);
            # a non-finite distance sends us to the finiteness check
            dist2 = float(torch.linalg.vector_norm(theta - loc)) ** 2
            spread = spread2(False)
        return dist2, spread, lambda: int((~torch.isfinite(theta)).sum())

    def draw_noise(self, cls: str, num_samples: int, rank: int, generator, ref: Tensor) -> Tuple[Tensor, Tensor]:
        """Latent draws (S, K) and this process's coordinate noise (S, D_r)."""
        h = _random.randn((num_samples, rank), generator, ref.dtype, ref.device)
        eps = _random.randn((num_samples, ref.shape[-1]), generator, ref.dtype, ref.device)
        return h, eps

    def normal(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, scale: float):
        """The posterior :math:`N(c, s(FF^T + \\Psi))` over these rows."""
        if scale == 1.0:
            return StableLowRankMultivariateNormal(loc, cov_factor, cov_diag)
        return StableLowRankMultivariateNormal(loc, cov_factor * math.sqrt(scale), cov_diag * scale)

    def gather(self, local: Tensor) -> Tensor:
        """Whole vectors (..., D) from these rows (..., D_r)."""
        return local

    def max_and_total(self, local_max: float, local_total: Callable[[], float]) -> Tuple[float, Optional[float]]:
        """A maximum over the ranks, and (sharded) a sum over the ranks of ``local_total()``; None in one process."""
        return local_max, None

    def mean_variance(self, var: Tensor, global_mean: Callable[[], float]) -> Tensor:
        """The mean over all D of the running variances ``var`` (this rank's rows), ``global_mean()`` when sharded."""
        return var.mean()

    def full_theta(self, theta, dim: int):
        """A whole vector to load: one of this rank's rows (e.g. ``swag.loc``) is gathered."""
        return theta

    def require_whole(self, cls: str, what: str) -> None:
        """Refuse (``RuntimeError``) what needs the whole factor in one process."""

    def describe(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The extra state, with the shard's descriptor when sharded."""
        return state

    def check_state(self, swag, state_dict, strict: bool, check_values) -> Optional[float]:
        """A saved state's keys, shapes, shard and values (collective when sharded); the running total, if sharded."""
        total = check_loadable(swag, state_dict, strict, self.sharding)
        raise_agreed(self.sharding, type(swag).__name__, check_values)
        return total

    def check_shard_state(self, cls: str, state) -> None:
        check_shard_state(cls, state, self.sharding)


class ShardedRows(LocalRows):
    """The rows of a :class:`~pyro_fa.SWAG` sharded over a process group: this rank's coordinates, collectives."""

    distributed = True

    def __init__(self, group):
        self.group = group  # None for the default group (see weak_group)

    def agree_params(self, cls: str, named, from_param_store: bool) -> None:
        if from_param_store:
            agree(self.group, cls, {"params": describe_parameters(named)})

    def rows(self, cls: str, dim: int, seed) -> Tuple[int, int]:
        import torch.distributed as dist

        W = dist.get_world_size(self.group)
        self.sharding = make_sharding(self.group, cls, dim, [None] * W, seed)
        return self.sharding.lo, self.sharding.hi

    def distance(self, theta: Tensor, loc: Tensor, guard: bool, spread2: Callable[[bool], float]):
        # one all-reduce; the count is taken only where the guard cannot accept
        dist2 = float(torch.linalg.vector_norm(theta - loc)) ** 2 if guard else 0.0
        bad = 0.0 if guard and math.isfinite(dist2) else float((~torch.isfinite(theta)).sum())
        table, (total,) = self.sharding.reduce([bad], torch.tensor([dist2], dtype=torch.float64))
        dist2, bad = float(total[0]), int(sum(row[0] for row in table))
        return dist2, spread2(True) if guard else 0.0, lambda: bad

    def draw_noise(self, cls: str, num_samples: int, rank: int, generator, ref: Tensor) -> Tuple[Tensor, Tensor]:
        # the latent draws are shared by the ranks, the coordinate noise is this rank's
        self.sharding.agree_sizes(cls, "number of samples", num_samples)
        h, gen = self.sharding.shared_normal(num_samples, rank, generator, ref.dtype, ref.device)
        eps = torch.randn(num_samples, ref.shape[-1], generator=gen, dtype=ref.dtype, device=ref.device)
        return h, eps

    def normal(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, scale: float):
        # this rank's rows; log_prob, entropy and sample are collective
        return ShardedLowRankNormal(loc, cov_factor * math.sqrt(scale), cov_diag * scale, self.sharding)

    def gather(self, local: Tensor) -> Tensor:
        return self.sharding.all_gather(local)

    def max_and_total(self, local_max: float, local_total: Callable[[], float]) -> Tuple[float, Optional[float]]:
        table, (total,) = self.sharding.reduce([local_max], torch.tensor([local_total()], dtype=torch.float64))
        return max(row[0] for row in table), float(total[0])

    def mean_variance(self, var: Tensor, global_mean: Callable[[], float]) -> Tensor:
        return var.new_tensor(global_mean())

    def full_theta(self, theta, dim: int):
        sh = self.sharding
        if torch.is_tensor(theta) and theta.shape == (sh.size,) and sh.size != dim:
            return sh.all_gather(theta)
        return theta

    def require_whole(self, cls: str, what: str) -> None:
        raise RuntimeError(f"{cls}: {what} needs the whole factor, got a SWAG sharded as {self.sharding!r}; use "
                           "pred_type='glm' with link_approx='mc' (sampled, collective).")

    def describe(self, state: Dict[str, Any]) -> Dict[str, Any]:
        state["shard"] = self.sharding.descriptor()
        return state
