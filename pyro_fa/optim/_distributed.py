r"""Data-parallel :class:`~pyro_fa.optim.FactorIVON` under ``torch.distributed``: each step's statistics averaged over
the ranks before the update (ivon-opt's ``sync=True``), so that every rank holds the same state.

Every rank holds the whole optimizer state and draws the same weights: the draws come from the global generator, as
ivon-opt's do, so the ranks must seed it alike (``torch.manual_seed(s)`` with the same ``s``), and each rank
computes the gradient of its share of the minibatch at that draw. What a step consumes is linear in the gradients
(the draws :math:`z_j` and :math:`a_j = Pz_j` being the same on every rank), so averaging over the ranks gives the
statistics of the whole minibatch (equal shares; their mean losses' mean is the whole minibatch's mean loss):

* the mean gradient :math:`\bar g` and IVON's curvature statistic (the mean of :math:`g_j \odot a_j`, or
  ivon-opt's :math:`z_j \odot g_j` at ``rank=0``): two all-reduces of :math:`D` numbers, ivon-opt's ``sync``
  operation for operation;
* at a refresh of the low-rank part (``rank`` > 0, every ``update_every`` steps): the :math:`M` gradients
  :math:`g_j` the sketch consumes, :math:`MD` numbers, from which both means are then recomputed (the same
  Welford means as a single process keeps).

Before these, one all-reduce of a table of :math:`4W` numbers (:math:`W` ranks; each rank fills its row: its
number of draws, of non-finite gradients, and two entries of its draws) checks that the ranks drew alike, the same
number of times, with finite gradients; otherwise every rank raises the same error, with its state unchanged,
instead of some ranks waiting in a collective. A step all-reduces at most :math:`\max(2, M)D + 4W` numbers, nothing
:math:`D \times K`; the state gains nothing (the means are reduced in place).
"""
from __future__ import annotations

from contextlib import contextmanager
import torch
from torch import Tensor

from pyro_fa.distributed.sharding import Sharding, agree, resolve_group, weak_group
from pyro_fa.optim._checks import NAME
from pyro_fa.optim._lowrank import welford_mean

__all__ = ["sync_group", "refused_together", "StepAverage", "NO_AVERAGE"]

#: the param groups' keys left out of the ranks' agreement (the tensors themselves)
_NOT_DESCRIBED = frozenset({"params"})


def sync_group(sync, process_group):
    """The process group a :class:`FactorIVON` averages over (None: no averaging), checked locally.

    ``process_group`` if given, else torch.distributed's default group with ``sync=True``. Raises, on every rank
    alike (nothing collective has started): ``TypeError`` for a ``sync`` that is not a bool or an object that is not
    a process group, ``RuntimeError`` when torch.distributed is not initialised, ``ValueError`` when this process is
    not in the group.
    """
    if not isinstance(sync, bool):
        raise TypeError(f"{NAME}: sync must be True or False, got {sync!r}.")
    if isinstance(process_group, Sharding):
        raise TypeError(f"{NAME}: process_group must be a torch.distributed.ProcessGroup, got a Sharding; pass its "
                        "group.")
    if process_group is None and sync:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{NAME}: sync=True needs an initialised torch.distributed, got none (ivon-opt "
                               "skips the averaging then). Call torch.distributed.init_process_group(...) on every "
                               "rank first, or leave sync=False.")
        process_group = dist.group.WORLD
    return resolve_group(process_group, NAME)


@contextmanager
def refused_together(group):
    """Around a constructor's argument checks: with a ``group``, a ``ValueError`` or ``TypeError`` on one rank is
    raised on every rank (the others meet it in :class:`StepAverage`'s agreement, the next collective)."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        if group is None:
            raise
        agree(group, NAME, {}, error=exc)
        raise


def _describe(opt) -> dict:
    """What every rank must pass alike (compared by ``repr``)."""
    return {
        "params (shapes, dtype)": ([tuple(p.shape) for p in opt._params], str(opt._params[0].dtype)),
        "param groups": [{k: v for k, v in g.items() if k not in _NOT_DESCRIBED} for g in opt.param_groups],
        "rank": opt.rank, "update_every": opt.update_every, "mc_samples": opt.mc_samples,
        "diag_floor": opt.diag_floor, "debias": opt.debias, "rescale_lr": opt.rescale_lr,
        "curvature": opt.curvature, "batch_size": opt.batch_size,
    }


class StepAverage:
    r"""The data-parallel part of a :class:`~pyro_fa.optim.FactorIVON` built with ``sync=True`` or a
    ``process_group`` (module docstring): held as its ``_averager``, called from ``_collect`` and ``step``.

    Building one is collective: the ranks agree on the optimizer's arguments (one ``all_gather_object``) and take
    rank 0's weights (one broadcast of :math:`D` numbers), so that the replicas start alike.

    Attributes
    ----------
    n_collectives, bytes_reduced : int
        Collectives issued and bytes all-reduced or broadcast by this rank so far (the agreement not counted).
    """

    def __init__(self, group, opt):
        import torch.distributed as dist

        self.process_group = weak_group(group)  # None: the default group
        self.world_size = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.n_collectives = 0
        self.bytes_reduced = 0
        self._reset()
        agree(group, NAME, _describe(opt))
        mean = opt._flat().clone()
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        self._collective(lambda b: dist.broadcast(b, src=src, group=self.process_group), mean)
        start = 0
        with torch.no_grad():  # into the parameters' own storage
            for p in opt._params:
                p.copy_(mean[start:start + p.numel()].view_as(p))
                start += p.numel()

    def _reset(self) -> None:
        self._draws, self._nonfinite, self._print = 0, 0, None

    def _collective(self, fn, buf: Tensor) -> None:
        fn(buf)
        self.n_collectives += 1
        self.bytes_reduced += buf.numel() * buf.element_size()

    def _all_reduce(self, buf: Tensor) -> None:
        import torch.distributed as dist

        self._collective(lambda b: dist.all_reduce(b, op=dist.ReduceOp.SUM, group=self.process_group), buf)

    def record(self, noise: Tensor, finite: bool) -> bool:
        """Note a training draw (``noise`` :math:`z`) and whether its gradient was finite; whether ``_collect`` goes
        on (False: a non-finite gradient, dropped here and refused at :meth:`average` on every rank)."""
        self._draws += 1
        self._nonfinite += not finite
        ends = noise[[0, -1]].to(torch.float64)
        self._print = ends if self._print is None else self._print + ends
        return finite

    def _table(self, opt) -> Tensor:
        """Every rank's (draws, non-finite, the draws' two fingerprints), one all-reduce of (W, 4) numbers."""
        table = torch.zeros(self.world_size, 4, dtype=torch.float64, device=opt.state["hess"].device)
        table[self.index, 0], table[self.index, 1] = float(self._draws), float(self._nonfinite)
        if self._print is not None:
            table[self.index, 2:] = self._print
        self._all_reduce(table)
        return table.cpu()

    def _check(self, table: Tensor) -> None:
        """Raise the same error on every rank unless the ranks drew alike (the table is the same on all)."""
        ranks = ", ".join
        draws, bad, prints = table[:, 0].tolist(), table[:, 1].tolist(), table[:, 2:]
        if any(d != draws[0] for d in draws):
            raise ValueError(f"{NAME}: every rank must draw the same number of times per step, got "
                             + ranks(f"{int(d)} on rank {r}" for r, d in enumerate(draws))
                             + "; the step is dropped on every rank, the state unchanged.")
        if any(bad):
            raise ValueError(f"{NAME}: the gradients must be finite, got NaN or inf on rank(s) "
                             + ranks(str(r) for r, b in enumerate(bad) if b)
                             + "; the step is dropped on every rank, the state unchanged.")
        if not bool((prints == prints[0]).all()):
            raise ValueError(f"{NAME}: every rank must draw the same weights, got different draws (the ranks' "
                             "global generators differ). Seed every rank alike (torch.manual_seed with the same "
                             "seed) and draw nothing else from the global generator on one rank only; the step is "
                             "dropped on every rank, the state unchanged.")

    @torch.no_grad()
    def average(self, opt) -> None:
        """Replace ``opt``'s step statistics by their means over the ranks (collective; raises on every rank
        alike, after dropping the step's draws, when the ranks did not draw alike)."""
        table = self._table(opt)
        self._reset()
        try:
            self._check(table)
        except ValueError:
            opt._reset_samples()
            raise
        if opt.state["count"] == 0:  # no draw on any rank: step() raises its own error everywhere
            return
        state, W = opt.state, self.world_size
        if opt._pairs:  # a refresh: the gradients themselves, then both means from them
            avg_grad = avg_nxg = None
            for j, (grad, a) in enumerate(opt._pairs):
                self._all_reduce(grad)
                grad.div_(W)
                avg_grad = welford_mean(avg_grad, grad, j + 1)
                avg_nxg = welford_mean(avg_nxg, grad * a, j + 1)
            state["avg_grad"], state["avg_nxg"] = avg_grad, avg_nxg
            return
        for name in ("avg_grad", "avg_nxg"):  # ivon-opt's _sync_samples
            self._all_reduce(state[name])
            state[name].div_(W)


class _NoAverage:
    """A single process's stand-in for :class:`StepAverage`: keeps a finite draw, averages nothing."""

    def record(self, noise: Tensor, finite: bool) -> bool:
        return True  # a non-finite gradient is refused at once, in FactorIVON._collect

    def average(self, opt) -> None:
        pass


#: what a :class:`FactorIVON` without a process group holds as its ``_averager``
NO_AVERAGE = _NoAverage()
