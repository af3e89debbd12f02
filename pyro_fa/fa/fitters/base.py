"""The fitter protocol (:class:`Fitter`, its typed state and read-only context) and the fitter registry; see
:mod:`pyro_fa.fa.fitters`."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple, Type

import torch
from torch import Tensor

from pyro_fa._registry import ClassRegistry
from pyro_fa.fa._online_warmup import floor_values

__all__ = ["Fitter", "FitState", "FitContext", "FITTERS", "register_fitter", "fitter_class", "resolve_fitter",
           "iterate_fitters", "curvature_fitters", "cholesky", "check_positive", "check_step_options", "scalar"]


def register_fitter(name: str) -> Callable[[Type["Fitter"]], Type["Fitter"]]:
    """Class decorator: make ``cls`` the fitter of ``OnlineFactorAnalysis(..., method=name)``.

    Raises
    ------
    ValueError
        If ``name`` is not a non-empty string or is taken by another class.
    TypeError
        If the decorated object is not a :class:`Fitter` subclass.
    """
    return _REGISTRY.register(name)


def fitter_class(method: str, owner: str, choices: Optional[Tuple[str, ...]] = None) -> Type["Fitter"]:
    """The fitter registered as ``method``, checked at the boundary of ``owner`` (a class name).

    Raises
    ------
    ValueError
        ``"<owner>: method must be one of (...), got '<method>'."``
    """
    return _REGISTRY.get(method, owner, choices)


def resolve_fitter(method, owner: str, choices: Optional[Tuple[str, ...]] = None, **options) -> "Fitter":
    """A :class:`Fitter` object: ``method`` itself, or the class registered as ``method`` built from ``options``.

    ``options`` are the keyword options of the owner's constructor (``lr=``, ``step_scale=``, ...); each
    fitter class takes those that apply to it (:meth:`Fitter.from_options`).

    Raises
    ------
    ValueError
        ``"<owner>: method must be one of (...), got '<method>'."`` for an unknown name (or a fitter
        object whose name is not among ``choices``).
    """
    if isinstance(method, Fitter):
        if choices is not None and method.name not in choices:
            raise ValueError(f"{owner}: method must be one of {tuple(choices)} or a fitter of them, got "
                             f"{type(method).__name__} ({method.name!r}).")
        return method
    return fitter_class(method, owner, choices).from_options(**options)


@dataclasses.dataclass
class FitState:
    """The state of a fit (base class): a dataclass whose tensor fields the model holds as buffers.

    :attr:`keys` maps a field to its buffer's key in the model's ``state_dict()`` (the field's name
    with a leading underscore by default); :attr:`parameters` names the fields held as
    ``nn.Parameter`` s; :attr:`extra` maps the plain-number fields to their key in the model's extra
    state. A field that is ``None`` has no buffer.
    """

    keys: ClassVar[Dict[str, str]] = {}
    parameters: ClassVar[Tuple[str, ...]] = ()
    extra: ClassVar[Dict[str, str]] = {}

    @classmethod
    def tensor_fields(cls) -> Dict[str, str]:
        """Field -> buffer key, in the order of the fields."""
        return {f.name: cls.keys.get(f.name, "_" + f.name) for f in dataclasses.fields(cls)
                if f.name not in cls.extra and f.metadata.get("tensor", True)}


def scalar(default=0):
    """A plain-number (or object) field of a :class:`FitState`, not a buffer (saved in the extra state when
    :attr:`FitState.extra` names it)."""
    return dataclasses.field(default=default, metadata={"tensor": False})


class FitContext:
    """What a fitter may read of the model that holds it (read-only), and the model's helpers.

    Attributes: ``owner`` (the model's class name, for messages), ``dim``, ``rank``, ``rows`` (the
    coordinates this process holds: ``dim`` unless sharded), ``warmup``, ``n_updates``,
    ``min_variance``, ``sharded``; properties ``variance`` (the running variances in the state's
    dtype, shape (rows,)) and ``cap_pending``. Methods: :meth:`floor`, :meth:`floor_values`,
    :meth:`block_rows`, :meth:`workspace`, :meth:`variance64`, :meth:`has_spread`,
    :meth:`mean_over_dim`, and the sums of a sharded fit (:meth:`cap_done`, :meth:`e_step_inputs`, ...),
    which are plain sums without sharding.
    """

    __slots__ = ("_model",)

    def __init__(self, model):
        object.__setattr__(self, "_model", model)

    def __setattr__(self, name, value):
        raise AttributeError(f"FitContext: the context is read-only, got an assignment to {name!r}.")

    owner = property(lambda self: type(self._model).__name__)
    dim = property(lambda self: self._model.dim)
    rank = property(lambda self: self._model.rank)
    rows = property(lambda self: self._model._local_dim)
    warmup = property(lambda self: self._model.warmup)
    n_updates = property(lambda self: self._model._n)
    min_variance = property(lambda self: self._model.min_variance)
    sharded = property(lambda self: self._model._sharding is not None)
    variance = property(lambda self: self._model.variance)
    cap_pending = property(lambda self: getattr(self._model, "_cap_pending", False))

    def variance64(self, n: int) -> Tensor:
        """The running variances after ``n`` vectors, in float64."""
        return self._model._moments.variance(n).to(torch.float64)

    def floor(self, psi: Tensor, var: Tensor) -> Tensor:
        r""":math:`\psi` floored relative to the variances ``var`` (``min_variance`` times each)."""
        return torch.maximum(psi, floor_values(self._model, var))

    def floor_values(self, var: Tensor) -> Tensor:
        r"""The floor of :math:`\psi` for the variances ``var``."""
        return floor_values(self._model, var)

    def block_rows(self, element_size: int) -> int:
        """Rows per block of a pass over a (rows, K) array (about 1 MB)."""
        return self._model._work.block_rows(element_size)

    def workspace(self, rows: int, like: Tensor) -> Tensor:
        """Two (rows, K) work blocks of ``like``'s dtype and device, reused across updates."""
        return self._model._work.blocks(rows, like)

    def has_spread(self) -> bool:
        """Whether the vectors seen so far differ (there is a scale to fit)."""
        return self._model._has_spread()

    def mean_over_dim(self, v: Tensor) -> Tensor:
        """Mean over all D of a per-row quantity (collective when sharded)."""
        return self._model._mean_over_dim(v)

    # the sums of the sharded fit (pyro_fa.distributed.ShardedOnlineFactorAnalysis overrides the model's hooks)
    def cap_done(self, cap: Tensor, sga: bool = False) -> None:
        """A capacitance summed over the rows held: add the identity (sharded: leave it for the next all-reduce)."""
        self._model._cap_done(cap, sga)

    def commit_cap(self, cap: Tensor, total: Tensor) -> None:
        """Sharded: the capacitance's sum over all ranks arrived; write it (plus the identity) into ``cap``."""
        self._model._commit_cap(cap, total)

    def e_step_inputs(self, d: Tensor, F: Tensor, psi: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        r"""EM's E-step inputs: the Cholesky factor of ``cap`` and :math:`F^\top\Psi^{-1}d^\top` (K, B), over all D."""
        return self._model._e_step_inputs(d, F, psi, cap)

    def stash_projection(self, n: int, u: Optional[Tensor]) -> None:
        """Sharded: keep the projection reduced with the update's checks for the E-step of update ``n``."""
        self._model._stash_projection(n, u)

    def sga_reduce(self, u: Tensor, cap: Tensor) -> Tuple[Tensor, Tensor]:
        """SGA's E-step inputs, the projection (B, K) and the capacitance, summed over all D."""
        return self._model._sga_reduce(u, cap)


class Fitter:
    r"""A fitting method of :class:`~pyro_fa.OnlineFactorAnalysis` (base class): its options and its steps.

    A fitter object holds options only (it may be shared by several models); the state it fits is the
    :class:`FitState` that :meth:`init` returns and every other method takes. The model's class
    name (``ctx.owner``) starts the fitter's messages.

    Class attributes: ``name`` (set by :func:`register_fitter`), ``finishes_warmup``,
    ``supports_iterates`` (SWAG may fit its collected iterates with it), ``curvature_fit`` (the name
    of FactorLaplace's ``curvature_fit=`` that fits the curvature's second moment with it, or None),
    ``curvature_passes`` (the default passes over the curvature vectors) and ``shardable``.
    """

    name: str = ""
    finishes_warmup: bool = False
    """Whether :meth:`finish_warmup` can end the warm-up early (else it raises ``RuntimeError``)."""
    supports_iterates: bool = True
    """Whether :class:`~pyro_fa.SWAG` offers this fitter as its ``method``."""
    curvature_fit: Optional[str] = None
    """The ``curvature_fit=`` name under which :class:`~pyro_fa.laplace.FactorLaplace` fits with it, or None."""
    curvature_passes: int = 1
    """Default passes over the curvature vectors for FactorLaplace."""
    iterate_caveat: Optional[str] = None
    """A warning SWAG gives when it is built with this fitter (None: none)."""

    @classmethod
    def from_options(cls, **options) -> "Fitter":
        """The fitter built from a model constructor's keyword options (those that apply to it)."""
        return cls()

    def options(self) -> Dict[str, Any]:
        """The options this fitter was built with (for ``repr`` and the sharded ranks' agreement)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"

    def check(self, owner: str, *, rank: int, warmup: int) -> None:
        """Refuse options this method cannot fit with (raise ``ValueError``); default none."""

    def init(self, ctx: FitContext, F0: Tensor) -> FitState:
        """The initial state; ``F0`` of shape (D, K) is the initial factor."""
        raise NotImplementedError

    def update(self, state: FitState, ctx: FitContext, d: Tensor, n_old: int, B: int,
               first_spread: bool) -> FitState:
        r"""Take a batch of ``B`` vectors centred at the new mean, ``d`` of shape (B, D); return the state.

        ``n_old`` vectors were seen before; ``first_spread`` says that this batch is the first
        whose vectors differ from the earlier ones (all identical vectors have no scale).
        """
        raise NotImplementedError

    def factors(self, state: FitState, ctx: FitContext) -> Tuple[Tensor, Tensor]:
        r"""The posterior's :math:`(F, \psi)`, tensors of shape (D, K) and (D,)."""
        raise NotImplementedError

    def noise(self, state: FitState, ctx: FitContext) -> Tensor:
        r"""The noise variances (D,) that the next step divides by (the overflow check reads them)."""
        return self.factors(state, ctx)[1]

    def noise_floor(self, state: FitState, ctx: FitContext) -> float:
        """The smallest value :meth:`noise` can take before the next step."""
        return float(self.noise(state, ctx).amin())

    def range_scale(self, state: FitState, ctx: FitContext) -> Optional[Tensor]:
        """Coordinate scales (D,) that the step divides the deviations by, or None (default)."""
        return None

    def finish_warmup(self, state: FitState, ctx: FitContext) -> FitState:
        """End the warm-up at the vectors seen so far (the model has checked the count)."""
        raise RuntimeError(f"{ctx.owner}: finish_warmup() needs a method that can end its warm-up early, "
                           f"got {self.name!r}. Pass a smaller warmup.")

    # hooks of the optimizer state (a fitter with an optimizer saves its state beside the buffers)
    def state_extra(self, state: FitState) -> Optional[dict]:
        """A state to save under ``_optimizer_state`` (e.g. an optimizer's), or None."""
        return None

    def check_optimizer_state(self, state: FitState, ctx: FitContext, saved) -> None:
        """Refuse a saved ``_optimizer_state`` that does not fit (raise ``ValueError``)."""

    def loaded(self, state: FitState, ctx: FitContext, extra: Optional[dict]) -> FitState:
        """After the model loaded a state (``extra``: the saved ``_optimizer_state`` or None)."""
        return state

    def moved(self, state: FitState, ctx: FitContext, fn) -> FitState:
        """After the model's ``.to(...)`` / ``_apply(fn)`` moved the buffers (``state`` holds the moved ones)."""
        return state

    # hooks of the sharded update (process_group=...): sums that ride on the update's one all-reduce
    def shard_sums(self, state: FitState, ctx: FitContext, d: Optional[Tensor], n_old: int, B: int) -> Tuple[list, Any]:
        """Tensors to sum over the ranks with the update's checks (``d``: None when x was refused), and a
        context for :meth:`shard_reduced`; default none."""
        return [], None

    def shard_reduced(self, state: FitState, ctx: FitContext, sums: list, n: int, context: Any) -> None:
        """The sums of :meth:`shard_sums`, over all ranks, once the update was accepted."""


_REGISTRY = ClassRegistry("register_fitter", Fitter, "method")
FITTERS: Dict[str, Type[Fitter]] = _REGISTRY.classes
"""The registered fitters, by the ``method`` name that picks them."""


def iterate_fitters() -> Tuple[str, ...]:
    """The registered fitters :class:`~pyro_fa.SWAG` offers (``supports_iterates``)."""
    return tuple(n for n, c in FITTERS.items() if c.supports_iterates)


def curvature_fitters() -> Dict[str, Type[Fitter]]:
    """The registered fitters FactorLaplace offers, by their ``curvature_fit`` name."""
    return {c.curvature_fit: c for c in FITTERS.values() if c.curvature_fit}


# checks of the options of the built-in fitters, shared so that a model constructor's keyword options
# and a fitter object's give the same messages
def check_positive(owner: str, name: str, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {name} must be a positive finite number, got {value!r}.")


def check_step_options(owner: str, step_scale, step_ramp, m_step_every) -> None:
    if not (isinstance(step_scale, (int, float)) and math.isfinite(step_scale) and step_scale >= 1):
        raise ValueError(f"{owner}: step_scale must be a finite number >= 1, got {step_scale!r}.")
    if step_ramp is not None and (isinstance(step_ramp, bool) or not isinstance(step_ramp, int) or step_ramp < 1):
        raise ValueError(f"{owner}: step_ramp must be a positive integer or None, got {step_ramp!r}.")
    if m_step_every is not None and (
        isinstance(m_step_every, bool) or not isinstance(m_step_every, int) or m_step_every < 1
    ):
        raise ValueError(f"{owner}: m_step_every must be a positive integer or None, got {m_step_every!r}.")


def cholesky(mat: Tensor) -> Tensor:
    """Cholesky factor of a symmetric positive-definite K x K matrix, with jitter as a fallback.

    The matrices factorised here (capacitances, E[h h^T]) are positive definite in exact
    arithmetic; in float32 rounding can make a badly conditioned one fail, and a diagonal
    jitter of a few ulps of its trace is then the smallest change that restores it.
    """
    L, info = torch.linalg.cholesky_ex(mat)
    if not bool(info):
        return L
    eye = torch.eye(mat.shape[-1], dtype=mat.dtype, device=mat.device)
    jitter = torch.finfo(mat.dtype).eps * mat.diagonal().abs().mean().clamp_min(1.0)
    for _ in range(8):
        jitter = jitter * 10
        L, info = torch.linalg.cholesky_ex(mat + jitter * eye)
        if not bool(info):
            return L
    raise RuntimeError(
        f"OnlineFactorAnalysis: a {mat.shape[-1]} x {mat.shape[-1]} matrix of the E-step is not positive "
        "definite even with jitter; the statistics hold non-finite values."
    )
