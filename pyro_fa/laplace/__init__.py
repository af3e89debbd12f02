r"""Laplace approximation with a factor-analysis curvature: the third way to a low-rank-plus-diagonal posterior.

* :class:`FactorLaplace` — post hoc at a trained network, laplace-torch's verbs (``fit``,
  ``log_marginal_likelihood``, ``optimize_prior_precision``, ``predict_proba`` / ``predict``), with one rank or a
  rank per layer (``rank=[400, 100, 100]``, or ``rank="auto"`` allocating a budget by the fitted spectrum);
* :class:`LowRankPrecisionNormal` — the Gaussian whose *precision* is low rank plus diagonal, the
  currency it hands to other layers (:class:`ShardedLowRankPrecisionNormal`: this rank's rows of it, what a
  fit with a ``process_group`` hands out; :class:`BlockLowRankPrecisionNormal`: its low-rank part block
  diagonal, held by blocks, what a fit with a rank per layer hands out);
* :mod:`pyro_fa.laplace.structures` — how the curvature is laid out (``"dense"``: one rank; ``"blocks"``: a rank
  per layer), a :class:`~pyro_fa.laplace.structures.Structure` registered by name;
* :class:`PyroFactorLaplace` — the same for a Pyro model at its ``AutoDelta`` MAP, handing back a guide for
  ``pyro.infer.Predictive`` (the :math:`O(DK)` counterpart of ``AutoLaplaceApproximation``);
* :func:`curvature_vectors`, :func:`select_parameters` — per-example GGN factors and Monte Carlo Fisher
  gradients by ``torch.func``; :func:`fit_second_moment` — their uncentred second moment fitted by the
  factor-analysis core.

"Laplace approximation" throughout: not :class:`pyro_fa.LaplacePrior`, the Laplace prior distribution.
"""
from pyro_fa.laplace.curvature import CURVATURES, curvature_vectors, flat_network, select_parameters
from pyro_fa.laplace.laplace import LIKELIHOODS, FactorLaplace
from pyro_fa.laplace.moment import MOMENT_FITS, fit_second_moment
from pyro_fa.distributions import BlockLowRankPrecisionNormal, LowRankPrecisionNormal
from pyro_fa.distributed import ShardedLowRankPrecisionNormal  # re-exported: the form a sharded fit returns
from pyro_fa.laplace.pyro_guide import PyroFactorLaplace

__all__ = ["FactorLaplace", "LowRankPrecisionNormal", "BlockLowRankPrecisionNormal", "ShardedLowRankPrecisionNormal", "PyroFactorLaplace",
           "curvature_vectors", "select_parameters", "flat_network", "fit_second_moment", "CURVATURES", "MOMENT_FITS",
           "LIKELIHOODS"]
