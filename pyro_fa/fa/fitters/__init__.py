r"""Fitters: how a stream of vectors becomes the factors :math:`(F, \psi)` of :math:`N(c, FF^\top + \Psi)`.

:class:`~pyro_fa.OnlineFactorAnalysis` owns what every online fit shares: the argument
checks, the exact running moments (:math:`c` and the coordinate variances), the refusal of
non-finite or overflowing input before it touches the state, checkpoints, sharding and the
fitted distribution. Its ``method`` names a :class:`Fitter`, looked up once in
:data:`FITTERS` at construction, which owns the rest: the factor's state and its update.

A fitter is stateless; its tensors are buffers of the model that holds it (so that
``.to()``, ``state_dict()`` and the checkpoint keys are the model's). The protocol:

* :meth:`Fitter.init` — register the factor's buffers on the model, from the initial
  orthogonal factor :math:`F_0` (shape (D, K));
* :meth:`Fitter.step` — one step on a batch of centred vectors ``d`` (shape (B, D)), after the
  running moments took it;
* :meth:`Fitter.factors` — the posterior's :math:`(F, \psi)`, shapes (D, K) and (D,);
* :meth:`Fitter.noise` / :meth:`Fitter.noise_floor` — the noise variances the next step
  divides by (the model's overflow check reads them);
* optional: :meth:`Fitter.check`, :meth:`Fitter.finish_warmup`, and the hooks of optimizer
  state and devices.

A new method is one module: subclass :class:`Fitter`, decorate it with
:func:`register_fitter`, and ``OnlineFactorAnalysis(dim, rank, method="name")`` uses it
(the architecture guide\'s "Add a fitter", has a complete example).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch
from torch import Tensor

from pyro_fa._registry import ClassRegistry

__all__ = ["Fitter", "FITTERS", "register_fitter", "fitter_class", "cholesky"]

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


class Fitter:
    r"""The protocol of a fitting method of :class:`~pyro_fa.OnlineFactorAnalysis` (base class).

    Every method receives the model ``fa`` that holds the state. Attributes of ``fa`` a fitter
    may read: ``dim``, ``rank``, ``warmup``, ``n_updates``, ``min_variance``, ``variance``
    (the running variances, shape (D,)), ``loc``; and the model's helpers ``_floor(psi, var)``
    (the relative floor of :math:`\psi`), ``_block_rows()``, ``_workspace(rows)``.
    """

    name: str = ""
    finishes_warmup: bool = False
    """Whether :meth:`finish_warmup` can end the warm-up early (else it raises ``RuntimeError``)."""

    def check(self, owner: str, *, rank: int, warmup: int) -> None:
        """Refuse options this method cannot fit with (raise ``ValueError``); default none."""

    def init(self, fa, F0: Tensor, *, optimizer=None, optimizer_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Register the fit's buffers on ``fa``; ``F0`` of shape (D, K) is the initial factor."""
        raise NotImplementedError

    def step(self, fa, d: Tensor, n_old: int, B: int, first_spread: bool) -> None:
        r"""Take a batch of ``B`` vectors centred at the new mean, ``d`` of shape (B, D).

        ``n_old`` vectors were seen before; ``first_spread`` says that this batch is the first
        whose vectors differ from the earlier ones (all identical vectors have no scale).
        """
        raise NotImplementedError

    def factors(self, fa) -> Tuple[Tensor, Tensor]:
        r"""The posterior's :math:`(F, \psi)`, tensors of shape (D, K) and (D,)."""
        raise NotImplementedError

    def noise(self, fa) -> Tensor:
        r"""The noise variances (D,) that the next step divides by (the overflow check reads them)."""
        return self.factors(fa)[1]

    def noise_floor(self, fa) -> float:
        """The smallest value :meth:`noise` can take before the next step."""
        return float(self.noise(fa).amin())

    def range_scale(self, fa) -> Optional[Tensor]:
        """Coordinate scales (D,) that the step divides the deviations by, or None (default)."""
        return None

    def finish_warmup(self, fa) -> None:
        """End the warm-up at the vectors seen so far (``fa.finish_warmup()`` has checked the count)."""
        raise RuntimeError(f"{type(fa).__name__}: finish_warmup() needs a method that can end its warm-up early, "
                           f"got {fa.method!r}. Pass a smaller warmup.")

    # hooks of the optimizer state (a fitter with an optimizer saves its state beside the buffers)
    def state_extra(self, fa) -> Optional[dict]:
        """A state to save under ``_optimizer_state`` (e.g. an optimizer's), or None."""
        return None

    def check_optimizer_state(self, fa, state) -> None:
        """Refuse a saved ``_optimizer_state`` that does not fit (raise ``ValueError``)."""

    def loaded(self, fa, extra: Optional[dict]) -> None:
        """After ``fa`` loaded a state (``extra``: the saved ``_optimizer_state`` or None)."""

    def moved(self, fa, fn) -> None:
        """After ``fa.to(...)`` / ``fa._apply(fn)`` moved the buffers."""

    # hooks of the sharded update (process_group=...): sums that ride on the update's one all-reduce
    def shard_sums(self, fa, d: Optional[Tensor], n_old: int, B: int) -> Tuple[list, Any]:
        """Tensors to sum over the ranks with the update's checks (``d``: None when x was refused), and a
        context for :meth:`shard_reduced`; default none."""
        return [], None

    def shard_reduced(self, fa, sums: list, n: int, context: Any) -> None:
        """The sums of :meth:`shard_sums`, over all ranks, once the update was accepted."""


_REGISTRY = ClassRegistry("register_fitter", Fitter, "method")
FITTERS: Dict[str, Type[Fitter]] = _REGISTRY.classes
"""The registered fitters, by the ``method`` name that picks them."""


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
