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

from pyro_fa.fa.moments import wide_dtype

__all__ = ["StableLowRankMultivariateNormal", "whitened_gram", "capacitance_tril"]

_ROWS = 1 << 14  # rows per block of the float64 sums: a (rows, K) float64 block stays small


def whitened_gram(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r""":math:`F^\top\Psi^{-1}F = W^\top W`, :math:`W = \Psi^{-1/2}F`, summed over row blocks in float64.

    Parameters
    ----------
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D), positive

    Returns
    -------
    Tensor of shape (..., K, K), in float64 (float32 on Apple's MPS)
        Symmetric positive semi-definite: the products of float32 numbers are exact in float64.

    Notes
    -----
    Cost :math:`O(DK^2)`; memory one block of :math:`16384 \times K` float64 numbers.
    """
    wide = wide_dtype(cov_factor.device)
    D = cov_factor.shape[-2]
    gram = None
    for lo in range(0, D, _ROWS):
        W = cov_factor[..., lo:lo + _ROWS, :].to(wide) * cov_diag[..., lo:lo + _ROWS].to(wide).rsqrt().unsqueeze(-1)
        part = W.transpose(-1, -2) @ W
        gram = part if gram is None else gram + part
    if gram is None:
        K = cov_factor.shape[-1]
        gram = cov_factor.new_zeros(cov_factor.shape[:-2] + (K, K), dtype=wide)
    return gram


def capacitance_tril(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r"""Lower Cholesky factor of :math:`I + F^\top\Psi^{-1}F`, in float64 (see :func:`whitened_gram`).

    Returns
    -------
    Tensor of shape (..., K, K), float64 (float32 on MPS)
    """
    cap = whitened_gram(cov_factor, cov_diag)
    cap.diagonal(dim1=-2, dim2=-1).add_(1.0)
    return torch.linalg.cholesky(cap)


class StableLowRankMultivariateNormal(LowRankMultivariateNormal):
    r""":class:`~torch.distributions.LowRankMultivariateNormal` whose capacitance is formed in float64.

    The same distribution, arguments and methods as torch's class (it is one:
    ``isinstance(d, LowRankMultivariateNormal)`` holds); the capacitance's Cholesky factor
    comes from :func:`capacitance_tril`, and :meth:`log_prob` and :meth:`entropy` are
    computed in float64 and returned in the dtype of ``loc``. Use it where
    :math:`\psi` may be tiny against the rows of :math:`F` (posteriors of iterates at large
    :math:`D`), where torch's float32 capacitance fails to factorise.

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
