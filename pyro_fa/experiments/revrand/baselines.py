r"""The scikit-learn methods of ``pyro-fa revrand``, as the revrand technical report ran them.

Every function takes standardised NumPy training data, fits on it alone (any choice is made by
cross-validation *inside* the training data or by the marginal likelihood), and returns the test
predictions. Steinberg et al., *revrand: technical report*, §2.1–2.3: the GP has the SLM's kernel (an
ARD RBF plus a dot product, amplitudes and length scales started at 1) fitted by its marginal
likelihood; the random forests have 40 trees; the SVMs an RBF kernel with its width chosen by grid
search and cross-validation; the logistic regression runs on the GLM's random Fourier features.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Tuple

import numpy as np

#: grids of the SVMs' cross-validated search (gamma in units of 1 / n_features: scikit-learn's "scale")
SVM_C = (0.1, 1.0, 10.0, 100.0)
SVM_GAMMA = (0.1, 0.3, 1.0, 3.0)


@contextlib.contextmanager
def _quiet():
    """scikit-learn's ConvergenceWarnings (an optimiser at its iteration cap) silenced; the result is used as is."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        yield


def _optimizer(maxiter: int):
    """L-BFGS-B for the GP's marginal likelihood with at most ``maxiter`` iterations (scikit-learn uses 15 000)."""
    from scipy.optimize import minimize

    def optimize(obj_func, initial_theta, bounds):
        res = minimize(obj_func, initial_theta, method="L-BFGS-B", jac=True, bounds=bounds,
                       options={"maxiter": maxiter})
        return res.x, res.fun

    return optimize


def gp_regressor(x, y, x_test, *, seed: int, ard: bool = True, linear: bool = True, restarts: int = 0,
                 maxiter: int = 15000) -> Tuple[np.ndarray, np.ndarray, str]:
    """Exact GP regression: amplitude·RBF (ARD) [+ amplitude·dot product] + white noise, by marginal likelihood.

    Returns the predictive mean and variance of y (the white noise included) at ``x_test``, and the fitted
    kernel as text. The best of ``restarts + 1`` optimisations by log marginal likelihood is kept.
    """
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, DotProduct, WhiteKernel

    d = x.shape[1]
    kernel = ConstantKernel(1.0) * RBF(np.ones(d) if ard else 1.0)
    if linear:
        kernel = kernel + ConstantKernel(1.0) * DotProduct(1.0)
    kernel = kernel + WhiteKernel(1.0)
    with _quiet():
        gp = GaussianProcessRegressor(kernel, n_restarts_optimizer=restarts, random_state=seed,
                                      optimizer=_optimizer(maxiter)).fit(x, y)
    mean, std = gp.predict(x_test, return_std=True)
    return mean, np.maximum(std, 1e-12) ** 2, str(gp.kernel_)


def random_forest_regressor(x, y, x_test, *, seed: int) -> np.ndarray:
    """A random forest of 40 trees (the report's); no predictive density, so no MSLL."""
    from sklearn.ensemble import RandomForestRegressor

    return RandomForestRegressor(n_estimators=40, random_state=seed, n_jobs=1).fit(x, y).predict(x_test)


def svr(x, y, x_test, *, seed: int, cv: int = 5) -> Tuple[np.ndarray, dict]:
    """RBF support-vector regression, C and the kernel width by ``cv``-fold grid search on the training data."""
    from sklearn.model_selection import GridSearchCV, KFold
    from sklearn.svm import SVR

    grid = {"C": list(SVM_C), "gamma": [g / x.shape[1] for g in SVM_GAMMA]}
    search = GridSearchCV(SVR(kernel="rbf"), grid, cv=KFold(cv, shuffle=True, random_state=seed), n_jobs=1)
    search.fit(x, y)
    return search.predict(x_test), search.best_params_


def logistic_regression(features, y, features_test, *, seed: int, cv: int = 5) -> Tuple[np.ndarray, float]:
    """L2 logistic regression on fixed features, C by ``cv``-fold cross-validated log-loss; returns P(y=1)."""
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold

    with _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # scikit-learn 1.9's notices of LogisticRegressionCV's changes
        model = LogisticRegressionCV(Cs=10, cv=StratifiedKFold(cv, shuffle=True, random_state=seed),
                                     scoring="neg_log_loss", max_iter=2000).fit(features, y)
    return model.predict_proba(features_test)[:, 1], float(model.C_[0])


def svc(x, y, x_test, *, seed: int, cv: int = 5) -> Tuple[np.ndarray, dict]:
    """RBF SVC, C and width by grid search (accuracy), with Platt-scaled probabilities; returns P(y=1).

    The probabilities are ``SVC(probability=True)``'s: a sigmoid fitted to out-of-fold decision values
    (``CalibratedClassifierCV(..., ensemble=False)``, which scikit-learn 1.9 recommends in its place).
    """
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.svm import SVC

    grid = {"C": list(SVM_C), "gamma": [g / x.shape[1] for g in SVM_GAMMA]}
    folds = StratifiedKFold(cv, shuffle=True, random_state=seed)
    search = GridSearchCV(SVC(kernel="rbf"), grid, cv=folds, n_jobs=1).fit(x, y)
    platt = CalibratedClassifierCV(SVC(kernel="rbf", **search.best_params_), method="sigmoid", cv=folds,
                                   ensemble=False).fit(x, y)
    return platt.predict_proba(x_test)[:, 1], search.best_params_


def gp_classifier(x, y, x_test, *, seed: int, restarts: int = 0, maxiter: int = 15000) -> Tuple[np.ndarray, str]:
    """GP classification with the Laplace approximation, amplitude·RBF kernel by marginal likelihood; P(y=1)."""
    from sklearn.gaussian_process import GaussianProcessClassifier
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel

    with _quiet():
        gp = GaussianProcessClassifier(ConstantKernel(1.0) * RBF(1.0), n_restarts_optimizer=restarts,
                                       random_state=seed, optimizer=_optimizer(maxiter)).fit(x, y)
    return gp.predict_proba(x_test)[:, 1], str(gp.kernel_)


def random_forest_classifier(x, y, x_test, *, seed: int) -> np.ndarray:
    """A random forest of 40 trees; returns P(y=1)."""
    from sklearn.ensemble import RandomForestClassifier

    return RandomForestClassifier(n_estimators=40, random_state=seed, n_jobs=1).fit(x, y).predict_proba(x_test)[:, 1]
