"""``pyro-fa posteriordb``: Pyro's guides and the factor-analysis fits scored against posteriordb's reference draws.

Per posterior, method and seed, the method's draws are scored against the reference draws in the unconstrained
space the Pathfinder way (Zhang et al. 2022, Section 4; :mod:`pyro_fa.metrics.transport`): the exact empirical
1-Wasserstein distance between ``num_draws`` draws of each, the reference-against-itself floor at that size, the
debiased W1 (cross minus self distances on disjoint halves), each marginal's mean error in reference standard
deviations and its s.d. ratio, the Pareto k̂ of ``log p - log q`` where the method has a density, the log-density
gradient evaluations and the seconds. The SVI methods are scored at checkpoints along one run (a curve of
(gradient evaluations, scores)); their Adam rate is chosen per posterior by the ELBO on a tuning seed
(:mod:`~pyro_fa.experiments.posteriordb.tuning`) unless ``--lr`` fixes it. Each (posterior, method, seed) is
written to its own unit file as soon as it is done (``<output>/units/``) and a run again reuses them;
``report.md`` holds a table per posterior and the goals' table (:mod:`~pyro_fa.experiments.posteriordb.goals`).

Posteriors are the ports of :mod:`pyro_fa.experiments.posteriordb` (``load_posterior``) or the stand-ins of
:mod:`pyro_fa.experiments.posteriordb.standins` (``gaussian_linreg``, whose reference is exact, is what
``--quick`` runs). The methods are the registry :data:`~pyro_fa.experiments.posteriordb.methods.METHODS`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from typing import Dict, List

from pyro_fa.experiments._io import (OutputFolder, atomic_write_json, atomic_write_text, positive_int,
                                     progress_bar, read_record, unit_path)

#: the subcommand's one-line help, which `pyro-fa` reads without importing this module
HELP = ("Pyro's guides, Pathfinder, NUTS and the factor-analysis methods scored against posteriordb's reference "
        "draws (W1 curves over gradient evaluations, debiased W1, moment errors, k-hat; Zhang et al. 2022).")

COMMAND = "pyro-fa posteriordb"
#: bumped when a change alters what a unit computes: older unit files are then not reused
UNIT_PROTOCOL = 2
_UNIT_FIELDS = {"key": dict, "posterior": str, "method": str, "seed": int, "scores": dict, "grad_evals": int,
                "seconds": (int, float), "curve": list}
QUICK_POSTERIOR = "gaussian_linreg"


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_arguments(parser) -> None:
    """The options of ``pyro-fa posteriordb`` (read when the subcommand is parsed: the methods' registry)."""
    from pyro_fa.experiments.posteriordb.methods import METHODS

    names = list(METHODS)
    parser.add_argument("--posteriors", nargs="+", default=None, metavar="NAME",
                        help="posteriors to score (default: every port; quick: the stand-in gaussian_linreg)")
    parser.add_argument("--methods", nargs="+", default=None, choices=names, metavar="METHOD",
                        help="methods to score (default: all: " + ", ".join(names) + ")")
    parser.add_argument("--seeds", type=positive_int, default=None, help="seeds per method (default 10; quick 2)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="SVI steps of the guides (default 2000; quick 100)")
    parser.add_argument("--checkpoints", type=positive_int, nargs="+", default=None, metavar="STEP",
                        help="SVI steps at which the curves are scored, besides --steps (default 100 250 500 1000; "
                             "quick 25 50)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="Adam's rate for every SVI method (default: chosen per posterior and method from "
                             "--lr-grid by the ELBO on a tuning seed)")
    parser.add_argument("--lr-grid", type=_positive_float, nargs="+", default=None, metavar="LR",
                        help="the rates tried (default 0.003 0.01 0.03 0.1; quick 0.01 0.1)")
    parser.add_argument("--rank", type=positive_int, default=None, help="rank of the low-rank guides (default 10)")
    parser.add_argument("--num-draws", type=positive_int, default=None,
                        help="draws scored per method, seed and checkpoint (default 1000; quick 200)")
    parser.add_argument("--data-dir", default=None, help="the posteriordb folder (default: the ports' own rule)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")


def load(name: str, data_dir=None):
    """A stand-in by name, else a posteriordb port (:func:`pyro_fa.experiments.posteriordb.load_posterior`)."""
    from pyro_fa.experiments.posteriordb.standins import STANDINS, load_standin

    if name in STANDINS:
        try:
            return load_standin(name, data_dir)
        except (OSError, ValueError) as err:  # a stand-in whose reference is made apart (big_logistic)
            raise SystemExit(f"{COMMAND}: cannot load posterior {name!r}: {err}") from None
    try:
        from pyro_fa.experiments.posteriordb.loader import load_posterior
    except ImportError:
        raise SystemExit(f"{COMMAND}: --posteriors {name!r} is not a stand-in ({', '.join(STANDINS)}) and no "
                         "posteriordb port is installed.") from None
    try:
        return load_posterior(name, data_dir)
    except (KeyError, OSError, FileNotFoundError) as err:
        raise SystemExit(f"{COMMAND}: cannot load posterior {name!r}: {err}") from None


def default_posteriors(quick: bool) -> List[str]:
    if quick:
        return [QUICK_POSTERIOR]
    try:
        from pyro_fa.experiments.posteriordb import PORTS
    except ImportError:
        return [QUICK_POSTERIOR]
    return sorted(PORTS)


def score(fit, posterior, seed: int) -> Dict[str, float]:
    """The Pathfinder-paper scores of a fit's draws (a :class:`~.methods.Point`, or a fit's last point) against
    ``posterior.reference`` (module docstring)."""
    import numpy as np
    import torch

    from pyro_fa.metrics.transport import (debiased_wasserstein1, marginal_errors, pareto_khat, wasserstein1,
                                           wasserstein1_floor)

    point = fit.points[-1] if hasattr(fit, "points") else fit
    ref = posterior.reference.detach().to(torch.float64)
    n = point.draws.shape[0]
    rng = np.random.default_rng(seed)
    floors = posterior.__dict__.setdefault("_w1_floors", {})  # the same at every checkpoint of a seed
    floor_key = (posterior.reference.data_ptr(), tuple(ref.shape), n, seed)
    if ref.shape[0] >= 2 * n:
        idx = rng.permutation(ref.shape[0])[:2 * n]
        ref_n, ref_2n = ref[idx[:n]].numpy(), ref[idx].numpy()
        if floor_key not in floors:
            floors[floor_key] = wasserstein1_floor(ref_2n, n, seed=seed)
    else:  # a small reference: the floor at half the size
        ref_n, ref_2n = ref[rng.permutation(ref.shape[0])[:n]].numpy(), ref.numpy()
        if floor_key not in floors:
            floors[floor_key] = wasserstein1_floor(ref_2n, seed=seed)
    floor = floors[floor_key]
    draws = point.draws.numpy()
    out = {"w1": float("nan"), "w1_floor": floor, "w1_debiased": float("nan"), "max_mean_error": float("nan"),
           "min_sd_ratio": float("nan"), "max_sd_ratio": float("nan"), "khat": float("nan")}
    if not bool(np.isfinite(draws).all()):
        return out
    out["w1"] = wasserstein1(draws, ref_n)
    out["w1_debiased"] = debiased_wasserstein1(draws, ref_2n[: 2 * (n // 2)], n // 2, seed=seed)["w1_debiased"]
    m = marginal_errors(draws, ref.numpy())
    out.update(max_mean_error=m["max_mean_error"], min_sd_ratio=float(m["sd_ratio"].min()),
               max_sd_ratio=float(m["sd_ratio"].max()))
    if point.log_q is None:  # resampled or MCMC draws: the k-hat of a proposal where the method has one
        out["khat"] = point.extra.get("khat_resampling", float("nan"))
    else:
        with torch.no_grad():
            log_p = posterior.log_density(point.draws)
        out["khat"] = pareto_khat((log_p - point.log_q.to(log_p)).numpy())
    return out


def _key(budget, posterior: str, method: str, seed: int, lr) -> dict:
    from pyro_fa.experiments.posteriordb.methods import METHODS

    key = {"protocol": UNIT_PROTOCOL, "budget": asdict(budget), "posterior": posterior, "method": method,
           "method_version": METHODS[method].version, "seed": seed, "lr": lr}
    return json.loads(json.dumps(key))


def _fit_unit(name, posterior, method, seed, budget, lr) -> dict:
    """Fit one unit and score every point of its curve; a method that fails on a posterior is a result."""
    from pyro_fa.experiments.posteriordb.methods import fit_method

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        fit = fit_method(method, posterior, budget, seed, lr=lr)
        curve = [{"step": p.step, "grad_evals": int(p.grad_evals), "density_evals": int(p.density_evals),
                  "scores": score(p, posterior, seed)} for p in fit.points]
        out = {"curve": curve, "scores": curve[-1]["scores"], "grad_evals": curve[-1]["grad_evals"],
               "density_evals": curve[-1]["density_evals"], "seconds": fit.seconds,
               "cpu_seconds": fit.cpu_seconds, "extra": fit.extra, "error": None}
    except (RuntimeError, ValueError) as err:
        out = {"curve": [], "scores": {}, "grad_evals": 0, "density_evals": 0, "seconds": time.perf_counter() - t0,
               "cpu_seconds": None, "extra": {}, "error": f"{type(err).__name__}: {err}"}
    out["score_seconds"] = time.perf_counter() - t0 - out["seconds"]
    out["score_cpu_seconds"] = time.process_time() - c0 - (out["cpu_seconds"] or 0)
    return out


def run_units(posteriors, methods, seeds, budget, output_dir, data_dir=None, progress=True, lr=None,
              lr_grid=None) -> List[dict]:
    """Run (or reuse) every (posterior, method, seed) unit, choosing the tuned methods' rates first (unless ``lr``
    fixes it); returns their records."""
    from pyro_fa.experiments.posteriordb.methods import METHODS
    from pyro_fa.experiments.posteriordb.tuning import LR_GRID, choose_lr, tuning_seed

    records: List[dict] = []
    bar = progress_bar(total=len(posteriors) * len(methods) * len(seeds), desc="posteriordb", unit="fit",
                       enabled=progress)
    for name in posteriors:
        cache = {}

        def posterior():
            if "p" not in cache:
                cache["p"] = load(name, data_dir)
            return cache["p"]

        for method in methods:
            rate, tuning = (None, None) if not METHODS[method].tuned else (lr, None)
            if METHODS[method].tuned and lr is None:
                tuning = choose_lr(method, name, posterior, budget, tuning_seed(seeds), output_dir,
                                   lr_grid or LR_GRID, COMMAND)
                rate = tuning["lr"]
            for seed in seeds:
                key = _key(budget, name, method, seed, rate)
                path = unit_path(output_dir, key, f"{name}__{method}__s{seed}")
                record = read_record(path, _UNIT_FIELDS, COMMAND) if path.exists() else None
                if record is None or record["key"] != key:
                    record = {"key": key, "posterior": name, "method": method, "seed": seed, "lr": rate,
                              "tuning": tuning, **_fit_unit(name, posterior(), method, seed, budget, rate)}
                    atomic_write_json(path, _finite_json(record))
                    w, error = record["scores"].get("w1_debiased"), record["error"]
                    bar.write(f"{COMMAND}: {name} {method} seed {seed}: " + (
                        f"W1 debiased {w if w is not None else float('nan'):.3g}, {record['grad_evals']} gradient "
                        f"evaluations, {record['seconds']:.1f}s" if error is None else f"failed ({error})"))
                records.append(record)
                bar.update(1)
    bar.close()
    return records


def _finite_json(obj):
    """NaN and infinities as null (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def budget_from_args(args):
    from pyro_fa.experiments.posteriordb.methods import Budget

    b = Budget.quick() if args.quick else Budget()
    for field_name, value in (("steps", args.steps), ("rank", args.rank), ("num_draws", args.num_draws)):
        if value is not None:
            b = replace(b, **{field_name: value})
    if args.checkpoints is not None:
        b = replace(b, checkpoints=tuple(sorted(set(args.checkpoints))))
    return b


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    budget = budget_from_args(args)
    posteriors = list(dict.fromkeys(args.posteriors or default_posteriors(args.quick)))
    from pyro_fa.experiments.posteriordb.methods import METHODS

    methods = list(dict.fromkeys(args.methods or METHODS))
    n_seeds = args.seeds or (2 if args.quick else 10)
    seeds = [args.seed + i for i in range(n_seeds)]
    with OutputFolder(args.output_dir, COMMAND, subfolders=("units",)):
        return _run_locked(args, budget, posteriors, methods, seeds)


def _run_locked(args, budget, posteriors, methods, seeds) -> int:
    from pyro_fa.experiments.posteriordb.report import figure, goals_table, posterior_table
    from pyro_fa.experiments.posteriordb.tuning import QUICK_LR_GRID

    grid = args.lr_grid or (QUICK_LR_GRID if args.quick else None)
    records = run_units(posteriors, methods, seeds, budget, args.output_dir, args.data_dir,
                        progress=not args.no_progress, lr=args.lr, lr_grid=grid)
    atomic_write_json(f"{args.output_dir}/results.json", _finite_json({"budget": asdict(budget), "units": records}))
    names = list(dict.fromkeys(r["posterior"] for r in records))
    report = goals_table(records) + "\n\n" + "\n\n".join(posterior_table(records, n) for n in names) + "\n"
    figure(records, f"{args.output_dir}/w1_vs_gradient_evaluations.png")
    atomic_write_text(f"{args.output_dir}/report.md", f"# {COMMAND}\n\n{report}\n"
                      "![debiased W1 against gradient evaluations](w1_vs_gradient_evaluations.png)\n")
    print(report)
    return 0
