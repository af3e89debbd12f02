"""A drop-in replacement for :class:`sklearn.decomposition.FactorAnalysis`."""
from __future__ import annotations

import functools
import warnings
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin, _fit_context
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_fa._validation import TORCH_DTYPES, check_device
from pyro_fa.fa import linalg
from pyro_fa.sklearn._algorithms import ALGORITHMS, SKLEARN_NOISE_FLOOR  # noqa: F401 (the floor is documented here)
from pyro_fa.sklearn._rotation import ROTATIONS, ortho_rotation

__all__ = ["FactorAnalysis"]


def _transaction(method):
    """Run a fitting method as one transaction: if it raises, the estimator's attributes are put back as they were.

    scikit-learn's ``validate_data`` records ``n_features_in_`` / ``feature_names_in_`` before
    later checks (and before the model is built) can fail; without this, a refused call
    would leave a fitted estimator expecting the refused data's features.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        saved = dict(self.__dict__)
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    return wrapper


class FactorAnalysis(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    r"""Factor analysis fitted in torch: batch EM, online EM or online SGA.

    The model is that of :class:`sklearn.decomposition.FactorAnalysis`,

    .. math::

        x = W^\top z + \mu + \varepsilon, \qquad z \sim N(0, I_K), \quad
        \varepsilon \sim N(0, \mathrm{diag}(\psi)),

    with ``components_`` :math:`= W` (:math:`K \times D`, the transpose of
    pyro_fa's ``cov_factor`` :math:`F`) and ``noise_variance_`` :math:`= \psi`,
    so :math:`x \sim N(\mu, W^\top W + \Psi)`. Constructor arguments, fitted
    attributes and methods are scikit-learn's, plus:

    - ``algorithm="svd"`` (default) and ``"em"``: batch fits on the
      sufficient statistics (:class:`pyro_fa.fa.batch.BatchFactorAnalysis`).
      One pass over ``X`` builds the mean and the :math:`D\times D`
      covariance :math:`S`; iterations then cost :math:`O(D^2K)` each,
      independent of ``n_samples``. ``"svd"`` is scikit-learn's own iteration
      (Barber Alg. 21.1: exact loadings for the current noise, by a
      warm-started randomized eigensolver) run on :math:`S`; ``"em"`` is EM
      (Ghahramani & Hinton 1996), cheaper per iteration but slower to
      converge when some noise variances are small. :meth:`partial_fit`
      merges the statistics of each batch exactly and refits, so it gives
      the same model as :meth:`fit` on the concatenated batches.
    - ``algorithm="online_em"`` / ``"sga"``: online EM (Brownlie 2021, Alg. 2, with
      the parameter-expanded M-step) or online stochastic gradient ascent
      (Alg. 1) through
      :class:`pyro_fa.OnlineFactorAnalysis`, in :math:`O(DK)` memory, one
      pass over the rows in order, ``batch_size`` rows per update.
      :meth:`partial_fit` continues the same stream.
    - ``device`` and ``dtype``: where and in which precision torch computes.

    Parameters
    ----------
    n_components : int, default None
        :math:`K`; ``None`` means ``n_features``. Must not exceed
        ``n_features`` (and must be below it for the online algorithms).
    tol : float, default 1e-2
        Stopping tolerance on the increase of the total log-likelihood
        (batch algorithms).
    copy : bool, default True
        Kept for compatibility: ``X`` is never modified.
    max_iter : int, default 1000
        Maximum number of batch iterations.
    noise_variance_init : array-like of shape (n_features,), default None
        Initial noise variances of the batch algorithms; by default those
        of probabilistic PCA.
    svd_method : {"randomized", "lapack"}, default "randomized"
        Eigensolver of the batch algorithms: randomized subspace iteration,
        or a full eigendecomposition of a :math:`D\times D` matrix.
    iterated_power : int, default 3
        Power iterations of the randomized eigensolver.
    rotation : {"varimax", "quartimax"}, default None
        Orthogonal rotation applied to ``components_`` (Kaiser 1958).
    random_state : int, RandomState instance or None, default 0
        Seeds the randomized eigensolver and the online initialisation.
    algorithm : {"svd", "em", "online_em", "sga"}, default "svd"
    batch_size : int, default 1
        Rows per update of the online algorithms.
    warmup : int, default 100
        Warm-up of the online algorithms (Brownlie 2021, §5.1).
    learning_rate : float, default 1e-3
        Learning rate of online SGA.
    device : str or torch.device, default None
        Torch device of the computation (``None``: CPU). Fitted attributes
        are NumPy arrays whatever the device.
    dtype : {"float64", "float32"} or torch dtype, default None
        Torch dtype of the computation (``None``: float64).

    Attributes
    ----------
    components_ : ndarray of shape (n_components, n_features)
        The loadings :math:`W = F^\top`.
    noise_variance_ : ndarray of shape (n_features,)
        :math:`\psi`.
    mean_ : ndarray of shape (n_features,)
        Per-feature mean of all data seen.
    loglike_ : list of float
        Batch: total log-likelihood of all data seen at each iteration of
        the last (re)fit. Online: total log-likelihood of each batch passed
        to :meth:`fit` / :meth:`partial_fit`, after its updates.
    n_iter_ : int
        Batch: iterations of the last (re)fit. Online: number of updates so
        far.
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Defined only when ``X`` has string feature names.

    Notes
    -----
    The batch algorithms cost :math:`O(ND^2)` for the statistics and :math:`O(D^2K)` per
    iteration (scikit-learn's randomized SVD: :math:`O(NDK)`); transform and scoring cost
    :math:`O(NDK + DK^2)` (Woodbury). Only :meth:`get_covariance` and :meth:`get_precision`
    form :math:`D\times D` matrices, and past ``max_dim`` features they refuse.

    With ``dtype="float64"`` the batch algorithms floor the noise variances at
    ``1e-12`` as scikit-learn does, so a constant column (e.g. the blank
    pixels of ``load_digits``) gets the same :math:`\psi_d` and ``score``
    matches scikit-learn's; with ``float32`` (and the online algorithms) the
    floor is relative, :math:`\sqrt{\epsilon}\max_d S_{dd}`, for stability,
    and scores on such data are lower than scikit-learn's.

    References
    ----------
    D. Barber, *Bayesian Reasoning and Machine Learning*, CUP 2012, ch. 21.
    Z. Ghahramani and G. E. Hinton, *The EM algorithm for mixtures of factor
    analyzers*, CRG-TR-96-1, 1996.
    S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*,
    MSc thesis, University of Edinburgh, 2021, Algorithms 1 and 2.

    See Also
    --------
    sklearn.decomposition.FactorAnalysis : the estimator this one replaces.
    pyro_fa.OnlineFactorAnalysis : the streaming fitter behind ``"online_em"`` and ``"sga"``.

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).standard_normal((200, 6))
    >>> fa = FactorAnalysis(n_components=2).fit(X)
    >>> fa.components_.shape, fa.transform(X).shape
    ((2, 6), (200, 2))
    """

    _parameter_constraints: dict = {
        "n_components": [Interval(Integral, 0, None, closed="left"), None],
        "tol": [Interval(Real, 0.0, None, closed="left")],
        "copy": ["boolean"],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "noise_variance_init": ["array-like", None],
        "svd_method": [StrOptions({"randomized", "lapack"})],
        "iterated_power": [Interval(Integral, 0, None, closed="left")],
        "rotation": [StrOptions(set(ROTATIONS)), None],
        "random_state": ["random_state"],
        "algorithm": [StrOptions(set(ALGORITHMS))],
        "batch_size": [Interval(Integral, 1, None, closed="left")],
        "warmup": [Interval(Integral, 1, None, closed="left")],
        "learning_rate": [Interval(Real, 0.0, None, closed="neither")],
        "device": "no_validation",
        "dtype": "no_validation",
    }

    def __init__(
        self,
        n_components=None,
        *,
        tol=1e-2,
        copy=True,
        max_iter=1000,
        noise_variance_init=None,
        svd_method="randomized",
        iterated_power=3,
        rotation=None,
        random_state=0,
        algorithm="svd",
        batch_size=1,
        warmup=100,
        learning_rate=1e-3,
        device=None,
        dtype=None,
    ):
        self.n_components = n_components
        self.tol = tol
        self.copy = copy
        self.max_iter = max_iter
        self.noise_variance_init = noise_variance_init
        self.svd_method = svd_method
        self.iterated_power = iterated_power
        self.rotation = rotation
        self.random_state = random_state
        self.algorithm = algorithm
        self.batch_size = batch_size
        self.warmup = warmup
        self.learning_rate = learning_rate
        self.device = device
        self.dtype = dtype

    # ------------------------------------------------------------ validation
    def _torch_options(self):
        name = type(self).__name__
        expected = "one of 'float64', 'float32', torch.float64, torch.float32 or None"
        if not (self.dtype is None or isinstance(self.dtype, (str, torch.dtype))):
            raise TypeError(f"{name}: dtype must be {expected}, got {self.dtype!r}.")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"{name}: dtype must be {expected}, got {self.dtype!r}.")
        return TORCH_DTYPES[self.dtype], check_device(name, self.device)

    def _n_components(self, n_features: int) -> int:
        name = type(self).__name__
        k = n_features if self.n_components is None else self.n_components
        if k > n_features:
            raise ValueError(f"{name}: n_components must be <= n_features={n_features}, got {k!r}.")
        if ALGORITHMS[self.algorithm].online and not 1 <= k < n_features:
            raise ValueError(
                f"{name}: n_components must be in [1, n_features={n_features}) for algorithm="
                f"{self.algorithm!r}, got {k!r}. Use a batch algorithm ('svd' or 'em') or fewer components."
            )
        return k

    def _seed(self) -> int:
        return int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max))

    def _tensor(self, X: np.ndarray) -> torch.Tensor:
        dtype, device = self._torch_options()
        with warnings.catch_warnings():  # read-only input (memmaps): the tensor is never written to
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.as_tensor(X, dtype=dtype).to(device)

    # -------------------------------------------------------------- fitting
    @_fit_context(prefer_skip_nested_validation=True)
    @_transaction
    def fit(self, X, y=None):
        """Fit the model to ``X``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : Ignored

        Returns
        -------
        self : FactorAnalysis

        Raises
        ------
        ValueError
            If ``X`` has NaN or inf, or ``n_components`` or
            ``noise_variance_init`` do not fit ``X``; a fitted model is then
            left as it was.
        TypeError
            If ``device`` or ``dtype`` is not a torch device or float dtype.
        """
        X = validate_data(self, X, dtype=[np.float64, np.float32])
        self._model = None
        return self._fit_batch(X)

    @_fit_context(prefer_skip_nested_validation=True)
    @_transaction
    def partial_fit(self, X, y=None):
        """Update the model with a batch of samples.

        The batch algorithms merge the batch into the exact mean and scatter
        of all data seen and refit (the result equals :meth:`fit` on all
        batches); the online algorithms continue their stream.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : Ignored

        Returns
        -------
        self : FactorAnalysis

        Raises
        ------
        ValueError
            If ``X`` has a different number of features than earlier batches,
            or NaN or inf; the model is then left unchanged.
        """
        first = getattr(self, "_model", None) is None
        X = validate_data(self, X, reset=first, dtype=[np.float64, np.float32])
        return self._fit_batch(X)

    def _fit_batch(self, X: np.ndarray):
        model = getattr(self, "_model", None)
        fresh = model is None
        if fresh:
            dtype, device = self._torch_options()
            n_features = X.shape[1]
            self._algorithm = ALGORITHMS[self.algorithm]
            model = self._algorithm.build(self, n_features, self._n_components(n_features),
                                          _noise_init(self, n_features), dtype, device)
        self._algorithm.update(self, model, self._tensor(X), fresh)
        self._model = model
        F = model.cov_factor.detach()
        self.components_ = F.T.cpu().numpy().astype(X.dtype, copy=True)
        if self.rotation is not None and self.components_.shape[0] > 0:
            self.components_ = ortho_rotation(self.components_.T, method=self.rotation).T.copy()
        self.noise_variance_ = model.cov_diag.detach().cpu().numpy().astype(X.dtype, copy=True)
        self.mean_ = model.loc.detach().cpu().numpy().astype(X.dtype, copy=True)
        return self

    # ------------------------------------------------------------ inference
    def _fitted_tensors(self):
        check_is_fitted(self)
        return (
            self._tensor(self.mean_),
            self._tensor(self.components_).T,
            self._tensor(self.noise_variance_),
        )

    def transform(self, X):
        """Posterior mean of the latent factors (Barber eq. 21.2.33).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        X_new : ndarray of shape (n_samples, n_components)
        """
        loc, F, psi = self._fitted_tensors()
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        mean, _ = linalg.latent_posterior(F, psi, self._tensor(X) - loc)
        return mean.cpu().numpy().astype(X.dtype, copy=False)

    def score_samples(self, X):
        """Log-likelihood of each sample under :math:`N(\\mu, W^\\top W + \\Psi)`.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ll : ndarray of shape (n_samples,)
        """
        loc, F, psi = self._fitted_tensors()
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        x = self._tensor(X)
        if F.shape[-1] == 0:  # LowRankMultivariateNormal needs K >= 1
            ll = torch.distributions.Normal(loc, psi.sqrt()).log_prob(x).sum(-1)
        else:
            ll = linalg.fa_distribution(loc, F, psi).log_prob(x)
        return ll.cpu().numpy().astype(X.dtype, copy=False)

    def score(self, X, y=None):
        """Average log-likelihood of the samples.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : Ignored

        Returns
        -------
        ll : float
        """
        return float(np.mean(self.score_samples(X)))

    def get_covariance(self, *, max_dim=linalg.MAX_DENSE_DIM):
        """The model covariance ``components_.T @ components_ + diag(noise_variance_)``.

        Parameters
        ----------
        max_dim : int or None, default 20000
            The largest ``n_features`` for which the dense matrix is built
            (20 000 features take 3.2 GB in float64); ``None`` lifts the limit.

        Returns
        -------
        cov : ndarray of shape (n_features, n_features)

        Raises
        ------
        ValueError
            If ``n_features_in_ > max_dim``, before anything is allocated: use
            ``components_`` and ``noise_variance_`` (the covariance in
            :math:`O(DK)` memory), or :meth:`score_samples` / :meth:`transform`,
            which never form it.
        """
        _check_dense(self, "get_covariance()", max_dim)
        _, F, psi = self._fitted_tensors()
        return linalg.dense_covariance(F, psi).cpu().numpy()

    def get_precision(self, *, max_dim=linalg.MAX_DENSE_DIM):
        """The model precision (inverse covariance), by the Woodbury identity.

        Parameters
        ----------
        max_dim : int or None, default 20000
            As :meth:`get_covariance`.

        Returns
        -------
        precision : ndarray of shape (n_features, n_features)

        Raises
        ------
        ValueError
            If ``n_features_in_ > max_dim``, before anything is allocated: apply
            the precision to vectors with
            ``pyro_fa.fa.linalg.solve(components_.T, noise_variance_, rhs)``
            (Woodbury, :math:`O(DK^2)`) instead.
        """
        _check_dense(self, "get_precision()", max_dim)
        _, F, psi = self._fitted_tensors()
        eye = torch.eye(psi.shape[0], dtype=psi.dtype, device=psi.device)
        return linalg.solve(F, psi, eye).cpu().numpy()

    @property
    def _n_features_out(self):
        return self.components_.shape[0]


def _noise_init(est: FactorAnalysis, n_features: int):
    """``noise_variance_init`` as a checked float64 array of shape (n_features,), or None."""
    if est.noise_variance_init is None:
        return None
    psi = np.asarray(est.noise_variance_init, dtype=np.float64)
    if psi.shape != (n_features,):
        raise ValueError(
            f"{type(est).__name__}: noise_variance_init must have shape ({n_features},), got {psi.shape!r}."
        )
    if not (np.all(np.isfinite(psi)) and np.all(psi > 0)):
        raise ValueError(
            f"{type(est).__name__}: noise_variance_init must be finite and positive, "
            f"got {est.noise_variance_init!r}."
        )
    return psi


def _check_dense(est: FactorAnalysis, what: str, max_dim) -> None:
    """Refuse a dense D x D result past ``max_dim`` features, naming the O(DK) alternatives."""
    check_is_fitted(est)
    name = type(est).__name__
    if max_dim is not None and (isinstance(max_dim, bool) or not isinstance(max_dim, Integral) or max_dim < 1):
        raise ValueError(f"{name}: max_dim must be a positive int or None, got {max_dim!r}.")
    alternative = (
        "Use components_ and noise_variance_ (the covariance is components_.T @ components_ + "
        "diag(noise_variance_), O(DK) memory), pyro_fa.fa.linalg.solve(components_.T, noise_variance_, rhs) "
        "for products with the precision, or score_samples / transform, which never form a D x D matrix; "
        "or pass max_dim=None to build it anyway."
    )
    linalg.check_dense_dim(name, what, est.n_features_in_, est._torch_options()[0], alternative,
                           max_dim=max_dim, argument="n_features")
