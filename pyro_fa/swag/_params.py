"""Where SWAG's parameter vector comes from (the followed weights), their checks, and loading a vector back."""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["ParamSource", "positive_int", "check_params", "split", "loaded_weights"]


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

    @classmethod
    def of(cls, owner: str, obj) -> "ParamSource":
        """The source of a module's trainable parameters, or of an iterable of leaf tensors (each once)."""
        if isinstance(obj, nn.Module):
            return cls(named=[(n, p) for n, p in obj.named_parameters() if p.requires_grad] or _none(owner),
                       module=obj)
        if torch.is_tensor(obj):
            raise TypeError(f"{owner}: module_or_params must be an nn.Module or an iterable of tensors, got a single "
                            "Tensor. Wrap it in a list.")
        try:
            named = [(str(i), p) for i, p in enumerate(obj)]
        except TypeError:
            raise TypeError(
                f"{owner}: module_or_params must be an nn.Module or an iterable of tensors, got {obj!r}.") from None
        seen = {}
        for name, p in named:
            if not torch.is_tensor(p):
                raise TypeError(f"{owner}: module_or_params must hold only tensors, got {p!r}.")
            # the same tensor twice (or two views of one storage) would count its weights twice in D
            key = id(p) if p.is_meta or p.numel() == 0 else (p.device, p.untyped_storage().data_ptr())
            if key in seen or id(p) in seen:
                raise ValueError(f"{owner}: module_or_params must hold each tensor once, got tensor {name} "
                                 f"sharing its storage with tensor {seen.get(key, seen.get(id(p)))} (its "
                                 "weights would be counted twice). Pass each parameter once.")
            seen[key] = seen[id(p)] = name
        return cls(named=named or _none(owner))


def _none(owner: str):
    raise ValueError(f"{owner}: module_or_params must hold at least one trainable tensor, got none.")


def check_params(owner: str, named: List[Tuple[str, Tensor]], rank: int) -> Tuple[int, torch.dtype, torch.device]:
    """The followed tensors must be float leaves holding data, of one dtype and device, with ``rank < D``;
    returns ``(D, dtype, device)``."""
    tensors = [p for _, p in named]
    for name, p in named:
        if not p.is_leaf:
            raise ValueError(
                f"{owner}: parameters must be leaf tensors (what an optimizer updates), got a non-leaf "
                f"tensor {name!r} produced by {type(p.grad_fn).__name__}. Pass the tensors the optimizer holds."
            )
        if p.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{owner}: parameters must be float32 or float64, got {name!r} of dtype {p.dtype}. "
                            "For a half-precision model, follow float32 master weights (e.g. those of "
                            "torch.autocast training) instead.")
    for name, p in named:
        if p.is_meta:
            raise ValueError(f"{owner}: parameters must hold data, got {name!r} on the meta device (shapes "
                             "without values). Materialise the model first, e.g. module.to_empty(device='cpu') "
                             "and initialise it.")
    dtypes = {p.dtype for p in tensors}
    devices = {p.device for p in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"{owner}: parameters must share one dtype, got {sorted(map(str, dtypes))!r}.")
    if len(devices) > 1:
        raise ValueError(f"{owner}: parameters must share one device, got {sorted(map(str, devices))!r}.")
    D = sum(p.numel() for p in tensors)
    if rank >= D:
        raise ValueError(f"{owner}: rank must be < the number of parameters D={D}, got {rank!r}.")
    return D, tensors[0].dtype, tensors[0].device


def check_followed(owner: str, named, shapes, ref: Tensor) -> None:
    """Between collections the followed tensors keep their shapes, and the posterior's dtype and device."""
    now = [p.shape for _, p in named]
    if now != shapes:
        raise ValueError(
            f"{owner}: parameter shapes must stay {[tuple(s) for s in shapes]!r} between collections, "
            f"got {[tuple(s) for s in now]!r}; nothing was collected. Build a new SWAG for the new model."
        )
    for name, p in named:
        if p.dtype != ref.dtype or p.device != ref.device:
            raise ValueError(
                f"{owner}: parameters must be on {ref.device} with dtype {ref.dtype} like the posterior, got "
                f"{name!r} on {p.device} with dtype {p.dtype}. Call swag.to(...) after moving the model."
            )


def split(shapes, theta: Tensor) -> List[Tensor]:
    """``theta`` (..., D) cut into tensors of ``shapes`` (the flattening order)."""
    out, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(theta[..., offset:offset + n].reshape(theta.shape[:-1] + shape))
        offset += n
    return out


@contextlib.contextmanager
def loaded_weights(owner: str, tensors: List[Tensor], theta: Tensor, module: Optional[nn.Module], loader=None):
    """Copy ``theta`` (D,) into ``tensors`` for the ``with`` block (batch norm refreshed by ``loader``); restore."""
    D = sum(p.numel() for p in tensors)
    if not torch.is_tensor(theta) or theta.shape != (D,):
        raise ValueError(f"{owner}: theta must be a tensor of shape ({D},), got {theta!r}.")
    if loader is not None and module is None:
        raise ValueError(f"{owner}: loader needs a SWAG built from an nn.Module, got parameters only.")
    pieces = split([p.shape for p in tensors], theta)
    with torch.no_grad():
        saved = [p.detach().clone() for p in tensors]
        buffers = {k: b.clone() for k, b in module.named_buffers()} if loader is not None else {}
    try:
        with torch.no_grad():
            for p, v in zip(tensors, pieces):
                p.copy_(v)
        if loader is not None:
            from torch.optim.swa_utils import update_bn

            update_bn(loader, module)
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(tensors, saved):
                p.copy_(v)
            if buffers:
                current = dict(module.named_buffers())
                for k, v in buffers.items():
                    current[k].copy_(v)
