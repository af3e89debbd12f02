r"""The linearised (GLM) predictive of :class:`~pyro_fa.laplace.FactorLaplace` under a sharded posterior."""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor

from pyro_fa.distributed import ShardedLowRankPrecisionNormal, all_reduce_sum

__all__ = ["sharded_glm_moments"]


def sharded_glm_moments(f: Callable[[Tensor, Tensor], Tensor], theta: Tensor, x: Tensor,
                        posterior: ShardedLowRankPrecisionNormal, chunk_size: int) -> Tuple[Tensor, Tensor]:
    r"""Mean (N, C) and covariance (N, C, C) of the linearised network's outputs under a sharded posterior.

    :math:`J\Sigma J^\top = J\,\mathrm{diag}(1/a)\,J^\top - (JB)(JB)^\top` with :math:`J` the per-example
    Jacobians at the whole :math:`\theta_*` (every rank holds the network), of which each rank contracts its
    own columns with its rows of :math:`1/a` and :math:`B`: per chunk of examples one all-reduce of
    :math:`C^2 + CK` numbers per example. Equal to :func:`pyro_fa.predictive.glm.linearized_moments` on the
    whole posterior. Collective: every rank passes the same ``x``.
    """
    from pyro_fa.laplace.curvature import _jacobians

    sh = posterior.sharding
    sh.agree_sizes("FactorLaplace", "number of inputs to predict", int(x.shape[0]))
    c, B = posterior.cov_diag, posterior.cov_factor
    means, covs = [], []
    for lo in range(0, x.shape[0], chunk_size):
        out, J = _jacobians(f, theta.detach(), x[lo:lo + chunk_size])  # (b, C), (b, C, D)
        Jr = J[..., sh.lo:sh.hi]
        b, C = out.shape
        local = torch.cat([((Jr * c) @ Jr.transpose(-1, -2)).reshape(b, -1), (Jr @ B).reshape(b, -1)], -1)
        total = all_reduce_sum(local.detach(), sh)
        JB = total[:, C * C:].reshape(b, C, -1)
        covs.append(total[:, :C * C].reshape(b, C, C) - JB @ JB.transpose(-1, -2))
        means.append(out.detach())
    return torch.cat(means), torch.cat(covs)
