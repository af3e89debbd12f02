r"""``JitFactorELBO``: :class:`~pyro_fa.FactorELBO` compiled with :func:`pyro.ops.jit.trace`."""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import pyro.ops.jit
import torch
from pyro.infer.util import torch_item
from pyro.util import warn_if_nan
from torch import Tensor

from pyro_fa.infer.elbo import FactorELBO

__all__ = ["JitFactorELBO"]


class JitFactorELBO(FactorELBO):
    r"""Like :class:`~pyro_fa.FactorELBO`, with its loss and surrogate compiled by the PyTorch JIT.

    The counterpart of :class:`~pyro.infer.JitTrace_ELBO`: the first call for
    a (model, guide) pair and each distinct ``**kwargs`` traces one estimate
    — the guide, the model replayed against it, the closed-form entropy and
    prior terms and the Monte-Carlo rest — into a TorchScript graph with
    :func:`pyro.ops.jit.trace`; later calls run the graph. On the same random
    draws its loss equals :class:`~pyro_fa.FactorELBO`'s (the graph consumes
    the random-number generator as the Python code does; the first call,
    which also traces, consumes it three times).

    The restrictions are :class:`~pyro.infer.JitTrace_ELBO`'s:

    * the model and guide have static structure (the same sites, shapes and
      control flow at every call);
    * they depend on no global data but the param store: every tensor input
      is passed in ``*args``;
    * every non-tensor input is passed in ``**kwargs``, and each distinct
      ``**kwargs`` compiles once.

    With ``vectorize_particles=False`` the graph holds ``num_particles``
    unrolled copies of the estimate; prefer ``vectorize_particles=True``
    for many particles. Which prior parameters depend on other latent
    variables is still decided outside the graph, by autograd, at the first
    call (see :class:`~pyro_fa.FactorELBO`).

    Parameters
    ----------
    num_particles, max_plate_nesting, vectorize_particles, strict_enumeration_warning, retain_graph, sampling
        As :class:`~pyro_fa.FactorELBO`.
    ignore_jit_warnings : bool, default False
        Silence the JIT's tracer warnings.
    jit_options : dict, optional
        Passed to :func:`torch.jit.trace` (e.g. ``{"check_trace": False}``,
        Pyro's default).

    Raises
    ------
    TypeError
        If ``jit_options`` is neither None nor a dict.
    ValueError
        As :class:`~pyro_fa.FactorELBO`.

    Notes
    -----
    The speed-up is Python overhead saved, so it is largest for small models.

    Examples
    --------
    >>> import pyro, pyro.distributions as dist
    >>> from pyro_fa import AutoLowRankFactorGuide
    >>> def model(y):
    ...     w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    ...     pyro.sample("y", dist.Normal(w.sum(-1), 1.0), obs=y)
    >>> guide = AutoLowRankFactorGuide(model, rank=1)
    >>> elbo = JitFactorELBO(ignore_jit_warnings=True)
    >>> loss = elbo.differentiable_loss(model, guide, torch.tensor(0.5))
    """

    def __init__(
        self,
        num_particles: int = 1,
        max_plate_nesting: float = float("inf"),
        vectorize_particles: bool = False,
        strict_enumeration_warning: bool = True,
        ignore_jit_warnings: bool = False,
        retain_graph: Optional[bool] = None,
        sampling: str = "auto",
        jit_options: Optional[dict] = None,
    ):
        if jit_options is not None and not isinstance(jit_options, dict):
            raise TypeError(f"JitFactorELBO: jit_options must be None or a dict, got {jit_options!r}.")
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=vectorize_particles,
            strict_enumeration_warning=strict_enumeration_warning,
            ignore_jit_warnings=ignore_jit_warnings,
            retain_graph=retain_graph,
            sampling=sampling,
        )
        self.jit_options = jit_options
        # one compiled function per (model, guide): each closes over its own pair
        self._compiled: Dict[Tuple[int, int], pyro.ops.jit.CompiledFunction] = {}

    def loss_and_surrogate_loss(self, model, guide, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """The negative ELBO estimate and its surrogate, from the compiled graph.

        Returns
        -------
        loss, surrogate_loss : Tensor of shape ()
        """
        self._maybe_detect(model, guide, args, kwargs)  # autograd probing, outside the graph
        key = (id(model), id(guide))
        if key not in self._compiled:
            weakself = weakref.ref(self)

            def loss_and_surrogate_loss(*args, **kwargs):
                return weakself()._loss_and_surrogate_loss(model, guide, args, kwargs)

            self._compiled[key] = pyro.ops.jit.trace(
                loss_and_surrogate_loss,
                ignore_warnings=self.ignore_jit_warnings,
                jit_options=None if self.jit_options is None else dict(self.jit_options),
            )
        return self._compiled[key](*args, **kwargs)

    def loss(self, model, guide, *args, **kwargs) -> float:
        """An estimate of the negative ELBO, as a float."""
        loss, _ = self.loss_and_surrogate_loss(model, guide, *args, **kwargs)
        loss = torch_item(loss.detach())
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> Tensor:
        """A differentiable estimate of the negative ELBO."""
        loss, surrogate_loss = self.loss_and_surrogate_loss(model, guide, *args, **kwargs)
        loss = loss.detach()  # the gradient comes from the surrogate alone (they coincide when reparameterised)
        warn_if_nan(loss, "loss")
        return loss + (surrogate_loss - surrogate_loss.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Estimate the negative ELBO and backpropagate its gradient."""
        loss, surrogate_loss = self.loss_and_surrogate_loss(model, guide, *args, **kwargs)
        if getattr(surrogate_loss, "requires_grad", False):
            surrogate_loss.backward(retain_graph=self.retain_graph)
        loss = torch_item(loss.detach())
        warn_if_nan(loss, "loss")
        return loss
