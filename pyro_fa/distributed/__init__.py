r"""Factor-analysis posteriors under ``torch.distributed``: sharded fits, DDP, data-parallel SVI.

Three patterns, one process per device (launched by ``torchrun`` or
``torch.multiprocessing.spawn``), every rank running the same program:

* **Sharded online FA.** ``OnlineFactorAnalysis(dim, rank, process_group=group)`` holds
  this rank's rows ``[lo, hi)`` (:func:`shard_bounds`) of :math:`c`, :math:`F`,
  :math:`\psi` and of every statistic, and is fed the same rows of each vector. The
  E-step needs only sums over :math:`D` (:math:`F^\top\Psi^{-1}(\theta - c)`, :math:`K`
  numbers per vector, and :math:`F^\top\Psi^{-1}F`, :math:`K\times K`): online EM
  all-reduces :math:`K + K^2` numbers (plus a few scalars per rank) once per update,
  the M-step is row-local, and the fit equals the single-process fit on the
  concatenated vector to rounding. Memory per rank: :math:`O(DK/W)`.
* **DDP.** ``SWAG(ddp_model, rank=K)`` detects ``DistributedDataParallel`` (and uses its
  process group): the weights are replicated, so each rank collects only its rows of
  :math:`\theta`, once per step; :meth:`SWAG.sample`, :meth:`SWAG.predict`
  and :meth:`SWAG.sampled_weights` assemble whole sampled vectors by an all-gather and
  agree on every rank.
* **Data-parallel SVI.** :class:`AllReduceOptim` wraps a ``pyro.optim`` optimizer (as
  Pyro's ``HorovodOptimizer`` does for Horovod): after each rank's
  ``elbo.loss_and_grads`` on its share of the data it averages the guide's gradients
  over the ranks in one all-reduce, then steps. Each rank's model scales its
  likelihood to the whole data, ``pyro.plate("data", N, subsample=local_indices(N))``,
  so that each rank's ELBO estimates the full-data ELBO and their average is an
  unbiased estimate with :math:`W` times the particles.

Every object built with a process group first checks (one ``all_gather_object``) that
the ranks passed the same arguments (rank, method, dtype, dimension, ...): a mismatch
raises the same error on every rank instead of leaving some waiting in a collective.
Sharded objects' methods that touch the posterior are collective: call them on every
rank, in the same order (as DDP's forward and backward).

Examples
--------
Two processes (``torchrun --nproc_per_node 2 script.py``)::

    import torch.distributed as dist
    from pyro_fa import OnlineFactorAnalysis
    from pyro_fa.distributed import shard_bounds

    dist.init_process_group("gloo")                 # "nccl" on GPUs
    D, K = 1_000_000, 20
    lo, hi = shard_bounds(D, dist.get_world_size(), dist.get_rank())
    fa = OnlineFactorAnalysis(D, K, process_group=dist.group.WORLD, seed=0)
    for theta in stream:                            # theta: whole vectors, or this rank's rows
        fa.update(theta[lo:hi])
    draws = fa.sample(8)                            # (8, hi - lo): this rank's rows of 8 coherent draws

The package is the one place that knows about ranks; the factor-analysis core (:mod:`pyro_fa.fa`) is
single-process:

* :mod:`~pyro_fa.distributed.sharding` — :func:`shard_bounds`, :class:`Sharding` (the packed collectives),
  the agreement of the ranks' arguments and checkpoints, the sharded initial factor;
* :mod:`~pyro_fa.distributed.online` — :class:`ShardedOnlineFactorAnalysis`, what
  ``OnlineFactorAnalysis(..., process_group=...)`` builds: the core's fit around any shardable fitter, its
  sums over :math:`D` all-reduced;
* :mod:`~pyro_fa.distributed.normal`, :mod:`~pyro_fa.distributed.laplace` — the sharded posteriors
  :class:`ShardedLowRankNormal` (covariance form) and :class:`ShardedLowRankPrecisionNormal` (precision
  form), members of the family :class:`pyro_fa.distributions.FactorNormal`;
* :mod:`~pyro_fa.distributed.swag` — a :class:`~pyro_fa.SWAG`'s rows, local or sharded (DDP detected);
* :mod:`~pyro_fa.distributed.data_parallel` — :func:`local_indices`, :class:`ShardedParameters`,
  :class:`AllReduceOptim`, :func:`check_agreement`.
"""

from pyro_fa.distributed.sharding import Sharding, shard_bounds
from pyro_fa.distributed.normal import ShardedLowRankNormal
from pyro_fa.distributed.laplace import (ShardedLowRankPrecisionNormal, all_reduce_sum, make_laplace_sharding,
                                         replicated)
from pyro_fa.distributed.online import ShardedOnlineFactorAnalysis
from pyro_fa.distributed.swag import unwrap_ddp
from pyro_fa.distributed.data_parallel import AllReduceOptim, ShardedParameters, check_agreement, local_indices

__all__ = [
    "shard_bounds",
    "local_indices",
    "Sharding",
    "ShardedOnlineFactorAnalysis",
    "ShardedLowRankNormal",
    "ShardedLowRankPrecisionNormal",
    "ShardedParameters",
    "AllReduceOptim",
    "check_agreement",
    "unwrap_ddp",
    "all_reduce_sum",
    "replicated",
    "make_laplace_sharding",
]
