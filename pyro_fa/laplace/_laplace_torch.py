"""laplace-torch's argument names, as a user of ``laplace.Laplace(model, likelihood, subset_of_weights,
hessian_structure, ...)`` (Daxberger et al. 2021) would pass them to :class:`~pyro_fa.laplace.FactorLaplace`.

A name that means what one of ours means is mapped to it (:func:`translate`); one that has no counterpart here is
refused with a message naming what to use instead (:func:`raise_laplace_torch_only`), never a bare
``TypeError: unexpected keyword argument``.

======================================  ==========================================================================
laplace-torch                           FactorLaplace
======================================  ==========================================================================
``subset_of_weights="all"``             ``subset="all"`` (our default; laplace-torch's is ``"last_layer"``)
``subset_of_weights="last_layer"``      ``subset="last_layer"``
``subset_of_weights="subnetwork"``      refused: ``subset=[the parameters]``
``hessian_structure="lowrank"``         ours: low rank plus diagonal, ``rank=K``
``hessian_structure="full"``            ``rank=D``: the curvature kept exactly (small D)
``hessian_structure="kron"/"diag"``     refused: ``rank=K``
``prior_structure="scalar"``            ``prior_precision`` of shape (1,)
``prior_structure="layerwise"``         ``prior_precision`` of shape (L,), one per parameter tensor
``prior_structure="diag"``              refused
``grid_size``, ``log_prior_prec_min``   ``optimize_prior_precision(grid_size=..., ...)`` (both accepted)
``link_approx="bridge"``                refused: ``"probit"`` or ``"mc"``
``posterior_precision`` / ``_covariance``  the dense (D, D) matrices, small D only
======================================  ==========================================================================
"""
from __future__ import annotations

from typing import Dict

__all__ = ["translate", "raise_laplace_torch_only", "dense_precision", "dense_covariance", "shaped_prior", "HESSIAN_STRUCTURES", "PRIOR_STRUCTURES"]

#: laplace-torch's ``hessian_structure`` values this library has -> whether the curvature is kept exactly (rank D)
#: rather than low rank plus diagonal
_FULL_CURVATURE: Dict[str, bool] = {"lowrank": False, "full": True}
HESSIAN_STRUCTURES = tuple(_FULL_CURVATURE)
#: laplace-torch's ``prior_structure`` values this library has -> whether the prior precision is one per parameter
#: tensor (shape (L,)) rather than one (shape (1,))
_LAYERWISE_PRIOR: Dict[str, bool] = {"scalar": False, "layerwise": True}
PRIOR_STRUCTURES = tuple(_LAYERWISE_PRIOR)

#: laplace-torch's keywords with no counterpart here -> what to use instead
_ONLY_THERE: Dict[str, str] = {
    "temperature": "the likelihood's temperature is not available (FactorLaplace's temperature is the one "
                   "optimize_prior_precision(method='gridsearch', temperature=True) fits after the fact)",
    "prior_mean": "the prior mean is 0 here; a non-zero prior mean is not available",
    "enable_backprop": "gradients to the inputs through the predictive are not available",
    "backend": "the curvature is computed by torch.func here: choose it with curvature='ggn' or 'mc' and "
               "its fit with curvature_fit=...",
    "backend_kwargs": "the curvature is computed by torch.func here: mc_samples=... and chunk_size=... set it",
    "asdl_fisher_kwargs": "the curvature is computed by torch.func here: curvature='mc', mc_samples=...",
    "dict_key_x": "dict (Hugging Face) batches are not read here: inputs must be a Tensor or a tuple of Tensors "
                  "(model(*x)); wrap a model that takes a dict",
    "dict_key_y": "dict (Hugging Face) batches are not read here: batches must be (inputs, targets) pairs",
    "last_layer_name": "use subset='last_layer' (the last module holding parameters) or subset=[its parameters]",
    "subnetwork_indices": "use subset=[the parameters] (whole parameter tensors)",
    "init_prior_prec": "the search starts from the stored prior_precision: set it with "
                       "FactorLaplace(prior_precision=...)",
    "prior_structure": "its shape is the stored prior_precision's: FactorLaplace(prior_precision=...) of shape "
                       "(1,) or (L,) (or prior_structure= at construction)",
    "loss": "gridsearch scores the validation negative log-likelihood of the predictive",
    "verbose": "no progress output here",
    "progress_bar": "no progress output here",
}


def raise_laplace_torch_only(owner: str, where: str, kwargs: dict) -> None:
    """Raise for the first of ``kwargs``: a ``ValueError`` for laplace-torch's names with no counterpart (naming
    what to use instead), else a ``TypeError`` as Python's for an unknown keyword."""
    for key in kwargs:
        if key in _ONLY_THERE:
            raise ValueError(f"{owner}: {key} is laplace-torch's argument of {where}, not available here: "
                             f"{_ONLY_THERE[key]}.")
    raise TypeError(f"{owner}: {where}() got an unexpected keyword argument {next(iter(kwargs))!r}.")


def translate(owner: str, subset, subset_of_weights, hessian_structure, prior_structure, kwargs: dict):
    """laplace-torch's ``subset_of_weights``, ``hessian_structure`` and ``prior_structure`` checked and mapped:
    ``(subset, full, layerwise)``, ``full`` True for ``hessian_structure="full"`` (the rank becomes D),
    ``layerwise`` None, False (``"scalar"``) or True (``"layerwise"``).

    Raises
    ------
    ValueError
        A value with no counterpart (naming ours), or a clash with our own argument.
    """
    if kwargs:
        raise_laplace_torch_only(owner, "__init__", kwargs)
    if subset_of_weights is not None:
        if subset_of_weights not in ("all", "last_layer"):
            raise ValueError(f"{owner}: subset_of_weights={subset_of_weights!r} is not available; pass subset='all', "
                             "subset='last_layer' or subset=[the parameters] (laplace-torch's subset_of_weights "
                             "'all' and 'last_layer' are accepted).")
        if not (isinstance(subset, str) and subset in ("all", subset_of_weights)):
            raise ValueError(f"{owner}: subset and subset_of_weights (laplace-torch's name) must agree, got "
                             f"subset={subset!r} and subset_of_weights={subset_of_weights!r}; pass one.")
        subset = subset_of_weights
    if hessian_structure is not None and hessian_structure not in HESSIAN_STRUCTURES:
        raise ValueError(f"{owner}: hessian_structure={hessian_structure!r} is not available; pyro_fa's curvature is "
                         "low-rank plus diagonal: use rank=K (the K leading directions, the rest in the diagonal; "
                         "hessian_structure='lowrank', the default here) or hessian_structure='full' (rank=D, the "
                         "curvature kept exactly, small D).")
    if prior_structure is not None and prior_structure not in PRIOR_STRUCTURES:
        raise ValueError(f"{owner}: prior_structure={prior_structure!r} is not available; use 'scalar' or "
                         "'layerwise' (prior_precision of shape (1,) or one per parameter tensor, (L,)).")
    layerwise = None if prior_structure is None else _LAYERWISE_PRIOR[prior_structure]
    return subset, _FULL_CURVATURE.get(hessian_structure, False), layerwise


#: the largest D whose dense (D, D) posterior precision or covariance is formed
MAX_DENSE_DIM = 20_000


def _dense(la, what: str):
    name = type(la).__name__
    if la._sharding is not None:
        raise ValueError(f"{name}: {what} is a dense (D, D) matrix, which a sharded approximation (each rank "
                         f"holding rows [lo, hi) of D={la.dim}) does not form; use get_posterior().")
    if la.dim > MAX_DENSE_DIM:
        raise ValueError(f"{name}: {what} is a dense (D, D) matrix, here D={la.dim} > {MAX_DENSE_DIM}; use "
                         "get_posterior(), a distribution with O(DK) memory (its variance, precision_matvec, "
                         "covariance_matvec, log_prob and rsample).")
    la._check_fitted(what)
    return la._posterior()


def dense_precision(la) -> Tensor:
    r"""laplace-torch's ``posterior_precision``: :math:`P = \mathrm{diag}(\delta) + \frac{N}{\sigma^2}(FF^\top +
    \Psi)` as a dense Tensor of shape (D, D), for D <= 20 000 (a new tensor on each access).

    Raises
    ------
    ValueError
        Larger D, or a sharded approximation: use the posterior distribution (``get_posterior()``).
    """
    return _dense(la, "posterior_precision").precision_matrix


def dense_covariance(la) -> Tensor:
    r"""laplace-torch's ``posterior_covariance``: :math:`P^{-1}`, a dense Tensor of shape (D, D), for
    D <= 20 000 (a new tensor on each access; see :attr:`posterior_precision`)."""
    return _dense(la, "posterior_covariance").covariance_matrix


def shaped_prior(owner: str, prior_precision, layerwise, n_layers: int):
    """``prior_precision`` (checked, shape (1,) or (L,)) in the shape ``prior_structure`` asks for: (L,) for
    ``"layerwise"`` (a scalar repeated), (1,) for ``"scalar"``; as it is without one (``layerwise`` None)."""
    if layerwise is not None and prior_precision.numel() != (n_layers if layerwise else 1):
        if layerwise and prior_precision.numel() == 1:
            return prior_precision.expand(n_layers).clone()
        raise ValueError(f"{owner}: prior_precision must have shape ({n_layers if layerwise else 1},) "
                         f"for prior_structure={'layerwise' if layerwise else 'scalar'!r}, got shape "
                         f"{tuple(prior_precision.shape)!r}.")
    return prior_precision
