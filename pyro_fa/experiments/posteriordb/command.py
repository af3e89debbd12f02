"""``pyro-fa posteriordb``: Pyro's guides and the factor-analysis fits scored against posteriordb's reference draws.

Per posterior, method and seed, the method's draws are scored against the reference draws in the unconstrained
space the Pathfinder way (Zhang et al. 2022, Section 4; :mod:`pyro_fa.metrics.transport`): the exact empirical
1-Wasserstein distance between ``num_draws`` draws of each, the reference-against-itself floor at that size, the
debiased W1 (cross minus self distances on disjoint halves), each marginal's mean error in reference standard
deviations and its s.d. ratio, the Pareto k̂ of ``log p - log q`` where the method has a density, the log-density
gradient evaluations and the seconds. Each (posterior, method, seed) is written to its own unit file as soon as it
is done (``<output>/units/``) and a run again reuses them; ``report.md`` holds a table per posterior.

Posteriors are the ports of :mod:`pyro_fa.experiments.posteriordb` (``load_posterior``) or the stand-ins of
:mod:`pyro_fa.experiments.posteriordb.standins` (``gaussian_linreg``, whose reference is exact, is what
``--quick`` runs).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from typing import Dict, List

from pyro_fa.experiments._io import (OutputFolder, atomic_write_json, atomic_write_text, markdown_table,
                                     positive_int, progress_bar, read_record, unit_path)

#: the subcommand's one-line help, which `pyro-fa` reads without importing this module
HELP = ("Pyro's guides, Pathfinder and the factor-analysis guide scored against posteriordb's reference draws "
        '(W1, debiased W1, moment errors, k-hat, gradient evaluations; Zhang et al. 2022).')

COMMAND = "pyro-fa posteriordb"
#: bumped when a change alters what a unit computes: older unit files are then not reused
UNIT_PROTOCOL = 1
_UNIT_FIELDS = {"key": dict, "posterior": str, "method": str, "seed": int, "scores": dict, "grad_evals": int,
                "seconds": (int, float)}
QUICK_POSTERIOR = "gaussian_linreg"
_METHOD_NAMES = ("auto-normal", "auto-lowrank", "auto-mvn", "auto-laplace", "factor-guide", "pathfinder",
                 "pathfinder-multi", "pathfinder-guide")  # pyro_fa.experiments.posteriordb.methods.METHODS


def add_arguments(parser) -> None:
    """The options of ``pyro-fa posteriordb`` (no heavy import here: the CLI is lazy)."""
    parser.add_argument("--posteriors", nargs="+", default=None, metavar="NAME",
                        help="posteriors to score (default: every port; quick: the stand-in gaussian_linreg)")
    parser.add_argument("--methods", nargs="+", default=None, choices=_METHOD_NAMES, metavar="METHOD",
                        help="methods to score (default: all: " + ", ".join(_METHOD_NAMES) + ")")
    parser.add_argument("--seeds", type=positive_int, default=None, help="seeds per method (default 10; quick 2)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="SVI steps of the guides (default 2000; quick 200)")
    parser.add_argument("--rank", type=positive_int, default=None, help="rank of the low-rank guides (default 10)")
    parser.add_argument("--num-draws", type=positive_int, default=None,
                        help="draws scored per method and seed (default 1000; quick 200)")
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
    """The Pathfinder-paper scores of a fit's draws against ``posterior.reference`` (module docstring)."""
    import numpy as np
    import torch

    from pyro_fa.metrics.transport import (debiased_wasserstein1, marginal_errors, pareto_khat, wasserstein1,
                                           wasserstein1_floor)

    ref = posterior.reference.detach().to(torch.float64)
    n = fit.draws.shape[0]
    rng = np.random.default_rng(seed)
    if ref.shape[0] >= 2 * n:
        idx = rng.permutation(ref.shape[0])[:2 * n]
        ref_n, ref_2n = ref[idx[:n]].numpy(), ref[idx].numpy()
        floor = wasserstein1_floor(ref_2n, n, seed=seed)
    else:  # a small reference: the floor at half the size
        ref_n, ref_2n = ref[rng.permutation(ref.shape[0])[:n]].numpy(), ref.numpy()
        floor = wasserstein1_floor(ref_2n, seed=seed)
    draws = fit.draws.numpy()
    finite = bool(np.isfinite(draws).all())
    out = {"w1": float("nan"), "w1_floor": floor, "w1_debiased": float("nan"), "max_mean_error": float("nan"),
           "min_sd_ratio": float("nan"), "max_sd_ratio": float("nan"), "khat": float("nan")}
    if not finite:
        return out
    out["w1"] = wasserstein1(draws, ref_n)
    out["w1_debiased"] = debiased_wasserstein1(draws, ref_2n[: 2 * (n // 2)], n // 2, seed=seed)["w1_debiased"]
    m = marginal_errors(draws, ref.numpy())
    out.update(max_mean_error=m["max_mean_error"], min_sd_ratio=float(m["sd_ratio"].min()),
               max_sd_ratio=float(m["sd_ratio"].max()))
    if fit.log_q is None:  # multi-path Pathfinder's resampled draws: k-hat of its pooled proposal instead
        out["khat"] = fit.extra.get("khat_resampling", float("nan"))
    else:
        with torch.no_grad():
            log_p = posterior.log_density(fit.draws)
        out["khat"] = pareto_khat((log_p - fit.log_q.to(log_p)).numpy())
    return out


#: bumped per method when a change alters what that method computes (its older unit files are then not reused);
#: pathfinder-guide 2: the guide's mean whitened by Pathfinder's marginal s.d.
METHOD_VERSIONS = {"pathfinder-guide": 2}


def _key(budget, posterior: str, method: str, seed: int) -> dict:
    key = {"protocol": UNIT_PROTOCOL, "budget": asdict(budget), "posterior": posterior, "method": method,
           "seed": seed}
    if method in METHOD_VERSIONS:
        key["method_version"] = METHOD_VERSIONS[method]
    return json.loads(json.dumps(key))


def run_units(posteriors, methods, seeds, budget, output_dir, data_dir=None, progress=True) -> List[dict]:
    """Run (or reuse) every (posterior, method, seed) unit; returns their records."""
    from pyro_fa.experiments.posteriordb.methods import fit_method

    records: List[dict] = []
    bar = progress_bar(total=len(posteriors) * len(methods) * len(seeds), desc="posteriordb", unit="fit",
                       enabled=progress)
    for name in posteriors:
        posterior = None
        for method in methods:
            for seed in seeds:
                key = _key(budget, name, method, seed)
                path = unit_path(output_dir, key, f"{name}__{method}__s{seed}")
                record = read_record(path, _UNIT_FIELDS, COMMAND) if path.exists() else None
                if record is None or record["key"] != key:
                    if posterior is None:
                        posterior = load(name, data_dir)
                    t0 = time.perf_counter()
                    try:
                        fit = fit_method(method, posterior, budget, seed)
                        scores, error = score(fit, posterior, seed), None
                        grad, dens, extra = fit.grad_evals, fit.density_evals, fit.extra
                    except (RuntimeError, ValueError) as err:  # a method that fails on a posterior is a result
                        scores, error, grad, dens, extra = {}, f"{type(err).__name__}: {err}", 0, 0, {}
                    record = {"key": key, "posterior": name, "method": method, "seed": seed, "scores": scores,
                              "grad_evals": grad, "density_evals": dens, "seconds": time.perf_counter() - t0,
                              "extra": extra, "error": error}
                    atomic_write_json(path, _finite_json(record))
                    w = record["scores"].get("w1_debiased")
                    bar.write(f"{COMMAND}: {name} {method} seed {seed}: " + (
                        f"W1 debiased {w:.3g}, {record['grad_evals']} gradient evaluations, "
                        f"{record['seconds']:.1f}s" if error is None else f"failed ({error})"))
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


def _median(values):
    vals = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not vals:
        return float("nan")
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])


def tables(records: List[dict]) -> str:
    """A markdown table per posterior: medians over seeds, ranked by the debiased W1."""
    out = []
    header = ["method", "W1", "W1 debiased", "W1 floor", "max mean err (sd)", "sd ratio min-max", "k-hat",
              "grad evals", "density evals", "seconds", "failed"]
    for name in dict.fromkeys(r["posterior"] for r in records):
        rows = []
        for method in dict.fromkeys(r["method"] for r in records if r["posterior"] == name):
            rs = [r for r in records if r["posterior"] == name and r["method"] == method]
            ok = [r for r in rs if not r.get("error")]
            med = {k: _median([r["scores"].get(k) for r in ok]) for k in
                   ("w1", "w1_debiased", "w1_floor", "max_mean_error", "min_sd_ratio", "max_sd_ratio", "khat")}
            rows.append((med["w1_debiased"], [
                method, f"{med['w1']:.3g}", f"{med['w1_debiased']:.3g}", f"{med['w1_floor']:.3g}",
                f"{med['max_mean_error']:.3g}", f"{med['min_sd_ratio']:.2f}-{med['max_sd_ratio']:.2f}",
                f"{med['khat']:.2f}", f"{_median([r['grad_evals'] for r in ok]):.0f}",
                f"{_median([r.get('density_evals', 0) for r in ok]):.0f}",
                f"{_median([r['seconds'] for r in ok]):.2f}", f"{len(rs) - len(ok)}/{len(rs)}"]))
        rows.sort(key=lambda t: (math.isnan(t[0]), t[0]))
        out.append(f"### {name}\n\nMedians over {len({r['seed'] for r in records if r['posterior'] == name})} "
                   "seeds, ranked by the debiased W1.\n\n" + markdown_table(header, [r for _, r in rows]))
    return "\n\n".join(out) + "\n"


def figure(records: List[dict], path) -> None:
    """Debiased W1 against log-density gradient evaluations, every method (one point per seed), a panel per
    posterior."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    from pyro_fa.experiments._io import atomic_savefig

    names = list(dict.fromkeys(r["posterior"] for r in records))
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 4.5 * cols), 3.5 * rows + 0.8), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in records))
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for ax, name in zip(axes.flat, names):
        for m in methods:
            pts = [(r["grad_evals"], r["scores"].get("w1_debiased")) for r in records
                   if r["posterior"] == name and r["method"] == m and not r.get("error")]
            pts = [(g, w) for g, w in pts if w is not None and math.isfinite(w)]
            if pts:
                ax.scatter(*zip(*pts), s=14, color=colours[m], label=m)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("gradient evaluations")
        ax.set_ylabel("debiased W1")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.16 / rows, 1, 1))
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def budget_from_args(args):
    from pyro_fa.experiments.posteriordb.methods import Budget

    b = Budget.quick() if args.quick else Budget()
    for field_name, value in (("steps", args.steps), ("rank", args.rank), ("num_draws", args.num_draws)):
        if value is not None:
            b = replace(b, **{field_name: value})
    return b


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    budget = budget_from_args(args)
    posteriors = list(dict.fromkeys(args.posteriors or default_posteriors(args.quick)))
    methods = list(dict.fromkeys(args.methods or _METHOD_NAMES))
    n_seeds = args.seeds or (2 if args.quick else 10)
    seeds = [args.seed + i for i in range(n_seeds)]
    with OutputFolder(args.output_dir, COMMAND, subfolders=("units",)):
        return _run_locked(args, budget, posteriors, methods, seeds)


def _run_locked(args, budget, posteriors, methods, seeds) -> int:
    records = run_units(posteriors, methods, seeds, budget, args.output_dir, args.data_dir,
                        progress=not args.no_progress)
    atomic_write_json(f"{args.output_dir}/results.json", _finite_json({"budget": asdict(budget), "units": records}))
    report = tables(records)
    figure(records, f"{args.output_dir}/w1_vs_gradient_evaluations.png")
    atomic_write_text(f"{args.output_dir}/report.md", f"# {COMMAND}\n\n{report}\n"
                      "![debiased W1 against gradient evaluations](w1_vs_gradient_evaluations.png)\n")
    print(report)
    return 0
