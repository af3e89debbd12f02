r"""The parts the scikit-learn estimators on random Fourier features share (private): the basis, standardisation,
device / dtype, seeding, and fit as one transaction."""
from __future__ import annotations

import functools
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions

from pyro_fa._validation import TORCH_DTYPES, check_device
from pyro_fa.basis import KERNELS, LinearBasis, RandomFourierBasis


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
