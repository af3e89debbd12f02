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
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn
from pyro_fa import _random

from pyro_fa.distributed.sharding import (agree, check_loadable, check_shard_state, checksum, draw_seed,
                                          flatten_slice, make_sharding, resolve_group, weak_group)

__all__ = ["ShardedSWAG", "unwrap_ddp", "flatten_slice"]


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
        return None  # Pyro's param store: read at the first collection (see ShardedSWAG._agree_params)
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


class ShardedSWAG:
    """The collectives of a sharded :class:`~pyro_fa.SWAG` (a mixin over its state)."""

    _distributed = False  # built with a process group (or a DDP model's)
    _group = None  # that group; None for the default one (see weak_group)
    _sharding = None
    _sq_dev_total = 0.0  # classic SWAG: sum over all D of the running squared deviations

    # ------------------------------------------------------------- set-up
    def _agree_args(self, obj, process_group, fields: Dict[str, Any]):
        """Detect DDP, then agree with the other ranks on every argument (collective when sharded).

        Returns ``(module_or_params, seed)``: the unwrapped module (a list for an iterable of
        tensors, read once) and the seed the ranks share (rank 0's when ``seed`` is None).
        """
        cls = type(self).__name__
        obj, ddp_group = unwrap_ddp(obj)
        group = process_group if process_group is not None else ddp_group
        if group is None:
            return obj, fields["seed"]
        self._group = weak_group(resolve_group(group, cls))
        self._distributed = True
        if obj is not None and not isinstance(obj, nn.Module) and not torch.is_tensor(obj):
            try:
                obj = list(obj)
            except TypeError:
                pass  # not iterable: SWAG raises on every rank alike
        # seed=None: rank 0's draw from torch's global generator (see draw_seed) is every rank's seed
        owns = agree(self._group, cls, dict(fields, params=_param_descriptor(obj)),
                     own={"seed": draw_seed() if fields["seed"] is None else None})
        return obj, fields["seed"] if fields["seed"] is not None else owns[0]["seed"]

    def _agree_params(self, named) -> None:
        """Param-store sources, read at the first collection: the ranks must hold the same parameters."""
        if self._distributed and self._source.from_param_store:
            agree(self._group, type(self).__name__, {"params": describe_parameters(named)})

    def _shard_rows(self, D: int) -> int:
        """Set this rank's rows of the D coordinates; their number."""
        if not self._distributed:
            return D
        import torch.distributed as dist

        W = dist.get_world_size(self._group)
        self._sharding = make_sharding(self._group, type(self).__name__, D, [None] * W, self._fa_kwargs["seed"])
        return self._sharding.size

    @property
    def sharding(self):
        """The :class:`~pyro_fa.distributed.Sharding` of the collected coordinates, or None."""
        return self._sharding

    def _sq_dev_global(self) -> float:
        return self._fit.sq_dev_total(self)

    # ------------------------------------------------------------- collect
    def _sharded_distance(self, theta: Tensor, guard: bool) -> Tuple[float, float, int]:
        """The divergence guard's squared distance and spread and the non-finite count, over all ranks.

        One all-reduce; the count is taken only where the guard cannot accept (as :meth:`SWAG._refusal`).
        """
        dist2 = float(torch.linalg.vector_norm(theta - self.loc)) ** 2 if guard else 0.0
        bad = 0.0 if guard and math.isfinite(dist2) else float((~torch.isfinite(theta)).sum())
        table, (total,) = self._sharding.reduce([bad], torch.tensor([dist2], dtype=torch.float64))
        dist2, bad = float(total[0]), int(sum(row[0] for row in table))
        spread2 = self._sq_dev_global() / self._n if guard else 0.0
        return dist2, spread2, bad

    # ------------------------------------------------------------- sample
    def _draw_noise(self, num_samples: int, generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
        """Latent draws (S, K), shared by the ranks when sharded, and this rank's coordinate noise (S, D_r)."""
        ref = self.loc
        if self._sharding is None:
            h = _random.randn((num_samples, self.rank), generator, ref.dtype, ref.device)
            eps = _random.randn((num_samples, self.dim), generator, ref.dtype, ref.device)
            return h, eps
        self._sharding.agree_sizes(type(self).__name__, "number of samples", num_samples)
        h, gen = self._sharding.shared_normal(num_samples, self.rank, generator, ref.dtype, ref.device)
        eps = torch.randn(num_samples, ref.shape[-1], generator=gen, dtype=ref.dtype, device=ref.device)
        return h, eps

    def _gather_full(self, local: Tensor) -> Tensor:
        """Whole vectors (..., D) from this rank's rows (..., D_r) (an all-gather when sharded)."""
        return local if self._sharding is None else self._sharding.all_gather(local)

    def _full_theta(self, theta):
        """A whole vector to load: one of shape (D_r,) (this rank's rows, e.g. ``swag.loc``) is gathered."""
        sh = self._sharding
        if sh is not None and torch.is_tensor(theta) and theta.shape == (sh.size,) and sh.size != self.dim:
            return sh.all_gather(theta)
        return theta

    # ------------------------------------------------------------- state
    def _check_shard_state(self, state) -> None:
        check_shard_state(type(self).__name__, state, self._sharding)

    def _check_loadable(self, state_dict, strict: bool) -> Optional[float]:
        return check_loadable(self, state_dict, strict, self._sharding)

    def _loaded_total(self, total: Optional[float]) -> None:
        if total is None:
            return
        self._fit.set_sq_dev_total(self, total)
