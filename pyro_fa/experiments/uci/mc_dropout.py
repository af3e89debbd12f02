r"""MC dropout's column of the ``pyro-fa uci`` benchmark (Gal & Ghahramani 2016, Section 5.3 and the authors'
UCI experiments, ``DropoutUncertaintyExps``).

Each fit: the network of the other columns (one hidden layer of 50 ReLU units, 100 for protein) with dropout
of rate :math:`p` on its input and on its hidden layer, at training and at prediction time, trained by Adam at
the authors' rate (Keras's default, :data:`ADAM_LR`) on the mean squared error plus weight decay on the weights
(not the biases), the authors' objective

.. math::

    \frac1B \sum_{b=1}^B \big(y_b - \hat f(x_b)\big)^2 + \lambda \sum_l \lVert W_l \rVert^2, \qquad
    \lambda = \frac{l^2 (1 - p)}{2 N \tau}

(:func:`weight_decay`; prior length-scale :math:`l` = :data:`LENGTHSCALE`, :math:`N` training points, model
precision :math:`\tau`). The predictive is the mixture over :math:`T` stochastic passes of
:math:`N(\hat f_t(x), 1/\tau)`: the test log-likelihood is their log-sum-exp minus :math:`\log T`, in the original
units of y as every column reports it. :math:`\tau` and the noise are in standardised units (the authors'
``tau_values.txt`` are in original units, while their weight decay uses the same value on standardised targets;
here one precision serves both). :math:`T` is the budget's draw count (``Budget.test_samples``, 100, as the other
sampled columns; the paper's 10 000), ``Budget.eval_samples`` at the search's checkpoints.

The search is the other columns': every (dropout rate, :math:`\tau`) of the grid — the authors' rates
:data:`DROPOUT_RATES` times :data:`TAUS`, the ratios (1, 5, 10, 20, 100) of their Boston grid from
:math:`\tau = 1` (noise of y's own spread; their Boston base, 0.016 in original units, is 1.35 here) — on every
tuning split, the validation log-likelihood every ``steps / checkpoints`` steps over the budget's ``steps`` (Adam's
rate on the budget's half cosine, full batch up to ``Budget.batch_limit`` points, batches of ``batch_size``
above), stopped early as the VI columns' search is (:func:`~pyro_fa.experiments.uci.protocol.train`), then the
(setting, step count) of best mean; every split is then trained on its whole training part and tested once. All
fits of a stage are one batch of tensors (each replica its own data, masks, rate and weight decay; Adam's update
is per coordinate, so the replicas train independently). A budget of one Adam rate (``--quick``) tries
:data:`QUICK_GRID` only.

References
----------
Y. Gal & Z. Ghahramani (2016), *Dropout as a Bayesian approximation: representing model uncertainty in deep
learning*, ICML, Section 5.3.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch
from torch import Tensor

from pyro_fa.experiments.uci.protocol import Budget, SplitData, _batch_size, _choose, checkpointer, final_data, \
    final_record, tuning_data
from pyro_fa.nn.batched import BatchedMLP, sample_rows, take_rows

__all__ = ["ADAM_LR", "DROPOUT_RATES", "LENGTHSCALE", "QUICK_GRID", "TAUS", "DropoutReplicas", "run_mc_dropout",
           "weight_decay"]

#: the authors' dropout rates on UCI
DROPOUT_RATES = (0.005, 0.01, 0.05, 0.1)
#: model precisions (standardised y): the ratios of the authors' Boston grid, from 1
TAUS = (1.0, 5.0, 10.0, 20.0, 100.0)
QUICK_GRID = ((0.05, 10.0),)
#: the prior length-scale of the authors' weight decay
LENGTHSCALE = 1e-2
#: Keras's default Adam rate, the authors'
ADAM_LR = 1e-3
#: draws x replicas x points x width held at once when predicting
_CHUNK = 1 << 24


def weight_decay(rate, tau, n: int, lengthscale: float = LENGTHSCALE):
    r"""The authors' weight decay :math:`\lambda = l^2 (1 - p) / (2 N \tau)` (Gal & Ghahramani 2016, Section 5.3;
    ``reg`` of their ``net.py``): the coefficient of :math:`\sum_l \lVert W_l \rVert^2` in the mean squared error.
    ``rate`` and ``tau`` floats or tensors (broadcast)."""
    return lengthscale ** 2 * (1 - rate) / (2 * n * tau)


class DropoutReplicas:
    r"""R networks with dropout on the input of every linear layer (MC dropout), trained as one batch.

    Replica :math:`r` has its weights :math:`\theta_r` (:class:`~pyro_fa.nn.BatchedMLP`'s layout, ReLU, started
    as ``nn.Linear`` starts), dropout rate :math:`p_r`, model precision :math:`\tau_r` and weight decay
    :func:`weight_decay` for its ``n`` training points. Train it with :meth:`optimizer` on the sum of
    :meth:`loss`; :meth:`predict` gives the stochastic passes the predictive mixes.

    Parameters
    ----------
    mlp : BatchedMLP
    rate, tau : Tensor of shape (R,)
        Dropout rates in [0, 1) and model precisions (standardised y), on the data's device and dtype.
    n : int
        Training points per replica (the weight decay's :math:`N`).
    init_generator : torch.Generator, optional
        Draws the initial weights (on the CPU).
    mask_generator : torch.Generator, optional
        Draws the dropout masks, on the device of ``rate``.

    See Also
    --------
    run_mc_dropout : the benchmark's column.
    """

    def __init__(self, mlp: BatchedMLP, rate: Tensor, tau: Tensor, n: int,
                 init_generator: Optional[torch.Generator] = None, mask_generator: Optional[torch.Generator] = None):
        self.mlp, self.rate, self.tau = mlp, rate, tau
        self.decay = weight_decay(rate, tau, n)
        self.theta = mlp.init(rate.shape[0], generator=init_generator, dtype=rate.dtype,
                              device=rate.device).requires_grad_(True)
        self._gen = mask_generator

    def optimizer(self) -> torch.optim.Adam:
        """Adam at :data:`ADAM_LR` on the weights of every replica."""
        return torch.optim.Adam([self.theta], lr=ADAM_LR)

    def _drop(self, h: Tensor) -> Tensor:
        """``h`` (..., R, N, k) with each entry kept with probability 1 - p_r and scaled by 1 / (1 - p_r)."""
        rate = self.rate.reshape(-1, 1, 1)
        u = torch.rand(h.shape, generator=self._gen, dtype=h.dtype, device=h.device)
        return h * (u >= rate) / (1 - rate)

    def forward(self, theta: Tensor, x: Tensor) -> Tensor:
        """One stochastic pass per leading index: x (..., R, N, p) -> outputs (..., R, N), fresh masks per entry."""
        w = self.mlp.unflatten(theta)
        h = x
        for layer in range(len(self.mlp.layers)):
            if layer:
                h = h.relu()
            h = self._drop(h) @ w[f"{2 * layer}.weight"].transpose(-1, -2) + w[f"{2 * layer}.bias"].unsqueeze(-2)
        return h.squeeze(-1)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        r"""Per replica, shape (R,): the mean squared error of one stochastic pass over the batch x (R, B, p),
        y (R, B), plus :math:`\lambda_r \sum_l \lVert W_l \rVert^2`."""
        w = self.mlp.unflatten(self.theta)
        decay = sum(w[f"{2 * layer}.weight"].square().sum((-1, -2)) for layer in range(len(self.mlp.layers)))
        return (y - self.forward(self.theta, x)).square().mean(-1) + self.decay * decay

    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int):
        """``num_samples`` stochastic passes at x (R, M, p): means (S, R, M) and the noise variances 1 / tau (R, 1)."""
        R, M = x.shape[0], x.shape[1]
        chunk = max(1, _CHUNK // (R * M * max(w for _, w in self.mlp.layers)))
        theta = self.theta.detach()
        means = [self.forward(theta, x.expand(min(chunk, num_samples - s), *x.shape))
                 for s in range(0, num_samples, chunk)]
        return torch.cat(means), (1 / self.tau).unsqueeze(-1)


def _grid(budget: Budget) -> List[dict]:
    pairs = QUICK_GRID if len(budget.lrs) == 1 else [(p, t) for p in DROPOUT_RATES for t in TAUS]
    return [{"dropout": p, "tau": t} for p, t in pairs]


def _train(model: DropoutReplicas, data: SplitData, steps: int, budget: Budget, seed: int, checkpoint=None,
           progress=None) -> None:
    """``steps`` Adam steps of every replica on its own data, the rate on the budget's half cosine over
    ``budget.steps`` (a fit stopped early has followed the rates of a longer one); ``checkpoint(step, model)``
    after each step stops the fit when it returns True."""
    opt = model.optimizer()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget.steps)
    R, N = data.y.shape
    batch = _batch_size(data, budget)
    gen = torch.Generator(device=data.y.device).manual_seed(seed)
    for step in range(1, steps + 1):
        xb, yb = take_rows(data.x, data.y, sample_rows(R, N, batch, gen, data.y.device))
        opt.zero_grad(set_to_none=True)
        model.loss(xb, yb).sum().backward()
        opt.step()
        sched.step()
        if progress is not None:
            progress(1)
        if checkpoint is not None and checkpoint(step, model):
            break


def run_mc_dropout(method, splits, budget: Budget, seed: int, progress: Optional[Callable] = None, references=None,
                   fidelity: Optional[dict] = None) -> dict:
    """Search on the tuning splits, then train and test every split: MC dropout on one dataset (the return value
    of :func:`pyro_fa.experiments.uci.protocol.run_vi`'s form, with the chosen ``weight_decay`` per split;
    ``references`` and ``fidelity`` as there, the prior precision recorded being :math:`l^2`)."""
    width = splits[0].n_hidden or 50
    mlp = BatchedMLP(splits[0].x_train.shape[1], (width,) * method.depth)
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    configs = _grid(budget)
    index = torch.arange(n_tune, device=tune.x.device).repeat(len(configs))
    data = tune.take(index)
    model = _replicas(mlp, configs, data, n_tune, seed)
    curve, checkpoint = checkpointer(data, budget.steps, budget, budget.checkpoints, progress, patience=True,
                                     n_configs=len(configs))
    _train(model, data, budget.steps, budget, seed, checkpoint, progress)
    choice, val_ll, table = _choose(curve, configs, n_tune)
    final = final_data(splits)
    start = time.perf_counter()
    model = _replicas(mlp, [choice], final, final.y.shape[0], seed)
    _train(model, final, choice["steps"], budget, seed, progress=progress)
    seconds = (time.perf_counter() - start) / final.y.shape[0]
    means, nv = model.predict(final.x_eval, budget.test_samples)
    record = final_record(method, means, nv, final, splits, (choice, val_ll, table, n_tune), mlp.dim,
                          LENGTHSCALE ** 2, nv.reshape(-1).sqrt(), seconds, seed, references, fidelity)
    record["weight_decay"] = model.decay.tolist()
    return record


def _replicas(mlp: BatchedMLP, configs, data: SplitData, repeat: int, seed: int) -> DropoutReplicas:
    """The replicas of ``configs``, each repeated ``repeat`` times (config-major), on ``data``'s device and dtype."""
    rate = data.x.new_tensor([c["dropout"] for c in configs]).repeat_interleave(repeat)
    tau = data.x.new_tensor([c["tau"] for c in configs]).repeat_interleave(repeat)
    return DropoutReplicas(mlp, rate, tau, data.x.shape[-2], torch.Generator().manual_seed(seed),
                           torch.Generator(device=data.x.device).manual_seed(seed))
