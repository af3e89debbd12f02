r"""The UCI benchmark's SWAG family: one MAP search, SGD collection phases feeding SWAG posteriors, one column each.

The MAP fits are :class:`pyro_fa.nn.BatchedVI` replicas of the ``"delta"`` family (Pyro's
``AutoDelta``), trained by :func:`pyro_fa.experiments.uci.protocol.train`; the collection
phase steps plain SGD on every replica's weight vector and feeds :class:`~pyro_fa.SWAG`.

Each kind's scale (online EM, SGA, classic SWAG) is chosen on the tuning splits' validation parts by
:func:`pyro_fa.predictive.select_scale` (its default rule, ``"gated"``:
the mean unless the best scale's paired gain exceeds two standard errors; scale 0 — the SWA mean — among the
candidates), together with the SGD rate of the collection phase, and used on every split
(MultiSWAG mixes SWAG-EM members at a scale of its own, chosen on mixtures of members trained on the tuning
splits);
each SWAG row also reports its mean's (SWA's; for MultiSWAG the ensemble of the members'
means) test log-likelihood as ``mean_ll``.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from pyro_fa.experiments.uci.protocol import (Budget, Method, SplitData, _choose, _spec, evaluate, final_data,
                                               train, tuning_data)
from pyro_fa.nn.batched import BatchedVI, sample_rows, take_rows
from pyro_fa.experiments.uci.fidelity import MAP_NAME, Fit, score_fit
from pyro_fa.predictive import DEFAULT_SCALES, log_mean_exp, select_scale


def _collect_schedule(data: SplitData, budget: Budget) -> Tuple[int, int]:
    """SGD steps of the collection phase and the collection interval: about one collection per epoch."""
    N = data.y.shape[1]
    per_epoch = max(1, N // budget.swag_batch)
    every = min(per_epoch, max(1, budget.swag_steps // budget.swag_collections))
    return every * budget.swag_collections, every


def _map_then_collect(spec, data: SplitData, precision: float, lr: float, steps: int, swag_lr: float,
                      budget: Budget, kinds: Sequence[str], members: Sequence[int], cpu_gen, gen, progress=None,
                      timings: Optional[dict] = None):
    """MAP fits (AutoDelta) of every replica, then minibatch SGD feeding SWAG posteriors.

    Returns ``{kind: [SWAG per replica]}`` and the MAP model (its learned noise scales). ``timings``, when given,
    receives the seconds of the MAP fits (``"map"``) and of the collection phase (``"collect"``), and the MAP
    weights (``"map_loc"``, (R, D)) before SGD moves them.
    """
    start = time.perf_counter()
    from pyro_fa.swag.swag import SWAG

    R = data.y.shape[0]
    like = data.x
    model = BatchedVI(spec, "delta", "gaussian", like.new_full((R,), precision), like.new_full((R,), lr),
                      generator=cpu_gen, dtype=like.dtype, device=like.device)
    train(model, data, steps, budget, gen, None, progress)
    theta = model.params()["loc"]  # one learning rate: the leaf itself, in replica order
    assert theta.is_leaf
    if timings is not None:
        timings.update(map=time.perf_counter() - start, map_loc=theta.detach().clone())
        start = time.perf_counter()
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
    if timings is not None:
        timings["collect"] = time.perf_counter() - start
    return swags, model


def _swag_predict(swags: Dict[int, object], model: BatchedVI, data: SplitData, replicas: Sequence[Sequence[int]],
                  num_samples: int, generator: torch.Generator):
    """Predictive means (S, R_out, M) of SWAG posteriors; output replica j mixes the members ``replicas[j]``."""
    spec = model.mlp
    theta = []
    for members in replicas:
        per = max(1, num_samples // len(members))
        draws = [swags[r].sample(per, generator=generator) for r in members]
        theta.append(torch.cat(draws)[:num_samples] if len(members) > 1 else draws[0])
    theta = torch.stack(theta, 1)  # (S, R_out, D)
    x = data.x_eval[[m[0] for m in replicas]]
    noise = model.likelihood_scale().detach().pow(2)
    nv = torch.stack([noise[list(m)].repeat_interleave(max(1, num_samples // len(m)))[:num_samples]
                      for m in replicas], 1).unsqueeze(-1)  # (S, R_out, 1): each draw keeps its member's noise
    with torch.no_grad():
        return spec.forward(theta, x), nv


@torch.no_grad()
def _scale_curve(swags: Dict[int, object], model: BatchedVI, data: SplitData, num_samples: int,
                 generator: torch.Generator, scales: Sequence[float], members: int = 1) -> torch.Tensor:
    r"""Per-point held-out log-likelihoods (original units) of every replica's SWAG at each scale, common draws.

    Returns a Tensor of shape (len(scales), R * M): the model average over ``num_samples`` draws
    :math:`c + \sqrt{s}\,\delta` (the same :math:`\delta` for every scale) at every held-out point of every
    replica, scale 0 being the mean's prediction. With ``members`` > 1 the replicas are ``members`` blocks of
    the same splits (replica = member * n + split) and each split's model average mixes its members (MultiSWAG,
    ``num_samples // members`` draws each; scale 0 is the ensemble of the members' means): shape
    (len(scales), n * M).
    """
    R = data.y.shape[0]
    per = max(1, num_samples // members)
    loc = torch.stack([swags[r].loc for r in range(R)])  # (R, D)
    dev = torch.stack([swags[r].predictive().deviations(per, generator) for r in range(R)], 1)  # (S, R, D)
    sd = model.likelihood_scale().detach()[:R].unsqueeze(-1)  # (R, 1), standardised units
    shift = data.y_std.log().unsqueeze(-1)  # (R, 1): to the original units
    rows = []
    for s in scales:
        theta = loc.unsqueeze(0) if s == 0 else loc + math.sqrt(s) * dev
        means = model.mlp.forward(theta, data.x_eval)  # (S, R, M)
        ll = torch.distributions.Normal(means, sd).log_prob(data.y_eval)  # (S, R, M)
        if members > 1:  # (members * S, n, M): every member's draws of a split pooled
            ll = ll.reshape(ll.shape[0], members, R // members, -1).transpose(0, 1).reshape(-1, R // members,
                                                                                            ll.shape[-1])
        rows.append((log_mean_exp(ll) - shift[:ll.shape[1]]).reshape(-1))
    return torch.stack(rows)


def _choose_scale(swags: Dict[int, object], model: BatchedVI, data: SplitData, num_samples: int, seed: int,
                  widen: int = 3, members: int = 1) -> Tuple[float, dict]:
    """The scale chosen on the validation parts (grid widened past an upper edge where the best sits), and a record;
    ``members`` > 1: of the mixtures of :func:`_scale_curve`."""
    scales: List[float] = [0.0, *DEFAULT_SCALES]
    gen = torch.Generator(device=data.x.device).manual_seed(seed)
    L = _scale_curve(swags, model, data, num_samples, gen, scales, members)
    for _ in range(widen):
        if int(L[1:].mean(1).argmax()) + 1 != len(scales) - 1:
            break
        scales.append(scales[-1] * scales[-1] / scales[-2])
        gen = torch.Generator(device=data.x.device).manual_seed(seed)  # the same draws again
        L = torch.cat([L, _scale_curve(swags, model, data, num_samples, gen, scales[-1:], members)])
    if not bool(torch.isfinite(L[0]).all()):
        return 1.0, {"scale": 1.0, "reason": "the mean's validation log-likelihood is not finite: scale 1 kept"}
    i, reason = select_scale(scales, L)  # the default rule, "gated"
    N = L.shape[1]
    d = L - L[0]
    return scales[i], {"scale": scales[i], "reason": reason, "scales": scales, "val_ll": L.mean(1).tolist(),
                       "gain_se": (d.std(1) / math.sqrt(N)).tolist() if N > 1 else [0.0] * len(scales),
                       "val_points": N}


def run_swag(methods: Sequence[Method], splits, budget: Budget, seed: int, progress=None, references=None,
             fidelity: Optional[dict] = None) -> Dict[str, dict]:
    """The SWAG family on one dataset: one shared search, one set of SGD runs, one column per method.

    With ``references`` (split -> :class:`~pyro_fa.experiments.uci.fidelity.Reference`), every column's test
    predictive, and the MAP fit's, on each split that has one is scored against it into ``fidelity``
    (:func:`~pyro_fa.experiments.uci.fidelity.score_fit`; cost: the MAP fit's seconds per replica, plus the
    collection phase's for a SWAG column, times the members for MultiSWAG); the other results are unchanged.
    """
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
    # 2. the SGD learning rate of the collection phase, by SWAG-EM's validation log-likelihood at its chosen
    # scale; each kind's scale chosen on the same validation parts (scale 0, the SWA mean, a candidate)
    kinds = sorted({"em" if m.swag == "multiswag" else m.swag for m in methods} | {"em"})
    swag_scores, scale_choices = [], []
    for swag_lr in budget.swag_lrs:
        swags, m = _map_then_collect(spec, tune, choice["precision"], choice["lr"], choice["steps"], swag_lr,
                                     budget, kinds, range(n_tune), cpu_gen, gen, progress)
        picked = {kind: _choose_scale(swags[kind], m, tune, budget.eval_samples, seed + 1) for kind in kinds}
        scale_choices.append(picked)
        rec = picked["em"][1]
        swag_scores.append(rec["val_ll"][rec["scales"].index(rec["scale"])] if "val_ll" in rec else -math.inf)
    best = max(range(len(budget.swag_lrs)), key=lambda i: swag_scores[i])
    choice = {**choice, "swag_lr": budget.swag_lrs[best]}
    M = budget.ensemble if any(m.swag == "multiswag" for m in methods) else 1
    if M > 1:  # MultiSWAG's own scale, on the mixtures of M members per tuning split at the chosen rate
        tune_m = tune.take(torch.arange(n_tune, device=device).repeat(M))
        swags, m = _map_then_collect(spec, tune_m, choice["precision"], choice["lr"], choice["steps"],
                                     choice["swag_lr"], budget, ["em"], range(n_tune), cpu_gen, gen, progress)
        scale_choices[best]["multiswag"] = _choose_scale(swags["em"], m, tune_m, budget.eval_samples, seed + 1,
                                                         members=M)
    scales = {kind: picked[0] for kind, picked in scale_choices[best].items()}
    # 3. every split: `ensemble` members per split (member 0 is the single-SWAG run)
    final = final_data(splits)
    n = final.y.shape[0]
    data = final.take(torch.arange(n, device=device).repeat(M))  # replica = member * n + split
    timings: dict = {}
    swags, model = _map_then_collect(spec, data, choice["precision"], choice["lr"], choice["steps"],
                                     choice["swag_lr"], budget, kinds, range(n), cpu_gen, gen, progress, timings)
    score = _scorer(model, final, splits, references, seed, spec.dim, choice["precision"], timings, fidelity)
    if score is not None:
        map_means = model.mlp.forward(timings["map_loc"][:n].unsqueeze(0), final.x_eval)
        score(MAP_NAME, map_means, model.likelihood_scale().detach()[:n].pow(2).unsqueeze(-1), timings["map"])
    test_gen = torch.Generator(device=device).manual_seed(seed + 2)
    out = {}
    for method in methods:
        kind = "em" if method.swag == "multiswag" else method.swag  # MultiSWAG mixes SWAG-EM members
        groups = [[m * n + s for m in range(M)] for s in range(n)] if method.swag == "multiswag" \
            else [[s] for s in range(n)]
        key = method.swag if method.swag in scales else kind  # the scale: MultiSWAG's own
        for sw in swags[kind].values():  # the mean first (SWA; MultiSWAG: the ensemble of the members' means)
            sw.scale = 0.0
        means, nv = _swag_predict(swags[kind], model, data, groups, len(groups[0]), test_gen)  # one draw a member
        mean_ll = evaluate(means, nv, final)["ll"]
        for sw in swags[kind].values():
            sw.scale = scales[key]
        means, nv = _swag_predict(swags[kind], model, data, groups, budget.test_samples, test_gen)
        scores = evaluate(means, nv, final)
        if score is not None:
            score(method.name, means, nv, len(groups[0]) * (timings["map"] + timings["collect"]))
        out[method.name] = {
            "choice": choice, "val_ll": map_val_ll, "tune_splits": n_tune,
            "swag_val_ll": dict(zip(map(str, budget.swag_lrs), swag_scores)),
            "scale": scales[key], "scale_choice": scale_choices[best][key][1], "mean_ll": mean_ll.tolist(),
            "search": table, "dim": spec.dim, **{k: v.tolist() for k, v in scores.items()},
            "noise_scale": (model.likelihood_scale()[:n].detach() * final.y_std).tolist(),
        }
    return out


def _scorer(model: BatchedVI, final: SplitData, splits, references, seed: int, dim: int, precision: float,
            timings: dict, fidelity: Optional[dict]):
    """None without references; else ``score(name, means, noise_var, seconds)`` writing ``fidelity[name]``, where
    ``seconds`` is what the fits of a split's posterior took in the batch of every replica (divided by the
    replicas here: each replica's share)."""
    if not references:
        return None
    replicas = model.likelihood_scale().shape[0]
    noise = model.likelihood_scale().detach()

    def score(name: str, means, noise_var, seconds: float) -> None:
        fit = Fit(means, noise_var, dim, precision, noise, seconds / replicas, timings["map"] / replicas)
        fidelity[name] = score_fit(fit, final, splits, references, seed)

    return score
