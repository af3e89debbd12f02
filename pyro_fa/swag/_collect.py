r"""Collecting from an optimizer: the weights a :class:`~pyro_fa.SWAG` follows, its schedule and its divergence guard.

The followed weights (a module's parameters, leaf tensors or Pyro's param store) are flattened
into :math:`\theta \in \mathbb{R}^D` (this rank's rows when sharded) at each collected step and
handed to the fit (:mod:`pyro_fa.swag._fits`) unless refused: a non-finite vector, one whose
update would overflow the dtype, or one from a diverged run (the guard: further from the running
mean than ``max_deviation`` times the collected spread). :meth:`IterateCollector.sampled_weights`
loads a vector back into the weights.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from pyro_fa.swag._params import ParamSource as _ParamSource
from pyro_fa.distributed.sharding import flatten_slice

__all__ = ["IterateCollector"]

_GUARD_AFTER = 10  # collected vectors before the divergence guard trusts the spread
_GUARD_PATIENCE = 20  # refusals in a row after which a run that stopped moving away is collected again


class IterateCollector:
    """The collection of a :class:`~pyro_fa.SWAG` (a mixin over its state): weights, schedule, guard."""

    # ------------------------------------------------------------- the followed weights
    def _source_from(self, obj) -> _ParamSource:
        cls = type(self).__name__
        if isinstance(obj, nn.Module):
            named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
            module = obj
        elif torch.is_tensor(obj):
            raise TypeError(
                f"{cls}: module_or_params must be an nn.Module or an iterable of tensors, got a single Tensor. "
                "Wrap it in a list."
            )
        else:
            try:
                named = [(str(i), p) for i, p in enumerate(obj)]
            except TypeError:
                raise TypeError(
                    f"{cls}: module_or_params must be an nn.Module or an iterable of tensors, got {obj!r}."
                ) from None
            module = None
            seen = {}
            for name, p in named:
                if not torch.is_tensor(p):
                    raise TypeError(f"{cls}: module_or_params must hold only tensors, got {p!r}.")
                # the same tensor twice (or two views of one storage) would count its weights twice in D
                key = id(p) if p.is_meta or p.numel() == 0 else (p.device, p.untyped_storage().data_ptr())
                if key in seen or id(p) in seen:
                    raise ValueError(f"{cls}: module_or_params must hold each tensor once, got tensor {name} "
                                     f"sharing its storage with tensor {seen.get(key, seen.get(id(p)))} (its "
                                     "weights would be counted twice). Pass each parameter once.")
                seen[key] = seen[id(p)] = name
        if not named:
            raise ValueError(f"{cls}: module_or_params must hold at least one trainable tensor, got none.")
        return _ParamSource(named=named, module=module)

    def _setup(self, named: List[Tuple[str, Tensor]]) -> None:
        cls = type(self).__name__
        self._agree_params(named)
        tensors = [p for _, p in named]
        for name, p in named:
            if not p.is_leaf:
                raise ValueError(
                    f"{cls}: parameters must be leaf tensors (what an optimizer updates), got a non-leaf "
                    f"tensor {name!r} produced by {type(p.grad_fn).__name__}. Pass the tensors the optimizer holds."
                )
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"{cls}: parameters must be float32 or float64, got {name!r} of dtype {p.dtype}. "
                                "For a half-precision model, follow float32 master weights (e.g. those of "
                                "torch.autocast training) instead.")
        for name, p in named:
            if p.is_meta:
                raise ValueError(f"{cls}: parameters must hold data, got {name!r} on the meta device (shapes "
                                 "without values). Materialise the model first, e.g. module.to_empty(device='cpu') "
                                 "and initialise it.")
        dtypes = {p.dtype for p in tensors}
        devices = {p.device for p in tensors}
        if len(dtypes) > 1:
            raise TypeError(f"{cls}: parameters must share one dtype, got {sorted(map(str, dtypes))!r}.")
        if len(devices) > 1:
            raise ValueError(f"{cls}: parameters must share one device, got {sorted(map(str, devices))!r}.")
        D = sum(p.numel() for p in tensors)
        if self.rank >= D:
            raise ValueError(f"{cls}: rank must be < the number of parameters D={D}, got {self.rank!r}.")
        dtype, device = tensors[0].dtype, tensors[0].device
        self.dim = D
        rows = self._shard_rows(D)  # this rank's coordinates: all D without a process group
        self._shapes = [p.shape for p in tensors]
        self._names = [n for n, _ in named]
        self._fit.setup(self, D, rows, dtype, device)
        if self.window > 1:
            self.register_buffer("_window_sum", torch.zeros(rows, dtype=dtype, device=device))

    def _named(self) -> List[Tuple[str, Tensor]]:
        named = self._source.resolve(type(self).__name__)
        if self.dim is None:
            self._setup(named)
        return named

    def _vector(self) -> Tensor:
        cls = type(self).__name__
        named = self._named()
        shapes = [p.shape for _, p in named]
        if shapes != self._shapes:
            raise ValueError(
                f"{cls}: parameter shapes must stay {[tuple(s) for s in self._shapes]!r} between collections, "
                f"got {[tuple(s) for s in shapes]!r}; nothing was collected. Build a new SWAG for the new model."
            )
        ref = self._ref
        for name, p in named:
            if p.dtype != ref.dtype or p.device != ref.device:
                raise ValueError(
                    f"{cls}: parameters must be on {ref.device} with dtype {ref.dtype} like the posterior, got "
                    f"{name!r} on {p.device} with dtype {p.dtype}. Call swag.to(...) after moving the model."
                )
        flat = getattr(self, "_flat", None)
        if flat is None or flat.dtype != ref.dtype or flat.device != ref.device:
            flat = self._flat = torch.empty_like(ref)
        lo, hi = (0, self.dim) if self._sharding is None else (self._sharding.lo, self._sharding.hi)
        return flatten_slice([p for _, p in named], lo, hi, flat)  # this rank's coordinates

    @torch.no_grad()
    def collect(self) -> bool:
        """Collect the current parameter vector now (whatever the step schedule).

        Returns
        -------
        bool
            Whether a vector reached the fit (``False`` while a window fills, or
            when a non-finite vector was skipped).

        Raises
        ------
        ValueError
            If the parameter shapes changed, the parameters moved to another
            device or dtype, or the vector holds NaN / inf (with
            ``on_nonfinite="raise"``); the state is unchanged.
        """
        theta = self._vector()
        reason, diverged = self._refusal(theta)
        if diverged and self._relocated():
            warnings.warn(
                f"{type(self).__name__}: the last {len(self._streak)} vectors lay beyond max_deviation="
                f"{self.max_deviation:g} times the collected spread without moving further away (a run that "
                "changed regime, e.g. a new learning rate or collect_every, not one that diverged): collecting "
                "again.", RuntimeWarning, stacklevel=3)
            reason, diverged = None, False
        if reason is None:
            self._streak.clear()
        if diverged:
            # the divergence guard is a heuristic: it skips with a warning and never stops training
            # (a diverged run soon gives non-finite vectors, which on_nonfinite="raise" raises on)
            self._n_refused += 1
            warnings.warn(f"{type(self).__name__}: {reason} It was not collected and the posterior is unchanged "
                          f"({self._n} vectors collected).", RuntimeWarning, stacklevel=3)
            return False
        if reason is None and self.window > 1:
            if self._n_window + 1 < self.window:
                self._window_sum.add_(theta)
                self._n_window += 1
                return False
            theta = (self._window_sum + theta) / self.window
        if reason is None:
            try:
                self._fit.update(self, theta)
            except ValueError as err:  # the online fit refused an update that would overflow its dtype
                reason = str(err).split(": ", 1)[-1]
        if reason is not None:
            self._n_refused += 1
            msg = (f"{type(self).__name__}: {reason} It was not collected and the posterior is unchanged "
                   f"({self._n} vectors collected).")
            if self.on_nonfinite == "skip":
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                return False
            raise ValueError(msg + " Pass on_nonfinite='skip' to skip such vectors with a warning.")
        if self.window > 1:
            self._window_sum.zero_()
            self._n_window = 0
        return True

    def _relocated(self) -> bool:
        # the guard's escape: _GUARD_PATIENCE refusals in a row whose distances stopped growing
        # (at most x2 over the last half: a diverging run grows geometrically and goes on growing)
        if len(self._streak) < _GUARD_PATIENCE:
            return False
        last = self._streak[-(_GUARD_PATIENCE // 2):]
        return max(last) <= 2.0 * min(last)

    def _refusal(self, theta: Tensor) -> Tuple[Optional[str], bool]:
        """Why ``theta`` must not be collected, or None; and whether the reason is the divergence guard."""
        guard = self.max_deviation is not None and self._n >= _GUARD_AFTER
        if self._sharding is not None:
            dist2, spread2, bad = self._sharded_distance(theta, guard)  # summed over the ranks
            count_bad = lambda: bad  # noqa: E731
        else:
            dist2 = spread2 = 0.0
            if guard:
                # the distance in the state's dtype (the mean rounded once is close enough for a guard);
                # a non-finite distance sends us to the finiteness check below
                dist2 = float(torch.linalg.vector_norm(theta - self.loc)) ** 2
                moments = self._fit.moments(self)
                spread2 = float(moments.sq_dev.sum()) / self._n
            count_bad = lambda: int((~torch.isfinite(theta)).sum())  # noqa: E731
        # no spread yet (identical vectors, e.g. after a schedule that ended at rate 0): no judgement
        if guard and math.isfinite(dist2) and (spread2 == 0.0 or dist2 <= self.max_deviation ** 2 * spread2):
            return None, False
        bad = count_bad()
        if bad:
            self._streak.clear()
            return f"the parameter vector must be finite, got NaN or inf in {bad} entries.", False
        if not guard:
            return None, False
        self._streak.append(math.sqrt(dist2))
        return (f"the parameter vector must lie within max_deviation={self.max_deviation:g} times the collected "
                f"spread of the running mean, got a distance of {math.sqrt(dist2):.3g} against a spread of "
                f"{math.sqrt(spread2):.3g} (the run looks diverged; if it only changed regime, pass a larger "
                "max_deviation, or None)."), True

    def step(self) -> bool:
        """Count one optimizer step and collect if the schedule says so.

        Step :math:`t` (counted from one) is collected when ``t > start_after`` and
        ``(t - start_after) % collect_every == 0``. This is what the hook of
        :meth:`attach` calls; Pyro users call it after each ``svi.step``.

        Returns
        -------
        bool
            Whether a vector reached the fit.
        """
        self._n_steps += 1
        t = self._n_steps - self.start_after
        if t > 0 and t % self.collect_every == 0:
            return self.collect()
        return False

    def attach(self, optimizer: torch.optim.Optimizer):
        """Collect after the steps of ``optimizer`` (per ``start_after`` / ``collect_every``).

        Parameters
        ----------
        optimizer : torch.optim.Optimizer

        Returns
        -------
        torch.utils.hooks.RemovableHandle
            ``handle.remove()`` detaches.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "With pyro.optim, call swag.step() after each svi.step(...)."
            )
        attached = self.__dict__.setdefault("_attached", {})
        live = attached.get(id(optimizer))
        if live is not None and live[1].id in getattr(optimizer, "_optimizer_step_post_hooks", {}):
            raise ValueError(
                f"{type(self).__name__}: optimizer must not be attached twice (every step would be collected twice), "
                "got one that is attached already. Call handle.remove() on the first handle to attach again."
            )
        handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())
        # the optimizer is held weakly: optimizer -> hook -> SWAG -> optimizer would be a reference cycle,
        # freed only by the garbage collector (under DDP possibly at exit, after the process group is gone)
        attached[id(optimizer)] = (weakref.ref(optimizer), handle)
        return handle

    @property
    def n_collected(self) -> int:
        return self._n

    @property
    def n_steps(self) -> int:
        return self._n_steps

    @property
    def n_refused(self) -> int:
        """Vectors not collected: non-finite, overflowing, or from a diverged run (see ``max_deviation``)."""
        return self._n_refused

    def _split(self, theta: Tensor) -> List[Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            out.append(theta[..., offset:offset + n].reshape(theta.shape[:-1] + shape))
            offset += n
        return out

    @contextlib.contextmanager
    def sampled_weights(self, theta: Optional[Tensor] = None, loader=None, generator: Optional[torch.Generator] = None):
        """Load sampled weights into the model for the ``with`` block, then restore the originals.

        Parameters
        ----------
        theta : Tensor of shape (D,), optional
            The weights to load; default one draw of :meth:`sample`.
        loader : iterable, optional
            Training batches: batch-norm statistics are recomputed for the
            sampled weights by ``torch.optim.swa_utils.update_bn`` (module only).
        generator : torch.Generator, optional

        Yields
        ------
        Tensor of shape (D,)
            The loaded vector. Parameters and buffers are restored on exit, also
            after an exception.
        """
        cls = type(self).__name__
        theta = self._full_theta(theta)  # sharded: this rank's rows (e.g. swag.loc) are gathered
        if theta is None:
            theta = self.sample(generator=generator)
        elif not torch.is_tensor(theta) or theta.shape != (self.dim,):
            raise ValueError(f"{cls}: theta must be a tensor of shape ({self.dim},), got {theta!r}.")
        module = self._source.module
        if loader is not None and module is None:
            raise ValueError(f"{cls}: loader needs a SWAG built from an nn.Module, got parameters only.")
        tensors = [p for _, p in self._named()]
        with torch.no_grad():
            saved = [p.detach().clone() for p in tensors]
            buffers = {k: b.clone() for k, b in module.named_buffers()} if loader is not None else {}
        try:
            with torch.no_grad():
                for p, v in zip(tensors, self._split(theta)):
                    p.copy_(v)
            if loader is not None:
                from torch.optim.swa_utils import update_bn

                update_bn(loader, module)
            yield theta
        finally:
            with torch.no_grad():
                for p, v in zip(tensors, saved):
                    p.copy_(v)
                if buffers:
                    current = dict(module.named_buffers())
                    for k, v in buffers.items():
                        current[k].copy_(v)
