r"""The UCI benchmark's protocol: methods, budget, data of the search and final fits, and the VI methods' runs.

What :mod:`pyro_fa.experiments.uci.command` describes (the search on validation parts of the first
splits, the final fits on every split), for the methods trained by the public batched trainer
(:class:`pyro_fa.nn.BatchedVI`, :func:`pyro_fa.nn.fit_batched`); the SWAG family is
:mod:`pyro_fa.experiments.uci.swag_family`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from pyro_fa.experiments.uci.scores import evaluate  # noqa: F401  (part of this module's interface)
from pyro_fa.nn.batched import BatchedMLP, BatchedVI, fit_batched, replica_log_likelihood

# ----------------------------------------------------------------------------- methods

@dataclass(frozen=True)
class Method:
    """One column of the benchmark table."""

    name: str
    label: str
    depth: int
    family: str = "fa"  # BatchedVI family; "delta" for the SWAG family
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
    # trained by its own runner (pyro_fa.experiments.uci.factor_ivon), not by BatchedVI
    out["factor-ivon-1x50"] = Method("factor-ivon-1x50", "FactorIVON (ours) 1×50", 1, "factor-ivon")
    out["ivon-1x50"] = Method("ivon-1x50", "IVON 1×50 (FactorIVON's column at rank 0)", 1, "ivon")
    # trained by its own runner (pyro_fa.experiments.uci.mc_dropout): Gal & Ghahramani (2016)'s UCI protocol
    out["mcdropout-1x50"] = Method("mcdropout-1x50", "MC dropout 1×50", 1, "mcdropout")
    return out


METHODS: Dict[str, Method] = _methods()
#: what ``pyro-fa uci`` runs by default: all but Pyro's guides on 2×50 (``--methods`` adds them)
DEFAULT_METHODS = tuple(n for n in METHODS if n not in ("autonormal-2x50", "lowrank-2x50"))
QUICK_METHODS = ("vifa-gaussian-1x50", "vippca-gaussian-2x50", "autonormal-1x50", "lowrank-1x50", "swag-em-1x50",
                 "factor-ivon-1x50")
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


@torch.no_grad()
def heldout_ll(means: Tensor, noise_var: Tensor, data: SplitData) -> Tensor:
    """Mean held-out log-likelihood per replica in original units, shape (R,); ``-inf`` where a fit diverged.

    :func:`pyro_fa.nn.replica_log_likelihood`: one call of
    :func:`pyro_fa.metrics.gaussian_log_likelihood` over all replicas' points.
    """
    return replica_log_likelihood(means, noise_var, data.y_eval, y_std=data.y_std)


@torch.no_grad()
def _batch_size(data: SplitData, budget: "Budget") -> int:
    N = data.y.shape[1]
    return N if N <= budget.batch_limit else budget.batch_size


def checkpointer(data: SplitData, steps: int, budget: Budget, checkpoints: Optional[int] = None, progress=None,
                 patience: bool = False, n_configs: int = 1):
    """The search's checkpoints, for :func:`train` and a runner's own training loop: ``(curve, callback)``.

    ``callback(step, model, loss)`` (``fit_batched``'s callback; ``loss`` unused) appends, every
    ``steps // checkpoints`` steps, ``(step, held-out log-likelihood per replica)`` of
    ``model.predict(data.x_eval, budget.eval_samples)`` (means (S, R, M), noise variances) to ``curve``, and
    returns True when training is to stop (``patience``, as :func:`train` says).
    """
    every = max(1, steps // checkpoints) if checkpoints else None
    curve, best = [], {"step": 0, "score": -math.inf}

    def checkpoint(step: int, model, loss: Optional[Tensor] = None) -> bool:
        if not (every and step % every == 0):
            return False
        means, nv = model.predict(data.x_eval, budget.eval_samples)
        ll = heldout_ll(means, nv, data)
        curve.append((step, ll))
        score = float(ll.reshape(n_configs, -1).mean(1).max())
        if score > best["score"]:
            best["score"], best["step"] = score, step
        if patience and step >= steps // 4 and best["step"] <= step // 3:
            if progress is not None:
                progress(steps - step)
            return True
        return False

    return curve, checkpoint


def train(model: BatchedVI, data: SplitData, steps: int, budget: Budget, generator: torch.Generator,
          checkpoints: Optional[int] = None, progress=None, patience: bool = False,
          n_configs: int = 1) -> List[Tuple[int, Tensor]]:
    """:func:`pyro_fa.nn.fit_batched` under the budget's rate schedule, batch size and particles, with checkpoints.

    Returns ``[(step, held-out log-likelihood per replica)]`` every ``steps // checkpoints``
    steps (none without ``checkpoints``). Replicas are ``n_configs`` consecutive blocks, one per
    configuration. With ``patience``, training stops early once the best mean held-out
    log-likelihood of any configuration was reached in the first third of the steps run
    (and at least a quarter of ``steps`` have run): later checkpoints could only be chosen
    if they beat a long-standing best.
    """
    curve, checkpoint = checkpointer(data, steps, budget, checkpoints, progress, patience, n_configs)
    # the schedule is a function of the step number alone, over the budget's steps: a final fit that stops at
    # the chosen step has followed the same rates as the search's fit up to that step
    fit_batched(model, data.x, data.y, steps, batch_size=_batch_size(data, budget), particles=budget.particles,
                lr_schedule=budget.lr_schedule, total_steps=budget.steps, generator=generator, progress=progress,
                callback=checkpoint)
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


def _vi_model(method: Method, spec: BatchedMLP, configs, budget: Budget, generator, like: Tensor, repeat: int):
    prec = like.new_tensor([c["precision"] for c in configs]).repeat_interleave(repeat)
    lr = like.new_tensor([c["lr"] for c in configs]).repeat_interleave(repeat)
    sigma = None
    if method.family == "ppca":
        sigma = like.new_tensor([math.nan if c["sigma"] is None else c["sigma"] for c in configs])
        sigma = sigma.repeat_interleave(repeat)
    return BatchedVI(spec, method.family, method.prior, prec, lr, rank=budget.rank, guide_noise_scale=sigma,
                     generator=generator, dtype=like.dtype, device=like.device)


def run_vi(method: Method, splits, budget: Budget, seed: int, progress=None, references=None,
           fidelity: Optional[dict] = None) -> dict:
    """Search on the tuning splits, then train and test every split: one VI method on one dataset.

    With ``references`` (split -> :class:`~pyro_fa.experiments.uci.fidelity.Reference`), the test predictive of
    each split that has one is scored against it into ``fidelity[method.name]``
    (:func:`~pyro_fa.experiments.uci.fidelity.score_fit`); the other results are unchanged.
    """
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
    start = time.perf_counter()
    model = _vi_model(method, spec, [choice], budget, cpu_gen, final.x, final.y.shape[0])
    train(model, final, choice["steps"], budget, gen, None, progress)
    seconds = (time.perf_counter() - start) / final.y.shape[0]
    means, nv = model.predict(final.x_eval, budget.test_samples)
    return final_record(method, means, nv, final, splits, (choice, val_ll, table, n_tune), spec.dim,
                        choice["precision"], model.likelihood_scale().detach(), seconds, seed, references, fidelity)


def final_record(method: Method, means: Tensor, noise_var: Tensor, final: SplitData, splits, search: tuple, dim: int,
                 precision: float, noise: Tensor, seconds: float, seed: int, references=None,
                 fidelity: Optional[dict] = None, diverged: Optional[Tensor] = None) -> dict:
    """A method's record of one dataset from its final fits, every runner's return value.

    ``means`` (S, R, M) and ``noise_var`` ((R, 1) or (S, R, 1)) are the test predictives of the R splits run
    (standardised units), ``search`` the ``(choice, val_ll, table, tuning splits)`` of the search, ``noise`` (R,)
    the noise scales, ``precision`` the prior precision; with ``references`` (split -> HMC reference) each split
    that has one is scored against it into ``fidelity[method.name]``
    (:func:`~pyro_fa.experiments.uci.fidelity.score_fit`). Raises FloatingPointError where a fit diverged, unless
    ``diverged`` (R,) marks it: then that split scores LL -inf, RMSE inf and calibration error NaN, and the record
    lists it under ``"diverged"`` (the other splits scored as usual; a runner that tells diverged fits apart).
    """
    choice, val_ll, table, n_tune = search
    lost = [] if diverged is None else diverged.nonzero().flatten().tolist()
    if lost:
        if references:
            raise FloatingPointError(f"pyro-fa uci: {method.name}'s final fit diverged on split(s) {lost}; not "
                                     "scored against HMC references.")
        kept = (~diverged).nonzero().flatten()
        part = evaluate(means[:, kept], noise_var[kept] if noise_var.dim() == 2 else noise_var[:, kept],
                        final.take(kept)) if len(kept) else {}
        fill = {"ll": -math.inf, "rmse": math.inf, "calibration_error": math.nan}
        scores = {k: final.y_std.new_full(diverged.shape, v, dtype=torch.float64) for k, v in fill.items()}
        for k, v in part.items():
            scores[k][kept] = v.to(torch.float64)
    else:
        scores = evaluate(means, noise_var, final)
    if references:
        from pyro_fa.experiments.uci.fidelity import Fit, score_fit

        fit = Fit(means, noise_var, dim, precision, noise, seconds)
        fidelity[method.name] = score_fit(fit, final, splits, references, seed)
    record = {"choice": choice, "val_ll": val_ll, "tune_splits": n_tune, "search": table, "dim": dim,
              **{k: v.tolist() for k, v in scores.items()}, "noise_scale": (noise * final.y_std).tolist()}
    return {**record, "diverged": lost} if lost else record


def _spec(method: Method, splits) -> BatchedMLP:
    width = splits[0].n_hidden or 50
    return BatchedMLP(splits[0].x_train.shape[1], (width,) * method.depth)
