r"""Exact running means and variances of a stream of vectors, in any dtype.

The streams this library follows are parameter vectors of a network late in
training: their spread is tiny against their size (a weight of 1 that moves by
1e-4). Accumulated in float32 the mean stops moving one ulp away from the truth,
the deviations inherit that constant error and the variance a bias that does
not shrink. The moments are therefore accumulated in float64 whatever the dtype
of the vectors (two length-D vectors; a float32 state of D x K tensors stays
float32), and the deviations are formed there before being rounded once.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

from pyro_fa.distributions.numerics import wide_dtype  # re-exported: the core's accumulation dtype

__all__ = ["RunningMoments", "wide_dtype"]


class RunningMoments(nn.Module):
    r"""Running mean and sum of squared deviations of vectors, merged exactly (Chan, Golub & LeVeque 1983).

    .. math::

        \bar x_n = \bar x_{n_0} + \tfrac{B}{n}(\bar x_B - \bar x_{n_0}), \qquad
        M_n = M_{n_0} + \textstyle\sum_{b}(x_b - \bar x_B)^2 + \tfrac{n_0 B}{n}(\bar x_B - \bar x_{n_0})^2,

    for a batch of :math:`B` vectors with mean :math:`\bar x_B` after :math:`n_0` earlier ones,
    :math:`n = n_0 + B`. The buffers ``mean`` and ``sq_dev`` (shape (D,)) stay in
    :func:`~pyro_fa.distributions.numerics.wide_dtype` through ``.to(dtype)``; only their device follows the owner.

    The update is split in two so that an owner can refuse a batch before anything
    changes: :meth:`propose` computes the merged moments out of place, :meth:`commit`
    writes them. The count :math:`n_0` is the owner's (it has one already).

    Parameters
    ----------
    dim : int
        :math:`D`.
    device : torch.device or str, optional
    """

    def __init__(self, dim: int, device=None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        wide = wide_dtype(device)
        self.register_buffer("mean", torch.zeros(dim, dtype=wide, device=device))
        self.register_buffer("sq_dev", torch.zeros(dim, dtype=wide, device=device))

    def propose(self, x: Tensor, n_old: int) -> Tuple[Tensor, Tensor, Tensor]:
        """The moments after ``x`` (shape (B, D)) and ``x`` in the wide dtype, out of place.

        Returns
        -------
        mean, sq_dev : Tensors of shape (D,)
        x_wide : Tensor of shape (B, D)
        """
        xw = x.to(self.mean.dtype)
        B = xw.shape[0]
        n = n_old + B
        # shifted by the first vector: identical vectors give exactly their value and zero deviations
        # (the plain mean of B equal numbers can be an ulp off, a spread that is only rounding)
        batch_mean = (xw - xw[0]).mean(0).add_(xw[0]) if B > 1 else xw[0]
        delta = batch_mean - self.mean
        mean = torch.add(self.mean, delta, alpha=B / n)
        if B == 1:
            sq_dev = torch.addcmul(self.sq_dev, delta, delta, value=n_old / n)
        else:
            sq_dev = (xw - batch_mean).pow_(2).sum(0).add_(self.sq_dev).addcmul_(delta, delta, value=n_old * B / n)
        return mean, sq_dev, xw

    def deviation(self, x: Tensor) -> Tuple[Tensor, float]:
        r"""One vector's deviation :math:`t = x - \bar x` from the current mean, and :math:`\max_d |t_d|`.

        ``t`` (shape (D,), wide dtype) lives in a kept buffer, valid until the next call:
        at D = 10^6 allocating it per vector costs page faults. Nothing changes until
        :meth:`add_deviation`.
        """
        buf = self.__dict__.get("_t")
        if buf is None or buf.dtype != self.mean.dtype or buf.device != self.mean.device:
            buf = self.__dict__["_t"] = torch.empty_like(self.mean)
        t = torch.sub(x, self.mean, out=buf)
        # two vectorised reductions (the inf-norm is 10x slower on the CPU)
        return t, max(float(t.amax()), -float(t.amin()))

    def add_deviation(self, t: Tensor, n_old: int) -> None:
        """Merge one vector, given by its :meth:`deviation` ``t``, after ``n_old`` vectors, in place."""
        n = n_old + 1
        self.mean.add_(t, alpha=1.0 / n)
        if n_old:  # the first vector becomes the mean (and t * 0 could be inf * 0)
            self.sq_dev.addcmul_(t, t, value=n_old / n)

    def commit(self, mean: Tensor, sq_dev: Tensor) -> None:
        """Write moments returned by :meth:`propose`."""
        self.mean.copy_(mean)
        self.sq_dev.copy_(sq_dev)

    def variance(self, n: int) -> Tensor:
        """The maximum-likelihood variances after ``n`` vectors, in the wide dtype."""
        return self.sq_dev / max(n, 1)

    def _apply(self, fn, recurse=True):
        keep = (self.mean, self.sq_dev)
        out = super()._apply(fn, recurse)
        device = self.mean.device
        wide = wide_dtype(device)
        # the owner's dtype may change; the accumulators keep their width (and their bits)
        self.mean = keep[0].to(device=device, dtype=wide)
        self.sq_dev = keep[1].to(device=device, dtype=wide)
        return out
