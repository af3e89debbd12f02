r"""The Gaussian :math:`N(c, FF^\top + \Psi)` with a capacitance that stays positive definite in float32.

:class:`torch.distributions.LowRankMultivariateNormal` forms the :math:`K\times K` capacitance
:math:`I + F^\top\Psi^{-1}F` in the dtype of :math:`F`. Its eigenvalues are at least one, but
the posteriors of SWAG-like fits at large :math:`D` have noise variances :math:`\psi_d` many
orders of magnitude below the factor's rows: :math:`F^\top\Psi^{-1}F` then has eigenvalues
near :math:`10^{8}` beside eigenvalues near 0, float32 rounding of the sum over :math:`D`
moves the small ones by more than one, and the Cholesky factorisation fails (seen on
``SWAG(nn.Linear(1000, 200), rank=10)``). Here the capacitance is the Gram matrix of the
whitened factor :math:`W = \Psi^{-1/2}F`, accumulated in float64 over row blocks:
:math:`I + W^\top W` is then positive definite by construction (a Gram matrix computed
accurately), and its Cholesky factor is taken in float64. :meth:`log_prob` and
:meth:`entropy` use the float64 factor and float64 sums over :math:`D` too; everything else
(sampling, moments) is torch's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributions import LowRankMultivariateNormal

from pyro_fa import _random
from pyro_fa.distributions.base import FactorNormal
from pyro_fa.distributions.numerics import _ROWS, capacitance_tril

__all__ = ["StableLowRankMultivariateNormal"]


class StableLowRankMultivariateNormal(LowRankMultivariateNormal, FactorNormal):
    r""":class:`~torch.distributions.LowRankMultivariateNormal` whose capacitance is formed in float64.

    The same distribution, arguments and methods as torch's class (it is one:
    ``isinstance(d, LowRankMultivariateNormal)`` holds); the capacitance's Cholesky factor
    comes from :func:`capacitance_tril`, and :meth:`log_prob` and :meth:`entropy` are
    computed in float64 and returned in the dtype of ``loc``. Use it where
    :math:`\psi` may be tiny against the rows of :math:`F` (posteriors of iterates at large
    :math:`D`), where torch's float32 capacitance fails to factorise.

    The covariance form of the family (:class:`~pyro_fa.distributions.FactorNormal`,
    :attr:`factor_sign` = +1): :meth:`rsample` and :meth:`sample` take a ``generator`` too.

    Parameters
    ----------
    loc : Tensor of shape (..., D)
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D), positive
    validate_args : bool, optional

    Notes
    -----
    Construction costs :math:`O(DK^2)` in float64 (torch's: the same in the factor's dtype);
    ``log_prob`` of N vectors :math:`O(NDK)`, in row blocks.

    Examples
    --------
    >>> F = torch.randn(1000, 3) * 1e-2
    >>> psi = torch.full((1000,), 1e-14)
    >>> q = StableLowRankMultivariateNormal(torch.zeros(1000), F, psi)
    >>> bool(torch.isfinite(q.log_prob(q.sample())))
    True
    """

    def __init__(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, validate_args: Optional[bool] = None):
        # torch's own checks and broadcasting, without its capacitance (see LowRankMultivariateNormal.__init__)
        if loc.dim() < 1:
            raise ValueError("StableLowRankMultivariateNormal: loc must be at least one-dimensional, got a scalar.")
        event_shape = loc.shape[-1:]
        if cov_factor.dim() < 2 or cov_factor.shape[-2:-1] != event_shape:
            raise ValueError(f"StableLowRankMultivariateNormal: cov_factor must have shape (..., {event_shape[0]}, K), "
                             f"got {tuple(cov_factor.shape)!r}.")
        if cov_diag.shape[-1:] != event_shape:
            raise ValueError(f"StableLowRankMultivariateNormal: cov_diag must have shape (..., {event_shape[0]}), "
                             f"got {tuple(cov_diag.shape)!r}.")
        try:
            loc_, self.cov_factor, cov_diag_ = torch.broadcast_tensors(
                loc.unsqueeze(-1), cov_factor, cov_diag.unsqueeze(-1))
        except RuntimeError as e:
            raise ValueError(f"StableLowRankMultivariateNormal: incompatible batch shapes: loc {tuple(loc.shape)}, "
                             f"cov_factor {tuple(cov_factor.shape)}, cov_diag {tuple(cov_diag.shape)}.") from e
        self.loc = loc_[..., 0]
        self.cov_diag = cov_diag_[..., 0]
        self._unbroadcasted_cov_factor = cov_factor
        self._unbroadcasted_cov_diag = cov_diag
        self._capacitance_tril_wide = capacitance_tril(cov_factor, cov_diag)
        self._capacitance_tril = self._capacitance_tril_wide.to(cov_factor.dtype)  # for torch's other methods
        super(LowRankMultivariateNormal, self).__init__(self.loc.shape[:-1], event_shape,
                                                        validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(StableLowRankMultivariateNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new._capacitance_tril_wide = self._capacitance_tril_wide
        return new

    def rsample(self, sample_shape=torch.Size(), generator: Optional[torch.Generator] = None) -> Tensor:
        r"""Draws :math:`c + Fh + \Psi^{1/2}\varepsilon` of shape ``sample_shape + batch_shape + (D,)``.

        Without ``generator``, torch's :meth:`LowRankMultivariateNormal.rsample` (the global generator); with one,
        the same formula and order of draws (:math:`h` then :math:`\varepsilon`) on ``generator``, on any device.
        """
        if generator is None:
            return super().rsample(sample_shape)
        shape = self._extended_shape(sample_shape)
        W_shape = shape[:-1] + self.cov_factor.shape[-1:]
        ref = self.loc
        eps_W = _random.randn(W_shape, generator, ref.dtype, ref.device)
        eps_D = _random.randn(shape, generator, ref.dtype, ref.device)
        low = (self._unbroadcasted_cov_factor @ eps_W.unsqueeze(-1)).squeeze(-1)
        return self.loc + low + self._unbroadcasted_cov_diag.sqrt() * eps_D

    def _logdet_wide(self) -> Tensor:
        L = self._capacitance_tril_wide
        psi = self._unbroadcasted_cov_diag
        return 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1) + psi.to(L.dtype).log().sum(-1)

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        L = self._capacitance_tril_wide
        wide = L.dtype
        F, psi = self._unbroadcasted_cov_factor, self._unbroadcasted_cov_diag
        diff = value - self.loc
        D = diff.shape[-1]
        maha, u = None, None
        for lo in range(0, D, _ROWS):
            r = diff[..., lo:lo + _ROWS].to(wide)
            rp = r / psi[..., lo:lo + _ROWS].to(wide)
            t = (r * rp).sum(-1)
            p = (rp.unsqueeze(-2) @ F[..., lo:lo + _ROWS, :].to(wide)).squeeze(-2)  # F^T Psi^-1 r
            maha, u = (t, p) if maha is None else (maha + t, u + p)
        v = torch.linalg.solve_triangular(L, u.unsqueeze(-1), upper=False).squeeze(-1)
        maha = maha - v.pow(2).sum(-1)
        out = -0.5 * (D * math.log(2 * math.pi) + self._logdet_wide() + maha)
        return out.to(self.loc.dtype)

    def entropy(self) -> Tensor:
        D = self._event_shape[0]
        out = 0.5 * (D * (1.0 + math.log(2 * math.pi)) + self._logdet_wide())
        return out.to(self.loc.dtype).expand(self._batch_shape)
