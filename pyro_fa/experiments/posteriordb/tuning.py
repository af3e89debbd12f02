"""Adam's rate for each tuned method, chosen per posterior by the ELBO (never by the reference draws).

Each rate of the grid runs the method once, on a tuning seed that no scored seed uses, for the whole step budget;
the rate whose final fit has the largest ELBO, estimated from ``TUNING_DRAWS`` draws of q as the mean of
``log p(z) - log q(z)``, is chosen. The reference draws are the test set and are not read here. Each (posterior,
method, rate) is one unit file (``<output>/units/``), reused by later runs; the choice records every rate's ELBO
and the tuning's cost (gradient evaluations and seconds, all rates together).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from typing import Callable, Dict, Sequence

#: Adam's rates tried (Pyro's SVI tutorials use 0.001 to 0.1; the autoguides' examples 0.01 to 0.05)
LR_GRID = (0.003, 0.01, 0.03, 0.1)
QUICK_LR_GRID = (0.01, 0.1)
#: draws of q per ELBO estimate
TUNING_DRAWS = 200
#: the tuning seed is this plus the first scored seed, and never a scored seed
TUNING_SEED_OFFSET = 10_000

_FIELDS = {"key": dict, "lr": float, "grad_evals": int, "seconds": (int, float)}


def tuning_seed(seeds: Sequence[int]) -> int:
    """A seed for the tuning runs that is not among ``seeds``."""
    seed = TUNING_SEED_OFFSET + min(seeds)
    while seed in seeds:
        seed += 1
    return seed


def elbo_estimate(posterior, draws, log_q) -> float:
    """The mean of ``log p(z) - log q(z)`` over draws ``z`` of q (``-inf`` when q has no density or a draw is not
    finite: such a rate is never chosen)."""
    import torch

    if log_q is None or not bool(torch.isfinite(draws).all()):
        return -math.inf
    with torch.no_grad():
        ratio = posterior.log_density(draws) - log_q.to(draws)
    value = float(ratio.mean())
    return value if math.isfinite(value) else -math.inf


def tuning_run(method: str, posterior, budget, seed: int, lr: float) -> dict:
    """One rate: the method's final fit from ``seed``, its ELBO from ``TUNING_DRAWS`` draws, and its cost."""
    from pyro_fa.experiments.posteriordb.methods import fit_method

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        fit = fit_method(method, posterior, replace(budget, num_draws=TUNING_DRAWS), seed, lr=lr,
                         steps=[budget.steps])
        elbo, grad, error = elbo_estimate(posterior, fit.draws, fit.log_q), fit.grad_evals, None
    except (RuntimeError, ValueError) as err:  # a rate on which the method fails is never chosen
        elbo, grad, error = -math.inf, 0, f"{type(err).__name__}: {err}"
    return {"lr": float(lr), "elbo": elbo, "grad_evals": int(grad), "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0, "error": error}


def _key(budget, posterior: str, method: str, version: int, seed: int, lr: float) -> dict:
    b = asdict(budget)
    return {"tuning_protocol": 1, "steps": b["steps"], "rank": b["rank"], "num_paths": b["num_paths"],
            "laplace_samples": b["laplace_samples"], "draws": TUNING_DRAWS, "posterior": posterior,
            "method": method, "method_version": version, "seed": seed, "lr": float(lr)}


def choose_lr(method: str, name: str, load: Callable[[], object], budget, seed: int, output_dir,
              grid: Sequence[float] = LR_GRID, command: str = "pyro-fa posteriordb") -> Dict:
    """The rate of ``grid`` with the largest ELBO for ``method`` on the posterior ``name`` (``load()`` gives it,
    called only when a rate's unit file is missing).

    Returns
    -------
    dict
        ``lr`` (the chosen rate), ``elbos`` (rate -> ELBO, as strings of the rates), ``seed``, ``grad_evals`` and
        ``seconds`` (the tuning's whole cost).
    """
    import json

    from pyro_fa.experiments._io import atomic_write_json, read_record, unit_path
    from pyro_fa.experiments.posteriordb.methods import METHODS

    runs, posterior = [], None
    for lr in grid:
        key = json.loads(json.dumps(_key(budget, name, method, METHODS[method].version, seed, lr)))
        path = unit_path(output_dir, key, f"{name}__{method}__tune_lr{lr:g}")
        record = read_record(path, _FIELDS, command) if path.exists() else None
        if record is None or record["key"] != key:
            posterior = load() if posterior is None else posterior
            record = {"key": key, **tuning_run(method, posterior, budget, seed, lr)}
            elbo = record["elbo"]
            atomic_write_json(path, {**record, "elbo": elbo if math.isfinite(elbo) else None})
        runs.append(record)
    elbos = {r["lr"]: (-math.inf if r.get("elbo") is None else r["elbo"]) for r in runs}
    best = max(elbos, key=lambda lr: (elbos[lr], -lr))  # ties: the smaller rate
    return {"lr": best, "elbos": {f"{lr:g}": (e if math.isfinite(e) else None) for lr, e in elbos.items()},
            "seed": seed, "grad_evals": sum(r["grad_evals"] for r in runs),
            "seconds": sum(r["seconds"] for r in runs),
            "cpu_seconds": sum(r.get("cpu_seconds") or 0 for r in runs)}
