r"""scikit-learn estimators for :class:`~pyro_fa.linear_model.GeneralizedLinearModel` on random Fourier features:
:class:`GLMRegressor` and :class:`GLMClassifier` (re-exported by :mod:`pyro_fa.linear_model`)."""
from __future__ import annotations

import contextlib
from numbers import Integral, Real
from typing import Optional

import numpy as np
import torch
from sklearn.base import ClassifierMixin, RegressorMixin, _fit_context
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_fa import GaussianPrior
from pyro_fa.linear_model._sklearn_base import _RandomFeatureEstimator, _transaction
from pyro_fa.linear_model.glm import GeneralizedLinearModel
from pyro_fa.linear_model.likelihoods import LIKELIHOODS

__all__ = ["GLMRegressor", "GLMClassifier"]


class _GLMEstimator(_RandomFeatureEstimator):
    _parameter_constraints: dict = {
        **_RandomFeatureEstimator._parameter_constraints,
        "rank": [Interval(Integral, 1, None, closed="left")],
        "n_steps": [Interval(Integral, 1, None, closed="left")],
        "batch_size": [None, Interval(Integral, 1, None, closed="left")],
        "lr": [Interval(Real, 0, None, closed="neither")],
        "lr_decay": [Interval(Real, 0, 1, closed="right")],
        "num_particles": [Interval(Integral, 1, None, closed="left")],
        "n_samples": [Interval(Integral, 1, None, closed="left")],
    }

    def _fit_glm(self, Z: torch.Tensor, t: torch.Tensor, likelihood: str) -> GeneralizedLinearModel:
        basis_seed, fit_seed, self._predict_seed = self._seeds()
        glm = GeneralizedLinearModel(
            self._make_basis(Z.shape[1], basis_seed), likelihood, rank=self.rank,
            prior=GaussianPrior(self.prior_precision), num_particles=self.num_particles,
            **self._glm_kwargs(),
        )
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(fit_seed)
            glm.fit(Z, t, n_steps=self.n_steps, batch_size=self.batch_size, lr=self.lr, lr_decay=self.lr_decay)
        self.model_ = glm
        self.lengthscale_ = self._lengthscale_attr(glm)
        self.n_iter_ = glm.n_steps_
        return glm

    def _glm_kwargs(self) -> dict:
        return {}

    @contextlib.contextmanager
    def _seeded(self):
        """Fork and seed the torch RNG, so Monte Carlo predictions are reproducible and leave it untouched."""
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(self._predict_seed)
            yield


class GLMRegressor(RegressorMixin, _GLMEstimator):
    r"""Bayesian GLM regression on random Fourier features with a factor-analysis posterior, fitted by SVI.

    The estimator form of :class:`~pyro_fa.linear_model.GeneralizedLinearModel`
    with a Gaussian (or Poisson) likelihood (Steinberg et al. 2016, §1.3 and
    §2.1): the posterior over the weights is
    :math:`N(c, FF^\top + \Psi)` of rank ``rank``, fitted with the noise
    scale and the length scales by stochastic variational inference in
    :math:`O(MD + DK^2)` per step.

    Parameters
    ----------
    n_components : int, default 100
        Random Fourier frequencies :math:`n`; the basis has :math:`2n`
        features (plus ``n_features + 1`` with ``linear=True``).
    kernel : {"rbf", "laplace", "cauchy", "matern32", "matern52"}, default "rbf"
        Kernel approximated (see :class:`pyro_fa.basis.RandomFourierBasis`).
    linear : bool, default True
        Concatenate a linear basis with an intercept, :math:`[x, 1]`
        (the kernel plus a dot-product kernel, as in Steinberg et al. 2016,
        §2.1).
    lengthscale : float or array-like of shape (n_features,), default 1.0
        Initial length scale, in units of the standardised inputs when
        ``standardize=True``.
    ard : bool, default False
        One length scale per feature.
    orthogonal : bool, default False
        Orthogonal random features (not with ``kernel="laplace"``).
    learn_lengthscale : bool, default True
        Fit the length scale(s) with the other parameters.
    likelihood : {"gaussian", "poisson"}, default "gaussian"
        Poisson targets must be non-negative integer counts; they are never
        standardised, and predictions are mean rates.
    rank : int, default 10
        :math:`K`, at most the number of basis features.
    prior_precision : float, default 1.0
        Precision of the Gaussian prior on every weight.
    noise_scale : float, default 1.0
        Initial noise standard deviation (standardised units; Gaussian only).
    n_steps : int, default 3000
    batch_size : int, optional
        Rows per SVI step (default: all).
    lr : float, default 0.01
    lr_decay : float, default 0.1
        Final learning rate as a fraction of ``lr``.
    num_particles : int, default 1
    n_samples : int, default 1000
        Monte Carlo weight draws where predictions need them.
    random_state : int, RandomState instance or None, default None
        Seeds the frequencies, the SVI run and Monte Carlo predictions
        (through a forked torch RNG: the global one is left alone).
    device, dtype, standardize
        As :class:`SLMRegressor` (``standardize`` scales ``y`` only for the
        Gaussian likelihood).

    Attributes
    ----------
    model_ : GeneralizedLinearModel
    noise_scale_ : float
        Fitted noise standard deviation in the units of ``y`` (Gaussian).
    lengthscale_ : ndarray
    n_iter_ : int
        SVI steps run.
    x_mean_, x_scale_ : ndarray of shape (n_features,)
    y_mean_, y_scale_ : float
    n_features_in_ : int

    References
    ----------
    Steinberg et al. (2016), *revrand: technical report*, CSIRO Data61,
    §1.3 and §2.1–2.3.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).uniform(-3, 3, (100, 1)); y = np.sin(X[:, 0])
    >>> reg = GLMRegressor(n_components=20, n_steps=100, lr=0.05, random_state=0).fit(X, y)
    >>> reg.predict(X[:3]).shape
    (3,)
    """

    _parameter_constraints: dict = {
        **_GLMEstimator._parameter_constraints,
        "likelihood": [StrOptions({"gaussian", "poisson"})],
        "noise_scale": [Interval(Real, 0, None, closed="neither")],
    }

    def __init__(
        self,
        n_components: int = 100,
        kernel: str = "rbf",
        linear: bool = True,
        lengthscale=1.0,
        ard: bool = False,
        orthogonal: bool = False,
        learn_lengthscale: bool = True,
        likelihood: str = "gaussian",
        rank: int = 10,
        prior_precision: float = 1.0,
        noise_scale: float = 1.0,
        n_steps: int = 3000,
        batch_size: Optional[int] = None,
        lr: float = 0.01,
        lr_decay: float = 0.1,
        num_particles: int = 1,
        n_samples: int = 1000,
        random_state=None,
        device=None,
        dtype=None,
        standardize: bool = True,
    ):
        self.n_components = n_components
        self.kernel = kernel
        self.linear = linear
        self.lengthscale = lengthscale
        self.ard = ard
        self.orthogonal = orthogonal
        self.learn_lengthscale = learn_lengthscale
        self.likelihood = likelihood
        self.rank = rank
        self.prior_precision = prior_precision
        self.noise_scale = noise_scale
        self.n_steps = n_steps
        self.batch_size = batch_size
        self.lr = lr
        self.lr_decay = lr_decay
        self.num_particles = num_particles
        self.n_samples = n_samples
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.standardize = standardize

    def _glm_kwargs(self) -> dict:
        return {"noise_scale": self.noise_scale} if LIKELIHOODS[self.likelihood].has_noise else {}

    @_fit_context(prefer_skip_nested_validation=True)
    @_transaction
    def fit(self, X, y):
        """Fit the posterior over the weights (and the noise and length scales) by SVI.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,)
            Real targets, or non-negative integer counts for Poisson.

        Returns
        -------
        self

        Raises
        ------
        ValueError
            For NaN or inf in ``X`` or ``y``, counts that are negative or
            fractional (Poisson), or a ``device`` that holds no data (``"meta"``)
            or is not available; the estimator is then left as it was.
        """
        self._torch_device()
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=True)
        Z = self._fit_x_scaling(X)
        has_noise = LIKELIHOODS[self.likelihood].has_noise  # a location-scale likelihood: y may be standardised
        if self.standardize and has_noise:
            self.y_mean_, self.y_scale_ = float(y.mean()), float(y.std()) or 1.0
        else:
            self.y_mean_, self.y_scale_ = 0.0, 1.0
        t = torch.as_tensor((y - self.y_mean_) / self.y_scale_, dtype=Z.dtype, device=Z.device)
        glm = self._fit_glm(Z, t, self.likelihood)
        if has_noise:
            self.noise_scale_ = float(glm.noise_scale) * self.y_scale_
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
            For Poisson, the mean rate.
        std : ndarray of shape (n_samples,)
            Only with ``return_std=True``.
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        with self._seeded():
            mean, std = self.model_.predict(self._scale_x(X), return_std=True, n_samples=self.n_samples)
        mean = mean.cpu().numpy() * self.y_scale_ + self.y_mean_
        return (mean, std.cpu().numpy() * self.y_scale_) if return_std else mean


class GLMClassifier(ClassifierMixin, _GLMEstimator):
    r"""Bayesian logistic regression on random Fourier features with a factor-analysis posterior.

    The estimator form of :class:`~pyro_fa.linear_model.GeneralizedLinearModel`
    with the Bernoulli likelihood and logit link (Steinberg et al. 2016,
    §1.3 and §2.2), for two classes with arbitrary labels: ``classes_[1]``
    is the positive class. Probabilities are Monte Carlo averages of
    :math:`\mathrm{sigmoid}(f_*)` over ``n_samples`` weight draws.

    Parameters
    ----------
    n_components : int, default 100
    kernel, linear, lengthscale, ard, orthogonal, learn_lengthscale
        The basis, as :class:`GLMRegressor`.
    rank : int, default 10
    prior_precision : float, default 1.0
    n_steps : int, default 3000
    batch_size : int, optional
    lr : float, default 0.01
    lr_decay : float, default 0.1
    num_particles : int, default 1
    n_samples : int, default 1000
    random_state, device, dtype
        As :class:`GLMRegressor`.
    standardize : bool, default True
        Standardise the inputs (training statistics).

    Attributes
    ----------
    classes_ : ndarray of shape (2,)
    model_ : GeneralizedLinearModel
    lengthscale_ : ndarray
    n_iter_ : int
    x_mean_, x_scale_ : ndarray of shape (n_features,)
    n_features_in_ : int

    Raises
    ------
    ValueError
        In :meth:`fit`, if ``y`` does not hold exactly two classes.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(size=(100, 2)); y = np.where(X[:, 0] > 0, "a", "b")
    >>> clf = GLMClassifier(n_components=20, n_steps=100, lr=0.05, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:3]).shape
    (3, 2)
    """

    _parameter_constraints: dict = dict(_GLMEstimator._parameter_constraints)

    def __init__(
        self,
        n_components: int = 100,
        kernel: str = "rbf",
        linear: bool = True,
        lengthscale=1.0,
        ard: bool = False,
        orthogonal: bool = False,
        learn_lengthscale: bool = True,
        rank: int = 10,
        prior_precision: float = 1.0,
        n_steps: int = 3000,
        batch_size: Optional[int] = None,
        lr: float = 0.01,
        lr_decay: float = 0.1,
        num_particles: int = 1,
        n_samples: int = 1000,
        random_state=None,
        device=None,
        dtype=None,
        standardize: bool = True,
    ):
        self.n_components = n_components
        self.kernel = kernel
        self.linear = linear
        self.lengthscale = lengthscale
        self.ard = ard
        self.orthogonal = orthogonal
        self.learn_lengthscale = learn_lengthscale
        self.rank = rank
        self.prior_precision = prior_precision
        self.n_steps = n_steps
        self.batch_size = batch_size
        self.lr = lr
        self.lr_decay = lr_decay
        self.num_particles = num_particles
        self.n_samples = n_samples
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.standardize = standardize

    @_fit_context(prefer_skip_nested_validation=True)
    @_transaction
    def fit(self, X, y):
        """Fit the posterior over the weights (and the length scales) by SVI.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,)
            Exactly two distinct labels.

        Returns
        -------
        self

        Raises
        ------
        ValueError
            For NaN or inf in ``X``, ``y`` without exactly two classes, or a
            ``device`` that holds no data (``"meta"``) or is not available; the
            estimator is then left as it was.
        """
        self._torch_device()
        X, y = validate_data(self, X, y, dtype=np.float64)
        check_classification_targets(y)
        self.classes_, codes = np.unique(y, return_inverse=True)
        if len(self.classes_) != 2:
            n = len(self.classes_)
            raise ValueError(
                f"{type(self).__name__}: Only binary classification is supported: y must hold exactly 2 classes, "
                f"got {n} class{'' if n == 1 else 'es'}: {self.classes_[:5].tolist()}."
            )
        Z = self._fit_x_scaling(X)
        t = torch.as_tensor(codes.reshape(-1), dtype=Z.dtype, device=Z.device)
        self._fit_glm(Z, t, "bernoulli")
        return self

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        return tags

    def predict_proba(self, X):
        """Class probabilities, columns in the order of ``classes_``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ndarray of shape (n_samples, 2)
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        with self._seeded():
            proba = self.model_.predict_proba(self._scale_x(X), n_samples=self.n_samples)
        return proba.cpu().numpy()

    def predict_log_proba(self, X):
        """Log of :meth:`predict_proba`, shape (n_samples, 2), computed stably over the same draws (finite
        where a class's probability is below the smallest float)."""
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        with self._seeded():
            log_proba = self.model_.predict_log_proba(self._scale_x(X), n_samples=self.n_samples)
        return log_proba.cpu().numpy()

    def predict(self, X):
        """The more probable class of each row, shape (n_samples,)."""
        check_is_fitted(self)
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]
