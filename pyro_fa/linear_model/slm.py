r"""``StandardLinearModel``: Bayesian linear regression on a basis, with evidence-maximised hyperparameters."""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.distributions import MultivariateNormal

from pyro_fa.fa.linalg import MAX_DENSE_DIM, check_dense_dim
from pyro_fa._validation import positive_float
from pyro_fa.linear_model._slm_ops import OPTIMIZERS, log_evidence, minimise, posterior
from pyro_fa.linear_model._validation import (
    as_inputs,
    as_targets,
    check_basis,
    integer,
    module_dtype_device,
)

__all__ = ["StandardLinearModel", "DegenerateEvidenceWarning"]


class DegenerateEvidenceWarning(UserWarning):
    r"""The log evidence was maximised on too few targets to determine the hyperparameters.

    Maximum-likelihood type-II estimates of :math:`h` hyperparameters from
    :math:`N \le h` informative targets have no unique maximum (or one at the
    boundary): the noise variance sinks to its floor or the prior precision grows
    without bound, and predictive standard deviations mean nothing.
    """


class StandardLinearModel(nn.Module):
    r"""Bayesian linear regression on the features of a basis, with the exact Gaussian posterior.

    .. math::

        y_n = \phi(x_n)^\top w + \varepsilon_n, \qquad
        w \sim N(0, \lambda^{-1} I_D), \qquad \varepsilon_n \sim N(0, \sigma^2).

    Given the hyperparameters, the posterior over the weights is
    :math:`N(m, S)` with

    .. math::

        A = \lambda I + \sigma^{-2}\Phi^\top\Phi, \qquad
        m = A^{-1} b, \quad b = \sigma^{-2}\Phi^\top y, \qquad S = A^{-1}

    (Brownlie 2021, eqs. 2.11 and 2.13, with :math:`\alpha = \lambda`, :math:`\beta = \sigma^{-2}` and the
    features :math:`\phi(x_n)` for :math:`x_n`; Steinberg et al. 2016, §1.2). :meth:`fit` first maximises
    the log evidence

    .. math::

        \log p(y \mid \lambda, \sigma^2, \theta)
        = \log N\big(y;\, 0,\; \sigma^2 I_N + \lambda^{-1}\Phi\Phi^\top\big)

    over :math:`\log\lambda`, :math:`\log\sigma^2` and the basis's learnable length scales :math:`\theta`
    (Steinberg et al. 2016, §1.2 eq. 14 and §1.1 eq. 9; Bishop 2006, §3.5).

    Parameters
    ----------
    basis : Basis
        A module mapping ``(N, in_features)`` to ``(N, out_features)``, e.g.
        ``RandomFourierBasis(d, 400) + LinearBasis(d)``; its parameters are fitted with the model's (freeze
        them with ``requires_grad_(False)``).
    prior_precision : float, default 1.0
        Initial :math:`\lambda > 0` (scikit-learn's ``BayesianRidge.lambda_``).
    noise_variance : float, default 1.0
        Initial :math:`\sigma^2 > 0` (``1 / BayesianRidge.alpha_``).
    min_noise_variance : float, default 1e-8
        Floor on :math:`\sigma^2` (units of :math:`y^2`; the evidence of noiseless data grows without bound as
        :math:`\sigma^2 \to 0`).
    max_dim : int or None, default 20000
        The largest number of features :math:`D` accepted (the posterior is a dense :math:`D\times D`
        matrix); ``None`` lifts the limit.

    Attributes
    ----------
    basis : Basis
    log_prior_precision, log_noise_variance : Parameter of shape ()
    prior_precision, noise_variance : Tensor of shape ()
        :math:`\lambda` and :math:`\sigma^2`.
    posterior_mean : Tensor of shape (D,) or None
        :math:`m`, set by :meth:`fit` (a buffer).
    posterior_precision_cholesky : Tensor of shape (D, D) or None
        Lower Cholesky factor :math:`L` of :math:`A = LL^\top`, set by
        :meth:`fit` (a buffer).
    n_iter_ : int
        Optimiser iterations of the last :meth:`fit`.
    log_evidence_ : float
        Log evidence of the training data at the fitted hyperparameters.

    Raises
    ------
    TypeError, ValueError
        If ``basis`` is not a basis module (or lives on the ``meta`` device), a hyperparameter is not a
        positive finite number, or ``basis.out_features > max_dim`` (refused before allocating, naming
        :class:`~pyro_fa.linear_model.GeneralizedLinearModel`, the :math:`O(DK)` alternative).

    Notes
    -----
    The parameters take the basis's dtype and device; ``.to()`` moves everything. :meth:`log_evidence` costs
    :math:`O(ND\min(N, D) + \min(N, D)^3)` (a Cholesky factor of :math:`A` when :math:`D \le N`, of the
    covariance of :math:`y` otherwise); the posterior is :math:`D\times D`, :math:`O(D^3)` whatever :math:`N`.

    References
    ----------
    Brownlie (2021), *Extending the Bayesian Deep Learning Method
    MultiSWAG*, MSc thesis, University of Edinburgh, §2.2, eqs. 2.10–2.14;
    Steinberg et al. (2016), *revrand: technical report*, CSIRO Data61, §1.2
    (eqs. 12–17); Bishop (2006), *Pattern recognition and machine learning*,
    §3.3 and §3.5; MacKay (1992), *Bayesian interpolation*.

    Examples
    --------
    >>> from pyro_fa.basis import LinearBasis
    >>> _ = torch.manual_seed(0)
    >>> X = torch.randn(50, 2); y = X @ torch.tensor([1.0, -2.0]) + 0.1 * torch.randn(50)
    >>> slm = StandardLinearModel(LinearBasis(2, bias=False)).fit(X, y)
    >>> slm.posterior_mean.round(decimals=1)
    tensor([ 1., -2.])
    >>> mean, std = slm.predict(X[:3], return_std=True)
    """

    def __init__(
        self,
        basis: nn.Module,
        prior_precision: float = 1.0,
        noise_variance: float = 1.0,
        *,
        min_noise_variance: float = 1e-8,
        max_dim: Optional[int] = MAX_DENSE_DIM,
    ):
        super().__init__()
        name = type(self).__name__
        self.basis = check_basis(name, basis)
        alpha = positive_float(name, "prior_precision", prior_precision)
        sigma2 = positive_float(name, "noise_variance", noise_variance)
        self.min_noise_variance = positive_float(name, "min_noise_variance", min_noise_variance)
        self.max_dim = None if max_dim is None else integer(name, "max_dim", max_dim, 1)
        dtype, device = module_dtype_device(basis, name)
        check_dense_dim(
            name, "the posterior precision", int(basis.out_features), dtype,
            "Use GeneralizedLinearModel (a rank-K factor-analysis posterior in O(DK) memory) or a basis with fewer "
            "features, or pass max_dim=None to build it anyway.",
            max_dim=self.max_dim, argument="basis.out_features",
        )
        self.log_prior_precision = nn.Parameter(torch.tensor(math.log(alpha), dtype=dtype, device=device))
        self.log_noise_variance = nn.Parameter(torch.tensor(math.log(sigma2), dtype=dtype, device=device))
        self.register_buffer("posterior_mean", None)
        self.register_buffer("posterior_precision_cholesky", None)
        self.n_iter_ = 0
        self.log_evidence_: Optional[float] = None

    # ---------------------------------------------------------------- helpers
    @property
    def prior_precision(self) -> Tensor:
        r""":math:`\lambda`, a tensor of shape () (detached)."""
        return self.log_prior_precision.detach().exp()

    @property
    def noise_variance(self) -> Tensor:
        r""":math:`\sigma^2`, a tensor of shape () (detached; at least ``min_noise_variance``)."""
        return self._log_noise_variance().detach().exp()

    def _log_noise_variance(self) -> Tensor:
        # clamped: the evidence of (nearly) noiseless data grows without bound as sigma^2 -> 0
        return self.log_noise_variance.clamp_min(math.log(self.min_noise_variance))

    def _n_hyperparameters(self) -> int:
        """The number of scalars :meth:`fit` optimises: log lambda, log sigma^2 and the basis's learnable ones."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _inputs(self, X, arg: str = "X") -> Tensor:
        p = self.log_noise_variance
        return as_inputs(type(self).__name__, X, self.basis.in_features, p.dtype, p.device, arg)

    def features(self, X) -> Tensor:
        r""":math:`\Phi`, a tensor of shape (N, D), for ``X`` of shape (N, in_features) (tensor or array)."""
        return self.basis(self._inputs(X))

    # ---------------------------------------------------------------- evidence
    def _log_evidence(self, Phi: Tensor, y: Tensor) -> Tensor:
        return log_evidence(type(self).__name__, Phi, y, self.log_prior_precision, -self._log_noise_variance())

    def log_evidence(self, X, y) -> Tensor:
        r"""Log marginal likelihood :math:`\log N(y; 0, \sigma^2 I + \lambda^{-1}\Phi\Phi^\top)`.

        Differentiable in the hyperparameters (Steinberg et al. 2016, eq. 14;
        Bishop 2006, eq. 3.86).

        Parameters
        ----------
        X : Tensor or array of shape (N, in_features)
        y : Tensor or array of shape (N,)

        Returns
        -------
        Tensor of shape ()

        Raises
        ------
        TypeError
            If ``X`` or ``y`` is not numeric.
        ValueError
            If shapes do not match or an entry is not finite.
        RuntimeError
            If the Cholesky factorisation fails (e.g. float32 with an extreme
            noise variance).
        """
        X = self._inputs(X)
        y = as_targets(type(self).__name__, y, X.shape[0], X.dtype, X.device)
        return self._log_evidence(self.basis(X), y)

    # ---------------------------------------------------------------- fitting
    def fit(
        self,
        X,
        y,
        n_iter: int = 100,
        lr: Optional[float] = None,
        progress: bool = False,
        *,
        optimizer: str = "lbfgs",
    ) -> "StandardLinearModel":
        r"""Maximise the log evidence, then store the exact posterior over the weights.

        Parameters
        ----------
        X : Tensor or array of shape (N, in_features)
        y : Tensor or array of shape (N,)
        n_iter : int, default 100
            Optimiser iterations (L-BFGS iterations, or Adam steps); 0 keeps
            the hyperparameters and only computes the posterior.
        lr : float, optional
            Learning rate; default 1.0 for L-BFGS (with a strong-Wolfe line
            search) and 0.05 for Adam.
        progress : bool, default False
            Show a progress bar with the log evidence per data point.
        optimizer : {"lbfgs", "adam"}, default "lbfgs"
            L-BFGS (strong-Wolfe line search) for the smooth objective, Adam for very noisy or badly
            scaled problems.

        Returns
        -------
        self

        Raises
        ------
        TypeError, ValueError
            For bad data (as :meth:`log_evidence`) or options, before anything
            changes.
        RuntimeError
            If a Cholesky factorisation fails (as :meth:`log_evidence`); the
            hyperparameters, the posterior, ``n_iter_`` and ``log_evidence_``
            are then restored to what they were before the call.

        Warns
        -----
        DegenerateEvidenceWarning
            If hyperparameters are optimised (``n_iter > 0``) on :math:`N \le h` targets, :math:`h` the number
            of scalars optimised (2 plus the basis's length scales): the fit then drifts to the boundary.

        Notes
        -----
        The objective is the log evidence over :math:`N`, maximised over every parameter with
        ``requires_grad``; the features are computed once when the basis has nothing to learn.
        """
        name = type(self).__name__
        n_iter = integer(name, "n_iter", n_iter, 0)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{name}: optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}.")
        lr = positive_float(name, "lr", OPTIMIZERS[optimizer].default_lr if lr is None else lr)
        if not isinstance(progress, bool):
            raise TypeError(f"{name}: progress must be a bool, got {progress!r}.")
        X = self._inputs(X)
        y = as_targets(name, y, X.shape[0], X.dtype, X.device)
        N = X.shape[0]
        params = [p for p in self.parameters() if p.requires_grad]
        n_hyper = self._n_hyperparameters()
        if n_iter > 0 and N <= n_hyper:
            warnings.warn(
                f"{name}: the log evidence of N = {N} target{'s' if N > 1 else ''} cannot determine the {n_hyper} "
                f"hyperparameters it is maximised over (N must be > {n_hyper}); expect a noise variance at its floor "
                "or an unbounded prior precision, and predictive standard deviations that mean nothing. Fit on more "
                "data, or fix the hyperparameters (n_iter=0, or requires_grad_(False) on the basis).",
                DegenerateEvidenceWarning, stacklevel=2,
            )
        learn_basis = any(p.requires_grad for p in self.basis.parameters())
        fixed_phi = None if learn_basis else self.basis(X).detach()

        def objective() -> Tensor:
            Phi = self.basis(X) if fixed_phi is None else fixed_phi
            return -self._log_evidence(Phi, y) / N

        # one transaction: a fit that fails part-way (e.g. a Cholesky factor that fails in float32) leaves the
        # hyperparameters, the posterior and the recorded numbers as they were
        saved = ([p.detach().clone() for p in params], self.posterior_mean, self.posterior_precision_cholesky,
                 self.n_iter_, self.log_evidence_)
        try:
            self.n_iter_ = minimise(objective, params, n_iter, lr, optimizer, progress, name)
            with torch.no_grad():
                Phi = self.basis(X) if fixed_phi is None else fixed_phi
                self._set_posterior(Phi, y)
                self.log_evidence_ = float(self._log_evidence(Phi, y))
        except BaseException:
            values, self.posterior_mean, self.posterior_precision_cholesky, self.n_iter_, self.log_evidence_ = saved
            with torch.no_grad():
                for p, v in zip(params, values):
                    p.copy_(v)
            raise
        return self

    def _set_posterior(self, Phi: Tensor, y: Tensor) -> None:
        beta = (-self._log_noise_variance()).exp()
        self.posterior_mean, self.posterior_precision_cholesky = posterior(
            type(self).__name__, Phi, y, self.prior_precision, beta)

    def _check_fitted(self) -> None:
        if self.posterior_mean is None:
            raise RuntimeError(f"{type(self).__name__}: call fit(X, y) before using the posterior.")

    # ---------------------------------------------------------------- posterior and prediction
    def posterior(self) -> MultivariateNormal:
        r"""The posterior :math:`N(m, A^{-1})` over the weights (Brownlie 2021, eq. 2.14).

        Returns
        -------
        torch.distributions.MultivariateNormal
            Event shape (D,), parameterised by its precision :math:`A`.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        """
        self._check_fitted()
        L = self.posterior_precision_cholesky
        return MultivariateNormal(self.posterior_mean, precision_matrix=L @ L.T)

    @property
    def posterior_covariance(self) -> Tensor:
        r""":math:`S = A^{-1}`, a tensor of shape (D, D) (built on request, :math:`O(D^3)`)."""
        self._check_fitted()
        return torch.cholesky_inverse(self.posterior_precision_cholesky)

    @torch.no_grad()
    def predict(self, X, return_std: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        r"""Predictive mean and standard deviation of :math:`y` at new inputs.

        .. math::

            \mathbb{E}[y_*] = \phi_*^\top m, \qquad
            \mathbb{V}[y_*] = \sigma^2 + \phi_*^\top A^{-1}\phi_*

        (Steinberg et al. 2016, eqs. 15–17).

        Parameters
        ----------
        X : Tensor or array of shape (M, in_features)
        return_std : bool, default False
            Also return the predictive standard deviation of :math:`y_*`
            (noise included).

        Returns
        -------
        mean : Tensor of shape (M,)
        std : Tensor of shape (M,)
            Only with ``return_std=True``.

        Raises
        ------
        RuntimeError
            Before :meth:`fit`.
        TypeError, ValueError
            For bad ``X``.

        Notes
        -----
        Costs :math:`O(MD^2)`: one triangular solve with :math:`L`.
        """
        self._check_fitted()
        Phi = self.features(X)
        mean = Phi @ self.posterior_mean
        if not return_std:
            return mean
        V = torch.linalg.solve_triangular(self.posterior_precision_cholesky, Phi.T, upper=False)
        return mean, (V.pow(2).sum(0) + self.noise_variance).sqrt()

    def extra_repr(self) -> str:
        return f"prior_precision={float(self.prior_precision):.4g}, noise_variance={float(self.noise_variance):.4g}"

