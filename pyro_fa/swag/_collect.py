r"""A :class:`~pyro_fa.SWAG`'s collector: when it collects (the schedule) and what it refuses (the guard).

The collector counts the optimizer's steps (:meth:`IterateCollector.step`, the hook of
:meth:`IterateCollector.attach`), asks its schedule (:meth:`IterateCollector.due`) whether to collect,
and hands each collected :math:`\theta` to the SWAG's fit unless refused: a non-finite vector, one whose
update would overflow the dtype, or one from a diverged run (the divergence guard: further from the running
mean than ``max_deviation`` times the collected spread). With ``window > 1`` it hands the fit the mean of
``window`` consecutive collected vectors. A new schedule is a subclass overriding :meth:`~IterateCollector.due`
(docs/architecture.md, "Add a collector").
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa._state import check_count
from pyro_fa.swag._params import positive_int

__all__ = ["IterateCollector"]

_GUARD_AFTER = 10  # collected vectors before the divergence guard trusts the spread
_GUARD_PATIENCE = 20  # refusals in a row after which a run that stopped moving away is collected again


def _skip_refused(msg: str) -> bool:
    """``on_nonfinite="skip"``: warn, and report the vector as not collected."""
    warnings.warn(msg, RuntimeWarning, stacklevel=5)
    return False


def _raise_refused(msg: str) -> bool:
    """``on_nonfinite="raise"``: refuse the vector with an error naming the way to skip such vectors."""
    raise ValueError(msg + " Pass on_nonfinite='skip' to skip such vectors with a warning.")


#: on_nonfinite -> what a refused vector does (returns False, or raises)
ON_NONFINITE = {"raise": _raise_refused, "skip": _skip_refused}
_ON_NONFINITE = tuple(ON_NONFINITE)
_DEFAULTS = dict(start_after=0, collect_every=1, window=1, on_nonfinite="raise", max_deviation=10.0)


class IterateCollector:
    r"""When a :class:`~pyro_fa.SWAG` collects, and which vectors it refuses.

    :class:`~pyro_fa.SWAG` builds one from its own arguments unless given ``collector=``. A subclass
    changes the schedule by overriding :meth:`due` (docs/architecture.md, "Add a collector").

    Parameters
    ----------
    start_after : int, default 0
        Optimizer steps to skip (pre-training) before collecting.
    collect_every : int, default 1
        Collect every this many optimizer steps (after ``start_after``).
    window : int, default 1
        Finite-window iterate averaging (Brownlie 2021, §6.1.2; Mandt et al. 2017): each
        vector handed to the fit is the mean of ``window`` consecutive collected
        iterates.
    on_nonfinite : {"raise", "skip"}, default "raise"
        What a parameter vector that cannot be collected does (NaN / inf, or an update
        that would overflow the dtype): raise ``ValueError``, or be skipped with a
        ``RuntimeWarning``; the posterior is unchanged either way. (The divergence
        guard, ``max_deviation``, always skips with a warning.)
    max_deviation : float or None, default 10.0
        Divergence guard: once 10 vectors have been collected, a vector further from
        the running mean than ``max_deviation`` times the root of the summed running
        variances, :math:`\|\theta - c\| > r\sqrt{\mathrm{tr}\,S}`, is taken for a diverged
        run and not collected: it is skipped with a ``RuntimeWarning`` whatever
        ``on_nonfinite`` says (a heuristic never stops training; the non-finite vectors a
        diverged run soon gives follow ``on_nonfinite``). Iterates of a run that is sampling, drifting or
        random-walking sit at 1 to 3 such units (a Gaussian's expected value is about
        1); a run blowing up leaves by orders of magnitude at once, and the posterior
        collected before it is kept. A run that changed regime (a higher learning rate,
        a larger ``collect_every``) may leave the spread too; after 20 refusals in a row
        whose distances stopped growing (at most twice over the last 10), it is
        collected again, with a warning. ``None`` disables the guard.
    owner : str, optional
        The class named in error messages (default this collector's).

    Attributes
    ----------
    n_steps : int
        Optimizer steps seen by :meth:`step`.
    n_refused : int
        Vectors not collected (non-finite, overflowing, or from a diverged run).
    """

    def __init__(self, start_after: int = 0, collect_every: int = 1, window: int = 1, *,
                 on_nonfinite: str = "raise", max_deviation: Optional[float] = 10.0, owner: Optional[str] = None):
        cls = owner or type(self).__name__
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"{cls}: on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}.")
        self.start_after = positive_int(cls, "start_after", start_after, 0)
        self.collect_every = positive_int(cls, "collect_every", collect_every)
        self.window = positive_int(cls, "window", window)
        self.on_nonfinite = on_nonfinite
        if max_deviation is not None and not (
            isinstance(max_deviation, (int, float)) and not isinstance(max_deviation, bool)
            and math.isfinite(max_deviation) and max_deviation > 1
        ):
            raise ValueError(f"{cls}: max_deviation must be a finite number > 1 or None, got {max_deviation!r}.")
        self.max_deviation = None if max_deviation is None else float(max_deviation)
        self.n_steps = self.n_window = self.n_refused = 0
        self._streak: List[float] = []  # distances of the guard's refusals in a row
        self._attached: Dict[int, tuple] = {}

    @classmethod
    def chosen(cls, owner: str, collector, settings: Dict[str, object]) -> "IterateCollector":
        """``collector``, or (None) the one ``settings`` build; a collector comes with the default settings."""
        if collector is None:
            return cls(**settings, owner=owner)
        if not isinstance(collector, IterateCollector):
            raise TypeError(f"{owner}: collector must be an IterateCollector, got {type(collector).__name__}.")
        changed = {k: v for k, v in settings.items() if v != _DEFAULTS[k]}
        if changed:
            raise ValueError(f"{owner}: start_after, collect_every, window, on_nonfinite and max_deviation must be "
                             f"left at their defaults with a collector (they are its settings), got {changed!r}.")
        return collector

    # ------------------------------------------------------------- the schedule
    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from one) is collected: after ``start_after``, every
        ``collect_every``-th. Override it for another schedule."""
        t = step - self.start_after
        return t > 0 and t % self.collect_every == 0

    def step(self, swag) -> bool:
        """Count one optimizer step and collect ``swag``'s weights if :meth:`due`; whether a vector reached the fit."""
        self.n_steps += 1
        return swag.collect() if self.due(self.n_steps) else False

    def attach(self, swag, optimizer: torch.optim.Optimizer):
        """Call ``swag.step()`` after every step of ``optimizer``; returns the hook's handle."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(swag).__name__}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "With pyro.optim, call swag.step() after each svi.step(...)."
            )
        live = self._attached.get(id(optimizer))
        if live is not None and live[1].id in getattr(optimizer, "_optimizer_step_post_hooks", {}):
            raise ValueError(
                f"{type(swag).__name__}: optimizer must not be attached twice (every step would be collected twice), "
                "got one that is attached already. Call handle.remove() on the first handle to attach again."
            )
        handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: swag.step())
        # the optimizer is held weakly: optimizer -> hook -> SWAG -> optimizer would be a reference cycle,
        # freed only by the garbage collector (under DDP possibly at exit, after the process group is gone)
        self._attached[id(optimizer)] = (weakref.ref(optimizer), handle)
        return handle

    # ------------------------------------------------------------- collecting
    def setup(self, swag, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """Register the window's running sum on ``swag`` (its checkpoint key ``_window_sum``)."""
        if self.window > 1:
            swag.register_buffer("_window_sum", torch.zeros(rows, dtype=dtype, device=device))

    def collect(self, swag, theta: Tensor) -> bool:
        """Hand ``theta`` (this rank's rows) to ``swag``'s fit unless refused; whether it reached the fit."""
        cls = type(swag).__name__
        reason, diverged = self._refusal(swag, theta)
        if diverged and self._relocated():
            warnings.warn(
                f"{cls}: the last {len(self._streak)} vectors lay beyond max_deviation="
                f"{self.max_deviation:g} times the collected spread without moving further away (a run that "
                "changed regime, e.g. a new learning rate or collect_every, not one that diverged): collecting "
                "again.", RuntimeWarning, stacklevel=4)
            reason, diverged = None, False
        if reason is None:
            self._streak.clear()
        if diverged:
            # the divergence guard is a heuristic: it skips with a warning and never stops training
            # (a diverged run soon gives non-finite vectors, which on_nonfinite="raise" raises on)
            self.n_refused += 1
            warnings.warn(f"{cls}: {reason} It was not collected and the posterior is unchanged "
                          f"({swag._n} vectors collected).", RuntimeWarning, stacklevel=4)
            return False
        if reason is None and self.window > 1:
            if self.n_window + 1 < self.window:
                swag._window_sum.add_(theta)
                self.n_window += 1
                return False
            theta = (swag._window_sum + theta) / self.window
        if reason is None:
            try:
                swag._fit.update(swag, theta)
            except ValueError as err:  # the online fit refused an update that would overflow its dtype
                reason = str(err).split(": ", 1)[-1]
        if reason is not None:
            self.n_refused += 1
            msg = f"{cls}: {reason} It was not collected and the posterior is unchanged ({swag._n} vectors collected)."
            return ON_NONFINITE[self.on_nonfinite](msg)
        if self.window > 1:
            swag._window_sum.zero_()
            self.n_window = 0
        return True

    def _relocated(self) -> bool:
        # the guard's escape: _GUARD_PATIENCE refusals in a row whose distances stopped growing
        # (at most x2 over the last half: a diverging run grows geometrically and goes on growing)
        if len(self._streak) < _GUARD_PATIENCE:
            return False
        last = self._streak[-(_GUARD_PATIENCE // 2):]
        return max(last) <= 2.0 * min(last)

    def _refusal(self, swag, theta: Tensor) -> Tuple[Optional[str], bool]:
        """Why ``theta`` must not be collected, or None; and whether the reason is the divergence guard."""
        guard = self.max_deviation is not None and swag._n >= _GUARD_AFTER
        def spread2(over_all_ranks: bool) -> float:  # the running squared deviations' sum per collected vector
            fit = swag._fit
            return (fit.sq_dev_total(swag) if over_all_ranks else float(fit.moments(swag).sq_dev.sum())) / swag._n

        dist2, spread2, count_bad = swag._rows.distance(theta, swag.loc, guard, spread2)  # sharded: over the ranks
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

    # ------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, int]:
        """The counts a checkpoint keeps (SWAG composes them into its extra state)."""
        return {"n_steps": self.n_steps, "n_window": self.n_window, "n_refused": self.n_refused}

    def check_state(self, cls: str, state) -> None:
        """Refuse (``ValueError``) saved counts this collector cannot hold."""
        for key in ("n_steps", "n_window", "n_refused"):
            check_count(cls, state, key, 0)
        if state["n_window"] >= self.window:
            raise ValueError(f"{cls}: the saved state's 'n_window' must be < window={self.window}, got "
                             f"{state['n_window']!r}; nothing was loaded.")

    def load_state_dict(self, state) -> None:
        self.n_steps, self.n_window = int(state["n_steps"]), int(state["n_window"])
        self.n_refused = int(state.get("n_refused", 0))
