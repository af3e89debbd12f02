r"""Many independent fits of one network, trained as one batch of tensors.

Tuning a prior precision, running five seeds or training an ensemble means R fits of
the same network. Through ``pyro.infer.SVI`` each step of each fit pays milliseconds of
Python and tracing for a small network; here the R *replicas* share every tensor
operation, with a leading replica dimension, and one Python dispatch
(the online documentation's *Batched training* page has the measured speed-up and how
to reproduce it):

* :class:`BatchedMLP` — an ``nn.Sequential(Linear, ReLU|Tanh, …, Linear(·, 1))`` whose
  weights are one vector per replica (``from_module``, ``flatten``, ``to_module``);
* :class:`BatchedVI` — R Bayesian regressions with a guide per replica: our
  factor-analysis guide (``"fa"``, ``"ppca"``), Pyro's ``AutoLowRankMultivariateNormal``,
  ``AutoNormal`` or ``AutoDelta`` (MAP), each tested equal in loss and gradients to the
  Pyro classes;
* :func:`fit_batched` — the training loop (minibatches, learning-rate schedule,
  progress, a callback for early stopping); :func:`sample_rows` and :func:`take_rows`, the
  minibatch it draws at each step, for a training loop of one's own;
* :func:`replica_log_likelihood`, :func:`replica_metrics` — held-out scores of every
  replica through :mod:`pyro_fa.metrics`.

:meth:`BayesianNetwork.fit_many <pyro_fa.nn.BayesianNetwork.fit_many>` trains copies of a
torch network this way and returns them as :class:`~pyro_fa.nn.BayesianNetwork` objects.
See the online documentation's *Batched training* page.
"""
from pyro_fa.nn.batched.evaluation import replica_log_likelihood, replica_metrics
from pyro_fa.nn.batched.fit import fit_batched, sample_rows, take_rows
from pyro_fa.nn.batched.mlp import BatchedMLP
from pyro_fa.nn.batched.vi import BatchedVI

__all__ = ["BatchedMLP", "BatchedVI", "fit_batched", "replica_log_likelihood", "replica_metrics", "sample_rows",
           "take_rows"]
