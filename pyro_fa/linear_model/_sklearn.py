r"""scikit-learn estimators for the revrand-style models on random Fourier features."""
from __future__ import annotations

import contextlib
import functools
import warnings
from numbers import Integral, Real
from typing import Optional

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, _fit_context
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_fa import GaussianPrior
from pyro_fa._validation import TORCH_DTYPES, check_device
from pyro_fa.basis import KERNELS, LinearBasis, RandomFourierBasis
from pyro_fa.fa.linalg import MAX_DENSE_DIM, check_dense_dim
from pyro_fa.linear_model.glm import GeneralizedLinearModel
from pyro_fa.linear_model.slm import DegenerateEvidenceWarning, StandardLinearModel

__all__ = ["SLMRegressor", "GLMRegressor", "GLMClassifier"]

def _transaction(fit):
    """Run ``fit`` as one transaction: if it raises, the estimator's attributes are put back as they were.

    scikit-learn's ``validate_data`` records ``n_features_in_`` before the later checks
    (device, classes, model size) can fail; without this a refused call would leave a
    fitted estimator expecting the refused data's features.
    """

    @functools.wraps(fit)
    def wrapper(self, *args, **kwargs):
        saved = dict(self.__dict__)
        try:
            return fit(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    return wrapper


class _RandomFeatureEstimator(BaseEstimator):
    """Shared parts: the basis, standardisation, device / dtype and seeding."""

    _parameter_constraints: dict = {
        "n_components": [Interval(Integral, 1, None, closed="left")],
        "kernel": [StrOptions(set(KERNELS))],
        "linear": ["boolean"],
        "lengthscale": [Interval(Real, 0, None, closed="neither"), "array-like"],
        "ard": ["boolean"],
        "orthogonal": ["boolean"],
        "learn_lengthscale": ["boolean"],
        "prior_precision": [Interval(Real, 0, None, closed="neither")],
        "random_state": ["random_state"],
        "device": [None, str, torch.device],
        "dtype": [None, StrOptions({"float32", "float64"}), torch.dtype],
        "standardize": ["boolean"],
    }

    def _torch_dtype(self) -> torch.dtype:
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: dtype must be None, 'float32', 'float64', torch.float32 or torch.float64, "
                f"got {self.dtype!r}."
            )
        return TORCH_DTYPES[self.dtype]

    def _torch_device(self) -> torch.device:
        return check_device(type(self).__name__, self.device)

    def _n_basis_features(self, n_features: int) -> int:
        """D: 2 n_components random features, plus n_features + 1 with the linear basis."""
        return 2 * self.n_components + (n_features + 1 if self.linear else 0)

    def _seeds(self):
        rng = check_random_state(self.random_state)
        return [int(s) for s in rng.randint(0, 2 ** 31 - 1, size=3)]

    def _make_basis(self, n_features: int, seed: int):
        kw = dict(dtype=self._torch_dtype(), device=self._torch_device())
        basis = RandomFourierBasis(
            n_features, self.n_components, kernel=self.kernel, lengthscale=self.lengthscale, ard=self.ard,
            orthogonal=self.orthogonal, learn_lengthscale=self.learn_lengthscale, seed=seed, **kw,
        )
        if self.linear:
            basis = basis + LinearBasis(n_features, bias=True)
        return basis

    def _fit_x_scaling(self, X: np.ndarray) -> np.ndarray:
        if self.standardize:
            self.x_mean_ = X.mean(0)
            scale = X.std(0)
            self.x_scale_ = np.where(scale > 0, scale, 1.0)
        else:
            self.x_mean_ = np.zeros(X.shape[1])
            self.x_scale_ = np.ones(X.shape[1])
        return self._scale_x(X)

    def _scale_x(self, X: np.ndarray) -> torch.Tensor:
        Z = (X - self.x_mean_) / self.x_scale_
        return torch.as_tensor(Z, dtype=self._torch_dtype(), device=self._torch_device())

    def _devices(self):
        device = self._torch_device()
        return [device.index or 0] if device.type == "cuda" else []

    def _lengthscale_attr(self, model) -> np.ndarray:
        basis = model.basis.bases[0] if self.linear else model.basis
        return basis.lengthscale.detach().cpu().numpy()




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
    feature_names_in_ : ndarray of shape (n_features_in_,)

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
        return {"noise_scale": self.noise_scale} if self.likelihood == "gaussian" else {}

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
        gaussian = self.likelihood == "gaussian"
        if self.standardize and gaussian:
            self.y_mean_, self.y_scale_ = float(y.mean()), float(y.std()) or 1.0
        else:
            self.y_mean_, self.y_scale_ = 0.0, 1.0
        t = torch.as_tensor((y - self.y_mean_) / self.y_scale_, dtype=Z.dtype, device=Z.device)
        glm = self._fit_glm(Z, t, self.likelihood)
        if gaussian:
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
