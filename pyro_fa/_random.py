"""Random draws with a user's ``torch.Generator`` on any device.

torch draws on the generator's own device and refuses a CPU generator for a CUDA tensor. Every draw
of pyro_fa that takes a user's generator goes through these: the numbers are drawn on the
generator's device, then moved to the tensors' device. A CPU generator (``torch.Generator()``, the
usual one) thus serves a model on any device, a generator on the model's device keeps the draws
there, and one seed gives the same draws on every device.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["randn", "rand", "randint"]

Device = Union[str, torch.device, None]


def randn(size: Sequence[int], generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
          device: Device = None) -> Tensor:
    """``torch.randn(size)`` on ``device``, drawn on ``generator``'s device when one is given."""
    if generator is None:
        return torch.randn(tuple(size), dtype=dtype, device=device)
    return torch.randn(tuple(size), generator=generator, dtype=dtype, device=generator.device).to(device)


def rand(size: Sequence[int], generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
         device: Device = None) -> Tensor:
    """``torch.rand(size)`` on ``device``, drawn on ``generator``'s device when one is given."""
    if generator is None:
        return torch.rand(tuple(size), dtype=dtype, device=device)
    return torch.rand(tuple(size), generator=generator, dtype=dtype, device=generator.device).to(device)


def randint(high: int, size: Sequence[int], generator: Optional[torch.Generator] = None, device: Device = None) -> Tensor:
    """``torch.randint(high, size)`` on ``device``, drawn on ``generator``'s device when one is given."""
    if generator is None:
        return torch.randint(high, tuple(size), device=device)
    return torch.randint(high, tuple(size), generator=generator, device=generator.device).to(device)
