r"""FactorIVON's column of the ``pyro-fa uci`` benchmark: the 1×50 network trained by
:class:`pyro_fa.optim.FactorIVON`'s update (IVON with a low-rank-plus-diagonal precision, rank ``Budget.rank``),
every fit of a phase as one replica of :class:`pyro_fa.optim.BatchedFactorIVON`: the whole grid on every tuning
split trains as one batch, then every split's final fit as another (:func:`pyro_fa.nn.batched.sample_rows`'
minibatches, drawn with replacement; a replica whose gradients or state turn non-finite, or whose minibatch loss
passes :data:`EXPLODED_LOSS`, is frozen and scores −∞ from then on, the others unaffected; a final fit that
diverged is trained again at half the rate, up to :data:`BACKOFF` times, and a split whose final fit still
diverged scores test LL −∞ and is listed under the record's ``"diverged"``, its frozen weights not scored).

Each fit: the ReLU network with one hidden layer of 50 units (``n_hidden``), a Gaussian likelihood whose noise
scale is learned as in the other methods (a point estimate, here by Adam at :data:`NOISE_LR` on the same
minibatch losses, from 1 in standardised units), FactorIVON with ``ess`` = the number of training points N, weight
decay (the prior precision per point) ``precision / N``, one draw per step, the low-rank part refreshed every
:data:`UPDATE_EVERY` steps, ``diag_floor`` :data:`DIAG_FLOOR`, IVON's rate following the budget's half cosine
over ``Budget.steps``; full batch up to ``Budget.batch_limit`` points, batches of ``Budget.batch_size`` above.
The search is the other methods': every prior precision of ``Budget.precisions`` (as the other methods search
theirs) x rate x initial Hessian x Hessian decay (:data:`IVON_LRS` x :data:`IVON_HESS_INITS` x :data:`BETA2S`)
on every tuning split, the validation log-likelihood (``Budget.eval_samples`` draws) every ``steps / checkpoints``
steps (stopping early as the other methods' search does, and halving the settings still training at
:data:`HALVE_AT` of the steps), the (setting, step count) of best mean; then every split
is trained on its whole training part and tested once (``Budget.test_samples`` draws). A budget of one Adam rate
(``--quick``) tries :data:`QUICK_GRID` only, at each of its prior precisions and the first decay.
:data:`PRECISIONS` replaces the budget's prior precisions when set.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.experiments.uci.protocol import Budget, SplitData, _choose, final_data, final_record, heldout_ll, \
    tuning_data
from pyro_fa.nn.batched import BatchedMLP, sample_rows, take_rows
from pyro_fa.optim import BatchedFactorIVON

__all__ = ["BACKOFF", "BETA2S", "DIAG_FLOOR", "EXPLODED_LOSS", "HALVE_AT", "HALVING", "IVON_LRS", "IVON_HESS_INITS",
           "QUICK_GRID", "run_factor_ivon", "run_ivon"]

#: the rates and initial Hessians searched, with every prior precision of ``Budget.precisions`` (the weight decay
#: ``precision / N``, as the other methods search their prior): IVON's classification grid of ``pyro-fa classify``
#: (rates 0.4-6.4, initial Hessians 0.01-2) put every UCI choice at its edge (the lowest rate, the largest Hessian;
#: benchmarks/results/factor_ivon_benchmarks.md), so the grid reaches lower rates and larger initial Hessians, as a
#: Gaussian likelihood's curvature per point (1 / noise variance in standardised units) is larger than a softmax's
IVON_LRS = (0.1, 0.4)
IVON_HESS_INITS = (1.0, 10.0, 100.0)
QUICK_GRID = ((0.4, 10.0),)
#: the prior precisions searched instead of ``Budget.precisions`` (None: the budget's)
PRECISIONS = None
UPDATE_EVERY = 10
#: FactorIVON's ``diag_floor`` here: the optimizer's default. At 1 the low-rank part is shrunk to nothing (the
#: column would be IVON with P refreshed every UPDATE_EVERY steps). Naval's final fits at the chosen setting diverge
#: on 9 of 20 splits at 0.25 and 8 at 0.5 (IVON, rank 0: 2 of 20): the learned noise scale falls (the likelihood's
#: curvature rising as its inverse square) while ``h`` stays near ``hess_init`` at beta2 0.99999, and steps off the
#: low-rank directions, up to 1 / diag_floor x IVON's, cross the stability edge first
#: (benchmarks/results/factor_ivon_benchmarks.md, "Naval")
DIAG_FLOOR = 0.25
#: successive halving in the search (Jamieson & Talwalkar, "Non-stochastic best arm identification and
#: hyperparameter optimization", 2016; Li et al., "Hyperband", 2018): at these fractions of the steps the
#: worse half of the settings still training stop. Cutting from 1/8 on lost the search ~0.09 nats of validation
#: log-likelihood on Concrete and 0.02 on Wine (settings at beta2 0.9995 start slower and were dropped); from 1/4,
#: 0.065 on Concrete, 0.03 on Boston and about nothing elsewhere, at about half the full search's CPU
#: (benchmarks/results/factor_ivon_benchmarks.md)
HALVE_AT = (1 / 4, 1 / 2)
#: whether the search halves (:data:`HALVE_AT`)
HALVING = True
#: a replica whose mean minibatch negative log-likelihood per point (standardised units) passes this has diverged
#: (its predictions some 140 noise scales off): frozen as a non-finite one is. Finite blow-ups (weights of 1e8,
#: predictions of 1e24) were otherwise trained on and scored
EXPLODED_LOSS = 1e4
#: a final fit that diverges is trained again from its start at half the rate, at most this many times (a signal of
#: the training loss alone, as a user would lower the rate); the record lists each such split's rate under
#: ``"lowered_lr"`` ({split number as a string: rate}, as JSON stores it). Naval's final fits at the chosen rate 0.1
#: diverged on 9 of 20 splits (none on the tuning split)
BACKOFF = 3
#: the Hessian decays searched, with the rest of the grid: ivon-opt's default, and a decay whose average spans the
#: last ~2 000 of the budget's 10 000 steps (at 0.99999 the curvature h is still ~90 % ``hess_init`` after a whole
#: run, the posterior's width then the grid's choice); a budget of one Adam rate (``--quick``) tries the first only
BETA2S = (0.99999, 0.9995)
NOISE_LR = 1e-2


def _grid(budget: Budget) -> List[dict]:
    quick = len(budget.lrs) == 1
    pairs = QUICK_GRID if quick else [(r, h) for r in IVON_LRS for h in IVON_HESS_INITS]
    return [{"precision": a, "lr": r, "hess_init": h, "beta2": b} for b in (BETA2S[:1] if quick else BETA2S)
            for a in (PRECISIONS or budget.precisions) for r, h in pairs]


def _gaussian_nll(pred: Tensor, y: Tensor, log_scale: Tensor) -> Tensor:
    """Mean Gaussian negative log-likelihood per point (without the constant) of each replica, shape (R,)."""
    log_scale = log_scale.unsqueeze(-1)
    return (0.5 * ((y - pred) * torch.exp(-log_scale)).square() + log_scale).mean(-1)


def _inits(spec: BatchedMLP, split_of: List[int], seed: int, like: Tensor) -> Tensor:
    """Initial weights (R, D): ``nn.Linear``'s initialisation, the same for every replica of one split."""
    first = {s: spec.init(1, generator=torch.Generator().manual_seed(seed + s), dtype=like.dtype)[0]
             for s in sorted(set(split_of))}
    return torch.stack([first[s] for s in split_of]).to(like.device)


def _fit(data: SplitData, spec: BatchedMLP, settings: List[dict], split_of: List[int], steps: int, budget: Budget,
         seed: int, evaluate: bool = False, progress=None, patience: bool = False, n_configs: int = 1,
         halving: bool = False) -> Tuple[BatchedFactorIVON, Tensor, list]:
    """Train one replica per setting on its split's data (``data`` holds R replicas) for ``steps`` steps:
    ``(optimizer, log noise scales (R,), [(step, held-out LL per replica (R,))] at the checkpoints)``; a diverged
    replica scores -inf from its divergence on. With ``evaluate`` and ``patience``, the early stop of the other
    methods' search (:func:`pyro_fa.experiments.uci.protocol.train`'s ``patience``): training stops once the best
    mean held-out log-likelihood of any of the ``n_configs`` settings (consecutive blocks of replicas) was reached
    in the first third of the steps run, at least a quarter of ``steps`` having run. With ``evaluate`` and
    ``halving``, successive halving: at the first checkpoints past each fraction :data:`HALVE_AT` of ``steps``, the
    settings still training whose best mean held-out log-likelihood so far is in the lower half stop (their
    replicas dropped from the batch, their later checkpoints -inf); the returned optimizer and noise scales are
    then the survivors' only."""
    R, n = data.y.shape
    batch = n if n <= budget.batch_limit else budget.batch_size
    opt = BatchedFactorIVON(_inits(spec, split_of, seed, data.x), lr=[c["lr"] for c in settings], ess=float(n),
                            hess_init=[c["hess_init"] for c in settings], beta2=[c["beta2"] for c in settings],
                            weight_decay=[c["precision"] / n for c in settings], rank=budget.rank,
                            update_every=UPDATE_EVERY, diag_floor=DIAG_FLOOR)
    base = opt.lr.clone()
    log_scale = data.x.new_zeros(R, requires_grad=True)
    noise_opt = torch.optim.Adam([log_scale], lr=NOISE_LR)
    gen = torch.Generator(device=data.x.device).manual_seed(seed)  # the minibatches and the draws
    eval_gen = torch.Generator(device=data.x.device).manual_seed(seed + 1)
    every = max(1, budget.steps // budget.checkpoints) if evaluate else None
    curve, best = [], {"step": 0, "score": -math.inf}
    alive = torch.arange(R, device=data.x.device)  # the replicas still trained (numbers in the whole batch)
    halve_at = [f * steps for f in HALVE_AT] if halving and evaluate else []
    total = R
    for step in range(1, steps + 1):
        frac = 0.5 * (1.0 + math.cos(math.pi * (step - 1) / budget.steps))  # the budget's half cosine
        opt.lr = base * frac
        noise_opt.param_groups[0]["lr"] = NOISE_LR * frac
        xb, yb = take_rows(data.x, data.y, sample_rows(R, n, batch, gen, data.x.device))
        theta = opt.draw(generator=gen).requires_grad_()
        loss = _gaussian_nll(spec(theta, xb), yb, log_scale)
        grad, log_scale.grad = torch.autograd.grad(loss.sum(), [theta, log_scale])  # replica r's: its own loss's
        opt.diverged |= ~(loss.detach() <= EXPLODED_LOSS)  # non-finite too; frozen by the step below
        opt.step(grad)
        kept = log_scale.detach().clone()
        noise_opt.step()
        with torch.no_grad():  # a diverged replica's noise scale stays as it was before its divergence
            log_scale.copy_(torch.where(opt.diverged, kept, log_scale))
        if every and step % every == 0:
            means = spec(opt.sample(budget.eval_samples, generator=eval_gen), data.x_eval)
            ll = heldout_ll(means, torch.exp(2 * log_scale.detach()).unsqueeze(-1), data)
            ll = torch.where(torch.isfinite(ll) & ~opt.diverged, ll, -math.inf)
            curve.append((step, ll.new_full((total,), -math.inf).index_copy_(0, alive, ll)))
            score = float(curve[-1][1].double().reshape(n_configs, -1).mean(1).max())
            if score > best["score"]:
                best["score"], best["step"] = score, step
            if patience and step >= steps // 4 and best["step"] <= step // 3:  # as the others' search stops
                if progress is not None:
                    progress(steps - step + 1)
                break
            if halve_at and step >= halve_at[0]:
                halve_at = [at for at in halve_at if at > step]  # one cut per checkpoint, however many fractions passed
                rows = _halve(curve, alive, n_configs)
                alive, data, base = alive[rows], data.take(rows), base[rows]
                opt.keep(rows)
                log_scale, noise_opt = _keep_noise(log_scale, noise_opt, rows)
                R = len(rows)
        if progress is not None:
            progress(1)
    return opt, log_scale.detach(), curve


def _halve(curve: list, alive: Tensor, n_configs: int) -> Tensor:
    """Successive halving's cut: positions (in the batch of ``alive`` replicas) of the settings to go on with, the
    better half (rounded up) of those still training by their best mean held-out log-likelihood so far."""
    lls = torch.stack([ll for _, ll in curve]).double()  # (checkpoints, all replicas)
    best = lls.reshape(len(curve), n_configs, -1).mean(-1).amax(0)  # per setting
    per = lls.shape[1] // n_configs
    training = sorted(set((alive // per).tolist()))
    kept = set(sorted(training, key=lambda c: -float(best[c]))[:math.ceil(len(training) / 2)])
    return torch.tensor([i for i, r in enumerate(alive.tolist()) if r // per in kept], device=alive.device)


def _keep_noise(log_scale: Tensor, noise_opt: torch.optim.Adam, rows: Tensor):
    """The noise scales of the replicas ``rows`` and an Adam over them that goes on as the whole one would."""
    kept = log_scale.detach()[rows].clone().requires_grad_()
    new = torch.optim.Adam([kept], lr=noise_opt.param_groups[0]["lr"])
    state = noise_opt.state[log_scale]
    if state:
        new.state[kept] = {k: (v if v.dim() == 0 else v[rows].clone()) for k, v in state.items()}
    return kept, new


def run_factor_ivon(method, splits, budget: Budget, seed: int, progress: Optional[Callable] = None, references=None,
                    fidelity: Optional[dict] = None) -> dict:
    """Search on the tuning splits, then train and test every split: FactorIVON on one dataset (the return value
    of :func:`pyro_fa.experiments.uci.protocol.run_vi`'s form; ``references`` and ``fidelity`` as there: each
    split with an HMC reference is scored against it, the prior precision being ``ess * weight_decay``)."""
    spec = BatchedMLP(splits[0].x_train.shape[1], (splits[0].n_hidden or 50,))
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    configs = _grid(budget)
    split_of = [r for _ in configs for r in range(n_tune)]  # replica c * n_tune + r: setting c on split r
    _, _, curve = _fit(tune.take(torch.tensor(split_of)), spec, [c for c in configs for _ in range(n_tune)], split_of,
                       budget.steps, budget, seed, evaluate=True, progress=progress, patience=True,
                       n_configs=len(configs), halving=HALVING)
    curves = [(step, ll.double().cpu()) for step, ll in curve]
    choice, val_ll, table = _choose(curves, configs, n_tune)
    final = final_data(splits)
    R = final.y.shape[0]
    start = time.perf_counter()
    opt, log_scale, _ = _fit(final, spec, [choice] * R, list(range(R)), choice["steps"], budget, seed,
                             progress=progress)
    test_gen = torch.Generator(device=final.x.device).manual_seed(seed + 2)
    means = spec(opt.sample(budget.test_samples, generator=test_gen), final.x_eval)
    diverged, lowered, setting = opt.diverged.clone(), {}, choice
    for _ in range(BACKOFF):  # a diverged final fit again from its start at half the rate (training loss only)
        lost = diverged.nonzero().flatten()
        if not len(lost):
            break
        setting = {**setting, "lr": setting["lr"] / 2}
        again, scale_again, _ = _fit(final.take(lost), spec, [setting] * len(lost), lost.tolist(), choice["steps"],
                                     budget, seed)
        log_scale[lost] = scale_again
        means[:, lost] = spec(again.sample(budget.test_samples, generator=test_gen), final.x_eval[lost])
        diverged[lost] = again.diverged
        lowered.update({str(s): setting["lr"] for s in lost.tolist()})  # str: the keys JSON keeps
    noise_var = torch.exp(2 * log_scale)
    seconds = (time.perf_counter() - start) / R
    record = final_record(method, means, noise_var.unsqueeze(-1), final, splits, (choice, val_ll, table, n_tune),
                          spec.dim, choice["precision"], noise_var.sqrt(), seconds, seed, references, fidelity,
                          diverged=diverged)
    return {**record, "lowered_lr": lowered} if lowered else record


def run_ivon(method, splits, budget: Budget, seed: int, progress: Optional[Callable] = None, references=None,
             fidelity: Optional[dict] = None) -> dict:
    """The IVON column (``ivon-1x50``): :func:`run_factor_ivon` with the optimizer at rank 0, IVON's update (equal,
    replica by replica, to ivon-opt's IVON: ``tests/test_factor_ivon_batched.py``, ``tests/test_factor_ivon.py``),
    everything else the FactorIVON column's: its grid with the decay searched, search, backoff and seeds. The peer
    the low-rank part has to beat."""
    return run_factor_ivon(method, splits, dataclasses.replace(budget, rank=0), seed, progress, references, fidelity)
