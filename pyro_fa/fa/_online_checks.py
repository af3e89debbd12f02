r"""What every online factor-analysis fit checks: its input before an update, a saved state before a load.

:class:`~pyro_fa.OnlineFactorAnalysis` mixes this in. An update is refused before it touches the
state when it is not finite or would overflow the state's dtype; a ``state_dict`` is checked whole
(keys, shapes, finiteness, the values no fit can hold, the fitter's optimizer state) before any of
it is written (:mod:`pyro_fa._state`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor

from pyro_fa._state import check_count, check_state_dict

__all__ = ["OnlineChecks", "check_fitted", "check_density_input"]


def check_fitted(owner: str, what: str, n_updates: int) -> None:
    """Refuse to read a fit out before its first update (``what``: the call refused)."""
    if n_updates == 0:
        raise RuntimeError(f"{owner}: {what} needs at least one update, got none. Call update(x) first.")


def check_density_input(owner: str, x, dtype: torch.dtype) -> None:
    """Refuse a point to evaluate the density at that is not a tensor of the state's ``dtype`` (torch's
    distributions do not convert)."""
    if not torch.is_tensor(x):
        raise TypeError(f"{owner}: x must be a torch.Tensor of shape (..., D), got {type(x).__name__}.")
    if x.dtype != dtype:
        raise TypeError(f"{owner}: x must have dtype {dtype} like the model state, got "
                        f"{x.dtype}. Convert x (x.to({dtype})) or call .to({x.dtype}) on the model.")


class OnlineChecks:
    """Input and checkpoint checks of :class:`~pyro_fa.OnlineFactorAnalysis` (a mixin over its state)."""

    # the fit state's counters are saved under these keys (the defaults where a fitter has no such counter),
    # in this order, so that checkpoints keep their layout whatever the fitter
    _EXTRA_DEFAULTS = {"since_m_step": 0, "sga_steps": 0, "A_coef": 0.0}

    def get_extra_state(self):
        fit = self.fit_state
        counters = {key: getattr(fit, field) for field, key in fit.extra.items()}
        state = {"n_updates": self._n}
        state.update({key: counters.get(key, default) for key, default in self._EXTRA_DEFAULTS.items()})
        state.update({key: value for key, value in counters.items() if key not in state})
        state["warmup"] = self.warmup
        return state

    def set_extra_state(self, state):
        self.warmup = int(state.get("warmup", self.warmup))
        self._n = int(state["n_updates"])
        fit = self._fit_state
        for field, key in fit.extra.items():
            default = self._EXTRA_DEFAULTS.get(key, getattr(type(fit), field, 0))
            setattr(fit, field, type(default)(state.get(key, default)))
        self.__dict__.pop("_spread_seen", None)  # the loaded moments decide

    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        extra = self.fitter.state_extra(self.fit_state)
        if extra is not None:
            sd[kwargs.get("prefix", "") + "_optimizer_state"] = extra
        return sd

    def _check_extra_state(self, state) -> None:
        cls = type(self).__name__
        if not isinstance(state, dict) or "n_updates" not in state:
            raise ValueError(f"{cls}: the saved state's extra state must be a dict with 'n_updates', got {state!r}; "
                             "nothing was loaded.")
        for key in ("n_updates", "since_m_step", "sga_steps"):
            check_count(cls, state, key, 0)
        check_count(cls, state, "warmup", self.warmup)
        coef = state.get("A_coef", 0.0)
        if not (isinstance(coef, (int, float)) and math.isfinite(coef)):
            raise ValueError(f"{cls}: the saved state's 'A_coef' must be a finite number, got {coef!r}; "
                             "nothing was loaded.")
        self._check_shard_state(state)

    def _check_optimizer_state(self, state) -> None:
        self.fitter.check_optimizer_state(self.fit_state, self._ctx, state)

    def _check_values(self, state_dict, prefix: str = "", owner: Optional[str] = None) -> None:
        """Refuse saved values no fit can hold (checked after shapes and finiteness): psi <= 0, a capacitance
        that is not positive definite, negative squared deviations, a non-positive SGA scale.

        ``prefix`` and ``owner`` (the class that loads, e.g. SWAG) name the entries in the message."""
        cls = owner or type(self).__name__

        def get(key):
            v = state_dict.get(key)
            return v if torch.is_tensor(v) else None

        for key, what in (("_psi", "the noise variances psi (cov_diag)"), ("_scale", "the SGA coordinate scales")):
            v = get(key)
            if v is not None and not bool((v > 0).all()):
                raise ValueError(f"{cls}: state_dict[{prefix + key!r}] must be positive ({what}), got "
                                 f"{int((v <= 0).sum())} entries <= 0 (smallest {float(v.min()):.3g}); nothing was "
                                 "loaded.")
        v = get("_moments.sq_dev")
        if v is not None and not bool((v >= 0).all()):
            raise ValueError(f"{cls}: state_dict[{prefix + '_moments.sq_dev'!r}] must be >= 0 (running squared "
                             f"deviations), got {int((v < 0).sum())} negative entries; nothing was loaded.")
        v = get("_cap")
        if v is not None:
            if int(torch.linalg.cholesky_ex(v.double()).info) != 0:
                raise ValueError(f"{cls}: state_dict[{prefix + '_cap'!r}] must be positive definite (the "
                                 "capacitance I + F^T Psi^-1 F), got one that is not; nothing was loaded.")

    def _check_state(self, state_dict, strict: bool, prefix: str = ""):
        """Check a whole saved state (keys relative to this module) before any of it is written.

        Collective when sharded (every rank must call it). Returns the sharded running total of squared
        deviations (else None).
        """
        total = self._check_loadable(state_dict, strict)
        self._agreed(lambda: self._check_values(state_dict, prefix))
        return total

    # hooks: the sharded subclass (pyro_fa.distributed) agrees on each check with the other ranks
    def _agreed(self, check) -> None:
        check()

    def _check_loadable(self, state_dict, strict: bool) -> Optional[float]:
        check_state_dict(self, state_dict, strict=strict)
        return None

    def _check_shard_state(self, state) -> None:
        saved = state.get("shard")
        if saved is not None:
            raise ValueError(f"{type(self).__name__}: state_dict must come from a model that is not sharded, got the "
                             f"shard of rank {saved.get('rank')!r} of world size {saved.get('world_size')!r}; nothing "
                             "was loaded.")

    def _rows_note(self) -> str:
        return ""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # runs for a direct load_state_dict and for a parent module's alike: the whole state of this fit is
        # checked before any of it is written (unless a parent, e.g. SWAG, has just checked it)
        checked = self.__dict__.pop("_load_checked", None)
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        hint = self.__dict__.get("_load_strict")
        if checked is not None:
            total = checked[0]
        elif mine or hint is not None:
            total = self._check_state(mine, True if hint is None else hint, prefix)
        else:  # a parent's non-strict load without this fit's entries: nothing to load
            total = None
        opt_key = prefix + "_optimizer_state"
        opt_state = state_dict.get(opt_key)
        if opt_key in state_dict:
            state_dict = {k: v for k, v in state_dict.items() if k != opt_key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if total is not None:
            self._sq_dev_total = total
        self._bind_state(self.fitter.loaded(self.fit_state, self._ctx, opt_state))
        self._cache = None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict`, checked whole first: on error nothing is loaded.

        The same checks run when a parent module (e.g. :class:`~pyro_fa.SWAG`) loads its state.

        Raises
        ------
        ValueError, TypeError
            If an entry is missing or unexpected (``strict``), has another shape
            (another ``dim`` or ``rank``), holds NaN / inf, holds a noise variance
            :math:`\\psi \\le 0` or a capacitance that is not positive definite, or the
            extra or optimizer state does not fit; the model is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{type(self).__name__}: state_dict must be a mapping from names to tensors, got "
                            f"{type(state_dict).__name__}.")
        self.__dict__.pop("_load_checked", None)  # a mark left by a parent's load that stopped midway
        self.__dict__["_load_strict"] = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_load_strict", None)

    def _validate(self, x) -> Tensor:
        name = type(self).__name__
        if not torch.is_tensor(x):
            raise TypeError(f"{name}: x must be a torch.Tensor of shape (D,) or (B, D), got {type(x).__name__}.")
        if x.dim() == 1:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.shape[-1] != self._local_dim:
            raise ValueError(
                f"{name}: x must have shape (D,) or (B, D) with D={self._local_dim}"
                + self._rows_note()
                + f", got shape {tuple(x.shape)!r}."
            )
        if x.shape[0] == 0:
            raise ValueError(f"{name}: x must hold at least one observation, got shape {tuple(x.shape)!r}.")
        if x.dtype != self.loc.dtype:
            raise TypeError(
                f"{name}: x must have dtype {self.loc.dtype} like the model state, got {x.dtype}. "
                f"Convert x or call .to({x.dtype}) on the model."
            )
        if x.is_meta or self.loc.is_meta:
            raise ValueError(
                f"{name}: x must be on a device that holds data like the model state (on {self.loc.device}), got "
                f"a tensor on {x.device}: the meta device has shapes but no values to fit."
            )
        if x.device != self.loc.device:
            raise ValueError(
                f"{name}: x must be on device {self.loc.device} like the model state, got {x.device}. "
                f"Move x or call .to('{x.device}') on the model."
            )
        return x  # finiteness is checked with the range, on the deviations (see _check_range)

    def _check_range(self, x: Tensor, tmax: float, B: int, t: Optional[Tensor] = None, *,
                     floor: Optional[float] = None, scale2: Optional[float] = None) -> None:
        r"""Refuse a batch that is not finite or whose update would overflow, before anything changes.

        ``tmax`` is the largest :math:`|x_{bd} - c_d|` from the current mean. The deviations
        from the new mean are at most :math:`2t_{\max}`, the variances grow to at most
        :math:`\max(\mathrm{var}, 5t_{\max}^2)`, and the step's products are bounded by the
        squared deviation in units of the noise variances,
        :math:`q \le 4Dt_{\max}^2/\psi_{\min}`: the E-step's latent mean has
        :math:`\|m\|^2 \le q/4` (the map :math:`(I + W^\top W)^{-1}W^\top`,
        :math:`W = \Psi^{-1/2}F`, has norm at most 1/2), the statistics' entries at most
        :math:`2t_{\max}\sqrt q` and :math:`q`; the ascent's squared gradients (Adam's second
        moment) grow like :math:`q^2/\psi_{\min}`. A margin of 64 is left for sums over the
        batch. Legitimate vectors are far inside: overflow in float32 needs a deviation of
        about :math:`10^{11}` running standard deviations.
        """
        name = type(self).__name__
        if not math.isfinite(tmax):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(
                    f"{name}: x must be finite, got NaN or inf in {int((~torch.isfinite(x)).sum())} entries; "
                    "the update was refused and the model is unchanged."
                )
        limit = torch.finfo(x.dtype).max / 64
        t2 = tmax * tmax
        tiny = torch.finfo(x.dtype).tiny

        scaled = self.fitter.range_scale(self.fit_state, self._ctx) is not None

        def worst_case(q: float, t2_std: float) -> float:
            worst = max(5.0 * t2, q, 2.0 * math.sqrt(t2 * q))
            if scaled:  # a scaled ascent (SGA): Adam's squared gradient, entries (2 t/scale)(sqrt(q)/2)/psi~
                worst = max(worst, t2_std * q / self.min_variance ** 2)
            return worst

        floor = max(self._noise_floor_now() if floor is None else floor, tiny)  # over all ranks if given
        if not scaled:
            scale2 = 1.0
        elif scale2 is None:
            scale2 = float(self.fitter.range_scale(self.fit_state, self._ctx).amin()) ** 2
        worst = worst_case(4.0 * self.dim * t2 / floor, 4.0 * t2 / max(scale2, tiny))
        if math.isfinite(worst) and worst > limit and t is not None:
            # the cheap bound (every deviation in the coordinate of least noise) failed: the exact q
            q, t2_std = self._exact_range(t)
            worst = worst_case(q, t2_std)
        if not math.isfinite(worst) or worst > limit:
            raise ValueError(
                f"{name}: x must stay within the range whose update fits {x.dtype}, got a deviation of {tmax:.3g} from "
                "the running mean: the statistics would overflow. The update was refused and the model is unchanged."
            )
