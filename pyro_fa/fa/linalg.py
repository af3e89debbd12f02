r"""Covariance algebra of factor-analysis (low-rank plus diagonal) matrices.

Every function here works with

.. math::

    \Sigma = F F^\top + \Psi, \qquad F \in \mathbb{R}^{D \times K},
    \quad \Psi = \mathrm{diag}(\psi),

in :math:`O(DK^2)` time and :math:`O(DK)` memory through a Cholesky factor of
the :math:`K \times K` *capacitance* matrix :math:`I + F^\top \Psi^{-1} F`
(Woodbury identity, matrix determinant lemma). No :math:`D \times D` matrix is
ever formed, except by :func:`dense_covariance`, which is asked for
explicitly. Arguments use torch's names: ``cov_factor`` is :math:`F` (a tensor
of shape ``(..., D, K)``) and ``cov_diag`` is :math:`\psi` (shape ``(..., D)``).

For log-densities, entropies and samples use
:class:`torch.distributions.LowRankMultivariateNormal` (see
:func:`fa_distribution`), which implements the same algebra.

References
----------
D. Barber, *Bayesian Reasoning and Machine Learning*, CUP 2012, ch. 21.
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc
thesis, University of Edinburgh, 2021.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.distributions.covariance import StableLowRankMultivariateNormal
from pyro_fa.distributions.numerics import MAX_DENSE_DIM, capacitance_tril, check_dense_dim  # re-exported

__all__ = [
    "capacitance_cholesky",
    "logdet",
    "solve",
    "inverse_diag",
    "latent_posterior",
    "relative_frobenius_distance",
    "frobenius_norm",
    "gaussian_wasserstein2",
    "dense_covariance",
    "check_dense_dim",
    "MAX_DENSE_DIM",
    "orthogonal_init",
    "fa_distribution",
]


def _check_pair(cov_factor: Tensor, cov_diag: Tensor, fn: str) -> None:
    if cov_factor.dim() < 2:
        raise ValueError(
            f"{fn}: cov_factor must have shape (..., D, K), got shape {tuple(cov_factor.shape)!r}."
        )
    if cov_diag.shape[-1] != cov_factor.shape[-2]:
        raise ValueError(
            f"{fn}: cov_diag must have length D={cov_factor.shape[-2]} to match cov_factor, "
            f"got shape {tuple(cov_diag.shape)!r}."
        )


def capacitance_cholesky(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r"""Lower Cholesky factor of the capacitance :math:`I + F^\top \Psi^{-1} F`.

    Parameters
    ----------
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D), positive

    Returns
    -------
    Tensor of shape (..., K, K)
        Lower-triangular :math:`L` with :math:`L L^\top = I + F^\top\Psi^{-1}F`.

    Notes
    -----
    Cost :math:`O(DK^2)`. The arithmetic is that of
    :func:`pyro_fa.distributions.numerics.capacitance_tril` (the one implementation, in the lower layer):
    the capacitance has eigenvalues :math:`\ge 1`; it is formed as :math:`I + W^\top W`,
    :math:`W = \Psi^{-1/2}F`, summed in float64 and factorised there, so it is positive definite by
    construction even where float32 sums would not be (tiny :math:`\psi` against :math:`F`). This function
    adds the checks of its arguments and returns the factor in the dtype of ``cov_factor`` (its diagonal
    is :math:`\ge 1`), which the core's solves work in.
    """
    _check_pair(cov_factor, cov_diag, "capacitance_cholesky")
    return capacitance_tril(cov_factor, cov_diag).to(cov_factor.dtype)


def logdet(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r"""Log-determinant :math:`\log|FF^\top + \Psi|` (matrix determinant lemma).

    .. math::

        \log|FF^\top+\Psi| = \sum_d \log\psi_d + 2\sum_k \log L_{kk}.

    Parameters
    ----------
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D)

    Returns
    -------
    Tensor of shape (...)

    Examples
    --------
    >>> F, psi = torch.randn(5, 2, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    >>> dense = torch.logdet(F @ F.T + torch.diag(psi))
    >>> bool(torch.allclose(logdet(F, psi), dense))
    True
    """
    L = capacitance_cholesky(cov_factor, cov_diag)
    return cov_diag.log().sum(-1) + 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)


def solve(cov_factor: Tensor, cov_diag: Tensor, rhs: Tensor) -> Tensor:
    r"""Solve :math:`(FF^\top + \Psi) x = b` by the Woodbury identity.

    .. math::

        \Sigma^{-1} b = \Psi^{-1} b - \Psi^{-1} F (I + F^\top\Psi^{-1}F)^{-1} F^\top \Psi^{-1} b.

    Parameters
    ----------
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
    rhs : Tensor of shape (..., D)
        Right-hand sides, one per leading index (vectors in the last dimension).

    Returns
    -------
    Tensor of shape (..., D)

    Notes
    -----
    Cost :math:`O(DK^2 + NDK)` for :math:`N` right-hand sides.
    """
    _check_pair(cov_factor, cov_diag, "solve")
    if rhs.shape[-1] != cov_factor.shape[-2]:
        raise ValueError(
            f"solve: rhs must have last dimension D={cov_factor.shape[-2]}, got shape {tuple(rhs.shape)!r}."
        )
    L = capacitance_cholesky(cov_factor, cov_diag)
    b = rhs / cov_diag  # (..., D)
    u = b @ cov_factor  # (..., K) = F^T Psi^-1 b
    v = torch.cholesky_solve(u.unsqueeze(-1), L).squeeze(-1)  # (..., K)
    return b - (v @ cov_factor.transpose(-1, -2)) / cov_diag


def inverse_diag(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r"""Diagonal of :math:`(FF^\top + \Psi)^{-1}` without forming it.

    .. math::

        \mathrm{diag}(\Sigma^{-1})_d = \psi_d^{-1} - \| L^{-1} F^\top \Psi^{-1} e_d \|^2 .

    Parameters
    ----------
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D)

    Returns
    -------
    Tensor of shape (..., D)
    """
    L = capacitance_cholesky(cov_factor, cov_diag)
    Wt = (cov_factor / cov_diag.unsqueeze(-1)).transpose(-1, -2)  # (..., K, D)
    Z = torch.linalg.solve_triangular(L, Wt, upper=False)  # (..., K, D)
    return cov_diag.reciprocal() - Z.pow(2).sum(-2)


def latent_posterior(cov_factor: Tensor, cov_diag: Tensor, centred: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Posterior of the latent factors given centred observations (the E-step).

    For :math:`\theta = Fh + c + \varepsilon`, :math:`h \sim N(0, I)`,
    :math:`\varepsilon \sim N(0, \Psi)` and :math:`d = \theta - c`
    (Brownlie 2021, eqs. 4.10 and 4.23; Barber eq. 21.2.17):

    .. math::

        p(h \mid \theta) = N(m, \Sigma_h), \quad
        \Sigma_h = (I + F^\top\Psi^{-1}F)^{-1}, \quad
        m = \Sigma_h F^\top \Psi^{-1} d .

    Parameters
    ----------
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
    centred : Tensor of shape (..., D)
        Centred observations :math:`d`.

    Returns
    -------
    mean : Tensor of shape (..., K)
    cov : Tensor of shape (K, K)
        The posterior covariance, shared by all observations.

    Notes
    -----
    Cost :math:`O(DK^2 + NDK)`; the inverse is applied through
    ``cholesky_solve``, never formed explicitly, except for the returned
    :math:`K\times K` covariance.
    """
    _check_pair(cov_factor, cov_diag, "latent_posterior")
    K = cov_factor.shape[-1]
    L = capacitance_cholesky(cov_factor, cov_diag)
    u = (centred / cov_diag) @ cov_factor  # (..., K)
    mean = torch.cholesky_solve(u.unsqueeze(-1), L).squeeze(-1)
    eye = torch.eye(K, dtype=cov_factor.dtype, device=cov_factor.device)
    cov = torch.cholesky_solve(eye, L)
    return mean, cov


_CHUNK = 1 << 16


def _accumulate(cov_factors, cov_diags):
    """Sums over D, in float64 chunks, of the terms the Frobenius norms need.

    For U = [F_1, ..., F_n] returns U^T U, sum_d delta_d U_d. ** 2 and ||delta||^2 where
    delta is a signed combination of the diagonals, all in float64 so that the
    cancellations of a small difference between large covariances stay accurate.
    """
    U = torch.cat(cov_factors, dim=-1)
    D = U.shape[-2]
    G = U.new_zeros(U.shape[-1], U.shape[-1], dtype=torch.float64)
    cross = U.new_zeros(U.shape[-1], dtype=torch.float64)
    dsq = U.new_zeros((), dtype=torch.float64)
    for lo in range(0, D, _CHUNK):
        Uc = U[lo : lo + _CHUNK].double()
        dc = cov_diags[0][lo : lo + _CHUNK].double()
        if len(cov_diags) > 1:
            dc = dc - cov_diags[1][lo : lo + _CHUNK].double()
        G += Uc.T @ Uc
        cross += dc @ Uc.pow(2)
        dsq += dc.pow(2).sum()
    return G, cross, dsq


def frobenius_norm(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r""":math:`\|FF^\top + \Psi\|_F` through :math:`K \times K` traces.

    .. math::

        \|FF^\top+\Psi\|_F^2 = \mathrm{tr}((F^\top F)^2) + 2\sum_d \psi_d \|F_{d\cdot}\|^2 + \|\psi\|^2 .

    Parameters
    ----------
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)

    Returns
    -------
    Tensor, a scalar of the dtype of ``cov_factor``

    Notes
    -----
    Sums over D are accumulated in float64, in chunks of 65 536 rows.
    """
    _check_pair(cov_factor, cov_diag, "frobenius_norm")
    G, cross, dsq = _accumulate([cov_factor], [cov_diag])
    sq = (G * G).sum() + 2 * cross.sum() + dsq
    return sq.clamp_min(0).sqrt().to(cov_factor.dtype)


def relative_frobenius_distance(
    cov_factor1: Tensor, cov_diag1: Tensor, cov_factor2: Tensor, cov_diag2: Tensor
) -> Tensor:
    r"""Relative distance :math:`\|\Sigma_1 - \Sigma_2\|_F / \|\Sigma_1\|_F` of two FA covariances.

    With :math:`U = [F_1, F_2]`, :math:`W = \mathrm{diag}(I_{K_1}, -I_{K_2})`
    and :math:`\delta = \psi_1 - \psi_2`,

    .. math::

        \|\Sigma_1-\Sigma_2\|_F^2 = \mathrm{tr}((WU^\top U)^2)
        + 2\sum_d \delta_d (UWU^\top)_{dd} + \|\delta\|^2 ,

    all in :math:`O(D(K_1+K_2)^2)`, so it works at :math:`D = 10^6`
    (Brownlie 2021, §5.2, uses it on dense matrices).

    Parameters
    ----------
    cov_factor1, cov_factor2 : Tensors of shape (D, K1) and (D, K2)
    cov_diag1, cov_diag2 : Tensors of shape (D,)

    Returns
    -------
    Tensor, a scalar of the dtype of ``cov_factor1``

    Notes
    -----
    The sums over D are accumulated in float64 (in chunks), because the
    distance is the square root of a small difference of large traces: in
    float32 the error would grow with D.

    Examples
    --------
    >>> F1, F2 = torch.randn(6, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    >>> p1, p2 = torch.rand(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    >>> S1, S2 = F1 @ F1.T + torch.diag(p1), F2 @ F2.T + torch.diag(p2)
    >>> dense = torch.linalg.norm(S1 - S2) / torch.linalg.norm(S1)
    >>> bool(torch.allclose(relative_frobenius_distance(F1, p1, F2, p2), dense))
    True
    """
    _check_pair(cov_factor1, cov_diag1, "relative_frobenius_distance")
    _check_pair(cov_factor2, cov_diag2, "relative_frobenius_distance")
    _check_finite("relative_frobenius_distance", cov_factor1=cov_factor1, cov_diag1=cov_diag1,
                  cov_factor2=cov_factor2, cov_diag2=cov_diag2)
    if cov_factor1.shape[-2] != cov_factor2.shape[-2]:
        raise ValueError(
            "relative_frobenius_distance: both covariances must have the same dimension D, "
            f"got {cov_factor1.shape[-2]} and {cov_factor2.shape[-2]}."
        )
    cov_factor2 = cov_factor2.to(cov_factor1.dtype)
    G, cross, dsq = _accumulate([cov_factor1, cov_factor2], [cov_diag1, cov_diag2.to(cov_diag1.dtype)])
    K1 = cov_factor1.shape[-1]
    sign = torch.ones(G.shape[0], dtype=G.dtype, device=G.device)
    sign[K1:] = -1
    GW = G * sign  # U^T U W
    low = (GW * GW.T).sum()  # tr((U^T U W)^2)
    diff_sq = (low + 2 * (cross * sign).sum() + dsq).clamp_min(0)
    norm1 = frobenius_norm(cov_factor1, cov_diag1).double()
    return (diff_sq.sqrt() / norm1).to(cov_factor1.dtype)


def _sqrtm_psd(mat: Tensor) -> Tensor:
    evals, evecs = torch.linalg.eigh(mat)
    return (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)


def gaussian_wasserstein2(loc1: Tensor, cov1: Tensor, loc2: Tensor, cov2: Tensor) -> Tensor:
    r"""2-Wasserstein distance between two Gaussians (dense; small D only).

    .. math::

        W_2^2 = \|\mu_1-\mu_2\|^2 + \mathrm{tr}\big(\Sigma_1 + \Sigma_2
        - 2(\Sigma_2^{1/2}\Sigma_1\Sigma_2^{1/2})^{1/2}\big).

    Parameters
    ----------
    loc1, loc2 : Tensors of shape (D,)
    cov1, cov2 : Tensors of shape (D, D), symmetric positive semi-definite

    Returns
    -------
    Tensor, a scalar: :math:`W_2` (not squared).

    Notes
    -----
    Cost :math:`O(D^3)` through symmetric eigendecompositions.
    """
    for name, cov in (("cov1", cov1), ("cov2", cov2)):
        if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
            raise ValueError(f"gaussian_wasserstein2: {name} must be a square matrix, got shape {tuple(cov.shape)!r}.")
    if not (loc1.shape == loc2.shape == cov1.shape[:1] == cov2.shape[:1]):
        raise ValueError(
            "gaussian_wasserstein2: loc1, loc2 must have shape (D,) matching cov1, cov2 of shape (D, D), got "
            f"{tuple(loc1.shape)}, {tuple(loc2.shape)}, {tuple(cov1.shape)}, {tuple(cov2.shape)}."
        )
    _check_finite("gaussian_wasserstein2", loc1=loc1, cov1=cov1, loc2=loc2, cov2=cov2)
    s2 = _sqrtm_psd(cov2)
    cross = _sqrtm_psd(s2 @ cov1 @ s2)
    w2 = (loc1 - loc2).pow(2).sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * torch.trace(cross)
    return w2.clamp_min(0).sqrt()


def _check_finite(fn: str, **tensors: Tensor) -> None:
    """Refuse NaN or inf in the arguments of an evaluation function (a distance of NaN is no distance)."""
    for name, value in tensors.items():
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            raise ValueError(
                f"{fn}: {name} must be finite, got NaN or inf in {int((~finite).sum())} of {value.numel()} entries."
            )


def dense_covariance(cov_factor: Tensor, cov_diag: Tensor) -> Tensor:
    r"""The dense :math:`D \times D` matrix :math:`FF^\top + \Psi` (small D only).

    Parameters
    ----------
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D)

    Returns
    -------
    Tensor of shape (..., D, D)
    """
    _check_pair(cov_factor, cov_diag, "dense_covariance")
    return cov_factor @ cov_factor.transpose(-1, -2) + torch.diag_embed(cov_diag)


def orthogonal_init(
    dim: int,
    rank: int,
    *,
    scale: float = 1.0,
    generator: Optional[torch.Generator] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    r"""A :math:`D \times K` matrix with orthogonal columns of norm ``scale``.

    The Q factor of the reduced QR decomposition of a standard-normal matrix
    (Brownlie 2021, §4.4), with the signs fixed so that the result is Haar
    distributed.

    Parameters
    ----------
    dim, rank : int
        :math:`D` and :math:`K`, with :math:`1 \le K \le D`.
    scale : float, default 1.0
    generator : torch.Generator, optional
    dtype, device : optional

    Returns
    -------
    Tensor of shape (dim, rank)
    """
    if rank < 1 or rank > dim:
        raise ValueError(f"orthogonal_init: rank must be in [1, dim={dim}], got {rank!r}.")
    # draw on the CPU generator when one is given, then move
    gen_device = generator.device if generator is not None else device
    A = torch.randn(dim, rank, generator=generator, dtype=dtype or torch.get_default_dtype(), device=gen_device)
    Q, R = torch.linalg.qr(A, mode="reduced")
    del A
    Q.mul_(torch.sign(torch.sign(R.diagonal()) + 0.5).mul_(scale))
    # row-major (QR returns column-major Q): the online fits pass over F in blocks of rows
    F = torch.empty(dim, rank, dtype=Q.dtype, device=Q.device).copy_(Q)
    del Q
    return F.to(device=device) if device is not None else F


def fa_distribution(loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, validate_args=None) -> LowRankMultivariateNormal:
    r"""The Gaussian :math:`N(c, FF^\top + \Psi)` as a torch distribution.

    Parameters
    ----------
    loc : Tensor of shape (..., D)
    cov_factor : Tensor of shape (..., D, K)
    cov_diag : Tensor of shape (..., D)

    Returns
    -------
    torch.distributions.LowRankMultivariateNormal
        A :class:`~pyro_fa.distributions.StableLowRankMultivariateNormal` (its capacitance in float64).
    """
    return StableLowRankMultivariateNormal(loc, cov_factor, cov_diag, validate_args=validate_args)

