r"""The curvature structure of :class:`~pyro_fa.laplace.FactorLaplace`: how the fitted curvature is laid out.

A structure turns the stream of per-example curvature vectors :math:`v` (:mod:`pyro_fa.laplace.curvature`) into
the curvature per example :math:`FF^\top + \Psi` in its own layout, holds the layout's buffers on the
approximation (so that its :meth:`~torch.nn.Module.state_dict` keys are the layout's), and answers what the
approximation asks of it: the posterior at given hyperparameters, the GLM predictive's moments and the log
determinant the evidence needs. :class:`~pyro_fa.laplace.FactorLaplace` holds one and never branches on which.

A new structure is one class registered by name (:func:`register_structure`), chosen by
``FactorLaplace(..., structure=name)``; without ``structure`` the first registered structure whose
:meth:`Structure.accepts` takes the ``rank`` argument is used (an int: ``"dense"``; a list, dict or ``"auto"``:
``"blocks"``). ``docs/architecture.md`` ("Add a curvature structure") shows one.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa._registry import ClassRegistry
from pyro_fa.predictive.glm import linearized_moments

__all__ = ["Structure", "STRUCTURES", "register_structure", "get_structure"]


class Structure:
    """The base class of curvature structures (see the module): its defaults are those of one factor :math:`F`.

    Parameters
    ----------
    width : int
        The columns of the whole factor :math:`F` (``FactorLaplace.rank``).
    """

    name: str = ""

    def __init__(self, width: int):
        self.width = width

    # ------------------------------------------------------------------ choice and construction
    @classmethod
    def accepts(cls, rank) -> bool:
        """Whether this structure is the default one for ``FactorLaplace(rank=rank)`` (none by default: a structure
        that returns False is used only when named by ``structure=``)."""
        return False

    @classmethod
    def build(cls, owner: str, rank, named, *, curvature_fit: str, process_group=None, rank_budget=None,
              rank_max=None) -> "Structure":
        """The structure for ``FactorLaplace``'s arguments (``named``: the subset's ``(name, parameter)`` pairs),
        checked: raises ``ValueError`` / ``TypeError`` naming the argument. Default: one factor of ``rank``
        columns, ``rank_budget`` and ``rank_max`` refused."""
        for arg, value in (("rank_max", rank_max), ("rank_budget", rank_budget)):
            if value is not None:
                raise ValueError(f"{owner}: {arg} is only used with rank='auto', got rank={rank!r} and "
                                 f"{arg}={value!r}.")
        return cls(rank)

    def register_factor(self, module: torch.nn.Module, rows: int, ref: Tensor) -> None:
        """Register the buffers of the factor on ``module`` (``rows`` of them on this rank), zeros of ``ref``'s dtype
        and device; called before ``cov_diag`` is registered. Default: none."""

    def register_extra(self, module: torch.nn.Module, ref: Tensor) -> None:
        """Register the layout's other buffers, after the approximation's own. Default: none."""

    # ------------------------------------------------------------------ fit
    def fit(self, passes: Callable[[], Iterator[Tensor]], dim: int, **options) -> Tuple[object, Tensor, dict]:
        r"""Fit :math:`FF^\top + \Psi \approx \frac1V\sum_v vv^\top` to the stream ``passes`` (each call one pass,
        blocks of vectors (V_b, D)); ``options``: ``method``, ``num_passes``, ``seed``, ``dtype``, ``device``,
        ``owner``, ``process_group``. Returns the factor (in the layout's form), :math:`\psi` and an ``info`` dict
        with ``n_vectors``, :math:`V`."""
        raise NotImplementedError

    def store(self, buffers: Dict[str, Tensor], factor, psi: Tensor, ratio: float, prior: Tensor, scale: float,
              info: dict) -> Dict[str, Tensor]:
        r"""The buffers to set from a fit of :math:`G/V` rescaled by ``ratio`` :math:`= V/N` to the curvature per
        example (``prior``: :math:`\delta` per weight, ``scale``: :math:`N/\sigma^2`, for a layout that allocates
        by them): a dict with ``cov_diag`` and the factor's buffers (the approximation rebinds them in new storage).
        Buffers whose shape changes may be rebound in ``buffers`` here."""
        return {"cov_factor": factor * ratio ** 0.5, "cov_diag": psi * ratio}

    # ------------------------------------------------------------------ what the approximation asks
    def posterior(self, buffers: Dict[str, Tensor], loc: Tensor, prec_diag: Tensor, scale: Tensor, sharding=None):
        r""":math:`N(\theta_*, P^{-1})`, :math:`P = \mathrm{diag}(` ``prec_diag`` :math:`) + s\,FF^\top`, ``scale``
        :math:`= s`, a :class:`~pyro_fa.distributions.FactorNormal` owning its storage (``loc`` is a copy)."""
        raise NotImplementedError

    def glm_factor(self, post):
        """The posterior's covariance factor in the form :func:`~pyro_fa.predictive.glm.linearized_moments` takes."""
        return post.cov_factor

    def glm_moments(self, posterior: Callable[[], object], x, *, owner: str, model, f, loc: Tensor, params,
                    chunk_size: int, sharding=None):
        r"""The GLM predictive's mean :math:`f(x; \theta_*)` and covariance :math:`J_x P^{-1} J_x^\top` (unscaled),
        ``posterior()`` the approximation's posterior."""
        post = posterior()
        return linearized_moments(model, loc, x, cov_diag=post.cov_diag, cov_factor=self.glm_factor(post),
                                  factor_sign=-1.0, chunk_size=chunk_size, params=params)

    def log_det(self, post) -> Tensor:
        r""":math:`\log\det P` of the posterior (the evidence's Occam factor, before the prior's)."""
        return post.log_det_precision()

    def cov_factor(self, buffers: Dict[str, Tensor], loc: Tensor) -> Tensor:
        """:math:`F` as one (D, K) Tensor (the buffer ``cov_factor``; raises ``AttributeError`` before it exists)."""
        if "cov_factor" not in buffers:
            raise AttributeError("cov_factor")
        return buffers["cov_factor"]

    def block_factors(self, owner: str, buffers: Dict[str, Tensor], rank) -> List[Tuple[int, int, Tensor]]:
        """``(lo, hi, F_b)`` per block; refused by a layout without blocks."""
        raise ValueError(f"{owner}: block_factors needs a rank per block (a list, dict or 'auto'), got rank={rank}; "
                         "use cov_factor.")

    # ------------------------------------------------------------------ state
    def check_layout(self, owner: str, state_dict, rank) -> None:
        """Refuse (``ValueError``, nothing loaded) the state of another layout, naming both. Default: a state with
        ``block_ranks`` (a rank per block)."""
        saved = state_dict.get("block_ranks")
        if saved is not None:
            got = saved.tolist() if torch.is_tensor(saved) else saved
            raise ValueError(f"{owner}: state_dict must come from a fit with one rank for all weights, like this one "
                             f"(rank={rank}), got a fit with a rank per block (block_ranks {got!r}); nothing was "
                             "loaded. Construct it with the rank it was fitted with (a list, dict or 'auto').")

    def prepare_load(self, owner: str, buffers: Dict[str, Tensor], state_dict) -> None:
        """Check the layout's own keys of ``state_dict`` and give the factor's buffers the shapes it holds (called
        with the approximation's buffers restored if it raises). Default: nothing to do."""

    def describe(self, buffers: Dict[str, Tensor]) -> str:
        """What ``extra_repr`` adds (empty by default)."""
        return ""


#: the curvature structures by name (:func:`register_structure`)
STRUCTURES = ClassRegistry("register_structure", Structure, "structure")
register_structure = STRUCTURES.register


def get_structure(owner: str, structure: Optional[str], rank) -> type:
    """The structure class named by ``structure``, or (None) the first registered one that accepts ``rank``."""
    if structure is not None:
        return STRUCTURES.get(structure, owner)
    return next((cls for cls in STRUCTURES.view.values() if cls.accepts(rank)), STRUCTURES.get("blocks", owner))
