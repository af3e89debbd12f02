r"""The UCI benchmark's SWAG family: one MAP search, SGD collection phases feeding SWAG posteriors, one column each.

The MAP fits are :class:`pyro_fa.nn.BatchedVI` replicas of the ``"delta"`` family (Pyro's
``AutoDelta``), trained by :func:`pyro_fa.experiments.uci.protocol.train`; the collection
phase steps plain SGD on every replica's weight vector and feeds :class:`~pyro_fa.SWAG`.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from pyro_fa.experiments.uci.protocol import (Budget, Method, SplitData, _choose, _spec, evaluate, final_data,
                                               heldout_ll, train, tuning_data)
from pyro_fa.nn.batched import BatchedVI, sample_rows, take_rows


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
    model = BatchedVI(spec, "delta", "gaussian", like.new_full((R,), precision), like.new_full((R,), lr),
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
    noise_var = model.likelihood_scale().detach().pow(2)
    N = data.y.shape[1]
    for _ in range(n_steps):
        xb, yb = take_rows(data.x, data.y, sample_rows(R, N, budget.swag_batch, gen, data.y.device))
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


def _swag_predict(swags: Dict[int, object], model: BatchedVI, data: SplitData, replicas: Sequence[Sequence[int]],
                  num_samples: int, generator: torch.Generator):
    """Predictive means (S, R_out, M) of SWAG posteriors; output replica j mixes the members ``replicas[j]``."""
    spec = model.mlp
    theta = []
    for members in replicas:
        per = max(1, num_samples // len(members))
        draws = [swags[r].sample_parameters(per, generator=generator) for r in members]
        theta.append(torch.cat(draws)[:num_samples] if len(members) > 1 else draws[0])
    theta = torch.stack(theta, 1)  # (S, R_out, D)
    x = data.x_eval[[m[0] for m in replicas]]
    noise = model.likelihood_scale().detach().pow(2)
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
    model = BatchedVI(spec, "delta", "gaussian", prec, lr, generator=cpu_gen, dtype=tune.x.dtype, device=device)
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
            "choice": choice, "val_ll": map_val_ll, "tune_splits": n_tune,
            "swag_val_ll": dict(zip(map(str, budget.swag_lrs), swag_scores)),
            "search": table, "dim": spec.dim, **{k: v.tolist() for k, v in scores.items()},
            "noise_scale": (model.likelihood_scale()[:n].detach() * final.y_std).tolist(),
        }
    return out
