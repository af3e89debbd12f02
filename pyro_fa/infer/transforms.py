r"""``LowRankAffine``: the affine map that turns N(0, I) into N(c, FFᵀ + Ψ), in O(DK) per point."""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import constraints
from torch.distributions.transforms import Transform

__all__ = ["LowRankAffine"]


class LowRankAffine(Transform):
    r"""Affine bijection :math:`y = c + Lz` with :math:`LL^\top = FF^\top + \Psi`, applied in :math:`O(DK)`.

    With :math:`s = \psi^{1/2}` and :math:`W = \mathrm{diag}(s)^{-1}F`, the
    covariance is :math:`\mathrm{diag}(s)(I + WW^\top)\mathrm{diag}(s)`. Take a
    thin QR factorisation :math:`W = QR` (:math:`Q` of shape (D, K) with
    orthonormal columns) and the lower Cholesky factor :math:`T` of the
    :math:`K \times K` matrix :math:`I + RR^\top`; then

    .. math::

        L = \mathrm{diag}(s)\,\bigl(I + Q(T - I)Q^\top\bigr),\qquad
        LL^\top = \mathrm{diag}(s)\bigl((I - QQ^\top) + QTT^\top Q^\top\bigr)\mathrm{diag}(s)
                = FF^\top + \Psi,

    because :math:`I + Q(T-I)Q^\top` acts as :math:`T` on the span of
    :math:`Q` and as the identity on its orthogonal complement. Hence

    .. math::

        L^{-1} = \bigl(I + Q(T^{-1} - I)Q^\top\bigr)\mathrm{diag}(s)^{-1},\qquad
        \log|\det L| = \textstyle\sum_i \log s_i + \sum_k \log T_{kk}
                     = \tfrac12 \log|FF^\top + \Psi|.

    The base space has the dimension :math:`D` of the target, so a standard
    normal pushed through the transform is exactly
    ``LowRankMultivariateNormal(loc, cov_factor, cov_diag)``; this is what
    :class:`pyro.infer.reparam.NeuTraReparam` needs from a guide's
    ``get_transform`` (the counterpart of Pyro's
    :class:`~pyro.distributions.transforms.LowerCholeskyAffine`).

    Parameters
    ----------
    loc : Tensor of shape (D,)
        :math:`c`.
    cov_factor : Tensor of shape (D, K)
        :math:`F`.
    cov_diag : Tensor of shape (D,), positive
        :math:`\psi`.
    cache_size : int, default 0
        As for every :class:`torch.distributions.transforms.Transform`.

    Raises
    ------
    ValueError
        If the shapes do not agree.

    Notes
    -----
    Building the transform costs :math:`O(DK^2)` (the QR factorisation and a
    :math:`K \times K` Cholesky factor); each forward or inverse map costs
    :math:`O(DK)` per point (two products with :math:`Q` and a triangular
    :math:`K \times K` product or solve). Points may carry any batch shape
    ``(..., D)``; the parameters are unbatched.

    References
    ----------
    M. Hoffman et al. (2019), *NeuTra-lizing bad geometry in Hamiltonian Monte
    Carlo using neural transport*.
    D. Barber, *Bayesian Reasoning and Machine Learning*, CUP 2012, ch. 21
    (the factor-analysis covariance).

    Examples
    --------
    >>> F, psi = torch.tensor([[1.0], [2.0]]), torch.tensor([0.5, 0.25])
    >>> t = LowRankAffine(torch.zeros(2), F, psi)
    >>> z = torch.tensor([0.3, -1.2])
    >>> torch.allclose(t.inv(t(z)), z)
    True
    """

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, cache_size: int = 0):
        super().__init__(cache_size=cache_size)
        if loc.dim() != 1 or cov_diag.shape != loc.shape or cov_factor.dim() != 2 or cov_factor.shape[0] != loc.shape[0]:
            raise ValueError(
                "LowRankAffine: loc, cov_factor, cov_diag must have shapes (D,), (D, K), (D,), got "
                f"{tuple(loc.shape)!r}, {tuple(cov_factor.shape)!r}, {tuple(cov_diag.shape)!r}."
            )
        self.loc = loc
        self.cov_factor = cov_factor
        self.cov_diag = cov_diag
        self._scale = cov_diag.sqrt()
        Q, R = torch.linalg.qr(cov_factor / self._scale.unsqueeze(-1))  # W = Q R, Q of shape (D, min(D, K))
        eye = torch.eye(R.shape[0], dtype=R.dtype, device=R.device)
        self._Q = Q
        self._T = torch.linalg.cholesky(eye + R @ R.mT)
        self._T_minus_eye = self._T - eye
        self._half_logdet = self._scale.log().sum() + self._T.diagonal().log().sum()

    def with_cache(self, cache_size: int = 1) -> "LowRankAffine":
        if self._cache_size == cache_size:
            return self
        return LowRankAffine(self.loc, self.cov_factor, self.cov_diag, cache_size=cache_size)

    def __eq__(self, other) -> bool:
        return (isinstance(other, LowRankAffine) and self.loc is other.loc and self.cov_factor is other.cov_factor
                and self.cov_diag is other.cov_diag)

    def _call(self, z: Tensor) -> Tensor:
        a = z @ self._Q  # (..., K): Q^T z
        return self.loc + self._scale * (z + (a @ self._T_minus_eye.mT) @ self._Q.mT)

    def _inverse(self, y: Tensor) -> Tensor:
        u = (y - self.loc) / self._scale
        a = u @ self._Q
        T = self._T.expand(a.shape[:-1] + self._T.shape)
        b = torch.linalg.solve_triangular(T, a.unsqueeze(-1), upper=False).squeeze(-1)  # T^{-1} Q^T u
        return u + (b - a) @ self._Q.mT

    def log_abs_det_jacobian(self, x: Tensor, y: Tensor) -> Tensor:
        r""":math:`\log|\det L|`, the same for every point: a tensor of shape ``x.shape[:-1]``."""
        return self._half_logdet.expand(x.shape[:-1])

    def forward_shape(self, shape):
        return shape

    def inverse_shape(self, shape):
        return shape
