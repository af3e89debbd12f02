"""What a posterior that is not in posteriordb is: a Pyro model, its dimension, reference draws in Pyro's
unconstrained space and its log density (the stand-ins of :mod:`~pyro_fa.experiments.posteriordb.standins` and the
D = 5000 :mod:`~pyro_fa.experiments.posteriordb.big`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class StandInPosterior:
    name: str
    model: Callable
    dim: int
    reference: torch.Tensor
    _log_density: Callable

    def log_density(self, z: torch.Tensor) -> torch.Tensor:
        """log p(z), ``z`` of shape (D,) or (n, D)."""
        return self._log_density(z)
