"""SWAG and MultiSWAG posteriors as a Pyro guide, for ``pyro.infer.Predictive``."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["FactorPosteriorGuide"]


class FactorPosteriorGuide:
    """A Pyro guide that draws a model's latent sites from one or more SWAG posteriors.

    Built by :meth:`SWAG.to_guide` (one member) or ``MultiSWAG.to_guide`` (an
    equally weighted mixture: each call picks a member uniformly at random).
    Each call draws one flattened vector, splits it into the sites (matched by
    name), maps param-store values through ``biject_to(site support)``, and
    records each site as a ``Delta``. The model is traced once, at the first
    call, to check that the posterior's sites are latent sites of the model
    with the right sizes; the model's other latent sites (e.g. predictions)
    are left to the model.

    Parameters
    ----------
    model : callable
        The Pyro model whose latent sites the posterior stands for.
    members : sequence of SWAG
        The posteriors (one, or a MultiSWAG's members).
    """

    def __init__(self, model: Callable, members: Sequence):
        self.model = model
        self.members = list(members)
        self._supports: Optional[Dict[str, object]] = None

    def _setup(self, *args, **kwargs) -> None:
        import pyro.poutine as poutine
        from pyro.poutine.util import site_is_subsample

        trace = poutine.block(poutine.trace(self.model).get_trace)(*args, **kwargs)
        latent = {name: site for name, site in trace.nodes.items()
                  if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)}
        for member in self.members:
            names = member.site_names()
            unknown = [n for n in names if n not in latent]
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}: the posterior's sites must be latent sites of the model, got "
                    f"{unknown!r} not among the model's latent sites {list(latent)!r}. Sites are matched by "
                    "parameter name (SWAG.site_names())."
                )
            for name, shape in zip(names, member._shapes):
                if latent[name]["value"].numel() != shape.numel():
                    raise ValueError(
                        f"{type(self).__name__}: site {name!r} must have {shape.numel()} elements like the "
                        f"posterior's piece, got shape {tuple(latent[name]['value'].shape)!r}."
                    )
        self._supports = {name: site["fn"].support for name, site in latent.items()}
        self._shapes = {name: site["value"].shape for name, site in latent.items()}

    def __call__(self, *args, **kwargs) -> Dict[str, Tensor]:
        import pyro
        import pyro.distributions as dist
        from torch.distributions import biject_to

        if self._supports is None:
            self._setup(*args, **kwargs)
        if len(self.members) == 1:
            member = self.members[0]
        else:
            member = self.members[int(torch.randint(len(self.members), ()))]
        theta = member.sample()
        out = {}
        for name, value in zip(member.site_names(), member._split(theta)):
            value = value.reshape(self._shapes[name])
            if member._source.from_param_store:
                value = biject_to(self._supports[name])(value)
            out[name] = pyro.sample(name, dist.Delta(value, event_dim=value.dim()))
        return out
