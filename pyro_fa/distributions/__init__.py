r"""The one family of distributions every posterior of pyro_fa returns from ``get_posterior()``.

Gaussians over the flattened weights :math:`\theta \in \mathbb{R}^D` whose covariance or precision is low rank
plus diagonal, behind one interface (:class:`FactorNormal`: ``mean``, ``variance``, ``stddev``, ``log_prob``,
``rsample`` / ``sample`` with ``generator=``, ``entropy``, ``covariance_matvec``, ``cov_factor``, ``cov_diag``,
``covariance_matrix`` at small :math:`D`):

* :class:`StableLowRankMultivariateNormal` — covariance :math:`FF^\top + \Psi` (SWAG, online FA, the guide);
* :class:`LowRankPrecisionNormal`, :class:`BlockLowRankPrecisionNormal` — precision :math:`\mathrm{diag}(a) + UU^\top`,
  one low-rank part or one per block (Laplace);
* :class:`PointMassNormal` — covariance 0 (any posterior at scale 0);
* :class:`FactorNormalMixture` — a mixture of members (MultiSWAG).

Layering: this package needs only torch (and :mod:`pyro_fa._random`); it is the lowest layer, beside the
factor-analysis core :mod:`pyro_fa.fa`, which imports it (for the distribution it returns and the shared numerics
of :mod:`pyro_fa.distributions.numerics`), never the other way round. The sharded forms live with the sharded
code (:mod:`pyro_fa.distributed`).
"""
from pyro_fa.distributions import numerics
from pyro_fa.distributions.base import FactorNormal, draw
from pyro_fa.distributions.covariance import StableLowRankMultivariateNormal
from pyro_fa.distributions.mixture import FactorNormalMixture
from pyro_fa.distributions.point_mass import PointMassNormal
from pyro_fa.distributions.precision import BlockLowRankPrecisionNormal, LowRankPrecisionNormal

__all__ = [
    "draw",
    "numerics",
    "FactorNormal",
    "StableLowRankMultivariateNormal",
    "LowRankPrecisionNormal",
    "BlockLowRankPrecisionNormal",
    "PointMassNormal",
    "FactorNormalMixture",
]
