r"""Optimizers that learn a posterior while training.

* :class:`FactorIVON` — IVON's variational online Newton (Shen et al. 2024) with a low-rank-plus-diagonal
  precision: :math:`q(\theta) = N(m, P^{-1})`, :math:`P = \lambda(\mathrm{diag}(\psi) + UU^\top)`, at about
  Adam's cost; ``rank=0`` is IVON; data parallel under ``torch.distributed`` with ``sync=True`` or
  ``process_group=`` (:mod:`pyro_fa.optim._distributed`);
* :class:`BatchedFactorIVON` — R independent FactorIVON runs over one small network's weights (R, D), one
  batch of tensors (:class:`pyro_fa.nn.batched.BatchedMLP`'s layout), each replica with its own ``lr``,
  ``hess_init``, ``ess``, ``weight_decay`` and ``beta2``: a grid search's points and splits train together;
* :data:`CURVATURES` — the curvature estimates FactorIVON's low-rank part can track (its ``curvature``), each
  mapped to whether it needs ``batch_size``;
* :class:`WeightPosterior` — a distribution over a module's weights as a :class:`~pyro_fa.predictive.Posterior`
  (``predict``, ``predict_proba``, ``tune_scale``, ...): what :meth:`FactorIVON.posterior` returns.

Layer: beside :mod:`pyro_fa.swag` and :mod:`pyro_fa.laplace`; needs :mod:`pyro_fa.distributions` and
:mod:`pyro_fa.predictive`, and :mod:`pyro_fa.distributed` for a process group.
"""
from pyro_fa.optim._checks import CURVATURES
from pyro_fa.optim.batched import BatchedFactorIVON
from pyro_fa.optim.factor_ivon import FactorIVON
from pyro_fa.optim.posterior import WeightPosterior

__all__ = ["BatchedFactorIVON", "CURVATURES", "FactorIVON", "WeightPosterior"]
