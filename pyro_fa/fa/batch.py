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
from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal

from pyro_fa.fa import linalg
from pyro_fa.fa._batch_solvers import BATCH_STEPS, EMResult, em_from_covariance, gaussian_loglike, initial_factors
from pyro_fa.fa.scatter import ScatterStatistics
from pyro_fa.distributions import draw

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
_BATCH_METHODS = tuple(BATCH_STEPS)  # ("svd", "em"), see pyro_fa.fa._batch_solvers


class ConvergenceWarning(UserWarning):
    """Batch EM stopped at ``max_iter`` before the log-likelihood converged."""


class BatchFactorAnalysis(nn.Module):
    r"""Factor analysis :math:`N(c, FF^\top + \Psi)` fitted by batch EM.

    Data are summarised by :class:`ScatterStatistics` (exactly, however they
    are split into batches) and :func:`em_from_covariance` fits
    :math:`(F, \psi)` to the sample covariance (by EM, or by the EM variant
    with an exact F-step, Barber Alg. 21.1), starting from
    :func:`initial_factors`; :math:`c` is the sample mean. The interface
    (``loc``, ``cov_factor``, ``cov_diag``, ``get_posterior()``,
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

    def get_posterior(self) -> LowRankMultivariateNormal:
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
        return self.get_posterior().log_prob(x)

    def sample(self, num_samples: Optional[int] = None, *, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draws from the fit: shape (num_samples, D), or (D,) when ``num_samples`` is None."""
        return draw(type(self).__name__, self.get_posterior(), num_samples, generator)

    def latent_posterior(self, x: Tensor) -> tuple:
        """Posterior mean (shape (..., K)) and covariance (K, K) of the factors of ``x``.

        See :func:`pyro_fa.fa.linalg.latent_posterior` (Barber eq. 21.2.33).
        """
        self._check_fitted()
        return linalg.latent_posterior(self.cov_factor, self.cov_diag, x - self.loc)
