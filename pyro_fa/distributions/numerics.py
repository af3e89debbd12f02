r"""The numerics every member of the family shares: the accumulation dtype, the float64 capacitance, the guard
on dense :math:`D\times D` matrices.

These sit in the lowest layer (torch only) so that the family (:mod:`pyro_fa.distributions`) and the
factor-analysis core (:mod:`pyro_fa.fa`, which imports them from here) share one copy.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["wide_dtype", "whitened_gram", "capacitance_tril", "check_dense_dim", "MAX_DENSE_DIM"]


def wide_dtype(device: torch.device) -> torch.dtype:
    """The accumulation dtype: float64, except where the device has none (Apple's MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


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

    The one implementation of the capacitance's factor: the family's members keep it in float64 for their
    solves, and :func:`pyro_fa.fa.linalg.capacitance_cholesky`, the factor-analysis core's checked form,
    returns this factor in the dtype of ``cov_factor``.

    Returns
    -------
    Tensor of shape (..., K, K), float64 (float32 on MPS)
    """
    cap = whitened_gram(cov_factor, cov_diag)
    cap.diagonal(dim1=-2, dim2=-1).add_(1.0)
    return torch.linalg.cholesky(cap)


#: The largest D for which a dense D x D matrix is built without being asked for a larger one
#: (3.2 GB in float64): past it, :func:`check_dense_dim` refuses.
MAX_DENSE_DIM = 20_000


def check_dense_dim(owner: str, what: str, dim: int, dtype: torch.dtype, alternative: str,
                    max_dim: Optional[int] = MAX_DENSE_DIM, argument: str = "D") -> None:
    r"""Refuse, before allocating, to build a dense :math:`D\times D` matrix when :math:`D` > ``max_dim``.

    Parameters
    ----------
    owner : str
        The class or function whose call is refused (starts the message).
    what : str
        What would be built, e.g. ``"get_covariance()"``.
    dim : int
        :math:`D`.
    dtype : torch.dtype
        The matrix's dtype, for its size in GB.
    alternative : str
        The :math:`O(DK)` way to get what the caller wants, appended to the message.
    max_dim : int or None, default :data:`MAX_DENSE_DIM` (20 000)
        The largest :math:`D` allowed; ``None`` allows any.
    argument : str, default "D"
        How the message names :math:`D` (e.g. ``"n_features"``).

    Raises
    ------
    ValueError
        If ``dim > max_dim``, naming the size of one :math:`D\times D` matrix in GB and ``alternative``.

    Examples
    --------
    >>> check_dense_dim("Model", "covariance()", 100, torch.float64, "Use get_posterior().")
    >>> check_dense_dim("Model", "covariance()", 30_000, torch.float64, "Use get_posterior().")
    Traceback (most recent call last):
    ...
    ValueError: Model: covariance() forms a dense D x D matrix (7.2 GB in torch.float64) and needs D <= 20000, got 30000. Use get_posterior().
    """
    if max_dim is None or dim <= max_dim:
        return
    gb = dim * dim * (torch.finfo(dtype).bits // 8) / 1e9
    raise ValueError(
        f"{owner}: {what} forms a dense {argument} x {argument} matrix ({gb:.3g} GB in {dtype}) and needs "
        f"{argument} <= {max_dim}, got {dim}. {alternative}"
    )
