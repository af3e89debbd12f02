r"""Fitters: how a stream of vectors becomes the factors :math:`(F, \psi)` of :math:`N(c, FF^\top + \Psi)`.

:class:`~pyro_fa.OnlineFactorAnalysis` owns what every online fit shares: the argument
checks, the exact running moments (:math:`c` and the coordinate variances), the refusal of
non-finite or overflowing input before it touches the state, checkpoints, sharding and the
fitted distribution. Its ``method`` is a :class:`Fitter`, given as an object built with its own
options (``method=OnlineSGA(lr=0.01)``) or by the name it is registered under in :data:`FITTERS`
(``method="sga"``), which owns the rest: the factor's state and its update.

A fitter holds its options only; its state is a typed :class:`FitState` (a dataclass of
tensors and counters) that the fitter creates and steps, in the shape of optax and
``posteriors``:

* :meth:`Fitter.init` ``(ctx, F0) -> state`` — the state from the initial orthogonal factor
  :math:`F_0` (shape (D, K));
* :meth:`Fitter.update` ``(state, ctx, d, n_old, B, first_spread) -> state`` — one step on a batch
  of centred vectors ``d`` (shape (B, D)), after the running moments took it (tensors may be
  updated in place: the state passed in is the state returned);
* :meth:`Fitter.factors` ``(state, ctx) -> (F, psi)`` — the posterior's factors, shapes (D, K) and (D,);
* :meth:`Fitter.noise` / :meth:`Fitter.noise_floor` — the noise variances the next step
  divides by (the model's overflow check reads them);
* optional: :meth:`Fitter.check`, :meth:`Fitter.finish_warmup`, and the hooks of optimizer
  state, devices and the sharded update.

``ctx`` is a read-only :class:`FitContext`: what a fitter may know of the model that holds it
(``dim``, ``rank``, ``warmup``, ``n_updates``, the running variances, the floor of
:math:`\psi`, a workspace). The model maps the state's tensors to its buffers under the keys
:attr:`FitState.keys` names, so that ``.to()``, ``state_dict()`` and the checkpoint keys are the
model's.

A new method is one module: a :class:`Fitter` subclass (and its :class:`FitState`) decorated
with :func:`register_fitter`. ``OnlineFactorAnalysis(dim, rank, method="name")`` uses it, and
so do :class:`~pyro_fa.SWAG` where :attr:`Fitter.supports_iterates` and
:class:`~pyro_fa.laplace.FactorLaplace` where :attr:`Fitter.curvature_fit` names it (the
architecture guide's "Add a fitter" has a complete example).
"""
from __future__ import annotations

from pyro_fa.fa.fitters.base import (FITTERS, FitContext, FitState, Fitter, check_positive, check_step_options,
                                     cholesky, curvature_fitters, fitter_class, iterate_fitters, register_fitter,
                                     resolve_fitter, scalar)

__all__ = ["Fitter", "FitState", "FitContext", "FITTERS", "register_fitter", "fitter_class", "resolve_fitter",
           "iterate_fitters", "curvature_fitters", "cholesky", "OnlineEM", "OnlineSGA", "ScatterSketch"]


def _import_builtin_fitters() -> None:
    # every public module of this package is imported, and its fitters register themselves: a new built-in
    # fitter is its module, with no list to edit (in name order, which is the registry's and the messages')
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_import_builtin_fitters()
# the built-in fitters under short names: method=OnlineSGA(lr=0.01, optimizer="natural")
from pyro_fa.fa.fitters.em import OnlineEM  # noqa: E402
from pyro_fa.fa.fitters.sga import OnlineSGA  # noqa: E402
from pyro_fa.fa.fitters.sketch import ScatterSketch  # noqa: E402
