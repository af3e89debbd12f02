"""Where SWAG's parameter vector comes from, and the argument check SWAG and MultiSWAG share."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import Tensor, nn

__all__ = ["ParamSource", "positive_int"]


def positive_int(cls: str, arg: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{cls}: {arg} must be an integer >= {minimum}, got {value!r}.")
    return value


class ParamSource:
    """Where the parameter vector comes from: a list of named leaf tensors, or Pyro's param store."""

    def __init__(self, named: Optional[List[Tuple[str, Tensor]]] = None, prefix: Optional[str] = None,
                 names: Optional[Sequence[str]] = None, module: Optional[nn.Module] = None):
        self.named = named
        self.prefix = prefix
        self.names = list(names) if names is not None else None
        self.module = module
        self.from_param_store = named is None

    def resolve(self, cls: str) -> List[Tuple[str, Tensor]]:
        if self.module is not None:  # re-read: a replaced parameter is followed (and its shape checked)
            return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not self.from_param_store:
            return self.named
        import pyro

        store = dict(pyro.get_param_store().named_parameters())  # unconstrained leaves
        if self.names is not None:
            missing = [n for n in self.names if n not in store]
            if missing:
                raise RuntimeError(
                    f"{cls}: names must all be in Pyro's param store, got {missing!r} missing. "
                    "Collect after the first svi.step(...), once the guide has created its parameters."
                )
            names = self.names
        else:
            head = "" if not self.prefix else self.prefix + "."
            names = [n for n in store if n.startswith(head)]
            if not names:
                raise RuntimeError(
                    f"{cls}: Pyro's param store must hold parameters named {head + '*'!r}, got "
                    f"{sorted(store)!r}. Collect after the first svi.step(...), or pass prefix= or names=."
                )
            self.names = names
        return [(n, store[n]) for n in names]

    def site_name(self, name: str) -> str:
        if self.from_param_store and self.prefix and name.startswith(self.prefix + "."):
            return name[len(self.prefix) + 1:]
        return name
