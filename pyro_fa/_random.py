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

__all__ = ["randn", "rand", "randint", "draw_seed"]

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


def draw_seed() -> int:
    """A seed for an object built with ``seed=None``: one number from torch's global generator.

    torch's convention (``DataLoader`` seeds its workers so): no seed means the global
    generator, so that ``torch.manual_seed`` makes a run repeatable, and the global stream
    moves by one draw whatever the object's size. Sharded objects use rank 0's draw, so
    the ranks agree however their global generators were seeded.

    Returns
    -------
    int
        In :math:`[0, 2^{62})`.
    """
    return int(torch.empty((), dtype=torch.int64).random_(0, 2 ** 62))
