r"""Coordinate sharding of a factor-analysis posterior over ``torch.distributed`` ranks.

A posterior :math:`N(c, FF^\top + \Psi)` over :math:`\theta \in \mathbb{R}^D` splits by
coordinates: rank :math:`r` of :math:`W` holds rows :math:`[lo_r, hi_r)` of :math:`c`,
:math:`F`, :math:`\psi` and of every statistic. Everything the fits compute is either
row-local (the M-step, the running moments, Adam's moments) or a sum over :math:`D` of
a few numbers per row: the E-step's projection :math:`F^\top\Psi^{-1}(\theta - c)`
(:math:`K` numbers per vector) and the capacitance :math:`F^\top\Psi^{-1}F`
(:math:`K \times K`), plus scalars (squared norms, minima and maxima for the range
checks). Those are the only collectives, and the ones an update needs are packed into
one ``all_reduce`` (:meth:`Sharding.reduce`).

This module needs only torch.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from pyro_fa import _random
from pyro_fa._random import draw_seed  # re-exported: what every sharded object seeds itself with

__all__ = [
    "shard_bounds",
    "Sharding",
    "resolve_group",
    "weak_group",
    "agree",
    "raise_agreed",
    "agree_on_group",
    "draw_seed",
    "make_sharding",
    "check_shard_state",
    "check_loadable",
    "flatten_slice",
    "sharded_orthogonal_init",
    "checksum",
]

_WIDE = torch.float64  # what the collectives carry: partial sums of float32 states are added in float64
_SEED_MIX = 0x9E3779B1  # odd: rank -> seed offset is a bijection modulo 2**32
#: another rank's error, by its class name, re-raised here as this class (every other error as ValueError)
_RAISED_AS = {"TypeError": TypeError}
#: the extra-state entries that record a rank's place (differ by rank): left out of the checkpoints' agreement
_PLACE_KEYS = frozenset({"shard"})


def shard_bounds(dim: int, world_size: int, rank: int) -> Tuple[int, int]:
    r"""The rows ``[lo, hi)`` of a length-``dim`` vector that rank ``rank`` of ``world_size`` holds.

    Contiguous blocks in rank order, as even as possible: the first ``dim % world_size``
    ranks hold one row more.

    Parameters
    ----------
    dim : int
        :math:`D`, at least ``world_size`` (every rank holds a row).
    world_size : int
    rank : int
        In ``[0, world_size)``.

    Returns
    -------
    (int, int)

    Examples
    --------
    >>> [shard_bounds(10, 3, r) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    for name, value, low in (("dim", dim, 1), ("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"shard_bounds: {name} must be an integer >= {low}, got {value!r}.")
    if rank >= world_size:
        raise ValueError(f"shard_bounds: rank must be in [0, world_size) = [0, {world_size}), got {rank!r}.")
    if dim < world_size:
        raise ValueError(f"shard_bounds: dim must be >= world_size={world_size} (every rank holds a row), got {dim!r}.")
    base, extra = divmod(dim, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def checksum(obj: Any) -> int:
    """A 32-bit checksum of ``repr(obj)``: what ranks compare to agree on shapes and names."""
    return zlib.crc32(repr(obj).encode())


def resolve_group(process_group, cls: str):
    """Check that ``process_group`` can be used now; return it (``None`` stays ``None``).

    Raises (locally, on every rank alike: nothing collective has started) ``RuntimeError``
    when ``torch.distributed`` is unavailable or not initialised, ``TypeError`` for an
    object that is not a process group, ``ValueError`` when this process is not a member.
    """
    if process_group is None or isinstance(process_group, Sharding):
        return process_group
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"{cls}: process_group needs torch.distributed, got a torch build without it.")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{cls}: process_group needs an initialised torch.distributed, got an uninitialised (or destroyed) "
            "default process group. Call torch.distributed.init_process_group(...) on every rank first."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{cls}: process_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD), got {type(process_group).__name__}.")
    if dist.get_rank(process_group) < 0:
        raise ValueError(f"{cls}: process_group must contain this process (global rank {dist.get_rank()}), "
                         "got a group it is not a member of.")
    return process_group


def weak_group(group):
    """``None`` for the default group (what collectives take for it), any other group as is.

    Objects built on the default group then hold no reference to it: a process group
    whose last reference is dropped by the garbage collector at interpreter exit, after
    ``destroy_process_group()``, can abort the process (gloo's threads).
    """
    import torch.distributed as dist

    return None if group is None or group is dist.group.WORLD else group


def _comm_device(group) -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, cls: str, same: Dict[str, Any], own: Optional[Dict[str, Any]] = None,
          error: Optional[BaseException] = None) -> List[Dict[str, Any]]:
    """Exchange a small descriptor over ``group`` and raise the same error on every rank on disagreement.

    Collective (one ``all_gather_object``): every rank of ``group`` must call it. ``same``
    holds what every rank must pass alike (compared by ``repr``); ``own`` what each rank
    holds for itself (returned, in rank order); ``error`` an exception this rank met before
    the call, which is raised on this rank and reported on the others, so that a mistake
    on one rank stops all of them instead of leaving the others waiting in a collective.

    Returns
    -------
    list of dict
        Every rank's ``own``, in rank order.

    Raises
    ------
    ValueError
        If ranks disagree on a value of ``same``, or another rank met an error (its
        ``TypeError`` stays a ``TypeError``).
    """
    import torch.distributed as dist

    payload = {
        "same": {k: repr(v) for k, v in same.items()},
        "own": own or {},
        "error": None if error is None else (type(error).__name__, str(error)),
    }
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, payload, group=group)
    failed = [(r, p["error"]) for r, p in enumerate(out) if p["error"] is not None]
    if failed:
        if error is not None:
            try:
                raise error
            finally:  # no frame <-> traceback cycle: it would keep the process group alive until exit
                error = None
        r, (kind, msg) = failed[0]
        exc = _RAISED_AS.get(kind, ValueError)
        raise exc(f"{cls}: rank {r} refused its input ({msg}), so every rank stops and nothing was changed.")
    keys = [sorted(p["same"]) for p in out]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"{cls}: every rank must build the same kind of object, got descriptors with keys "
                         + ", ".join(f"{k!r} on rank {r}" for r, k in enumerate(keys)) + ".")
    for key in keys[0]:
        values = [p["same"][key] for p in out]
        if any(v != values[0] for v in values):
            raise ValueError(f"{cls}: every rank must pass the same {key}, got "
                             + ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
                             + "; nothing was built on any rank.")
    return [p["own"] for p in out]


def raise_agreed(sharding: Optional["Sharding"], cls: str, check: Callable[[], None]) -> None:
    """Run ``check()``; a ``ValueError`` it raises stops every rank when sharded (collective), else it is raised.

    Sharded, every rank must call it: the ranks exchange their outcome (:func:`agree`), so a
    value one rank refuses is refused on all of them.
    """
    error = None
    try:
        check()
    except ValueError as exc:
        error = exc
    if sharding is not None:
        agree(sharding.group, cls, {}, error=error)  # a refusal stops every rank
    elif error is not None:
        raise error


class Sharding:
    r"""Which rows of a :math:`D`-dimensional posterior this rank holds, and the collectives over the others.

    Built by :class:`~pyro_fa.OnlineFactorAnalysis` and :class:`~pyro_fa.SWAG` from a
    ``process_group`` after the ranks agreed on their arguments (:func:`agree`); pass one
    as ``process_group`` to build another object on the same rows without a second check.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
    dim : int
        :math:`D`, the length of the whole vector.
    bounds : sequence of (int, int)
        Every rank's rows ``[lo, hi)``, in rank order: contiguous, tiling ``[0, D)``.

    Attributes
    ----------
    world_size, rank : int
        Within ``group``.
    lo, hi, size : int
        This rank's rows and their number.
    n_collectives, bytes_reduced : int
        Counters of the collectives run through this object and of their payload.
    """

    def __init__(self, group, dim: int, bounds: Sequence[Tuple[int, int]]):
        import torch.distributed as dist

        self.group = weak_group(group)
        self.dim = int(dim)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.bounds = [(int(lo), int(hi)) for lo, hi in bounds]
        self.lo, self.hi = self.bounds[self.rank]
        self.size = self.hi - self.lo
        self.device = _comm_device(group)
        self._src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.seed: Optional[int] = None  # the seed the ranks agreed on (initial factors)
        self.n_collectives = 0
        self.bytes_reduced = 0

    def descriptor(self) -> Dict[str, int]:
        """What a saved shard records about its place (checked when it is loaded)."""
        return {"dim": self.dim, "world_size": self.world_size, "rank": self.rank, "lo": self.lo, "hi": self.hi}

    def __repr__(self) -> str:
        return (f"Sharding(dim={self.dim}, world_size={self.world_size}, rank={self.rank}, "
                f"rows=[{self.lo}, {self.hi}))")

    # ----------------------------------------------------------- collectives
    def all_reduce(self, buf: Tensor) -> Tensor:
        """Sum ``buf`` over the ranks in place (on the communication device) and return it."""
        import torch.distributed as dist

        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        self.n_collectives += 1
        self.bytes_reduced += buf.numel() * buf.element_size()
        return buf

    def reduce(self, per_rank: Sequence[float], *sums: Tensor) -> Tuple[List[List[float]], List[Tensor]]:
        r"""One ``all_reduce``: every rank's ``per_rank`` values, and the sums of ``sums`` over the ranks.

        The per-rank values travel in slots (each rank writes its own, zeros elsewhere,
        and a sum of one value and zeros is exact), so maxima, minima, counts and
        agreement checks ride in the same collective as the sums over :math:`D`: an
        update of the online fit needs one. Sums are carried in float64 and returned in
        each input's dtype, device and shape.

        Returns
        -------
        table : list of lists
            ``table[r]`` is rank r's ``per_rank``.
        sums : list of Tensors
        """
        W, n = self.world_size, len(per_rank)
        flat = [s.reshape(-1) for s in sums]
        buf = torch.zeros(W * n + sum(f.numel() for f in flat), dtype=_WIDE, device=self.device)
        if n:
            buf[self.rank * n:(self.rank + 1) * n] = torch.tensor([float(v) for v in per_rank], dtype=_WIDE)
        offset = W * n
        for f in flat:
            buf[offset:offset + f.numel()].copy_(f)
            offset += f.numel()
        self.all_reduce(buf)
        table = buf[:W * n].view(W, n).tolist() if n else [[] for _ in range(W)]
        out, offset = [], W * n
        for s, f in zip(sums, flat):
            out.append(buf[offset:offset + f.numel()].to(dtype=s.dtype, device=s.device).view(s.shape))
            offset += f.numel()
        return table, out

    def agree_sizes(self, cls: str, what: str, value: int) -> None:
        """Check (one small ``all_reduce``) that every rank passes the same ``value`` before a sized collective."""
        table, _ = self.reduce([value])
        values = [int(row[0]) for row in table]
        if any(v != values[0] for v in values):
            raise ValueError(f"{cls}: every rank must pass the same {what}, got "
                             + ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)) + ".")

    def broadcast(self, buf: Tensor) -> Tensor:
        """Broadcast ``buf`` from the group's rank 0, in place (on the communication device)."""
        import torch.distributed as dist

        dist.broadcast(buf, src=self._src, group=self.group)
        self.n_collectives += 1
        self.bytes_reduced += buf.numel() * buf.element_size()
        return buf

    def all_gather(self, local: Tensor) -> Tensor:
        """Concatenate every rank's shard along the last dimension: ``(..., size)`` to ``(..., D)``."""
        import torch.distributed as dist

        if local.shape[-1] != self.size:
            raise ValueError(f"Sharding: the shard must have last dimension {self.size} (rows [{self.lo}, "
                             f"{self.hi})), got shape {tuple(local.shape)!r}.")
        widest = max(hi - lo for lo, hi in self.bounds)
        lead = local.shape[:-1]
        buf = torch.zeros(*lead, widest, dtype=local.dtype, device=self.device)
        buf[..., :self.size].copy_(local)
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(parts, buf, group=self.group)
        self.n_collectives += 1
        self.bytes_reduced += buf.numel() * buf.element_size() * self.world_size
        full = torch.cat([p[..., :hi - lo] for p, (lo, hi) in zip(parts, self.bounds)], dim=-1)
        return full.to(local.device)

    def shared_normal(self, num: int, rank: int, generator: Optional[torch.Generator], dtype: torch.dtype,
                      device: torch.device) -> Tuple[Tensor, torch.Generator]:
        r"""Latent draws :math:`h` of shape (num, rank) shared by every rank, and this rank's noise generator.

        Rank 0 draws :math:`h` and a seed from ``generator`` (default: torch's global RNG)
        and broadcasts them: every rank's rows of a sample use the same :math:`h`, so a
        sampled network is one draw of the whole :math:`\theta`. The returned generator,
        seeded from the shared seed and the rank, draws this rank's coordinate noise,
        independent across ranks whatever the ranks' own RNG states. The draws depend
        on rank 0's ``generator`` only.
        """
        buf = torch.zeros(num * rank + 1, dtype=_WIDE, device=self.device)
        if self.rank == 0:
            h = _random.randn((num, rank), generator, dtype, device)
            seed = _random.randint(2 ** 31, (1,), generator, device)
            buf[:-1].copy_(h.reshape(-1))
            buf[-1] = seed.to(_WIDE).item()
        self.broadcast(buf)
        h = buf[:-1].view(num, rank).to(dtype=dtype, device=device)
        gen = torch.Generator(device=device)
        gen.manual_seed((int(buf[-1].item()) + _SEED_MIX * self.rank) % 2 ** 32)
        return h, gen


def agree_on_group(process_group, cls: str, fields: Dict[str, Any], shard=None) -> Tuple[Any, Any, int]:
    """Agree with the other ranks on the arguments of a sharded object (collective unless given a Sharding).

    Returns
    -------
    (group or Sharding, every rank's ``shard`` in rank order or None, the shared seed)
        The seed is rank 0's proposal, for objects built with ``seed=None``.
    """
    if isinstance(process_group, Sharding):  # built and checked by the owner (SWAG hands its fit one)
        return process_group, None, process_group.seed
    if process_group is None:
        raise ValueError(f"{cls}: shard needs a process_group, got shard={shard!r} without one.")
    group = resolve_group(process_group, cls)
    proposal = draw_seed() if fields.get("seed") is None else None  # only a seedless object draws
    owns = agree(group, cls, fields, own={"shard": shard, "seed": proposal})
    return group, [o["shard"] for o in owns], owns[0]["seed"]


def make_sharding(group, cls: str, dim: int, shards, seed: Optional[int] = None) -> "Sharding":
    """The :class:`Sharding` of ``dim`` rows over ``group``: the ranks' explicit ``shards`` or :func:`shard_bounds`.

    Every rank holds every rank's ``shards`` (from :func:`agree_on_group`), so a bad layout
    raises the same ``ValueError`` on every rank.
    """
    if isinstance(group, Sharding):
        if group.dim != dim:
            raise ValueError(f"{cls}: the sharding must cover dim={dim} rows, got one of {group.dim}.")
        return group
    import torch.distributed as dist

    W = dist.get_world_size(group)
    if all(s is None for s in shards):
        if dim < W:
            raise ValueError(f"{cls}: dim must be >= the world size {W} (every rank holds at least one row), "
                             f"got {dim}.")
        bounds = [shard_bounds(dim, W, r) for r in range(W)]
    else:
        ok = all(isinstance(s, (tuple, list)) and len(s) == 2
                 and all(isinstance(v, int) and not isinstance(v, bool) for v in s) for s in shards)
        bounds = [tuple(s) for s in shards] if ok else []
        if not ok or bounds[0][0] != 0 or bounds[-1][1] != dim or any(lo >= hi for lo, hi in bounds) \
                or any(bounds[r][1] != bounds[r + 1][0] for r in range(W - 1)):
            raise ValueError(
                f"{cls}: shard must give every rank rows (lo, hi) that tile [0, dim={dim}) in rank order, each "
                "non-empty, got " + ", ".join(f"{s!r} on rank {r}" for r, s in enumerate(shards))
                + "; nothing was built on any rank."
            )
    sharding = Sharding(group, dim, bounds)
    sharding.seed = seed
    return sharding


def check_shard_state(cls: str, state: Dict[str, Any], sharding: Optional["Sharding"]) -> None:
    """A saved extra state's ``shard`` entry must be this rank's place (or absent without sharding)."""
    saved = state.get("shard")
    if sharding is None:
        if saved is not None:
            raise ValueError(f"{cls}: state_dict must come from a model that is not sharded, got the shard of rank "
                             f"{saved.get('rank')!r} of world size {saved.get('world_size')!r}; nothing was loaded.")
        return
    mine = sharding.descriptor()
    if saved != mine:
        raise ValueError(
            f"{cls}: state_dict must come from rank {mine['rank']} of world size {mine['world_size']} holding rows "
            f"[{mine['lo']}, {mine['hi']}) of D={mine['dim']}, like this model, got "
            + ("a model that is not sharded" if saved is None else
               f"rank {saved.get('rank')!r} of world size {saved.get('world_size')!r} holding rows "
               f"[{saved.get('lo')!r}, {saved.get('hi')!r}) of D={saved.get('dim')!r}")
            + "; nothing was loaded on any rank. Save and load each rank's own state_dict."
        )


def check_loadable(module, state_dict, strict: bool, sharding: Optional["Sharding"]) -> Optional[float]:
    """:func:`pyro_fa._state.check_state_dict`, agreed over the ranks when sharded (collective).

    A state that one rank refuses is refused on every rank, and the ranks must load
    states saved at the same point of one run (their counts must agree).

    Returns
    -------
    float or None
        Sharded: the sum over all D of the loaded running squared deviations (the
        relative noise floor's scale), else None.
    """
    from pyro_fa._state import check_state_dict

    if sharding is None:
        check_state_dict(module, state_dict, strict=strict)
        return None
    error = None
    try:
        check_state_dict(module, state_dict, strict=strict)
    except (TypeError, ValueError) as exc:
        error = exc
    own = {"sq": 0.0, "counts": None}
    if error is None:
        own["sq"] = float(sum(float(v.double().sum()) for k, v in state_dict.items()
                              if k.endswith("_moments.sq_dev") and torch.is_tensor(v)))
        own["counts"] = checksum([(k, {kk: vv for kk, vv in v.items() if kk not in _PLACE_KEYS})
                                  for k, v in sorted(state_dict.items())
                                  if k.endswith("_extra_state") and isinstance(v, dict)])
    cls = type(module).__name__
    try:
        owns = agree(sharding.group, cls, {}, own=own, error=error)
    finally:
        error = None
    if any(o["counts"] != owns[0]["counts"] for o in owns):
        raise ValueError(f"{cls}: every rank must load a state saved at the same point of the same run, got states "
                         "whose counts differ between ranks; nothing was loaded on any rank.")
    return sum(o["sq"] for o in owns)


def flatten_slice(tensors: Sequence[Tensor], lo: int, hi: int, out: Tensor) -> Tensor:
    """Copy entries ``[lo, hi)`` of the concatenation of the flattened ``tensors`` into ``out``.

    Neither the whole flat vector nor any temporary of its size is formed: each tensor
    that overlaps the range contributes its overlapping part.
    """
    offset = 0
    with torch.no_grad():
        for p in tensors:
            n = p.numel()
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out[a - lo:b - lo].copy_(p.reshape(-1)[a - offset:b - offset])
            offset += n
            if offset >= hi:
                break
    return out


def sharded_orthogonal_init(sharding: Sharding, rank: int, *, scale: float, generator: torch.Generator,
                            dtype: torch.dtype, device: torch.device) -> Tensor:
    r"""This rank's rows of :func:`pyro_fa.fa.linalg.orthogonal_init` for the whole :math:`D`.

    The single-process initial factor is the Q factor of a standard-normal
    :math:`D\times K` matrix :math:`A` drawn from ``generator``. Each rank replays the
    stream up to its last row in chunks (a multiple of 16 numbers, which torch's CPU
    normal sampler draws exactly as in one call), keeps its rows, and orthonormalises
    them by Cholesky QR: :math:`Q = AR^{-1}` with :math:`R^\top R = A^\top A` summed over the
    ranks (one :math:`K\times K` all-reduce), in float64 row blocks. :math:`Q` is then the
    single-process factor to rounding (both are the Q with a positive-diagonal R). Memory:
    this rank's rows and one block; time: :math:`O(hi\cdot K)` draws.
    """
    lo, hi, K = sharding.lo, sharding.hi, rank
    total, start, stop = sharding.dim * K, lo * K, hi * K
    chunk = 1 << 16  # numbers per draw: a multiple of 16
    A = torch.empty(stop - start, dtype=dtype)
    pos = 0
    while pos < stop:
        # the last draw takes the remainder whole (and at least 16 numbers), as one call would
        n = total - pos if total - pos < chunk + 16 else chunk
        part = torch.randn(n, generator=generator, dtype=dtype)
        a, b = max(pos, start), min(pos + n, stop)
        if a < b:
            A[a - start:b - start] = part[a - pos:b - pos]
        pos += n
    A = A.view(hi - lo, K).to(device)
    block = max(1, chunk // K)  # rows per block: the float64 work stays small beside A
    gram = torch.zeros(K, K, dtype=_WIDE, device=device)
    for r in range(0, hi - lo, block):
        A_b = A[r:r + block].to(_WIDE)
        gram.addmm_(A_b.T, A_b)
    _, (gram,) = sharding.reduce((), gram)
    R = torch.linalg.cholesky(gram).T  # upper, positive diagonal
    for r in range(0, hi - lo, block):  # Q = A R^-1, in place
        A[r:r + block] = torch.linalg.solve_triangular(R, A[r:r + block].to(_WIDE), upper=True, left=False).mul_(scale)
    return A
