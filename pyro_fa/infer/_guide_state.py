r"""State of an :class:`~pyro_fa.infer.guide.AutoLowRankFactorGuide`: conversion to and from Pyro's low-rank guide.

:class:`_GuideStateMixin` holds :meth:`from_pyro`, :meth:`to_pyro` and the checked, transactional
:meth:`load_state_dict` (which also reads a Pyro ``AutoLowRankMultivariateNormal`` state); the guide class
inherits them. Kept apart from :mod:`pyro_fa.infer.guide` so that module stays short.
"""
from __future__ import annotations

from typing import Dict

import pyro
import torch
from pyro.infer.autoguide import AutoContinuous, AutoLowRankMultivariateNormal
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.nn import PyroParam
from torch import Tensor, nn
from torch.distributions import transform_to

#: the state keys of Pyro's ``AutoLowRankMultivariateNormal``
_PYRO_LOW_RANK_KEYS = ("loc", "cov_factor", "scale_unconstrained")


class _GuideStateMixin:
    """``from_pyro`` / ``to_pyro`` / ``load_state_dict`` of :class:`~pyro_fa.infer.guide.AutoLowRankFactorGuide`.

    Mixed in before :class:`~pyro.infer.autoguide.AutoContinuous`; uses the guide's ``loc``, ``factor``,
    ``scale``, ``_scale_vector``, ``_check_setup`` and ``_setup_params``.
    """

    # ------------------------------------------------------------------ Pyro's low-rank guide
    @classmethod
    def from_pyro(cls, guide: AutoLowRankMultivariateNormal) -> "AutoLowRankFactorGuide":
        r"""The same :math:`q` as a fitted :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`.

        Pyro's guide has the same parameterisation,
        :math:`q = N(c,\, \mathrm{diag}(s)(GG^\top + I)\mathrm{diag}(s))`, with
        :math:`G` named ``cov_factor`` (ours: ``factor``; our ``cov_factor``
        is :math:`\mathrm{diag}(s)G`, as in ``get_posterior()``) and
        :math:`s` kept positive by a softplus (ours: an exponential). The
        values of :math:`c`, :math:`G`, :math:`s` are copied (detached), so
        ``get_posterior()`` of both guides agree to rounding. The new guide
        has ``noise="diagonal"``, Pyro's rank and ``init_scale``, and shares
        the Pyro guide's model trace, so it needs no call before use.

        To load a Pyro checkpoint, either restore Pyro's guide
        (``pyro.get_param_store().load(path)``, then call the new Pyro guide
        once: it takes the stored values) and convert it, or load
        the Pyro guide's ``state_dict()`` straight into a set-up
        :class:`AutoLowRankFactorGuide` with :meth:`load_state_dict`.

        Parameters
        ----------
        guide : pyro.infer.autoguide.AutoLowRankMultivariateNormal
            Run at least once (its parameters exist).

        Returns
        -------
        AutoLowRankFactorGuide

        Raises
        ------
        TypeError
            If ``guide`` is not an ``AutoLowRankMultivariateNormal``.
        RuntimeError
            If ``guide`` has not run yet.
        """
        name = cls.__name__
        if not isinstance(guide, AutoLowRankMultivariateNormal):
            raise TypeError(f"{name}.from_pyro: guide must be an AutoLowRankMultivariateNormal, got {type(guide).__name__}.")
        if guide.prototype_trace is None:
            raise RuntimeError(f"{name}.from_pyro: guide has not run yet (it has no parameters); "
                               "call it once with the model's arguments or run one SVI step first.")
        model, init_loc_fn = _unwrap_init(guide.model)
        new = cls(model, init_loc_fn=init_loc_fn, init_scale=guide._init_scale, rank=guide.rank)
        _copy_prototype(guide, new)
        new._setup_params()
        with guide._pyro_context:  # read the param store's values when it holds the guide's parameters
            loc, cov_factor, scale = guide.loc.detach(), guide.cov_factor.detach(), guide.scale.detach()
        with torch.no_grad():
            new.loc.copy_(loc)
            new.factor.copy_(cov_factor)
            new.scale_unconstrained.copy_(transform_to(new.scale_constraint).inv(scale))
        new._drop_stale_param_store_entries()
        return new

    def to_pyro(self) -> AutoLowRankMultivariateNormal:
        r"""The same :math:`q` as Pyro's :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal`.

        The inverse of :meth:`from_pyro`: :math:`c`, :math:`G` and :math:`s`
        (expanded to shape (D,) for ``noise="isotropic"``) are copied
        (detached) into a new Pyro guide that shares this guide's model trace.
        Entries of the param store under that guide's names
        (``AutoLowRankMultivariateNormal.loc``, ...) left by another guide are
        dropped, so the converted values are the ones used; the same holds for
        the guide :meth:`from_pyro` returns.

        Returns
        -------
        pyro.infer.autoguide.AutoLowRankMultivariateNormal

        Raises
        ------
        RuntimeError
            If this guide has not run yet.
        """
        self._check_setup("to_pyro()")
        model, init_loc_fn = _unwrap_init(self.model)
        pyro_guide = AutoLowRankMultivariateNormal(model, init_loc_fn=init_loc_fn or init_to_median,
                                                   init_scale=self._init_scale, rank=self.rank)
        _copy_prototype(self, pyro_guide)
        with self._pyro_context:
            loc, G, scale = self.loc.detach(), self.factor.detach(), self._scale_vector().detach()
        # the three parameters AutoLowRankMultivariateNormal._setup_prototype creates
        pyro_guide.loc = nn.Parameter(loc.clone())
        pyro_guide.scale = PyroParam(scale.clone(), constraint=pyro_guide.scale_constraint)
        pyro_guide.cov_factor = nn.Parameter(G.clone())
        _drop_stale_param_store_entries(pyro_guide)  # the converted values win over a same-named guide's
        return pyro_guide

    # ------------------------------------------------------------------ serialization
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved by :meth:`state_dict` (or by Pyro's low-rank guide), as one transaction.

        Every entry is checked before any is written: the keys and shapes
        must match this guide's rank, latent dimension, noise kind and
        ``loc_scale``; every value must be finite and the noise scale
        positive. A refused state raises and leaves the guide as it was.

        A ``state_dict()`` of a Pyro
        :class:`~pyro.infer.autoguide.AutoLowRankMultivariateNormal` (keys
        ``loc``, ``cov_factor``, ``scale_unconstrained``) over the same model
        is accepted too (with ``noise="diagonal"``) and gives the same
        :math:`q` (see :meth:`from_pyro`).

        A :class:`~pyro.nn.PyroModule` reads its parameters from the global
        param store by name; when loading replaces the Parameter objects
        (``assign=True``, or a guide whose store entries were swapped out), the
        store would keep serving the old tensors, so the loaded values would be
        ignored and SVI would update the old copies. The guide's stale store
        entries are dropped, and the loaded Parameters are registered in their
        place on next use. (Restoring the whole store with
        ``pyro.get_param_store().set_state`` / ``.load`` also works: the guide
        then reads the restored values.) The checks and the store update also
        run when the guide is loaded as part of a parent module.

        Raises
        ------
        RuntimeError
            If the guide has not run yet (call it once first), or the state was
            saved with another rank, latent dimension, noise kind or
            ``loc_scale``.
        ValueError
            If a value is not finite or a noise scale not positive.
        """
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if own:
            self._check_setup("load_state_dict()")
            converted = self._from_pyro_state(own) if "cov_factor" in own and "factor" not in own else own
            self._validate_state(converted, strict)
            if converted is not own:
                state_dict = {k: v for k, v in state_dict.items() if not (k.startswith(prefix) and k[len(prefix):] in own)}
                state_dict.update({prefix + k: v for k, v in converted.items()})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._drop_stale_param_store_entries()

    def _local_state(self) -> Dict[str, Tensor]:
        persistent = {k: v for k, v in self._buffers.items() if k not in self._non_persistent_buffers_set}
        return {**{k: v for k, v in self._parameters.items() if v is not None}, **persistent}

    def _describe_state(self, state: Dict[str, Tensor]) -> str:
        """The settings a state was saved with, as far as its keys and shapes tell."""
        parts = []
        if torch.is_tensor(state.get("factor")) and state["factor"].dim() == 2:
            parts.append(f"rank={state['factor'].shape[-1]}")
        loc = state.get("loc", state.get("whitened_loc"))
        if torch.is_tensor(loc):
            parts.append(f"D={loc.numel()}")
        if torch.is_tensor(state.get("scale_unconstrained")):
            parts.append("noise='isotropic'" if state["scale_unconstrained"].dim() == 0 else "noise='diagonal'")
        elif "scale" in state:
            parts.append("noise='isotropic', noise_scale fixed")
        parts.append("loc_scale set" if "whitened_loc" in state else "loc_scale=None")
        return ", ".join(parts)

    def _validate_state(self, state: Dict[str, Tensor], strict: bool) -> None:
        name = type(self).__name__
        local = self._local_state()
        mine = (f"rank={self.rank}, D={self.latent_dim}, noise={self.noise!r}"
                + (", noise_scale fixed" if self._noise_scale is not None else "")
                + (", loc_scale set" if self._loc_scale_option is not None else ", loc_scale=None"))
        mismatch = (strict and set(state) != set(local)) or any(
            k in local and (not torch.is_tensor(v) or v.shape != local[k].shape) for k, v in state.items())
        if mismatch:
            raise RuntimeError(
                f"{name}: load_state_dict got a state saved with {self._describe_state(state)} "
                f"(keys {sorted(state)!r}), but this guide has {mine} (keys {sorted(local)!r}). "
                "Build the guide with the settings the state was saved with."
            )
        for key, value in state.items():
            if key in local and not torch.isfinite(value).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be finite, got {value!r}.")
        if "scale_unconstrained" in state:
            s = transform_to(self.scale_constraint)(state["scale_unconstrained"])
            if not (torch.isfinite(s).all() and (s > 0).all()):
                raise ValueError(f"{name}: load_state_dict: the noise scale must be positive and finite, got {s!r}.")
        for key in ("scale", "loc_scale"):
            if key in state and key in local and not (state[key] > 0).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be positive, got {state[key]!r}.")

    def _from_pyro_state(self, state: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Translate an ``AutoLowRankMultivariateNormal`` state (softplus-constrained scale) into this guide's keys."""
        name = type(self).__name__
        if self.noise != "diagonal":
            raise RuntimeError(f"{name}: load_state_dict got an AutoLowRankMultivariateNormal state, whose noise is "
                               f"per coordinate, but this guide has noise={self.noise!r}; build it with noise='diagonal'.")
        out = {k: v for k, v in state.items() if k not in _PYRO_LOW_RANK_KEYS}
        for key in _PYRO_LOW_RANK_KEYS:
            value = state.get(key)
            if not torch.is_tensor(value):
                raise RuntimeError(f"{name}: load_state_dict: an AutoLowRankMultivariateNormal state needs {key!r}, "
                                   f"got {sorted(state)!r}.")
            if not torch.isfinite(value).all():
                raise ValueError(f"{name}: load_state_dict: {key!r} must be finite, got {value!r}.")
        like = self.factor
        scale = transform_to(AutoLowRankMultivariateNormal.scale_constraint)(state["scale_unconstrained"].to(like))
        if not (scale > 0).all():
            raise ValueError(f"{name}: load_state_dict: the noise scale must be positive, got {scale!r}.")
        out["factor"] = state["cov_factor"]
        out["scale_unconstrained"] = transform_to(self.scale_constraint).inv(scale)
        if "whitened_loc" in self._parameters:
            loc = state["loc"].to(like)
            out["whitened_loc"] = loc / self.loc_scale if loc.shape == self.loc_scale.shape else loc
            out["loc_scale"] = self.loc_scale.detach().clone()
        else:
            out["loc"] = state["loc"]
        return out

    def _drop_stale_param_store_entries(self) -> None:
        _drop_stale_param_store_entries(self)


def _drop_stale_param_store_entries(module: pyro.nn.PyroModule) -> None:
    """Drop the param store's entries under ``module``'s names that are not its own Parameters.

    A :class:`~pyro.nn.PyroModule` reads a parameter from the store when the
    store has its name, so after its Parameters were replaced or written
    outside the store the stale entries would win.
    """
    if not module._pyro_name:
        return
    store = pyro.get_param_store()
    stored = dict(store.named_parameters())
    for name, param in module.named_parameters(recurse=False):
        base = name[: -len("_unconstrained")] if name.endswith("_unconstrained") else name
        fullname = f"{module._pyro_name}.{base}"
        if fullname in stored and stored[fullname] is not param:
            del store[fullname]


def _unwrap_init(model):
    """``(model, init_loc_fn)`` from the model an ``AutoContinuous`` keeps (wrapped in an ``InitMessenger``)."""
    func = getattr(model, "func", None)
    args = getattr(func, "args", ())
    if len(args) == 2 and isinstance(args[0], InitMessenger):
        return args[1], args[0].init_fn
    return model, None


def _copy_prototype(source: AutoContinuous, target: AutoContinuous) -> None:
    """Share the model trace (and what ``AutoContinuous._setup_prototype`` derives from it) between guides."""
    for attr in ("prototype_trace", "_prototype_frames", "_unconstrained_shapes", "_cond_indep_stacks", "latent_dim"):
        setattr(target, attr, getattr(source, attr))
