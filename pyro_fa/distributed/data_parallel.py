r"""Data-parallel training under ``torch.distributed``: each rank's share of the data, replicated parameters.

:func:`local_indices` (this rank's share of a data set), :func:`check_agreement`, :class:`ShardedParameters`
(this rank's coordinate shard of a model's weights) and :class:`AllReduceOptim` (data-parallel SVI).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.distributed.sharding import agree, flatten_slice, make_sharding, resolve_group, shard_bounds, weak_group
from pyro_fa.distributed.swag import describe_parameters, unwrap_ddp

__all__ = ["local_indices", "check_agreement", "ShardedParameters", "AllReduceOptim"]


def _default_group(process_group, cls: str):
    if process_group is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{cls}: needs an initialised torch.distributed, got none. Call "
                               "torch.distributed.init_process_group(...) on every rank first.")
        process_group = dist.group.WORLD
    return resolve_group(process_group, cls)


def local_indices(n: int, process_group=None) -> Tensor:
    """This rank's contiguous share of ``range(n)``, as a ``LongTensor`` (:func:`shard_bounds`).

    For data-parallel SVI: ``pyro.plate("data", n, subsample=local_indices(n))`` scales
    this rank's likelihood by ``n / len(subsample)``, so that its ELBO estimates the
    whole data's.
    """
    import torch.distributed as dist

    group = _default_group(process_group, "local_indices")
    lo, hi = shard_bounds(n, dist.get_world_size(group), dist.get_rank(group))
    return torch.arange(lo, hi)


def check_agreement(values: Dict[str, Any], process_group=None, what: str = "check_agreement") -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks pass equal ``values`` (collective).

    Values are compared by ``repr``. Use it before a collective whose sizes come from
    the ranks' own arguments.
    """
    agree(_default_group(process_group, what), what, values)


class ShardedParameters:
    r"""This rank's coordinate shard of a model's flattened trainable parameters, replicated over a group.

    The flattening order is ``named_parameters()`` order (as :class:`~pyro_fa.SWAG`'s);
    rank r holds entries ``[lo, hi)`` of the length-:math:`D` vector
    (:func:`shard_bounds`). Building one checks (collectively) that the ranks' models
    have the same parameter shapes and dtypes.

    Parameters
    ----------
    module_or_params : nn.Module (or DistributedDataParallel) or iterable of Tensors
    process_group : ProcessGroup, optional
        Default: the DDP wrapper's, else the default group.

    Attributes
    ----------
    dim : int
    sharding : Sharding
    """

    def __init__(self, module_or_params, process_group=None):
        cls = type(self).__name__
        obj, ddp_group = unwrap_ddp(module_or_params)
        group = _default_group(process_group if process_group is not None else ddp_group, cls)
        if isinstance(obj, nn.Module):
            named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
        else:
            named = [(str(i), p) for i, p in enumerate(obj)]
        agree(group, cls, {"params": describe_parameters(named)})
        self.params: List[Tensor] = [p for _, p in named]
        self.dim = sum(p.numel() for p in self.params)
        import torch.distributed as dist

        self.sharding = make_sharding(group, cls, self.dim, [None] * dist.get_world_size(group))

    @property
    def bounds(self) -> Tuple[int, int]:
        """This rank's ``(lo, hi)``."""
        return self.sharding.lo, self.sharding.hi

    def local(self, out: Optional[Tensor] = None) -> Tensor:
        """Entries ``[lo, hi)`` of the flattened parameters (no length-D temporary)."""
        ref = self.params[0]
        if out is None:
            out = torch.empty(self.sharding.size, dtype=ref.dtype, device=ref.device)
        return flatten_slice(self.params, self.sharding.lo, self.sharding.hi, out)

    def gather(self, local: Tensor) -> Tensor:
        """Whole vectors (..., D) from every rank's rows (..., hi - lo): an all-gather (collective)."""
        return self.sharding.all_gather(local)

    @torch.no_grad()
    def assign(self, theta: Tensor) -> None:
        """Copy a whole flattened vector of shape (D,) into the parameters (no collective)."""
        if theta.shape != (self.dim,):
            raise ValueError(f"{type(self).__name__}: theta must have shape ({self.dim},), got {tuple(theta.shape)!r}.")
        torch.nn.utils.vector_to_parameters(theta, self.params)


def _optim_base():
    from pyro.optim.optim import PyroOptim

    return PyroOptim


class AllReduceOptim(_optim_base()):
    r"""A ``pyro.optim`` optimizer that averages gradients over the ranks before each step.

    Data-parallel SVI with any guide (e.g. :class:`~pyro_fa.AutoLowRankFactorGuide`
    with :class:`~pyro_fa.FactorELBO`), in the pattern of Pyro's ``HorovodOptimizer``:
    every rank holds the whole guide, computes ``loss_and_grads`` on its share of the
    data, and this wrapper all-reduces the gradients of the parameters being stepped
    (sorted by name, packed: one all-reduce per step) and divides by the world size
    before handing them to the wrapped optimizer.

    .. math::

        \nabla \widehat{\mathrm{ELBO}} = \frac1W \sum_{r=1}^W \nabla \widehat{\mathrm{ELBO}}_r, \qquad
        \widehat{\mathrm{ELBO}}_r = \tfrac{N}{N_r}\textstyle\sum_{i \in \mathcal{D}_r}
        \mathbb{E}_q \log p(y_i \mid \theta) + \mathbb{E}_q \log p(\theta) + H[q],

    where the likelihood scale :math:`N/N_r` comes from the model's
    ``pyro.plate("data", N, subsample=local_indices(N))``. The entropy and prior terms
    (closed form in :class:`~pyro_fa.FactorELBO`) are the same on every rank. With the
    same seed on every rank the ranks draw the same :math:`\theta`, and the run equals
    the single-process run on the whole data to rounding; with different seeds the
    average has :math:`W` times the Monte Carlo particles.

    The first time a set of parameters is stepped, the ranks check that they hold the
    same parameters (names, shapes, dtypes) and, with ``broadcast=True``, take rank 0's
    values, so that the replicas agree from then on even when their initialisations
    differed (that first step's gradients were taken at each rank's own values: seed
    the ranks alike).

    Parameters
    ----------
    optim : pyro.optim.PyroOptim
        E.g. ``pyro.optim.Adam({"lr": 0.01})``; its constructor, arguments and clipping
        are reused (clipping acts on the averaged gradients).
    process_group : ProcessGroup, optional
        Default: the default group.
    broadcast : bool, default True

    Examples
    --------
    ::

        optim = AllReduceOptim(pyro.optim.Adam({"lr": 0.01}))
        svi = pyro.infer.SVI(model, guide, optim, FactorELBO())
        idx = local_indices(N)
        for step in range(steps):
            svi.step(x[idx], y[idx], idx, N)   # model: pyro.plate("data", N, subsample=idx)
    """

    def __init__(self, optim, process_group=None, broadcast: bool = True):
        PyroOptim = _optim_base()
        cls = type(self).__name__
        if not isinstance(optim, PyroOptim):
            raise TypeError(f"{cls}: optim must be a pyro.optim optimizer (PyroOptim), got {type(optim).__name__}.")
        if not isinstance(broadcast, bool):
            raise TypeError(f"{cls}: broadcast must be True or False, got {broadcast!r}.")
        self.process_group = weak_group(_default_group(process_group, cls))  # None: the default group
        self.broadcast = broadcast
        self._checked: set = set()
        self.n_collectives = 0
        self.bytes_reduced = 0
        super().__init__(optim.pt_optim_constructor, optim.pt_optim_args, optim.pt_clip_args)

    def _groups(self, tensors: List[Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[int]]:
        groups: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.dtype, t.device), []).append(i)
        return groups

    def _collective(self, fn, buf: Tensor) -> None:
        fn(buf)
        self.n_collectives += 1
        self.bytes_reduced += buf.numel() * buf.element_size()

    @torch.no_grad()
    def _sync_values(self, params: List[Tensor]) -> None:
        import torch.distributed as dist

        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        for idx in self._groups(params).values():
            buf = torch.cat([params[i].detach().reshape(-1) for i in idx])
            self._collective(lambda b: dist.broadcast(b, src=src, group=self.process_group), buf)
            offset = 0
            for i in idx:
                n = params[i].numel()
                params[i].copy_(buf[offset:offset + n].view_as(params[i]))
                offset += n

    @torch.no_grad()
    def _average_grads(self, params: List[Tensor]) -> None:
        import torch.distributed as dist

        W = dist.get_world_size(self.process_group)
        for idx in self._groups(params).values():
            # the gradients and, after them, which ranks had one (a site unused on some rank has none there)
            parts = [params[i].grad.reshape(-1) if params[i].grad is not None else params[i].new_zeros(params[i].numel())
                     for i in idx]
            parts.append(torch.tensor([float(params[i].grad is not None) for i in idx],
                                      dtype=params[idx[0]].dtype, device=params[idx[0]].device))
            buf = torch.cat(parts)
            self._collective(lambda b: dist.all_reduce(b, op=dist.ReduceOp.SUM, group=self.process_group), buf)
            had = buf[-len(idx):]
            offset = 0
            for j, i in enumerate(idx):
                p = params[i]
                n = p.numel()
                if float(had[j]) > 0:
                    p.grad = buf[offset:offset + n].view_as(p).div_(W).clone()
                offset += n

    def __call__(self, params, *args, **kwargs) -> None:
        import pyro

        store = pyro.get_param_store()
        params = sorted(params, key=store.param_name)  # the same order on every rank
        names = tuple(store.param_name(p) for p in params)
        if names not in self._checked:
            agree(self.process_group, type(self).__name__,
                  {"parameters (names, shapes, dtypes)": [(n, tuple(p.shape), str(p.dtype))
                                                          for n, p in zip(names, params)]})
            if self.broadcast:
                self._sync_values(params)
            self._checked.add(names)
        self._average_grads(params)
        super().__call__(params, *args, **kwargs)
