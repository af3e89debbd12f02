r"""The UCI Bayesian-neural-network regression benchmark on the standard splits.

Protocol (Hernández-Lobato & Adams 2015; the splits of Gal & Ghahramani 2016):
for each dataset, each of its 20 standard 90 % / 10 % splits (5 for protein), a
ReLU network with one or two hidden layers of 50 units (100 for protein, the
benchmark's ``n_hidden.txt``) and a Gaussian likelihood with a learned noise
scale; inputs and target standardised on the training part; test RMSE and test
log-likelihood of the Bayesian model average in the original units of y, mean
± standard error over the splits.

Methods, all run by the same vectorised trainer (:mod:`pyro_fa.experiments._bnn`,
checked against the Pyro classes in the tests), with the same search budget:

* ``vifa`` / ``vippca``: :class:`~pyro_fa.AutoLowRankFactorGuide` (diagonal /
  isotropic noise, rank 10, ``init_scale`` 0.01) with :class:`~pyro_fa.FactorELBO`,
  under a Gaussian prior (precision α) or a Laplace prior of the same variance;
* ``autonormal``, ``lowrank``: Pyro's ``AutoNormal`` and
  ``AutoLowRankMultivariateNormal`` (rank 10) with ``Trace_ELBO``, Gaussian
  prior, ``init_scale`` 0.01, means started as ``nn.Linear`` starts its weights;
* ``swag-em``, ``swag-sga``, ``swag``, ``multiswag``: a MAP fit (AutoDelta,
  Gaussian prior), then minibatch SGD whose iterates feed :class:`~pyro_fa.SWAG`
  (online EM, online SGA, classic SWAG; rank 10); MultiSWAG mixes 5 SWAG-EM
  posteriors trained from different initialisations.

Hyperparameter search (never on the test split): the training part of each of
the first few splits is cut at random into 80 % sub-training and 20 % validation
parts (re-standardised on the sub-training part); as many splits as it takes for
the validation parts to hold 300 points together, at most 5 (``--tune-splits``
fixes the number): Yacht 5, Boston 4, Energy 3, Concrete and Wine 2, Kin8nm,
Naval, Power and Protein 1. The chosen values are reused on every split, so some
test points of the later splits lie in the tuning splits' training parts (the
reuse of a few splits' search that keeps the run within two hours on 2 cores);
no split's own test part is ever seen before its one evaluation. Every
configuration of the grid — prior precision α ∈ {0.01, 0.1, 1, 10}, Adam learning
rate ∈ {0.003, 0.01} for one hidden layer and 0.003 for two; for VIPPCA, whose
isotropic σ is a hyperparameter in seed 003, learning rate 0.003 and σ ∈ {0.01,
0.03} instead (``Budget(ppca_scales=(None, 0.01, 0.03))`` adds a learned σ) — is
trained on every tuning split, with Adam's learning rate following a half cosine
from its initial value to zero over the 10 000 steps, and the validation
log-likelihood (32 posterior draws) is recorded every
``steps / 20`` steps (the search stops early once its best checkpoint lies in
the first third of the steps run, after at least a quarter of them); the
configuration and step count with the best mean validation log-likelihood are
chosen (for SWAG: the MAP fit's, then the SGD
learning rate of the collection phase ∈ {0.001, 0.003, 0.01} by SWAG-EM's validation
log-likelihood). Then every split is trained on its whole training part with the
chosen values, for the chosen number of steps on the same rate schedule (the
schedule depends on the step alone, so a fit stopped at the chosen step has
followed the rates the search saw), and evaluated once on its test part (100
posterior draws). The
noise scale is learned in every method. Full-batch training for datasets of up
to 1 000 training points, batches of 500 above (the likelihood scaled by N / 500).
SWAG's collection phase: about one collection per epoch, 100 in all, of SGD with
batches of 32 on the squared error plus weight decay (the loss in units of the
noise variance, which stays at its MAP value).

``pyro-fa uci --quick`` runs yacht, 2 splits, five methods and a smaller grid
(one tuning split, 1 500 steps) in about 15 seconds on one core.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from pyro_fa import metrics
from pyro_fa.datasets import UCI_DATASETS, list_uci, load_uci, uci_n_splits
from pyro_fa.experiments._bnn import MLPSpec, ReplicaVI
from pyro_fa.experiments._io import atomic_write_json, mean_se

# ----------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One column of the benchmark table."""

    name: str
    label: str
    depth: int
    family: str = "fa"  # ReplicaVI family; "delta" for the SWAG family
    prior: str = "gaussian"
    swag: Optional[str] = None  # "em" | "sga" | "swag" | "multiswag"


def _methods() -> Dict[str, Method]:
    out = {}
    for depth in (1, 2):
        arch = f"{depth}x50"
        for fam, fam_label in (("fa", "VIFA"), ("ppca", "VIPPCA")):
            for prior in ("gaussian", "laplace"):
                name = f"{'vifa' if fam == 'fa' else 'vippca'}-{prior}-{arch}"
                out[name] = Method(name, f"{fam_label} {prior.capitalize()} {depth}×50", depth, fam, prior)
        out[f"autonormal-{arch}"] = Method(f"autonormal-{arch}", f"Pyro AutoNormal {depth}×50", depth, "normal")
        out[f"lowrank-{arch}"] = Method(f"lowrank-{arch}", f"Pyro AutoLowRankMVN {depth}×50", depth, "lowrank")
    for swag, label in (("em", "SWAG online EM"), ("sga", "SWAG online SGA"), ("swag", "classic SWAG"),
                        ("multiswag", "MultiSWAG (5 × online EM)")):
        name = f"{'multiswag' if swag == 'multiswag' else 'swag-' + swag if swag != 'swag' else 'swag'}-1x50"
        out[name] = Method(name, f"{label} 1×50", 1, "delta", "gaussian", swag)
    return out


METHODS: Dict[str, Method] = _methods()
#: what ``pyro-fa uci`` runs by default: all but Pyro's guides on 2×50 (``--methods`` adds them)
DEFAULT_METHODS = tuple(n for n in METHODS if n not in ("autonormal-2x50", "lowrank-2x50"))
QUICK_METHODS = ("vifa-gaussian-1x50", "vippca-gaussian-2x50", "autonormal-1x50", "lowrank-1x50", "swag-em-1x50")
SWAG_METHODS = tuple(n for n, m in METHODS.items() if m.swag is not None)

# ----------------------------------------------------------------------------- search


@dataclass
class Budget:
    """How much each fit may train, and the grid it is tuned over."""

    steps: int = 10000
    precisions: Tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    lrs: Tuple[float, ...] = (3e-3, 1e-2)
    deep_lrs: Tuple[float, ...] = (3e-3,)  # the 2x50 networks' Adam rates
    ppca_lr: float = 3e-3
    ppca_scales: Tuple[Optional[float], ...] = (0.01, 0.03)  # None: learned
    swag_lrs: Tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    swag_steps: int = 2000
    swag_collections: int = 100
    swag_warmup: int = 20
    swag_batch: int = 32
    tune_splits: Optional[int] = None  # None: enough splits for ``val_points`` validation points
    val_points: int = 300
    max_tune_splits: int = 5
    val_fraction: float = 0.2
    checkpoints: int = 20
    lr_schedule: str = "cosine"  # "cosine": Adam's rate follows a half cosine to 0 over ``steps``; "constant"
    batch_limit: int = 1000  # full batch up to this many training points
    batch_size: int = 500
    rank: int = 10
    particles: int = 1
    eval_samples: int = 32
    test_samples: int = 100
    ensemble: int = 5

    @classmethod
    def quick(cls) -> "Budget":
        return cls(steps=1500, precisions=(0.1, 1.0, 10.0), lrs=(1e-2,), deep_lrs=(1e-2,), ppca_lr=1e-2,
                   ppca_scales=(None, 0.03),
                   swag_lrs=(3e-3,), swag_steps=500,
                   swag_collections=50,
                   tune_splits=1, checkpoints=10, test_samples=50, ensemble=3)


@dataclass
class SplitData:
    """Training and held-out tensors of several replicas, stacked: x (R, N, p), y (R, N), y_std (R,)."""

    x: Tensor
    y: Tensor
    x_eval: Tensor
    y_eval: Tensor
    y_std: Tensor

    def take(self, index: Tensor) -> "SplitData":
        return SplitData(self.x[index], self.y[index], self.x_eval[index], self.y_eval[index], self.y_std[index])


def _validation_split(d, fraction: float, seed: int):
    """Cut a split's training part into sub-training and validation parts, re-standardised on the former."""
    n = d.x_train.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_000 + seed))
    n_val = int(round(fraction * n))
    val, tr = perm[:n_val], perm[n_val:]
    x_tr, y_tr, x_va, y_va = d.x_train[tr], d.y_train[tr], d.x_train[val], d.y_train[val]
    xm, xs = x_tr.mean(0), x_tr.std(0, unbiased=False)
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    ym, ys = y_tr.mean(), y_tr.std(unbiased=False)
    return (x_tr - xm) / xs, (y_tr - ym) / ys, (x_va - xm) / xs, (y_va - ym) / ys, float(ys) * d.y_std


def _stack(parts) -> SplitData:
    x, y, xe, ye, ys = zip(*parts)
    return SplitData(torch.stack(x), torch.stack(y), torch.stack(xe), torch.stack(ye),
                     torch.tensor(ys, dtype=x[0].dtype, device=x[0].device))


def n_tune_splits(n_train: int, budget: Budget) -> int:
    """How many splits carry the search: ``budget.tune_splits`` if set, else the fewest whose validation parts
    hold ``budget.val_points`` points together (at most ``budget.max_tune_splits``).

    A validation log-likelihood is a mean over points, its standard error ~ 1/√points: Yacht's 55-point
    validation part (20 % of 277) cannot tell apart configurations a tenth of a nat apart, Protein's 8 000
    points can. Yacht gets 5 splits, Boston 4, Energy 3, Concrete and Wine 2, the other four 1.
    """
    if budget.tune_splits is not None:
        return budget.tune_splits
    n_val = max(1, int(round(budget.val_fraction * n_train)))
    return max(1, min(budget.max_tune_splits, math.ceil(budget.val_points / n_val)))


def tuning_data(splits, budget: Budget) -> SplitData:
    """Sub-training / validation parts of the first :func:`n_tune_splits` splits."""
    k = min(n_tune_splits(splits[0].x_train.shape[0], budget), len(splits))
    return _stack([_validation_split(d, budget.val_fraction, d.split) for d in splits[:k]])


def final_data(splits) -> SplitData:
    """Whole training parts and test parts of every split."""
    return _stack([(d.x_train, d.y_train, d.x_test, d.y_test, d.y_std) for d in splits])


# ----------------------------------------------------------------------------- training


def _batches(data: SplitData, batch_size: int, generator: torch.Generator):
    """Row indices of a random minibatch per replica, or None for full batch."""
    R, N = data.y.shape
    if batch_size >= N:
        return None
    return torch.randint(N, (R, batch_size), generator=generator, device=data.y.device)


def _gather(data: SplitData, idx: Optional[Tensor]):
    if idx is None:
        return data.x, data.y
    p = data.x.shape[-1]
    return torch.gather(data.x, 1, idx.unsqueeze(-1).expand(-1, -1, p)), torch.gather(data.y, 1, idx)


@torch.no_grad()
def heldout_ll(means: Tensor, noise_var: Tensor, data: SplitData) -> Tensor:
    """Mean held-out log-likelihood per replica in original units, shape (R,); ``-inf`` where a fit diverged.

    One call of :func:`pyro_fa.metrics.gaussian_log_likelihood` over all replicas' points.
    """
    S, R, M = means.shape
    nv = noise_var.expand(S, R, 1) if noise_var.dim() == 2 else noise_var
    ok = torch.isfinite(means).all(-1).all(0) & torch.isfinite(nv).all(-1).all(0) & (nv > 0).all(-1).all(0)
    means = torch.where(ok.unsqueeze(-1), means, torch.zeros_like(means))
    nv = torch.where(ok.unsqueeze(-1), nv, torch.ones_like(nv)).expand(S, R, M)
    per_point = metrics.gaussian_log_likelihood(means.reshape(S, R * M), nv.reshape(S, R * M),
                                                data.y_eval.reshape(R * M), reduction="none")
    ll = per_point.reshape(R, M).mean(1) - data.y_std.log()
    return torch.where(ok, ll, torch.full_like(ll, -math.inf))


@torch.no_grad()
def evaluate(means: Tensor, noise_var: Tensor, data: SplitData) -> Dict[str, Tensor]:
    """Test log-likelihood, RMSE (original units) and calibration error of every replica.

    Parameters
    ----------
    means : Tensor of shape (S, R, M)
        Predictive means of S posterior draws (standardised units).
    noise_var : Tensor of shape (R, 1) or (S, R, 1)
    data : SplitData
        ``y_eval`` (R, M) standardised targets, ``y_std`` (R,).

    Returns
    -------
    dict of Tensors of shape (R,): ``ll``, ``rmse``, ``calibration_error``.

    Raises
    ------
    FloatingPointError
        If a replica's predictions are not finite (its training diverged).
    """
    if not (torch.isfinite(means).all() and torch.isfinite(noise_var).all()):
        raise FloatingPointError("pyro-fa uci: a final fit diverged (non-finite predictions).")
    R = means.shape[1]
    ll, rmse, cal = [], [], []
    nv = noise_var.expand(means.shape[0], R, 1) if noise_var.dim() == 2 else noise_var
    for r in range(R):
        m, v, y, s = means[:, r].double(), nv[:, r].double(), data.y_eval[r].double(), float(data.y_std[r])
        ll.append(metrics.gaussian_log_likelihood(m, v, y, y_std=s))
        rmse.append(metrics.rmse(m, y, y_std=s))
        cal.append(metrics.calibration(m, v, y).error)
    return {"ll": torch.stack(ll), "rmse": torch.stack(rmse), "calibration_error": torch.stack(cal)}


def _batch_size(data: SplitData, budget: "Budget") -> int:
    N = data.y.shape[1]
    return N if N <= budget.batch_limit else budget.batch_size


def train(model: ReplicaVI, data: SplitData, steps: int, budget: Budget, generator: torch.Generator,
          checkpoints: Optional[int] = None, progress=None, patience: bool = False,
          n_configs: int = 1) -> List[Tuple[int, Tensor]]:
    """Adam on the summed negative ELBO of all replicas.

    Returns ``[(step, held-out log-likelihood per replica)]`` every ``steps // checkpoints``
    steps (none without ``checkpoints``). Replicas are ``n_configs`` consecutive blocks, one per
    configuration. With ``patience``, training stops early once the best mean held-out
    log-likelihood of any configuration was reached in the first third of the steps run
    (and at least a quarter of ``steps`` have run): later checkpoints could only be chosen
    if they beat a long-standing best.
    """
    opt = model.optimizer()
    # the schedule is a function of the step number alone, over the budget's steps: a final fit that stops at
    # the chosen step has followed the same rates as the search's fit up to that step
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=budget.steps)
             if budget.lr_schedule == "cosine" else None)
    N = data.y.shape[1]
    batch = _batch_size(data, budget)
    every = max(1, steps // checkpoints) if checkpoints else None
    curve, best_step, best = [], 0, -math.inf
    for step in range(1, steps + 1):
        xb, yb = _gather(data, _batches(data, batch, generator))
        opt.zero_grad(set_to_none=True)
        model.loss(xb, yb, N, budget.particles).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()
        if progress is not None:
            progress(1)
        if every and step % every == 0:
            means, nv = model.predict(data.x_eval, budget.eval_samples)
            ll = heldout_ll(means, nv, data)
            curve.append((step, ll))
            score = float(ll.reshape(n_configs, -1).mean(1).max())
            if score > best:
                best, best_step = score, step
            if patience and step >= steps // 4 and best_step <= step // 3:
                if progress is not None:
                    progress(steps - step)
                break
    return curve
def _choose(curves, configs, n_tune: int):
    """The (config, steps) with the best mean held-out log-likelihood over the tuning splits."""
    best = None
    table = []
    for step, ll in curves:
        per_config = ll.reshape(len(configs), n_tune)
        per_config = torch.where(torch.isfinite(per_config), per_config, torch.full_like(per_config, -1e30))
        score = per_config.mean(1)
        for c, cfg in enumerate(configs):
            table.append({**cfg, "steps": step, "val_ll": float(score[c])})
            if best is None or score[c] > best[0]:
                best = (float(score[c]), {**cfg, "steps": step})
    return best[1], best[0], table


def _configs(method: Method, budget: Budget) -> List[dict]:
    """The search grid: prior precision x learning rate (``budget.lrs`` for one hidden layer, ``budget.deep_lrs``
    for two); for VIPPCA, precision x sigma (fixed, or learned where ``budget.ppca_scales`` holds None)."""
    if method.family == "ppca":
        return [{"precision": a, "lr": budget.ppca_lr, "sigma": s} for a in budget.precisions
                for s in budget.ppca_scales]
    lrs = budget.lrs if method.depth == 1 else budget.deep_lrs
    return [{"precision": a, "lr": lr} for a in budget.precisions for lr in lrs]


def _vi_model(method: Method, spec: MLPSpec, configs, budget: Budget, generator, like: Tensor, repeat: int):
    prec = like.new_tensor([c["precision"] for c in configs]).repeat_interleave(repeat)
    lr = like.new_tensor([c["lr"] for c in configs]).repeat_interleave(repeat)
    sigma = None
    if method.family == "ppca":
        sigma = like.new_tensor([math.nan if c["sigma"] is None else c["sigma"] for c in configs])
        sigma = sigma.repeat_interleave(repeat)
    return ReplicaVI(spec, method.family, method.prior, prec, lr, rank=budget.rank, noise_scale=sigma,
                     generator=generator, dtype=like.dtype, device=like.device)


def run_vi(method: Method, splits, budget: Budget, seed: int, progress=None) -> dict:
    """Search on the tuning splits, then train and test every split: one VI method on one dataset."""
    device = splits[0].x_train.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    spec = _spec(method, splits)
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    configs = _configs(method, budget)
    index = torch.arange(n_tune, device=device).repeat(len(configs))
    model = _vi_model(method, spec, configs, budget, cpu_gen, tune.x, n_tune)
    curves = train(model, tune.take(index), budget.steps, budget, gen, budget.checkpoints, progress,
                   patience=True, n_configs=len(configs))
    choice, val_ll, table = _choose(curves, configs, n_tune)
    final = final_data(splits)
    model = _vi_model(method, spec, [choice], budget, cpu_gen, final.x, final.y.shape[0])
    train(model, final, choice["steps"], budget, gen, None, progress)
    means, nv = model.predict(final.x_eval, budget.test_samples)
    scores = evaluate(means, nv, final)
    return {"choice": choice, "val_ll": val_ll, "tune_splits": n_tune, "search": table, "dim": spec.dim,
            **{k: v.tolist() for k, v in scores.items()},
            "noise_scale": (model.noise_scale() * final.y_std).tolist()}


def _spec(method: Method, splits) -> MLPSpec:
    width = splits[0].n_hidden or 50
    return MLPSpec(splits[0].x_train.shape[1], (width,) * method.depth)


# ----------------------------------------------------------------------------- SWAG family


def _collect_schedule(data: SplitData, budget: Budget) -> Tuple[int, int]:
    """SGD steps of the collection phase and the collection interval: about one collection per epoch."""
    N = data.y.shape[1]
    per_epoch = max(1, N // budget.swag_batch)
    every = min(per_epoch, max(1, budget.swag_steps // budget.swag_collections))
    return every * budget.swag_collections, every


def _map_then_collect(spec, data: SplitData, precision: float, lr: float, steps: int, swag_lr: float,
                      budget: Budget, kinds: Sequence[str], members: Sequence[int], cpu_gen, gen, progress=None):
    """MAP fits (AutoDelta) of every replica, then minibatch SGD feeding SWAG posteriors.

    Returns ``{kind: [SWAG per replica]}`` and the MAP model (its learned noise scales).
    """
    from pyro_fa.swag.swag import SWAG

    R = data.y.shape[0]
    like = data.x
    model = ReplicaVI(spec, "delta", "gaussian", like.new_full((R,), precision), like.new_full((R,), lr),
                      generator=cpu_gen, dtype=like.dtype, device=like.device)
    train(model, data, steps, budget, gen, None, progress)
    theta = model.params()["loc"]  # one learning rate: the leaf itself, in replica order
    assert theta.is_leaf
    n_steps, every = _collect_schedule(data, budget)
    swags = {}
    with torch.no_grad():
        for kind in kinds:
            keep = members if kind != "em" else range(R)
            swags[kind] = {r: SWAG([theta[r]], rank=budget.rank, method=kind, warmup=budget.swag_warmup,
                                   collect_every=every, seed=r, on_nonfinite="skip") for r in keep}
    opt = torch.optim.SGD([theta], lr=swag_lr)  # the noise scale stays at its MAP value
    noise_var = model.noise_scale().detach().pow(2)
    N = data.y.shape[1]
    for _ in range(n_steps):
        xb, yb = _gather(data, _batches(data, budget.swag_batch, gen))
        opt.zero_grad(set_to_none=True)
        # the per-example loss in units of the noise variance: squared error / 2 plus weight decay, what a
        # torch user's SGD minimises (its step size then means the same whatever the learned noise)
        (model.loss(xb, yb, N) * noise_var).sum().div(N).backward()
        opt.step()
        for per_kind in swags.values():
            for sw in per_kind.values():
                sw.step()
        if progress is not None:
            progress(1)
    return swags, model


def _swag_predict(swags: Dict[int, object], model: ReplicaVI, data: SplitData, replicas: Sequence[Sequence[int]],
                  num_samples: int, generator: torch.Generator):
    """Predictive means (S, R_out, M) of SWAG posteriors; output replica j mixes the members ``replicas[j]``."""
    spec = model.spec
    theta = []
    for members in replicas:
        per = max(1, num_samples // len(members))
        draws = [swags[r].sample_parameters(per, generator=generator) for r in members]
        theta.append(torch.cat(draws)[:num_samples] if len(members) > 1 else draws[0])
    theta = torch.stack(theta, 1)  # (S, R_out, D)
    x = data.x_eval[[m[0] for m in replicas]]
    noise = model.noise_scale().detach().pow(2)
    nv = torch.stack([noise[list(m)].repeat_interleave(max(1, num_samples // len(m)))[:num_samples]
                      for m in replicas], 1).unsqueeze(-1)  # (S, R_out, 1): each draw keeps its member's noise
    with torch.no_grad():
        return spec.forward(theta, x), nv


def run_swag(methods: Sequence[Method], splits, budget: Budget, seed: int, progress=None) -> Dict[str, dict]:
    """The SWAG family on one dataset: one shared search, one set of SGD runs, one column per method."""
    device = splits[0].x_train.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    spec = _spec(methods[0], splits)
    tune = tuning_data(splits, budget)
    n_tune = tune.y.shape[0]
    # 1. the MAP fit: prior precision (weight decay), Adam learning rate, steps
    configs = [{"precision": a, "lr": lr} for a in budget.precisions for lr in budget.lrs]
    index = torch.arange(n_tune, device=device).repeat(len(configs))
    prec = tune.x.new_tensor([c["precision"] for c in configs]).repeat_interleave(n_tune)
    lr = tune.x.new_tensor([c["lr"] for c in configs]).repeat_interleave(n_tune)
    model = ReplicaVI(spec, "delta", "gaussian", prec, lr, generator=cpu_gen, dtype=tune.x.dtype, device=device)
    curves = train(model, tune.take(index), budget.steps, budget, gen, budget.checkpoints, progress,
                   patience=True, n_configs=len(configs))
    choice, map_val_ll, table = _choose(curves, configs, n_tune)
    # 2. the SGD learning rate of the collection phase, by SWAG-EM's validation log-likelihood
    swag_scores = []
    tune_gen = torch.Generator(device=device).manual_seed(seed + 1)
    for swag_lr in budget.swag_lrs:
        swags, m = _map_then_collect(spec, tune, choice["precision"], choice["lr"], choice["steps"], swag_lr,
                                     budget, ("em",), (), cpu_gen, gen, progress)
        means, nv = _swag_predict(swags["em"], m, tune, [[r] for r in range(n_tune)], budget.eval_samples,
                                  tune_gen)
        swag_scores.append(float(heldout_ll(means, nv, tune).mean()))
    best = max(range(len(budget.swag_lrs)), key=lambda i: swag_scores[i])
    choice = {**choice, "swag_lr": budget.swag_lrs[best]}
    # 3. every split: `ensemble` members per split (member 0 is the single-SWAG run)
    final = final_data(splits)
    n = final.y.shape[0]
    M = budget.ensemble if any(m.swag == "multiswag" for m in methods) else 1
    data = final.take(torch.arange(n, device=device).repeat(M))  # replica = member * n + split
    kinds = sorted({"em" if m.swag == "multiswag" else m.swag for m in methods})
    swags, model = _map_then_collect(spec, data, choice["precision"], choice["lr"], choice["steps"],
                                     choice["swag_lr"], budget, kinds, range(n), cpu_gen, gen, progress)
    test_gen = torch.Generator(device=device).manual_seed(seed + 2)
    out = {}
    for method in methods:
        kind = "em" if method.swag == "multiswag" else method.swag
        groups = [[m * n + s for m in range(M)] for s in range(n)] if method.swag == "multiswag" \
            else [[s] for s in range(n)]
        means, nv = _swag_predict(swags[kind], model, data, groups, budget.test_samples, test_gen)
        scores = evaluate(means, nv, final)
        out[method.name] = {
            "choice": choice, "val_ll": map_val_ll, "tune_splits": n_tune, "swag_val_ll": dict(zip(map(str, budget.swag_lrs), swag_scores)),
            "search": table, "dim": spec.dim, **{k: v.tolist() for k, v in scores.items()},
            "noise_scale": (model.noise_scale()[:n].detach() * final.y_std).tolist(),
        }
    return out


# ----------------------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    parser.add_argument("--data-dir", default=None,
                        help="UCI data folder (default: $PYRO_FA_DATA, else the download cache; yacht is bundled)")
    parser.add_argument("--datasets", nargs="+", default=None, choices=list_uci(), metavar="NAME",
                        help=f"datasets to run (default: all nine; quick: yacht); one of {', '.join(list_uci())}")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), metavar="METHOD",
                        help=f"methods to run (default: all; quick: {' '.join(QUICK_METHODS)}); "
                             f"one of {', '.join(METHODS)}")
    parser.add_argument("--splits", type=int, default=None,
                        help="use the first N standard splits (default: all, 20 or 5; quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="most Adam steps of a fit (default 10000; quick 1500)")
    parser.add_argument("--tune-splits", type=int, default=None,
                        help="splits whose training parts carry the search (default: enough for 300 validation "
                             "points, at most 5; quick 1)")
    parser.add_argument("--jobs", type=int, default=1, help="datasets run in parallel processes (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument("--report-only", action="store_true",
                        help="only rebuild the table and figures from the result files of earlier runs")
    parser.add_argument("--fresh", action="store_true",
                        help="recompute units whose result file exists (default: reuse those of the same budget, "
                             "seed, splits and, for the SWAG family, methods; unreadable ones are trained again)")


def _budget(args) -> Budget:
    b = Budget.quick() if args.quick else Budget()
    if args.steps is not None:
        if args.steps < b.checkpoints:
            raise SystemExit(f"pyro-fa uci: --steps must be >= {b.checkpoints}, got {args.steps}.")
        b.steps = args.steps
    if args.tune_splits is not None:
        if args.tune_splits < 1:
            raise SystemExit(f"pyro-fa uci: --tune-splits must be >= 1, got {args.tune_splits}.")
        b.tune_splits = args.tune_splits
    return b


def _load_splits(name: str, n: Optional[int], data_dir, device) -> list:
    try:
        total = uci_n_splits(name, data_dir)
        count = total if n is None else n
        if not 1 <= count <= total:
            raise SystemExit(f"pyro-fa uci: --splits must be in 1..{total} for {name!r}, got {n}.")
        return [load_uci(name, s, data_dir=data_dir, dtype=torch.float32, device=device) for s in range(count)]
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"pyro-fa uci: {err}") from err


def _units(names: Sequence[str], method_names: Sequence[str]) -> List[Tuple[str, str]]:
    """(dataset, unit) pairs in the order of ``names``; a unit is a VI method or "swag-family"."""
    vi = [m for m in method_names if METHODS[m].swag is None]
    swag = [m for m in method_names if METHODS[m].swag is not None]
    units = vi + (["swag-family"] if swag else [])
    return [(d, u) for d in dict.fromkeys(names) for u in units]


#: bumped whenever a change to the protocol changes what a unit computes: older unit files are then not reused.
#: 1: the protocol of the unit files without a ``key`` (named ``<dataset>__<unit>.json``), still read.
UNIT_PROTOCOL = 1
#: what every unit file holds (a file without them is not a unit, and is ignored with a warning); files
#: written since units are keyed also hold ``key`` (see :func:`_unit_key`)
_UNIT_FIELDS = {"dataset": str, "unit": str, "n_splits": int, "budget": dict, "seed": int, "device": str,
                "wall_seconds": (int, float), "cpu_seconds": (int, float), "methods": dict}


def _run_key(budget: Budget, splits_n: Optional[int], seed: int) -> dict:
    """What determines a unit's results besides its dataset and methods (JSON-normalised)."""
    import json
    from dataclasses import asdict

    return json.loads(json.dumps({"protocol": UNIT_PROTOCOL, "budget": asdict(budget), "seed": seed,
                                  "splits": splits_n}))


def _unit_key(run_key: dict, dataset: str, unit: str, method_names: Sequence[str]) -> dict:
    """Everything a unit's results depend on: the run's key, the dataset and the unit's methods (the SWAG
    family's columns share their fits, so its set of methods is part of its key)."""
    methods = sorted(m for m in method_names if METHODS[m].swag is not None) if unit == "swag-family" else [unit]
    return {**run_key, "dataset": dataset, "unit": unit, "methods": methods}


def _unit_path(out_dir, key: dict) -> Path:
    """``<out_dir>/units/<dataset>__<unit>__<hash of the key>.json``: runs of other budgets, seeds, splits or
    SWAG method sets keep their own files in the same folder."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(out_dir) / "units" / f"{key['dataset']}__{key['unit']}__{digest}.json"


def _legacy_path(out_dir, dataset: str, unit: str) -> Path:
    """Where unit files were written before their names carried their key."""
    return Path(out_dir) / "units" / f"{dataset}__{unit}.json"


def _legacy_key(record: dict, data_dir=None) -> dict:
    """The key of a unit file written before units were keyed (protocol 1): its splits are "all" (None) when
    it holds every standard split of its dataset, or when that count cannot be read here."""
    import json

    splits: Optional[int] = record["n_splits"]
    try:
        if uci_n_splits(record["dataset"], data_dir) == splits:
            splits = None
    except (OSError, ValueError, KeyError):
        splits = None
    methods = sorted(record["methods"]) if record["unit"] == "swag-family" else [record["unit"]]
    return json.loads(json.dumps({"protocol": 1, "budget": record["budget"], "seed": record["seed"],
                                  "splits": splits, "dataset": record["dataset"], "unit": record["unit"],
                                  "methods": methods}))


def read_unit(path, data_dir=None) -> Optional[dict]:
    """The record of a unit file, or None (with a warning naming the file) when it is not a readable unit
    file: empty, truncated, not JSON, not UTF-8, or a JSON file of another kind. A file written before
    units were keyed gets its key from its content (:func:`_legacy_key`)."""
    import json
    import warnings

    try:
        record = json.loads(Path(path).read_bytes().decode("utf-8"))
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        missing = [k for k, t in _UNIT_FIELDS.items() if not isinstance(record.get(k), t)]
        if missing or not isinstance(record.get("key", {}), dict):
            raise ValueError(f"no valid {', '.join(missing or ['key'])}")
        if "key" not in record:
            record["key"] = _legacy_key(record, data_dir)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        warnings.warn(f"pyro-fa uci: ignoring {path}, which is not a readable unit file ({err}); its unit, "
                      "if this run asks for it, is trained again.", stacklevel=2)
        return None
    return record


def _same_run(record: Optional[dict], key: dict) -> bool:
    return record is not None and record.get("key") == key


def run_unit(dataset: str, unit: str, method_names: Sequence[str], budget: Budget, splits_n: Optional[int], data_dir,
             device: str, seed: int, threads: int, out_dir: str, progress: bool = True) -> dict:
    """One VI method, or the SWAG family, on one dataset; writes ``<out_dir>/units/<dataset>__<unit>__<key>.json``
    (see :func:`_unit_path`)."""
    from dataclasses import asdict

    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    keep_freed_memory()
    splits = _load_splits(dataset, splits_n, data_dir, device)
    if budget.tune_splits is not None and budget.tune_splits > len(splits):
        raise SystemExit(f"pyro-fa uci: --tune-splits must be at most the {len(splits)} splits run, "
                         f"got {budget.tune_splits}.")
    bar = tqdm(desc=f"{dataset}: {unit}", unit="step", disable=not progress, leave=False, mininterval=1.0)
    t0, c0 = time.perf_counter(), time.process_time()
    if unit == "swag-family":
        results = run_swag([METHODS[m] for m in method_names if METHODS[m].swag is not None], splits, budget, seed,
                           bar.update)
    else:
        results = {unit: run_vi(METHODS[unit], splits, budget, seed, bar.update)}
    bar.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for r in results.values():
        r["seconds"] = wall / len(results)
    first = next(iter(results.values()))
    ll, rmse = mean_se(first["ll"]), mean_se(first["rmse"])
    tqdm.write(f"{dataset:>9} {unit:<22} test LL {ll[0]:7.3f} ± {ll[1]:.3f}   RMSE {rmse[0]:7.3f} ± {rmse[1]:.3f}"
               f"   {wall:6.0f} s")
    key = _unit_key(_run_key(budget, splits_n, seed), dataset, unit, method_names)
    record = {"dataset": dataset, "unit": unit, "key": key, "n_splits": len(splits), "budget": asdict(budget),
              "seed": seed, "device": str(device), "threads": threads, "wall_seconds": wall, "cpu_seconds": cpu,
              "methods": results}
    atomic_write_json(_unit_path(out_dir, key), record)
    return record


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep freed blocks of up to 32 MiB for reuse instead of returning them to the system.

    Each training step allocates and frees tensors of a few MiB (a 2×50 network's D × K factors of 40
    replicas are 4.7 MiB). By default glibc maps such blocks afresh and unmaps them on free, so every step
    pays the page faults of first touching them again; keeping them halves the cost of a fresh
    element-wise op on one core. The numbers computed are the same. Returns whether the settings took
    (False off glibc, e.g. on macOS, where nothing is changed).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def _worker(kwargs):
    run_unit(**kwargs)
    return kwargs["dataset"], kwargs["unit"]


def _exit_with_parent(parent_pid: int, every: float = 1.0) -> None:
    """Pool initializer: the worker exits as soon as the ``pyro-fa uci`` process that started it is gone.

    A pool's workers outlive a parent that is killed (``kill``, an out-of-memory kill, a
    closed session) and would go on training, and writing unit files, for hours.
    """
    import threading

    def watch():
        while True:
            time.sleep(every)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _amount(seconds: float, prefix: str = "") -> str:
    """A duration as the report prints it: hours to two decimals from six minutes on, whole seconds below
    (a quick run's 0.004 hours would print as 0.00); ``prefix`` names the kind, e.g. "CPU-"."""
    return f"{seconds / 3600:.2f} {prefix}hours" if seconds >= 360 else f"{seconds:.0f} {prefix}seconds"


def report(out_dir: str, budget: Budget, names: Sequence[str], methods: Optional[Sequence[str]] = None,
           splits_n: Optional[int] = None, seed: int = 0, data_dir=None) -> dict:
    """Aggregate the unit files of this budget, seed and splits: results.json, table.md, ll.png, rmse.png.

    Unreadable or stray ``*.json`` files in ``units/`` are ignored with a warning. Where several SWAG-family
    files of the run match (runs with other ``--methods``), the one of ``methods`` wins.
    """
    from dataclasses import asdict

    from pyro_fa.experiments import _uci_report as rep
    from pyro_fa.experiments._io import atomic_savefig, atomic_write_text

    out = Path(out_dir)
    run_key = _run_key(budget, splits_n, seed)
    wanted = [_unit_key(run_key, d, u, methods) for d, u in _units(names, methods or [])]
    records = []
    for path in sorted((out / "units").glob("*.json")):
        record = read_unit(path, data_dir)
        if record is None or record["dataset"] not in names:
            continue
        if {k: record["key"].get(k) for k in run_key} != run_key:
            continue
        records.append((record["key"] in wanted, path.name, record))
    results, meta = {}, {}
    for is_wanted, _, record in sorted(records, key=lambda r: (not r[0], r[1])):
        got = results.setdefault(record["dataset"], {})
        new = {k: v for k, v in record["methods"].items() if is_wanted or k not in got}
        if not new:
            continue
        got.update(new)
        m = meta.setdefault(record["dataset"], {"n_splits": record["n_splits"], "cpu_seconds": 0.0,
                                                "cuda_wall_seconds": 0.0, "devices": []})
        # a cell trained on a GPU spends its process time mostly waiting for kernels: count its wall time apart
        if str(record["device"]).startswith("cuda"):
            m["cuda_wall_seconds"] += record["wall_seconds"]
        else:
            m["cpu_seconds"] += record["cpu_seconds"]
        if record["device"] not in m["devices"]:
            m["devices"].append(record["device"])
    order = {n: i for i, n in enumerate(METHODS)}
    results = {ds: dict(sorted(r.items(), key=lambda kv: order.get(kv[0], 99))) for ds, r in results.items()}
    if not results:
        raise SystemExit(f"pyro-fa uci: no results of this budget in {out / 'units'} (the same --quick, "
                         "--steps, --tune-splits, --splits and --seed); run without --report-only first.")
    labels = {n: m.label for n, m in METHODS.items()}
    checks = rep.bar_checks(results)
    text = ["# UCI regression benchmark", "", __doc__.split("\n\n", 1)[1].strip(), "",
            "## Test log-likelihood (mean ± s.e. over splits, per point, original units; higher is better)", "",
            rep.summary_table(results, "ll"), "",
            "## Test RMSE (original units; lower is better)", "", rep.summary_table(results, "rmse"), "",
            "## Every method, with seed 003's number for the same method and the time per split", "",
            rep.results_table(results, labels), "", "## Published anchors (1×50)", "", rep.published_table(), ""]
    summary = rep.bar_summary(checks)
    if summary and budget != Budget():
        summary += ("\n\n(The bar is set for the full run, `pyro-fa uci`; this run's budget is smaller, so these "
                    "rows only show the checks.)")
    if summary:
        text += ["## The bar", "", summary, ""]
    atomic_write_text(out / "table.md", "\n".join(text))
    atomic_write_json(out / "results.json", {"budget": asdict(budget), "datasets": meta, "results": results,
                                             "bar": checks, "published": rep.PUBLISHED, "paper": rep.PAPER})
    import matplotlib.pyplot as plt

    for metric in ("ll", "rmse"):
        fig = rep.figure(results, labels, metric)
        atomic_savefig(fig, out / f"{metric}.png", dpi=110)
        plt.close(fig)
    print()
    print(rep.results_table(results, labels))
    print()
    print(rep.summary_table(results, "ll"))
    if summary:
        print()
        print(summary)
    cpu = sum(m["cpu_seconds"] for m in meta.values())
    gpu = sum(m["cuda_wall_seconds"] for m in meta.values())
    print(f"\ncompute: {_amount(cpu, 'CPU-')} in the cells trained on the CPU (single-threaded units: about "
          f"{_amount(cpu / 2)} on 2 cores)" + (f"; {_amount(gpu)} of wall time in the cells trained on CUDA "
                                               "(several at once)" if gpu else ""))
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'll.png'}, {out / 'rmse.png'}")
    return {"results": results, "bar": checks}


def _check_device(device: str) -> None:
    """Refuse a device that is no torch device, or one that holds no data (``meta``) or is not there."""
    hint = "e.g. cpu, cuda or cuda:0"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise SystemExit(f"pyro-fa uci: --device must be a torch device, {hint}, got {device!r}.") from None
    if dev.type == "meta":
        raise SystemExit(f"pyro-fa uci: --device must be a device that holds data, {hint}, got {device!r} "
                         "(meta tensors have shapes only).")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"pyro-fa uci: --device {device!r} needs CUDA, which this torch does not see.")
    try:
        torch.zeros(1, device=dev).cpu()
    except (RuntimeError, AssertionError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"pyro-fa uci: --device must be a device this torch can use, {hint}, got {device!r} "
                         f"({first}).") from None


class _FolderLock:
    """An exclusive, non-blocking ``flock`` on ``<folder>/.lock``, held while a run uses the folder.

    The lock is the kernel's: it goes with the process, so a killed run leaves no stale lock (the file
    stays, unlocked). A no-op where ``fcntl`` is missing (Windows).
    """

    def __init__(self, folder: Path):
        self.path = folder / ".lock"
        self.fd: Optional[int] = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            raise SystemExit(f"pyro-fa uci: --output-dir {str(self.path.parent)!r} is in use by another "
                             f"pyro-fa uci run{f' (process {holder})' if holder else ''}, which holds "
                             f"{str(self.path)!r}; wait for it to end, or choose another --output-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
        return False


def _prepare_output(out: Path) -> None:
    """Create ``out/units`` and check that files can be written there, before any training."""
    import tempfile

    try:
        (out / "units").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out / "units"):
            pass
    except OSError as err:
        raise SystemExit(f"pyro-fa uci: --output-dir must be a folder this process can write to, got "
                         f"{str(out)!r} ({err.strerror or err}).") from None


def _remove_stale_parts(out: Path) -> None:
    """Remove the ``.part`` temporary files a killed run left (the caller holds the folder's lock)."""
    for folder in (out, out / "units"):
        for part in folder.glob(".*.part"):
            try:
                part.unlink()
            except OSError:
                pass


def run(args) -> int:
    budget = _budget(args)
    names = args.datasets or (["yacht"] if args.quick else list(DATASET_ORDER))
    methods = args.methods or list(QUICK_METHODS if args.quick else DEFAULT_METHODS)
    splits = args.splits if args.splits is not None else (2 if args.quick else None)
    if args.jobs < 1 or args.threads < 1:
        raise SystemExit(f"pyro-fa uci: --jobs and --threads must be >= 1, got {args.jobs} and {args.threads}.")
    _check_device(args.device)
    out = Path(args.output_dir)
    if args.report_only and not (out / "units").is_dir():
        raise SystemExit(f"pyro-fa uci: no results of this budget in {out / 'units'}; run without "
                         "--report-only first.")
    _prepare_output(out)
    with _FolderLock(out):
        _remove_stale_parts(out)
        return _run_locked(args, budget, names, methods, splits)


def _run_locked(args, budget: Budget, names: List[str], methods: List[str], splits: Optional[int]) -> int:
    where = (f"{budget.tune_splits} split(s)" if budget.tune_splits else
             f"the first splits that hold {budget.val_points} validation points (at most {budget.max_tune_splits})")
    print(f"pyro-fa uci: {len(names)} dataset(s) x {len(methods)} method(s); {'quick' if args.quick else 'full'} "
          f"budget: up to {budget.steps} steps, search on {where}, "
          f"precision {list(budget.precisions)}, lr {list(budget.lrs)} (2x50: {list(budget.deep_lrs)}; VIPPCA: sigma "
          f"{['learned' if v is None else v for v in budget.ppca_scales]} at lr {budget.ppca_lr})")
    if not args.report_only:
        todo = []
        run_key = _run_key(budget, splits, args.seed)
        for dataset, unit in _units(names, methods):
            key = _unit_key(run_key, dataset, unit, methods)
            done = [p for p in (_unit_path(args.output_dir, key), _legacy_path(args.output_dir, dataset, unit))
                    if not args.fresh and p.is_file() and _same_run(read_unit(p, args.data_dir), key)]
            if done:
                print(f"{dataset:>9} {unit:<22} done before: {done[0]}")
                continue
            todo.append(dict(dataset=dataset, unit=unit, method_names=methods, budget=budget, splits_n=splits,
                             data_dir=args.data_dir, device=args.device, seed=args.seed, threads=args.threads,
                             out_dir=args.output_dir, progress=not args.no_progress and args.jobs == 1))
        if args.jobs == 1:
            for kw in todo:
                run_unit(**kw)
        elif todo:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            from tqdm.auto import tqdm

            with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"), initializer=_exit_with_parent,
                                     initargs=(os.getpid(),)) as pool:
                futures = [pool.submit(_worker, kw) for kw in todo]
                for f in tqdm(as_completed(futures), total=len(futures), desc="units", disable=args.no_progress):
                    f.result()
    report(args.output_dir, budget, names, methods, splits, args.seed, args.data_dir)
    return 0


#: the order datasets are run in: the costly ones first, so that parallel jobs end together
DATASET_ORDER = ("protein", "wine", "concrete", "naval", "power", "kin8nm", "energy", "boston", "yacht")
assert sorted(DATASET_ORDER) == list_uci() == sorted(UCI_DATASETS)
