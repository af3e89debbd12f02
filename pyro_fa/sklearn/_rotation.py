"""Orthogonal rotations of factor loadings for :class:`~pyro_fa.sklearn.FactorAnalysis` (``rotation=``).

``ROTATIONS`` maps a name to the target of Kaiser's (1958) iteration, as scikit-learn's
``_ortho_rotation`` (varimax: the column-centred cube; quartimax: the plain cube).
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

__all__ = ["ROTATIONS", "ortho_rotation"]


def _varimax_shift(rotated: np.ndarray, nrow: int):
    return rotated * ((rotated**2).sum(axis=0) / nrow)


def _quartimax_shift(rotated: np.ndarray, nrow: int):
    return 0.0


#: rotation name -> the term subtracted from the cubed loadings in each iteration
ROTATIONS: Dict[str, Callable] = {"varimax": _varimax_shift, "quartimax": _quartimax_shift}


def ortho_rotation(components: np.ndarray, method: str = "varimax", tol: float = 1e-6, max_iter: int = 100):
    """Varimax or quartimax rotation of loadings of shape (n_features, n_components) (Kaiser 1958).

    Returns the rotated loadings, shape (n_features, n_components).
    """
    shift = ROTATIONS[method]
    nrow, ncol = components.shape
    rotation = np.eye(ncol)
    var = 0.0
    for _ in range(max_iter):
        rotated = components @ rotation
        u, s, vt = np.linalg.svd(components.T @ (rotated**3 - shift(rotated, nrow)))
        rotation = u @ vt
        var_new = s.sum()
        if var != 0 and var_new < var * (1 + tol):
            break
        var = var_new
    return components @ rotation
