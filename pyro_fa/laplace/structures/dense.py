r"""``"dense"``: one factor :math:`F` (D, K) over all the weights, the default for an int ``rank``.

:math:`FF^\top + \Psi` fitted by :func:`~pyro_fa.laplace.moment.fit_second_moment` (any ``curvature_fit``,
shardable), held in the buffer ``cov_factor``; the posterior a :class:`~pyro_fa.distributions.LowRankPrecisionNormal`
(:class:`~pyro_fa.distributed.ShardedLowRankPrecisionNormal` under a ``process_group``: this rank's rows).
"""
from __future__ import annotations

from pyro_fa.distributed import ShardedLowRankPrecisionNormal
from pyro_fa.distributions import LowRankPrecisionNormal
from pyro_fa.laplace._sharded_glm import sharded_glm_moments
from pyro_fa.laplace.moment import fit_second_moment
from pyro_fa.laplace.structures.base import Structure, register_structure
from pyro_fa.predictive.glm import check_eval_mode

__all__ = ["DenseLowRank"]


@register_structure("dense")
class DenseLowRank(Structure):
    """One rank ``K`` for all weights: the buffer ``cov_factor`` of shape (D, min(K, D)), or this rank's rows."""

    @classmethod
    def accepts(cls, rank) -> bool:
        return isinstance(rank, int) and not isinstance(rank, bool)

    def register_factor(self, module, rows, ref):
        module.register_buffer("cov_factor", ref.new_zeros(rows, min(self.width, module.dim)))

    def fit(self, passes, dim, *, method, num_passes, seed, dtype, device, owner, process_group=None):
        return fit_second_moment(passes, dim, self.width, method=method, num_passes=num_passes, seed=seed,
                                 dtype=dtype, device=device, owner=owner, process_group=process_group)

    def posterior(self, buffers, loc, prec_diag, scale, sharding=None):
        prec_factor = buffers["cov_factor"] * scale.sqrt()
        if sharding is not None:
            return ShardedLowRankPrecisionNormal(loc, prec_factor, prec_diag, sharding)
        return LowRankPrecisionNormal(loc, prec_factor, prec_diag)

    def glm_moments(self, posterior, x, *, owner, model, f, loc, params, chunk_size, sharding=None):
        if sharding is None:
            return super().glm_moments(posterior, x, owner=owner, model=model, f=f, loc=loc, params=params,
                                       chunk_size=chunk_size)
        check_eval_mode(owner, model, "model")  # before any collective
        # the whole linearisation point (D numbers, gathered) and each rank's rows of the posterior
        return sharded_glm_moments(f, sharding.all_gather(loc), x, posterior(), chunk_size)
