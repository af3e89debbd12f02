r"""Batch EM for factor analysis from the sufficient statistics of the data.

The model (Linderman 2021; Barber 2012, §21.1) is

.. math::

    x = F h + c + \varepsilon, \qquad h \sim N(0, I_K), \quad
    \varepsilon \sim N(0, \Psi), \qquad\text{so}\qquad
    x \sim N(c, FF^\top + \Psi).

Its maximum-likelihood fit depends on the data only through the sample size
:math:`N`, the mean :math:`\bar x` (the estimate of :math:`c`) and the biased
sample covariance :math:`S = \frac1N\sum_n (x_n-\bar x)(x_n-\bar x)^\top`.
:class:`ScatterStatistics` accumulates these in one pass over the data, in
chunks, merging them exactly (Chan, Golub & LeVeque 1979), so a stream of
batches gives the same :math:`S` as the whole data set. :func:`em_from_covariance`
then runs EM on :math:`S` alone, so an iteration costs :math:`O(D^2K)`
whatever :math:`N`, and :class:`BatchFactorAnalysis` packages both behind the
interface of :class:`~pyro_fa.fa.online.OnlineFactorAnalysis`.

This is the only module of :mod:`pyro_fa.fa` that forms a :math:`D\times D`
matrix (:math:`S`); it is meant for :math:`D` up to a few thousand.

References
----------
D. Barber, *Bayesian Reasoning and Machine Learning*, CUP 2012, §21.2.
Z. Ghahramani and G. E. Hinton, *The EM algorithm for mixtures of factor
analyzers*, Technical Report CRG-TR-96-1, University of Toronto, 1996.
M. E. Tipping and C. M. Bishop, *Probabilistic principal component analysis*,
JRSS B 61(3), 1999.
S. Linderman, *Factor Analysis, Variational Autoencoders, and Variational
EM*, STATS271/371 Applied Bayesian Statistics lecture notes, Stanford
University, 2021.
T. F. Chan, G. H. Golub and R. J. LeVeque, *Updating formulae and a pairwise
algorithm for computing sample variances*, Stanford CS-79-773, 1979.
"""
from __future__ import annotations

import math
import warnings
from typing import List, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.fa import linalg
from pyro_fa.fa.scatter import ScatterStatistics

__all__ = [
    "ConvergenceWarning",
    "EMResult",
    "ScatterStatistics",
    "BatchFactorAnalysis",
    "em_from_covariance",
    "initial_factors",
    "gaussian_loglike",
]

_SVD_METHODS = ("randomized", "lapack")
_BATCH_METHODS = ("svd", "em")


class ConvergenceWarning(UserWarning):
    """Batch EM stopped at ``max_iter`` before the log-likelihood converged."""


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
    if svd_method == "lapack" or k + 10 >= D:
        evals, evecs = torch.linalg.eigh(A)
        return evals.flip(-1)[:k], evecs.flip(-1)[:, :k]
    # randomized subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4)
    p = min(10, D - k)
    gen_device = generator.device if generator is not None else A.device
    Q = torch.randn(D, k + p, generator=generator, dtype=A.dtype, device=gen_device).to(A.device)
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
    if method not in _BATCH_METHODS:
        raise ValueError(f"em_from_covariance: method must be one of {_BATCH_METHODS}, got {method!r}.")
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
    diag_S = S.diagonal()
    loglike: List[Tensor] = []
    old = -math.inf
    converged = False
    n_iter = 0
    Q = None
    p = min(10, D - K)
    exact = svd_method == "lapack" or p < 10
    if method == "svd" and not exact:
        gen_device = generator.device if generator is not None else S.device
        R = torch.randn(D, p, generator=generator, dtype=S.dtype, device=gen_device).to(S.device)
        Q = torch.linalg.qr(torch.cat([F / psi.sqrt().unsqueeze(-1), R], -1)).Q
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
        if method == "svd":
            F, psi, Q = _svd_step(S, psi, K, Q, iterated_power, floor)
            continue
        sigma_h = torch.cholesky_solve(eye, L)  # (K, K)
        SGt = SW @ sigma_h  # S G^T, (D, K)
        Ehh = sigma_h + sigma_h @ (W.T @ SW) @ sigma_h  # Sigma_h + G S G^T
        Ehh = 0.5 * (Ehh + Ehh.T)
        F = torch.cholesky_solve(SGt.T, torch.linalg.cholesky(Ehh)).T
        psi = (diag_S - (F * SGt).sum(-1)).clamp_min(floor)
    lls = torch.stack(loglike) if loglike else S.new_zeros(0)
    return EMResult(F, psi, lls, n_iter, converged)


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


class BatchFactorAnalysis(nn.Module):
    r"""Factor analysis :math:`N(c, FF^\top + \Psi)` fitted by batch EM.

    Data are summarised by :class:`ScatterStatistics` (exactly, however they
    are split into batches) and :func:`em_from_covariance` fits
    :math:`(F, \psi)` to the sample covariance (by EM, or by the EM variant
    with an exact F-step, Barber Alg. 21.1), starting from
    :func:`initial_factors`; :math:`c` is the sample mean. The interface
    (``loc``, ``cov_factor``, ``cov_diag``, ``distribution()``,
    ``log_prob``, ``sample``) is that of
    :class:`~pyro_fa.fa.online.OnlineFactorAnalysis`.

    Parameters
    ----------
    dim : int
        :math:`D \ge 1`.
    rank : int
        :math:`K`, with :math:`0 \le K \le D` (:math:`K = 0` fits a
        diagonal Gaussian).
    method : {"svd", "em"}, default "svd"
        The iteration of :func:`em_from_covariance`: the exact F-step
        (scikit-learn's iteration, on :math:`S`) or EM (Ghahramani & Hinton
        1996). Both increase the likelihood monotonically; ``"svd"`` needs
        far fewer iterations when some noise variances are small.
    tol : float, default 1e-2
        Tolerance on the increase of the total log-likelihood.
    max_iter : int, default 1000
        Maximum number of iterations per :meth:`fit`.
    svd_method : {"randomized", "lapack"}, default "randomized"
        Eigensolver of the initialisation (:func:`initial_factors`) and of
        the ``"svd"`` steps.
    iterated_power : int, default 3
        Subspace iterations of the randomized eigensolver (per step for
        ``"svd"``).
    noise_variance_init : Tensor of shape (D,), optional
        Initial :math:`\psi` (positive); default: PPCA's isotropic noise.
    seed : int, optional
        Seeds the randomized initialisation (default 0, so fits are
        reproducible).
    chunk_size : int, optional
        Rows per chunk when accumulating statistics.
    noise_floor : float, optional
        Smallest noise variance :math:`\psi_d` (Heywood cases, constant
        columns). Default :math:`\sqrt{\epsilon}\max_d S_{dd}`, which keeps
        EM well conditioned in any dtype; scikit-learn's ``FactorAnalysis``
        uses ``1e-12`` (float64), which :class:`pyro_fa.sklearn.FactorAnalysis`
        passes to match its likelihoods on data with constant columns.
    dtype, device : optional

    Attributes
    ----------
    loc : Tensor of shape (D,)
    cov_factor : Tensor of shape (D, K)
    cov_diag : Tensor of shape (D,)
    stats : ScatterStatistics
    loglike : Tensor of shape (n_iter,)
        Total log-likelihood per iteration of the last :meth:`fit` (not in
        the ``state_dict``).
    n_fitted : Tensor of shape (), int64
        Number of vectors the current fit was computed from (0 before
        :meth:`fit`).
    n_iter : int
    converged : bool
    n_updates : int
        Number of vectors in the statistics.

    Notes
    -----
    :meth:`update` costs :math:`O(BD^2)` for :math:`B` rows; :meth:`fit`
    :math:`O(D^2K)` per EM iteration, independent of :math:`N`.

    References
    ----------
    Barber 2012, §21.2; Ghahramani & Hinton 1996; Linderman 2021 (lecture
    notes on factor analysis and EM, Stanford).

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> F = torch.randn(20, 2, generator=g, dtype=torch.float64)
    >>> x = torch.randn(2000, 2, generator=g, dtype=torch.float64) @ F.T
    >>> x = x + 0.3 * torch.randn(2000, 20, generator=g, dtype=torch.float64)
    >>> fa = BatchFactorAnalysis(20, 2, dtype=torch.float64).fit(x)
    >>> fa.converged, fa.cov_factor.shape
    (True, torch.Size([20, 2]))
    """

    def __init__(
        self,
        dim: int,
        rank: int,
        method: str = "svd",
        *,
        tol: float = 1e-2,
        max_iter: int = 1000,
        svd_method: str = "randomized",
        iterated_power: int = 3,
        noise_variance_init: Optional[Tensor] = None,
        seed: Optional[int] = None,
        chunk_size: Optional[int] = None,
        noise_floor: Optional[float] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
    ):
        super().__init__()
        name = type(self).__name__
        if noise_floor is not None and (
            isinstance(noise_floor, bool) or not isinstance(noise_floor, (int, float))
            or not (0 < noise_floor < math.inf)
        ):
            raise ValueError(f"{name}: noise_floor must be a finite positive number or None, got {noise_floor!r}.")
        self.noise_floor = None if noise_floor is None else float(noise_floor)
        for arg, value in (("dim", dim), ("rank", rank), ("max_iter", max_iter), ("iterated_power", iterated_power)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: {arg} must be an int, got {value!r}.")
        if dim < 1:
            raise ValueError(f"{name}: dim must be >= 1, got {dim!r}.")
        if not 0 <= rank <= dim:
            raise ValueError(f"{name}: rank must be in [0, dim={dim}], got {rank!r}.")
        if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0:
            raise ValueError(f"{name}: tol must be a non-negative number, got {tol!r}.")
        if max_iter < 1:
            raise ValueError(f"{name}: max_iter must be >= 1, got {max_iter!r}.")
        if iterated_power < 0:
            raise ValueError(f"{name}: iterated_power must be >= 0, got {iterated_power!r}.")
        if svd_method not in _SVD_METHODS:
            raise ValueError(f"{name}: svd_method must be one of {_SVD_METHODS}, got {svd_method!r}.")
        if method not in _BATCH_METHODS:
            raise ValueError(f"{name}: method must be one of {_BATCH_METHODS}, got {method!r}.")
        self.method = method
        self.dim, self.rank = dim, rank
        self.tol, self.max_iter = float(tol), max_iter
        self.svd_method, self.iterated_power = svd_method, iterated_power
        self.seed = 0 if seed is None else int(seed)
        self.stats = ScatterStatistics(dim, chunk_size=chunk_size, dtype=dtype, device=device)
        dtype, device = self.stats.mean.dtype, self.stats.mean.device
        if noise_variance_init is not None:
            psi0 = torch.as_tensor(noise_variance_init, dtype=dtype, device=device)
            if psi0.shape != (dim,):
                raise ValueError(
                    f"{name}: noise_variance_init must have shape ({dim},), got {tuple(psi0.shape)!r}."
                )
            if not bool(torch.isfinite(psi0).all() and (psi0 > 0).all()):
                raise ValueError(f"{name}: noise_variance_init must be finite and positive, got {psi0!r}.")
            self.register_buffer("noise_variance_init", psi0)
        else:
            self.noise_variance_init = None
        self.register_buffer("loc", torch.zeros(dim, dtype=dtype, device=device))
        self.register_buffer("cov_factor", torch.zeros(dim, rank, dtype=dtype, device=device))
        self.register_buffer("cov_diag", torch.ones(dim, dtype=dtype, device=device))
        self.register_buffer("loglike", torch.zeros(0, dtype=dtype, device=device), persistent=False)
        self.register_buffer("n_fitted", torch.zeros((), dtype=torch.int64, device=device))
        self.n_iter = 0
        self.converged = False

    @property
    def n_updates(self) -> int:
        """Number of vectors accumulated in the statistics."""
        return int(self.stats.n_samples)

    def update(self, x: Tensor) -> "BatchFactorAnalysis":
        """Add vectors to the sufficient statistics (no EM; call :meth:`fit`).

        Parameters
        ----------
        x : Tensor of shape (D,) or (B, D)

        Returns
        -------
        self

        Raises
        ------
        ValueError
            Wrong shape or device, or non-finite entries (state unchanged).
        """
        self.stats.update(x)
        return self

    def fit(self, x: Optional[Tensor] = None, *, warn: bool = True) -> "BatchFactorAnalysis":
        """Run EM on the statistics; with ``x``, on ``x`` alone (statistics reset).

        Parameters
        ----------
        x : Tensor of shape (N, D), optional
            Data replacing the statistics accumulated so far; without it, EM
            runs on everything passed to :meth:`update`.
        warn : bool, default True
            Warn with :class:`ConvergenceWarning` when ``max_iter`` is reached.

        Returns
        -------
        self

        Raises
        ------
        RuntimeError
            Without ``x`` and before any :meth:`update`.
        """
        if x is not None:
            x = self.stats._validate(x)  # refuse bad data before resetting
            self.stats.reset().update(x)
        S = self.stats.covariance()
        generator = torch.Generator(device=S.device).manual_seed(self.seed)
        result = em_from_covariance(
            S,
            self.rank,
            self.n_updates,
            cov_diag=self.noise_variance_init,
            tol=self.tol,
            max_iter=self.max_iter,
            svd_method=self.svd_method,
            method=self.method,
            iterated_power=self.iterated_power,
            generator=generator,
            noise_floor=self.noise_floor,
        )
        self.loc.copy_(self.stats.mean)
        self.cov_factor.copy_(result.cov_factor)
        self.cov_diag.copy_(result.cov_diag)
        self.loglike = result.loglike
        self.n_fitted.fill_(self.n_updates)
        self.n_iter, self.converged = result.n_iter, result.converged
        if warn and not result.converged:
            warnings.warn(
                f"{type(self).__name__}: EM did not converge in max_iter={self.max_iter} iterations "
                f"(tol={self.tol}); increase max_iter or tol.",
                ConvergenceWarning,
                stacklevel=2,
            )
        return self

    def _check_fitted(self) -> None:
        if int(self.n_fitted) == 0:
            raise RuntimeError(f"{type(self).__name__}: not fitted yet; call fit() first.")

    def distribution(self) -> LowRankMultivariateNormal:
        """The fitted Gaussian :math:`N(c, FF^\\top + \\Psi)`.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fitted()
        return linalg.fa_distribution(self.loc, self.cov_factor, self.cov_diag)

    def log_prob(self, x: Tensor) -> Tensor:
        """Log-density of ``x`` (shape (..., D)) under the fit; shape (...)."""
        return self.distribution().log_prob(x)

    def sample(self, n: int = 1) -> Tensor:
        """``n`` samples from the fit, a Tensor of shape (n, D)."""
        return self.distribution().sample((n,))

    def latent_posterior(self, x: Tensor) -> tuple:
        """Posterior mean (shape (..., K)) and covariance (K, K) of the factors of ``x``.

        See :func:`pyro_fa.fa.linalg.latent_posterior` (Barber eq. 21.2.33).
        """
        self._check_fitted()
        return linalg.latent_posterior(self.cov_factor, self.cov_diag, x - self.loc)
