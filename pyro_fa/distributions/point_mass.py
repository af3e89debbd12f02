r"""The degenerate member of the family: all mass at the mean, :math:`\Sigma = 0`."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributions import constraints

from pyro_fa.distributions.base import FactorNormal

__all__ = ["PointMassNormal"]


class PointMassNormal(FactorNormal):
    r"""The point mass :math:`\delta_c`: the family's member with covariance 0 (rank 0, :math:`d = 0`).

    What a posterior at scale :math:`s = 0` is (:math:`N(c, s\Sigma)` as :math:`s \to 0`, e.g. when
    :meth:`~pyro_fa.SWAG.tune_scale` keeps the mean): :attr:`mean` is ``loc``, :attr:`variance` 0,
    :meth:`rsample` returns copies of ``loc`` (no random numbers drawn, ``generator`` untouched),
    :meth:`entropy` :math:`-\infty`, :meth:`covariance_matvec` zeros.

    :meth:`log_prob` follows :class:`pyro.distributions.Delta`: 0 at ``loc`` (every coordinate equal) and
    :math:`-\infty` elsewhere, the log of the mass (a density with respect to the counting measure, not the
    Lebesgue density of the other members, which does not exist here).

    Parameters
    ----------
    loc : Tensor of shape (..., D)
        The mean :math:`c`; leading dimensions are batch dimensions (a mixture's components).
    validate_args : bool, optional

    Raises
    ------
    ValueError
        If ``loc`` is a scalar.

    Examples
    --------
    >>> q = PointMassNormal(torch.tensor([1.0, 2.0]))
    >>> q.sample((2,))
    tensor([[1., 2.],
            [1., 2.]])
    >>> q.variance, q.entropy()
    (tensor([0., 0.]), tensor(-inf))
    """

    arg_constraints = {"loc": constraints.real_vector}

    def __init__(self, loc: Tensor, validate_args: Optional[bool] = None):
        if not torch.is_tensor(loc) or loc.dim() < 1:
            raise ValueError(f"PointMassNormal: loc must be a tensor of shape (..., D), got "
                             f"{tuple(loc.shape) if torch.is_tensor(loc) else type(loc).__name__!r}.")
        self.loc = loc
        super().__init__(loc.shape[:-1], loc.shape[-1:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(PointMassNormal, _instance)
        new.loc = self.loc.expand(torch.Size(batch_shape) + self.event_shape)
        super(PointMassNormal, new).__init__(torch.Size(batch_shape), self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def mode(self) -> Tensor:
        return self.loc

    @property
    def variance(self) -> Tensor:
        return torch.zeros_like(self.loc)

    @property
    def cov_factor(self) -> Tensor:
        """Shape (..., D, 0): no low-rank part."""
        return self.loc.new_zeros(self.loc.shape + (0,))

    @property
    def cov_diag(self) -> Tensor:
        """Zeros of shape (..., D)."""
        return torch.zeros_like(self.loc)

    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        """Copies of ``loc``, shape ``sample_shape + batch_shape + (D,)`` (differentiable in ``loc``)."""
        return self.loc.expand(self._extended_shape(sample_shape)).clone()

    def log_prob(self, value: Tensor) -> Tensor:
        """0 where ``value`` equals ``loc`` in every coordinate, :math:`-\\infty` elsewhere; shape ``value.shape[:-1]``."""
        if self._validate_args:
            self._validate_sample(value)
        hit = (value == self.loc).all(-1)
        return torch.where(hit, self.loc.new_zeros(()), self.loc.new_full((), -math.inf))

    def entropy(self) -> Tensor:
        r""":math:`-\infty` (the differential entropy of :math:`N(c, s\Sigma)` as :math:`s \to 0`), shape ``batch_shape``."""
        return self.loc.new_full(self.batch_shape, -math.inf)

    def covariance_matvec(self, v: Tensor) -> Tensor:
        """Zeros of ``v``'s shape."""
        return torch.zeros_like(v)
