r"""scikit-learn estimators for the revrand-style models on random Fourier features.

:class:`SLMRegressor` lives here; the GLM estimators are in :mod:`._sklearn_glm` and the shared base in
:mod:`._sklearn_base`, re-exported so that their old import path keeps working.
"""
from __future__ import annotations

import warnings
from numbers import Integral, Real
from typing import Optional

import numpy as np
import torch
from sklearn.base import RegressorMixin, _fit_context
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_fa.fa.linalg import MAX_DENSE_DIM, check_dense_dim
from pyro_fa.linear_model._sklearn_base import _RandomFeatureEstimator, _transaction
from pyro_fa.linear_model._sklearn_glm import GLMClassifier, GLMRegressor  # noqa: F401  (re-export)
from pyro_fa.linear_model.slm import DegenerateEvidenceWarning, StandardLinearModel

__all__ = ["SLMRegressor", "GLMRegressor", "GLMClassifier"]


class SLMRegressor(RegressorMixin, _RandomFeatureEstimator):
    r"""Bayesian linear regression on random Fourier features, hyperparameters by evidence maximisation.

    The estimator form of :class:`~pyro_fa.linear_model.StandardLinearModel`
    on ``RandomFourierBasis(n_features, n_components) (+ LinearBasis)``
    (Steinberg et al. 2016, §1.2 and §2.1): the log evidence is maximised
    over the prior precision, the noise variance and the length scales, and
    predictions come from the exact posterior over the weights.

    Parameters
    ----------
    n_components : int, default 400
    kernel, linear, lengthscale, ard, orthogonal, learn_lengthscale
        The basis; see :class:`GLMRegressor`.
    prior_precision : float, default 1.0
        Initial weight precision :math:`\lambda`.
    noise_variance : float, default 1.0
        Initial noise variance, in units of the standardised targets when
        ``standardize=True``.
    n_iter : int, default 100
        Optimiser iterations; 0 keeps the initial hyperparameters.
    lr : float, optional
        Learning rate (default 1.0 for L-BFGS, 0.05 for Adam).
    optimizer : {"lbfgs", "adam"}, default "lbfgs"
    random_state : int, RandomState instance or None, default None
        Seeds the random frequencies.
    device : str or torch.device, optional
        Torch device of the computation (default CPU); one that holds data
        (not ``"meta"``) and is available. Outputs are NumPy.
    dtype : {"float64", "float32"} or torch dtype, optional
        Default float64.
    standardize : bool, default True
        Fit on :math:`(x - \bar x)/s_x` and :math:`(y - \bar y)/s_y` (training
        statistics; constant features get scale 1) and map predictions back
        to the units of ``y``. Length scales, ``prior_precision`` and the
        initial ``noise_variance`` then refer to the standardised data.
        With ``False`` the data are used as given.
    max_dim : int or None, default 20000
        The largest number of basis features :math:`D = 2\,n_{\rm components}`
        (:math:`+\,n_{\rm features} + 1` with ``linear``) accepted: the
        posterior over the weights is a dense :math:`D\times D` matrix, so
        ``n_components=10000`` already needs 3.2 GB in float64 and
        ``n_components=20000`` 12.8 GB. ``None`` lifts the limit; past it use
        :class:`GLMRegressor`, whose factor-analysis posterior takes
        :math:`O(DK)` memory.

    Attributes
    ----------
    model_ : StandardLinearModel
        The fitted torch model (on standardised data when ``standardize``).
    prior_precision_ : float
        Fitted :math:`\lambda` (standardised units).
    noise_variance_ : float
        Fitted noise variance in the units of ``y``.
    lengthscale_ : ndarray of shape () or (n_features,)
        Fitted length scale(s) (standardised units).
    log_evidence_ : float
        Log evidence of the (standardised) training targets.
    n_iter_ : int
    x_mean_, x_scale_ : ndarray of shape (n_features,)
    y_mean_, y_scale_ : float
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (`n_features_in_`,)

    Raises
    ------
    ValueError
        In :meth:`fit`: for NaN or inf in ``X`` or ``y``; for a single sample
        when hyperparameters are fitted (``n_iter > 0``); for ``D > max_dim``
        (before anything is allocated); for a ``device`` that holds no data
        or is not available. A refused :meth:`fit` leaves a fitted estimator
        as it was.

    Warns
    -----
    DegenerateEvidenceWarning
        In :meth:`fit`, when the evidence is maximised on too few targets:
        :math:`N - 2 \le h` with ``standardize`` (the mean and scale of ``y``
        use two of its :math:`N` degrees of freedom; :math:`N \le h` without),
        :math:`h` the number of fitted hyperparameters (prior precision,
        noise variance and the learnable length scales: 3, or
        ``n_features + 2`` with ``ard``). Such fits drift to the boundary (a
        noise variance at its floor, or a prior precision of 1e10 and more)
        and their predictive standard deviations mean nothing.

    Notes
    -----
    Cost: :math:`O(ND\min(N, D) + \min(N, D)^3)` per evidence evaluation,
    then :math:`O(ND^2 + D^3)` time and :math:`O(D^2)` memory for the
    posterior, whatever :math:`N` (see
    :class:`~pyro_fa.linear_model.StandardLinearModel`).

    References
    ----------
    Steinberg et al. (2016), *revrand: technical report*, CSIRO Data61,
    §1.2, §1.4 and §2.1; Rahimi & Recht (2007), *Random features for
    large-scale kernel machines*.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).uniform(-3, 3, (100, 1)); y = np.sin(X[:, 0])
    >>> reg = SLMRegressor(n_components=50, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:5], return_std=True)
    >>> bool(np.abs(mean - y[:5]).max() < 0.1)
    True
    """

    _parameter_constraints: dict = {
        **_RandomFeatureEstimator._parameter_constraints,
        "noise_variance": [Interval(Real, 0, None, closed="neither")],
        "n_iter": [Interval(Integral, 0, None, closed="left")],
        "lr": [None, Interval(Real, 0, None, closed="neither")],
        "optimizer": [StrOptions({"lbfgs", "adam"})],
        "max_dim": [None, Interval(Integral, 1, None, closed="left")],
    }

    def __init__(
        self,
        n_components: int = 400,
        kernel: str = "rbf",
        linear: bool = True,
        lengthscale=1.0,
        ard: bool = False,
        orthogonal: bool = False,
        learn_lengthscale: bool = True,
        prior_precision: float = 1.0,
        noise_variance: float = 1.0,
        n_iter: int = 100,
        lr: Optional[float] = None,
        optimizer: str = "lbfgs",
        random_state=None,
        device=None,
        dtype=None,
        standardize: bool = True,
        max_dim: Optional[int] = MAX_DENSE_DIM,
    ):
        self.n_components = n_components
        self.kernel = kernel
        self.linear = linear
        self.lengthscale = lengthscale
        self.ard = ard
        self.orthogonal = orthogonal
        self.learn_lengthscale = learn_lengthscale
        self.prior_precision = prior_precision
        self.noise_variance = noise_variance
        self.n_iter = n_iter
        self.lr = lr
        self.optimizer = optimizer
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.standardize = standardize
        self.max_dim = max_dim

    @_fit_context(prefer_skip_nested_validation=True)
    @_transaction
    def fit(self, X, y):
        """Fit the hyperparameters by evidence maximisation and the posterior over the weights.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,)

        Returns
        -------
        self

        Raises
        ------
        ValueError
            See the class's Raises; the estimator is then left as it was.
        """
        name = type(self).__name__
        device = self._torch_device()
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        n, n_features = X.shape
        check_dense_dim(
            name, "the posterior over the weights", self._n_basis_features(n_features), self._torch_dtype(),
            f"n_components={self.n_components} is too many: use fewer, or GLMRegressor (a rank-K factor-analysis "
            "posterior in O(DK) memory), or pass max_dim=None to build it anyway.",
            max_dim=self.max_dim, argument="D",
        )
        Z = self._fit_x_scaling(X)
        self.y_mean_, self.y_scale_ = (float(y.mean()), float(y.std()) or 1.0) if self.standardize else (0.0, 1.0)
        t = torch.as_tensor((y - self.y_mean_) / self.y_scale_, dtype=Z.dtype, device=device)
        basis_seed, _, _ = self._seeds()
        model = StandardLinearModel(self._make_basis(n_features, basis_seed), self.prior_precision,
                                    self.noise_variance, max_dim=self.max_dim)
        n_hyper = model._n_hyperparameters() if self.n_iter > 0 else 0
        if n_hyper and n < 2:
            raise ValueError(
                f"{name}: fit needs n_samples >= 2 to maximise the evidence over the hyperparameters, got 1 sample "
                "(the evidence of one target has no maximum). Pass n_iter=0 to keep the given hyperparameters."
            )
        informative = n - 2 if self.standardize else n
        if n_hyper and informative <= n_hyper:
            warnings.warn(
                f"{name}: {n} samples are too few to fit {n_hyper} hyperparameters by evidence maximisation (needs "
                f"n_samples > {n_hyper + n - informative}"
                + (", as standardize=True takes the mean and scale of y from the same samples" if self.standardize
                   else "")
                + "); expect a noise variance at its floor or an unbounded prior precision, and predictive standard "
                "deviations that mean nothing. Fit on more data, or keep the hyperparameters fixed with n_iter=0.",
                DegenerateEvidenceWarning, stacklevel=4,
            )
        with warnings.catch_warnings():  # the model's own warning says the same in the torch layer's words
            warnings.simplefilter("ignore", DegenerateEvidenceWarning)
            model.fit(Z, t, n_iter=self.n_iter, lr=self.lr, optimizer=self.optimizer)
        self.model_ = model
        self.prior_precision_ = float(model.prior_precision)
        self.noise_variance_ = float(model.noise_variance) * self.y_scale_ ** 2
        self.lengthscale_ = self._lengthscale_attr(model)
        self.log_evidence_ = model.log_evidence_
        self.n_iter_ = model.n_iter_
        return self

    def predict(self, X, return_std: bool = False):
        """Predictive mean (and standard deviation, noise included) in the units of ``y``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        return_std : bool, default False

        Returns
        -------
        mean : ndarray of shape (n_samples,)
        std : ndarray of shape (n_samples,)
            Only with ``return_std=True``.
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        mean, std = self.model_.predict(self._scale_x(X), return_std=True)
        mean = mean.cpu().numpy() * self.y_scale_ + self.y_mean_
        return (mean, std.cpu().numpy() * self.y_scale_) if return_std else mean
