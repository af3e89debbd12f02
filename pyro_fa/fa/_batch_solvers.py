r"""Batch factor analysis on the sample covariance: the log-likelihood, the start, and the EM / SVD iterations.

:func:`em_from_covariance` fits :math:`(F, \psi)` of :math:`N(c, FF^\top + \Psi)` to a sample
covariance :math:`S` (shape (D, D)) from :func:`initial_factors`; its iteration is chosen once by
name from :data:`BATCH_STEPS` (``"em"``: :class:`EMStep`, ``"svd"``: :class:`SVDStep`). Each
iteration costs :math:`O(D^2K)` whatever the number of samples. :mod:`pyro_fa.fa.batch` packages
this behind :class:`~pyro_fa.fa.batch.BatchFactorAnalysis`.

References
----------
D. Barber, *Bayesian Reasoning and Machine Learning*, CUP 2012, §21.2.
Z. Ghahramani and G. E. Hinton, *The EM algorithm for mixtures of factor
analyzers*, Technical Report CRG-TR-96-1, University of Toronto, 1996.
M. E. Tipping and C. M. Bishop, *Probabilistic principal component analysis*,
JRSS B 61(3), 1999.
N. Halko, P.-G. Martinsson and J. A. Tropp, *Finding structure with randomness*, SIAM Review 53(2), 2011.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from pyro_fa import _random

from pyro_fa.fa import linalg

_FULL_EIGH = {"randomized": False, "lapack": True}  # svd_method: a full eigh (O(D^3)) or subspace iteration

__all__ = ["EMResult", "gaussian_loglike", "initial_factors", "em_from_covariance", "BATCH_STEPS", "EMStep", "SVDStep"]


class EMResult(NamedTuple):
    """What :func:`em_from_covariance` returns.

    Attributes
    ----------
    cov_factor : Tensor of shape (D, K)
        The loadings :math:`F`.
    cov_diag : Tensor of shape (D,)
        The noise variances :math:`\\psi`.
    loglike : Tensor of shape (n_iter,)
        Total log-likelihood of the :math:`N` samples before each M-step
        (the last entry is that of the returned parameters when converged).
    n_iter : int
        Number of EM iterations run.
    converged : bool
        Whether the log-likelihood increase fell below ``tol``.
    """

    cov_factor: Tensor
    cov_diag: Tensor
    loglike: Tensor
    n_iter: int
    converged: bool


def _noise_floor(covariance: Tensor, noise_floor: Optional[float] = None) -> Tensor:
    """Smallest noise variance allowed: ``noise_floor`` if given, else sqrt(eps) times the largest data variance."""
    if noise_floor is not None:
        return covariance.new_tensor(noise_floor)
    scale = covariance.diagonal().max() if covariance.numel() else covariance.new_ones(())
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale * math.sqrt(torch.finfo(covariance.dtype).eps)


def gaussian_loglike(cov_factor: Tensor, cov_diag: Tensor, covariance: Tensor, n_samples: int) -> Tensor:
    r"""Total Gaussian log-likelihood of data with sample covariance ``covariance``.

    For :math:`N` samples with biased sample covariance :math:`S`, evaluated at
    their own mean (the maximum-likelihood :math:`c`):

    .. math::

        \ell = -\frac N2 \Big( D\log 2\pi + \log|FF^\top+\Psi|
        + \mathrm{tr}\big((FF^\top+\Psi)^{-1} S\big) \Big),

    with the log-determinant from the determinant lemma and the trace from
    the Woodbury identity, :math:`\mathrm{tr}(\Psi^{-1}S) -
    \mathrm{tr}(C^{-1} W^\top S W)`, :math:`W = \Psi^{-1}F`,
    :math:`C = I + F^\top\Psi^{-1}F`.

    Parameters
    ----------
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
    covariance : Tensor of shape (D, D)
    n_samples : int

    Returns
    -------
    Tensor of shape ()

    Notes
    -----
    Cost :math:`O(D^2 K)`.
    """
    L = linalg.capacitance_cholesky(cov_factor, cov_diag)
    W = cov_factor / cov_diag.unsqueeze(-1)
    return _loglike(L, W, covariance @ W, cov_diag, covariance, n_samples)


def _loglike(L: Tensor, W: Tensor, SW: Tensor, cov_diag: Tensor, S: Tensor, n_samples: int) -> Tensor:
    D = cov_diag.shape[-1]
    logdet = cov_diag.log().sum() + 2 * L.diagonal().log().sum()
    Z = torch.linalg.solve_triangular(L, W.T @ SW, upper=False)  # L^{-1} W^T S W
    Z = torch.linalg.solve_triangular(L, Z.T, upper=False)  # L^{-1} W^T S W L^{-T}
    trace = (S.diagonal() / cov_diag).sum() - Z.diagonal().sum()
    return -0.5 * n_samples * (D * math.log(2 * math.pi) + logdet + trace)


def _top_eigh(
    A: Tensor, k: int, svd_method: str, iterated_power: int, generator: Optional[torch.Generator]
) -> tuple:
    """The k largest eigenpairs of a symmetric PSD matrix, in decreasing order."""
    D = A.shape[-1]
    if _FULL_EIGH.get(svd_method, False) or k + 10 >= D:
        evals, evecs = torch.linalg.eigh(A)
        return evals.flip(-1)[:k], evecs.flip(-1)[:, :k]
    # randomized subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4)
    p = min(10, D - k)
    Q = _random.randn((D, k + p), generator, A.dtype, A.device)
    Q = torch.linalg.qr(A @ Q).Q
    for _ in range(iterated_power):
        Q = torch.linalg.qr(A @ Q).Q
    evals, V = torch.linalg.eigh(Q.T @ A @ Q)
    return evals.flip(-1)[:k], (Q @ V).flip(-1)[:, :k]


def initial_factors(
    covariance: Tensor,
    rank: int,
    *,
    cov_diag: Optional[Tensor] = None,
    svd_method: str = "randomized",
    iterated_power: int = 3,
    generator: Optional[torch.Generator] = None,
    noise_floor: Optional[float] = None,
) -> tuple:
    r"""Starting point of EM: the optimal loadings for a given noise.

    For fixed :math:`\Psi` the likelihood is maximised by (Barber §21.2, Algorithm 21.1;
    this is one step of scikit-learn's SVD algorithm)

    .. math::

        F = \Psi^{1/2} U_K \,\mathrm{diag}\big(\sqrt{\max(\lambda_k - 1, 0)}\big),

    with :math:`(\lambda_k, U_K)` the :math:`K` leading eigenpairs of
    :math:`\Psi^{-1/2} S \Psi^{-1/2}`. Without ``cov_diag``, :math:`\Psi` is
    the isotropic maximum-likelihood noise of probabilistic PCA,
    :math:`\sigma^2 = (\mathrm{tr}\,S - \sum_{k\le K}\lambda_k(S))/(D-K)`
    (Tipping & Bishop 1999), so the start is the PPCA solution.

    Parameters
    ----------
    covariance : Tensor of shape (D, D)
        The sample covariance :math:`S`.
    rank : int
        :math:`K`, with :math:`0 \le K \le D`.
    cov_diag : Tensor of shape (D,), optional
        A positive initial :math:`\psi`.
    svd_method : {"randomized", "lapack"}, default "randomized"
        Randomized subspace iteration (:math:`O(D^2K)`) or a full symmetric
        eigendecomposition (:math:`O(D^3)`).
    iterated_power : int, default 3
        Power iterations of the randomized method.
    generator : torch.Generator, optional
        Seeds the randomized method.
    noise_floor : float, optional
        Smallest noise variance; default :math:`\sqrt{\epsilon}\max_d S_{dd}`.

    Returns
    -------
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
    """
    D = covariance.shape[-1]
    floor = _noise_floor(covariance, noise_floor)
    if cov_diag is None:
        evals, evecs = _top_eigh(covariance, rank, svd_method, iterated_power, generator)
        if D > rank:
            sigma2 = (covariance.diagonal().sum() - evals.sum()) / (D - rank)
        else:
            sigma2 = covariance.diagonal().mean() * 1e-3
        sigma2 = sigma2.clamp_min(floor)
        F = evecs * (evals - sigma2).clamp_min(0).sqrt()
        return F, sigma2.expand(D).clone()
    psi = cov_diag.to(covariance).clamp_min(floor)
    sqrt_psi = psi.sqrt()
    scaled = covariance / sqrt_psi.unsqueeze(-1) / sqrt_psi
    evals, evecs = _top_eigh(scaled, rank, svd_method, iterated_power, generator)
    F = sqrt_psi.unsqueeze(-1) * evecs * (evals - 1).clamp_min(0).sqrt()
    return F, psi


def em_from_covariance(
    covariance: Tensor,
    rank: int,
    n_samples: int,
    *,
    cov_factor: Optional[Tensor] = None,
    cov_diag: Optional[Tensor] = None,
    tol: float = 1e-2,
    max_iter: int = 1000,
    svd_method: str = "randomized",
    iterated_power: int = 3,
    generator: Optional[torch.Generator] = None,
    method: str = "em",
    noise_floor: Optional[float] = None,
) -> EMResult:
    r"""Maximum-likelihood factor analysis by EM on the sample covariance.

    With :math:`W = \Psi^{-1}F`, :math:`\Sigma_h = (I + F^\top W)^{-1}` (the
    latent posterior covariance) and :math:`G = \Sigma_h W^\top` (so that
    :math:`E[h\mid x] = G(x - \bar x)`), one iteration is (Ghahramani &
    Hinton 1996; Barber §21.2; Linderman 2021, the M-step slides)

    .. math::

        E[hh^\top] &= \Sigma_h + G S G^\top, \qquad E[(x-\bar x) h^\top] = S G^\top, \\
        F &\leftarrow S G^\top \, E[hh^\top]^{-1}, \\
        \psi &\leftarrow \mathrm{diag}(S) - \mathrm{diag}(F\, G S),

    and :math:`SG^\top = (SW)\Sigma_h` reuses the :math:`D \times K` product
    :math:`SW` that the log-likelihood (:func:`gaussian_loglike`) needs too.

    ``method="svd"`` replaces the partial F-step by the exact one
    (:func:`initial_factors`: the leading eigenvectors of
    :math:`\Psi^{-1/2}S\Psi^{-1/2}`), followed by
    :math:`\psi \leftarrow \mathrm{diag}(S - FF^\top)` (Barber Algorithm
    21.1, the iteration of scikit-learn's ``FactorAnalysis``, here on
    :math:`S` instead of the :math:`N\times D` data). The eigenvectors are
    tracked by subspace iteration warm-started from the previous step
    (``iterated_power`` products with the :math:`D\times D` matrix per
    iteration, or a full ``eigh`` with ``svd_method="lapack"``). It needs
    far fewer iterations than EM when some noise variances are small.

    Iteration stops when the total log-likelihood rises by less than ``tol``
    (the criterion of scikit-learn's ``FactorAnalysis``) or after
    ``max_iter`` iterations.

    Parameters
    ----------
    covariance : Tensor of shape (D, D)
        The biased sample covariance :math:`S` (see :class:`ScatterStatistics`).
    rank : int
        :math:`K`, with :math:`0 \le K \le D`.
    n_samples : int
        :math:`N`, which scales the log-likelihood (and so ``tol``).
    cov_factor, cov_diag : Tensors of shapes (D, K) and (D,), optional
        Starting point; by default :func:`initial_factors` (given ``cov_diag``
        when only that is passed).
    tol : float, default 1e-2
        Tolerance on the increase of the total log-likelihood.
    max_iter : int, default 1000
    svd_method, iterated_power, generator
        Passed to :func:`initial_factors` (and used by ``method="svd"``).
    method : {"em", "svd"}, default "em"
        The update: EM (Ghahramani & Hinton) or the exact F-step (Barber
        Alg. 21.1).

    Returns
    -------
    EMResult

    Notes
    -----
    Cost :math:`O(D^2K)` per iteration (one :math:`S\times W` product; about
    ``2 * iterated_power + 3`` of them with ``method="svd"``) plus
    :math:`O(DK^2)`, independent of :math:`N`; one host synchronisation per
    iteration for the convergence test. The noise variances are kept above
    ``noise_floor``, by default :math:`\sqrt{\epsilon}\max_d S_{dd}` (Heywood cases).
    Does not warn; :class:`BatchFactorAnalysis` does.
    """
    if not isinstance(method, str) or method not in BATCH_STEPS:
        raise ValueError(f"em_from_covariance: method must be one of {tuple(BATCH_STEPS)}, got {method!r}.")
    S = covariance
    D = S.shape[-1]
    if cov_factor is None:
        cov_factor, cov_diag = initial_factors(
            S, rank, cov_diag=cov_diag, svd_method=svd_method, iterated_power=iterated_power, generator=generator,
            noise_floor=noise_floor,
        )
    floor = _noise_floor(S, noise_floor)
    F, psi = cov_factor.to(S), cov_diag.to(S).clamp_min(floor)
    K = F.shape[-1]
    eye = torch.eye(K, dtype=S.dtype, device=S.device)
    loglike: List[Tensor] = []
    old = -math.inf
    converged = False
    n_iter = 0
    step = BATCH_STEPS[method](S, F, psi, floor, svd_method=svd_method, iterated_power=iterated_power,
                               generator=generator)
    for n_iter in range(1, max_iter + 1):
        W = F / psi.unsqueeze(-1)  # (D, K)
        L = torch.linalg.cholesky(eye + F.T @ W)
        SW = S @ W  # (D, K), the O(D^2 K) product
        ll = _loglike(L, W, SW, psi, S, n_samples)
        loglike.append(ll)
        ll_value = float(ll)
        if ll_value - old < tol:
            converged = True
            break
        old = ll_value
        F, psi = step(F, psi, L, W, SW)
    lls = torch.stack(loglike) if loglike else S.new_zeros(0)
    return EMResult(F, psi, lls, n_iter, converged)


class EMStep:
    r"""The EM update of :func:`em_from_covariance` (Ghahramani & Hinton 1996; Barber §21.2).

    .. math::

        F \leftarrow S G^\top E[hh^\top]^{-1}, \qquad \psi \leftarrow \mathrm{diag}(S) - \mathrm{diag}(F\, G S),

    from the products :math:`W = \Psi^{-1}F`, the Cholesky factor ``L`` of :math:`I + F^\top W`
    and :math:`SW` that the log-likelihood computed. Cost :math:`O(DK^2)`.
    """

    def __init__(self, S: Tensor, F: Tensor, psi: Tensor, floor: Tensor, **options):
        self.S, self.floor = S, floor
        self.eye = torch.eye(F.shape[-1], dtype=S.dtype, device=S.device)

    def __call__(self, F: Tensor, psi: Tensor, L: Tensor, W: Tensor, SW: Tensor) -> Tuple[Tensor, Tensor]:
        sigma_h = torch.cholesky_solve(self.eye, L)  # (K, K)
        SGt = SW @ sigma_h  # S G^T, (D, K)
        Ehh = sigma_h + sigma_h @ (W.T @ SW) @ sigma_h  # Sigma_h + G S G^T
        Ehh = 0.5 * (Ehh + Ehh.T)
        F = torch.cholesky_solve(SGt.T, torch.linalg.cholesky(Ehh)).T
        psi = (self.S.diagonal() - (F * SGt).sum(-1)).clamp_min(self.floor)
        return F, psi


class SVDStep:
    r"""The exact F-step of :func:`em_from_covariance` (Barber Algorithm 21.1), then :math:`\psi = \mathrm{diag}(S - FF^\top)`.

    :math:`F` is given by the leading eigenvectors of :math:`\Psi^{-1/2}S\Psi^{-1/2}`, tracked by
    subspace iteration warm-started from the previous step (``iterated_power`` products with the
    :math:`D\times D` matrix per step; a full ``eigh`` with ``svd_method="lapack"`` or at small D).
    The warm start is drawn from ``generator`` at construction.
    """

    def __init__(self, S: Tensor, F: Tensor, psi: Tensor, floor: Tensor, *, svd_method: str, iterated_power: int,
                 generator: Optional[torch.Generator]):
        self.S, self.floor, self.power, self.K = S, floor, iterated_power, F.shape[-1]
        D = S.shape[-1]
        self.Q = None
        p = min(10, D - self.K)
        if not (_FULL_EIGH.get(svd_method, False) or p < 10):
            R = _random.randn((D, p), generator, S.dtype, S.device)
            self.Q = torch.linalg.qr(torch.cat([F / psi.sqrt().unsqueeze(-1), R], -1)).Q

    def __call__(self, F: Tensor, psi: Tensor, L: Tensor, W: Tensor, SW: Tensor) -> Tuple[Tensor, Tensor]:
        F, psi, self.Q = _svd_step(self.S, psi, self.K, self.Q, self.power, self.floor)
        return F, psi


BATCH_STEPS: Dict[str, Callable[..., Callable]] = {"svd": SVDStep, "em": EMStep}
"""The iterations of :func:`em_from_covariance` by ``method``: ``cls(S, F, psi, floor, **options)`` is called
once per fit, then ``step(F, psi, L, W, SW) -> (F, psi)`` once per iteration."""


def _svd_step(S: Tensor, psi: Tensor, K: int, Q: Optional[Tensor], power: int, floor: Tensor) -> tuple:
    """One step of Barber's Algorithm 21.1 on S: exact F given psi, then psi = diag(S - FF^T)."""
    sqrt_psi = psi.sqrt()
    A = S / sqrt_psi.unsqueeze(-1) / sqrt_psi
    if Q is None:
        evals, evecs = torch.linalg.eigh(A)
        evals, U = evals.flip(-1)[:K], evecs.flip(-1)[:, :K]
    else:
        for _ in range(max(power, 1)):
            Q = torch.linalg.qr(A @ Q).Q
        evals, V = torch.linalg.eigh(Q.T @ A @ Q)
        Q = Q @ V.flip(-1)  # Ritz vectors, leading first: the next warm start
        evals, U = evals.flip(-1)[:K], Q[:, :K]
    F = sqrt_psi.unsqueeze(-1) * U * (evals - 1).clamp_min(0).sqrt()
    psi = (S.diagonal() - F.pow(2).sum(-1)).clamp_min(floor)
    return F, psi, Q
