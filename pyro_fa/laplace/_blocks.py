r"""Per-layer (block) ranks of :class:`~pyro_fa.laplace.FactorLaplace`: one factor-analysis fit per module.

The blocks are the subset's parameters grouped by the module that owns them (a layer: its weight and bias
together, named as in ``model.named_modules()``; ``""`` for the model itself), in the subset's order, each a
contiguous slice :math:`[a_b, e_b)` of :math:`\theta`. Block :math:`b`'s curvature is the restriction of the
same stream of curvature vectors to its coordinates, :math:`v_{[a_b, e_b)}`, fitted by the same core
(:func:`~pyro_fa.laplace.moment.fit_second_moment`, any method; ``"auto"`` picks per block, by its own size) at
its own rank :math:`K_b`. The curvature is then block diagonal,

.. math::

    \mathrm{blockdiag}(F_bF_b^\top + \Psi_b) = FF^\top + \Psi, \qquad F = \mathrm{blockdiag}(F_b)
    \in \mathbb R^{D\times\sum_b K_b},

but :math:`F` is never formed: each :math:`F_b` is held on its own (:func:`assemble`,
:class:`~pyro_fa.laplace.structures.Blocks`), the posterior is a
:class:`~pyro_fa.distributions.BlockLowRankPrecisionNormal` (one capacitance per block,
:math:`O(\sum_b D_bK_b^2)`) and the GLM predictive takes the factor by blocks, so everything downstream (marginal
likelihood, prior precision, sampling, ``state_dict``) gives the dense layout's numbers in
:math:`O(\sum_b D_bK_b)` memory instead of :math:`O(D\sum_b K_b)`. KFAC's block structure (Ritter, Botev & Barber, *A scalable Laplace approximation for neural
networks*, ICLR 2018; Daxberger et al., *Laplace Redux*, NeurIPS 2021) with each block low rank plus diagonal
instead of a Kronecker product.

**One pass for all blocks.** Each fitter consumes its stream in a loop of its own (and ``"randomized"`` /
``"online"`` come back for more passes), so the fitters run as coroutines: one thread per block, driven in
lockstep by the caller's single stream (:func:`fit_blocks`). Exactly one thread runs at a time (no extra cores,
no reordering: each block's numbers are those of a fit of its restricted stream alone), the curvature vectors
are computed once per pass for all blocks, and a block of vectors is dropped as soon as every fitter has
consumed it. Blocks whose fits need fewer passes (``"scatter"``: one) leave the lockstep when done.

**Ranks chosen by the fitted spectrum** (``rank="auto"``, ``rank_budget=K``; :func:`allocate`): every block is
fitted at a generous rank :math:`\min(K, D_b)` (``D_b - 1`` for the methods that need a rank below the
dimension; at most ``rank_max``, cheaper, with a warning where a block's allocation reaches it), its factor rotated to orthogonal columns (:math:`F_b \leftarrow F_bW`, :math:`F_b^\top F_b =
W\Lambda W^\top`, so :math:`F_bF_b^\top` is unchanged), and the :math:`K` columns :math:`f` of all blocks with
the largest value

.. math::

    \log\bigl(1 + s\,f^\top D_b^{-1} f\bigr), \qquad D_b = \mathrm{diag}(\delta) + s\,\Psi_b, \quad s = N/\sigma^2

are kept; the others' diagonals :math:`f_i^2` move into :math:`\psi` (the fitted diagonal of the curvature, each
weight's own curvature, is kept; only the correlations along the dropped directions are lost). By the matrix
determinant lemma this value is exactly what the column adds to :math:`\log\det P` over the diagonal
:math:`D_b`, i.e. how much it shrinks the posterior's volume, the Occam factor of the Laplace evidence (MacKay,
*A practical Bayesian framework for backpropagation networks*, Neural Computation 1992, §4: the well-determined
directions are those with :math:`N\lambda \gg \delta`; Daxberger et al. 2021, §2, the log marginal likelihood's
:math:`-\frac12\log\det(P/\delta)`). With a scalar :math:`\delta` and :math:`\psi = 0` it orders the columns as
their eigenvalues :math:`\lambda = \|f\|^2` do; with a diagonal it prefers directions the diagonal does not
already hold, in any layer, whatever the layers' curvature scales. The values are taken at the construction's
``prior_precision`` and ``sigma_noise``: a later :meth:`optimize_prior_precision` changes :math:`\delta` but not
the allocation. No held-out or OOD data enter the choice.
"""
from __future__ import annotations

import enum
import queue
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.laplace.moment import DENSE_FITS, fit_second_moment, resolve_fit

__all__ = ["BlockRanks", "block_ranks", "module_blocks", "fit_blocks", "allocate", "assemble"]

#: ``fit_second_moment``'s ``dense_max_dim``: ``"auto"`` fits a block of at most this many weights by ``"exact"``
_DENSE_MAX_DIM = 1024


def module_blocks(named) -> Tuple[List[str], List[Tuple[int, int]]]:
    """The modules owning the named parameters (``"0.weight"`` -> ``"0"``, ``"weight"`` -> ``""``) and each one's
    slice ``(a, e)`` of the flattened parameters, in the order of ``named``."""
    names, bounds, start = [], [], 0
    for pname, p in named:
        owner = pname.rpartition(".")[0]
        end = start + p.numel()
        if names and names[-1] == owner:
            bounds[-1] = (bounds[-1][0], end)
        else:
            names.append(owner)
            bounds.append((start, end))
        start = end
    return names, bounds


def _resolved(method: str, dim: int) -> str:
    return resolve_fit(method, dim, _DENSE_MAX_DIM)


@dataclass
class BlockRanks:
    """The blocks of a :class:`~pyro_fa.laplace.FactorLaplace` and their ranks.

    ``names``: the owning modules; ``bounds``: each block's slice of :math:`\\theta`; ``ranks``: the fixed
    columns per block (``None`` for ``"auto"``); ``budget``: the total of ``"auto"``; ``fit_ranks``: the rank each
    block is fitted at; ``width``: the columns of :math:`F`.
    """
    names: List[str]
    bounds: List[Tuple[int, int]]
    methods: List[str]
    ranks: Optional[List[int]]
    budget: Optional[int]
    fit_ranks: List[int]
    width: int

    @property
    def initial(self) -> List[int]:
        """The ``block_ranks`` buffer before a fit: the fixed ranks, or zeros for ``"auto"``."""
        return list(self.ranks) if self.ranks is not None else [0] * len(self.names)

    @property
    def factor_names(self) -> List[str]:
        """The buffers holding each block's factor :math:`F_b`, shape (D_b, K_b): ``block_factor_0``, ..."""
        return [f"block_factor_{b}" for b in range(len(self.names))]

    def dense(self, factors: List[Tensor], ref: Tensor) -> Tensor:
        """``blockdiag(F_b)`` of shape (D, width), zeros off the blocks (and in the columns of an unfitted ``"auto"``)."""
        out = ref.new_zeros(self.bounds[-1][1], self.width)
        col = 0
        for (a, e), F in zip(self.bounds, factors):
            out[a:e, col:col + F.shape[1]] = F
            col += F.shape[1]
        return out

    def saved_factor_shapes(self, state_dict) -> dict:
        """The shapes of the block factors that a state's ``block_ranks`` gives them (none where it has none)."""
        saved = state_dict.get("block_ranks")
        if not torch.is_tensor(saved) or saved.shape != (len(self.names),):
            return {}
        return {key: (e - a, int(k)) for key, (a, e), k in zip(self.factor_names, self.bounds, saved)}

    def check_state(self, owner: str, state_dict) -> None:
        """Refuse a saved ``block_ranks`` that does not fit these blocks (before anything is loaded)."""
        saved = state_dict.get("block_ranks")
        if not torch.is_tensor(saved) or saved.shape != (len(self.names),):
            return  # missing or misshapen: check_state_dict's own message
        saved = [int(v) for v in saved]
        if self.ranks is not None:
            ok = saved == self.ranks
        else:  # "auto": an allocation of the same budget within each block's fitted rank (0 before a fit)
            ok = all(0 <= k <= f for k, f in zip(saved, self.fit_ranks)) and sum(saved) in (0, self.width)
        if not ok:
            want = f"{self.ranks!r}" if self.ranks is not None else (
                f"an allocation of {self.width} columns with at most {self.fit_ranks!r} per block")
            raise ValueError(f"{owner}: state_dict['block_ranks'] must be {want} for the blocks {self.names!r}, "
                             f"got {saved!r}; nothing was loaded. It comes from another rank configuration.")


def block_ranks(owner: str, rank, rank_budget, named, curvature_fit: str, process_group=None,
                rank_max=None) -> Optional[BlockRanks]:
    """Parse ``FactorLaplace``'s ``rank`` / ``rank_budget`` / ``rank_max``: ``None`` for an int rank (one block,
    unchanged),
    else the :class:`BlockRanks`. Raises ``ValueError`` / ``TypeError`` naming the argument, what it must be and
    what it was."""
    names, bounds = module_blocks(named)
    sizes = [e - a for a, e in bounds]
    methods = [_resolved(curvature_fit, d) for d in sizes]
    if rank != "auto" and rank_max is not None:
        raise ValueError(f"{owner}: rank_max is only used with rank='auto', got rank={rank!r} and "
                         f"rank_max={rank_max!r}.")
    if isinstance(rank, int) and not isinstance(rank, bool):
        if rank_budget is not None:
            raise ValueError(f"{owner}: rank_budget is only used with rank='auto', got rank={rank!r} and "
                             f"rank_budget={rank_budget!r}.")
        return None
    if process_group is not None:
        raise ValueError(f"{owner}: rank must be an int with a process_group (the per-block fits run as "
                         f"coroutines in one process; the sharded fits' collectives cannot interleave), got "
                         f"rank={rank!r}.")
    listing = ", ".join(f"{n!r} ({d} weights)" for n, d in zip(names, sizes))
    budget = None
    if isinstance(rank, str):
        if rank != "auto":
            raise ValueError(f"{owner}: rank must be a positive int, a list of {len(names)} positive ints (one per "
                             f"block: {listing}), a dict from those module names to positive ints, or 'auto', "
                             f"got {rank!r}.")
        if isinstance(rank_budget, bool) or not isinstance(rank_budget, int) or rank_budget < 1:
            raise ValueError(f"{owner}: rank='auto' needs rank_budget, the total number of columns of F to "
                             f"allocate over the blocks, a positive int, got {rank_budget!r}.")
        if rank_max is not None and (isinstance(rank_max, bool) or not isinstance(rank_max, int) or rank_max < 1):
            raise ValueError(f"{owner}: rank_max must be a positive int (the rank each block is fitted at before "
                             f"the allocation), got {rank_max!r}.")
        budget = rank_budget
        fixed = None
        top = budget if rank_max is None else min(budget, rank_max)
        fit_ranks = [min(top, d) if m in DENSE_FITS else min(top, d - 1) for m, d in zip(methods, sizes)]
        if min(fit_ranks) < 1:
            bad = [n for n, k in zip(names, fit_ranks) if k < 1]
            raise ValueError(f"{owner}: rank='auto' with curvature_fit={curvature_fit!r} needs blocks of at least "
                             f"2 weights, got blocks {bad!r} of 1; use curvature_fit='scatter'.")
        width = min(budget, sum(fit_ranks))
    else:
        if rank_budget is not None:
            raise ValueError(f"{owner}: rank_budget is only used with rank='auto', got rank={rank!r} and "
                             f"rank_budget={rank_budget!r}.")
        if isinstance(rank, Mapping):
            unknown = [k for k in rank if k not in names]
            missing = [n for n in names if n not in rank]
            if unknown or missing:
                raise ValueError(f"{owner}: rank as a dict must map the name (as in model.named_modules()) of each "
                                 f"module owning parameters of the subset to a positive int, exactly {names!r}, got "
                                 f"unknown names {unknown!r} and missing names {missing!r}.")
            values = [rank[n] for n in names]
        elif isinstance(rank, Sequence):
            if len(rank) != len(names):
                raise ValueError(f"{owner}: rank as a list must have one entry per block, {len(names)} ({listing}), "
                                 f"got {len(rank)}: {list(rank)!r}.")
            values = list(rank)
        else:
            raise TypeError(f"{owner}: rank must be a positive int, a list of {len(names)} positive ints (one per "
                            f"block: {listing}), a dict from those module names to positive ints, or 'auto', got "
                            f"{type(rank).__name__}.")
        bad = [(n, k) for n, k in zip(names, values) if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if bad:
            raise ValueError(f"{owner}: rank must give every block a positive int, got "
                             + ", ".join(f"{k!r} for {n!r}" for n, k in bad) + ".")
        for n, k, d, m in zip(names, values, sizes, methods):
            if m not in DENSE_FITS and k >= d:
                raise ValueError(f"{owner}: rank for block {n!r} must be < its {d} weights with curvature_fit="
                                 f"{m!r}, got {k}; use curvature_fit='scatter' for a full-rank block.")
        fixed = [min(k, d) for k, d in zip(values, sizes)]
        fit_ranks = list(fixed)
        width = sum(fixed)
    return BlockRanks(names, bounds, methods, fixed, budget, fit_ranks, width)


# --------------------------------------------------------------------------- one stream, several fitters
_END = object()


class _Abort(Exception):
    """Raised inside a fitter's stream when the fit of all blocks is abandoned (another block's error)."""


def fit_blocks(passes: Callable[[], Iterator[Tensor]], blocks: BlockRanks, *, num_passes=None, seed: int = 0,
               dtype=None, device=None, owner: str = "fit_blocks") -> Tuple[List[Tensor], List[Tensor], dict]:
    """Every block's :func:`~pyro_fa.laplace.moment.fit_second_moment` on its columns of the one stream ``passes``.

    Returns each block's factor (D_b, K_b) and diagonal (D_b,) for :math:`G/V`, and an ``info`` with
    ``n_vectors``, ``passes`` (how many times ``passes()`` was run) and each block's own ``info``.
    """
    fits = [
        (lambda p, a=a, e=e, k=k, m=m, n=n: fit_second_moment(
            p, e - a, k, method=m, num_passes=num_passes, seed=seed, dtype=dtype, device=device,
            owner=f"{owner} (block {n!r})"))
        for n, (a, e), k, m in zip(blocks.names, blocks.bounds, blocks.fit_ranks, blocks.methods)]
    results, runs = _lockstep(passes, blocks.bounds, fits)
    infos = [dict(info, block=n) for n, (_, _, info) in zip(blocks.names, results)]
    info = {"method": "blocks", "n_vectors": infos[0]["n_vectors"], "passes": runs, "blocks": infos}
    return [r[0] for r in results], [r[1] for r in results], info


class _Msg(enum.Enum):
    """What a fit's thread tells the caller's: it wants a pass, the next block, it is done, or it failed."""
    PASS = enum.auto()
    NEXT = enum.auto()
    DONE = enum.auto()
    ERROR = enum.auto()


#: a fit waiting for vectors: at the start of a pass or within one
_WAITING = frozenset({_Msg.PASS, _Msg.NEXT})


def _lockstep(passes, bounds, fits):
    """Run ``fits[i](stream_i)`` for every ``i`` where ``stream_i()`` yields ``V[:, a_i:e_i]`` of each block ``V`` of
    ``passes()``: one thread per fit, one of them running at a time, one run of ``passes()`` per round of passes.
    Returns the fits' results in order and the number of runs of ``passes()``."""
    n = len(fits)
    inbox = [queue.SimpleQueue() for _ in range(n)]
    outbox = [queue.SimpleQueue() for _ in range(n)]

    def stream(i):
        outbox[i].put((_Msg.PASS, None))
        while True:
            msg = inbox[i].get()
            if msg is _END:
                return
            if isinstance(msg, _Abort):
                raise msg
            yield msg
            outbox[i].put((_Msg.NEXT, None))

    def work(i):
        try:
            outbox[i].put((_Msg.DONE, fits[i](lambda: stream(i))))
        except BaseException as exc:  # handed to the caller's thread, raised there
            outbox[i].put((_Msg.ERROR, exc))

    last, threads = {}, []

    def ask(i, msg=None):
        if msg is not None:
            inbox[i].put(msg)
        last[i] = outbox[i].get()
        return last[i]

    runs = 0
    try:
        for i in range(n):  # started one by one: each runs up to its first pass (or its end)
            t = threading.Thread(target=work, args=(i,), daemon=True, name=f"pyro_fa-block-{i}")
            threads.append(t)
            t.start()
            ask(i)
        while True:
            for kind, value in last.values():
                if kind is _Msg.ERROR:
                    raise value
            wanting = [i for i in range(n) if last[i][0] is _Msg.PASS]
            if not wanting:
                break
            runs += 1
            for V in passes():
                for i in wanting:
                    if last[i][0] in _WAITING:  # still in this pass
                        a, e = bounds[i]
                        if ask(i, V[:, a:e].contiguous())[0] is _Msg.ERROR:
                            raise last[i][1]
            for i in wanting:
                if last[i][0] in _WAITING:
                    ask(i, _END)
    except BaseException as exc:
        for i in range(len(threads)):  # every fitter still waiting for vectors ends (raising _Abort)
            for _ in range(3):
                if last.get(i, (None,))[0] not in _WAITING:
                    break
                ask(i, _Abort(f"abandoned: {exc!r}"))
        for t in threads:
            t.join(timeout=10)
        raise
    for t in threads:
        t.join()
    return [last[i][1] for i in range(n)], runs


# --------------------------------------------------------------------------- layout and allocation
def allocate(Fs: List[Tensor], psis: List[Tensor], budget: int, prior: List[Tensor], scale: float):
    r"""Keep the ``budget`` columns of all blocks with the largest :math:`\log(1 + s f^\top D_b^{-1} f)`.

    Parameters
    ----------
    Fs, psis : lists of Tensors (D_b, K_b) and (D_b,)
        Each block's fit (of the curvature per example).
    budget : int
    prior : list of Tensors (D_b,)
        :math:`\delta` of each block's weights.
    scale : float
        :math:`s = N/\sigma^2`.

    Returns
    -------
    Fs, psis : lists
        The kept orthogonal columns of each block, largest value first, and the diagonals plus the dropped
        columns' :math:`f_i^2`.
    ranks : list of int
    values : list of Tensors
        Every block's column values, largest first (the kept ones are the ``budget`` largest of all).
    """
    rotated, values = [], []
    for F, psi, d in zip(Fs, psis, prior):
        F64 = F.to(torch.float64)
        _, W = torch.linalg.eigh(F64.T @ F64)
        Fr = F64 @ W.flip(-1)  # orthogonal columns, the largest norm first
        v = torch.log1p(scale * (Fr.pow(2) / (d.to(torch.float64) + scale * psi.to(torch.float64))[:, None]).sum(0))
        order = torch.argsort(v, descending=True, stable=True)
        rotated.append(Fr[:, order])
        values.append(v[order])
    every = torch.cat(values)
    block_of = torch.cat([torch.full((len(v),), b, device=v.device) for b, v in enumerate(values)])
    keep = torch.argsort(every, descending=True, stable=True)[:budget]
    ranks = [int((block_of[keep] == b).sum()) for b in range(len(Fs))]
    out_F, out_psi = [], []
    for Fr, psi, k, F in zip(rotated, psis, ranks, Fs):  # each block's kept columns are its k largest values
        out_F.append(Fr[:, :k].to(F.dtype))
        out_psi.append((psi.to(torch.float64) + Fr[:, k:].pow(2).sum(-1)).to(psi.dtype))
    return out_F, out_psi, ranks, values


def assemble(blocks: BlockRanks, Fs: List[Tensor], psis: List[Tensor], ratio: float, prior: Tensor,
             scale: float) -> Tuple[List[Tensor], Tensor, Tensor, Optional[List[Tensor]]]:
    r"""Each block's :math:`F_b` (D_b, K_b) and the whole :math:`\psi` (D,) of the curvature per example (the fits
    of :math:`G/V` rescaled by ``ratio`` = V/N), allocated first for ``"auto"``; the ranks as an int64 tensor and
    the column values of ``"auto"`` (``None`` for fixed ranks). The factors are contiguous tensors of their own
    (not views of the generous fits of ``"auto"``): :math:`\sum_b D_bK_b` numbers in all."""
    Fs = [F * ratio ** 0.5 for F in Fs]
    psis = [psi * ratio for psi in psis]
    values = None
    if blocks.ranks is None:
        prior_b = [prior[a:e] for a, e in blocks.bounds]
        Fs, psis, ranks, values = allocate(Fs, psis, blocks.width, prior_b, scale)
        bound = [n for n, k, f, m, (a, e) in zip(blocks.names, ranks, blocks.fit_ranks, blocks.methods, blocks.bounds)
                 if k == f < min(blocks.budget, e - a - (m not in DENSE_FITS))]  # rank_max kept it from more
        if bound:
            warnings.warn(f"FactorLaplace: rank='auto' gave blocks {bound!r} every column they were fitted with "
                          f"(rank_max); a larger rank_max may give them more.", RuntimeWarning, stacklevel=3)
    else:
        ranks = [F.shape[1] for F in Fs]
    Fs = [F if _owns_its_storage(F) else F.clone(memory_format=torch.contiguous_format) for F in Fs]
    return Fs, torch.cat(psis), torch.tensor(ranks, dtype=torch.int64), values


def _owns_its_storage(t: Tensor) -> bool:
    """Whether ``t`` is contiguous and the whole of its storage (not a view of a larger tensor)."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
