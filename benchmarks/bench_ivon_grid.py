"""Is IVON short of its best in ``pyro-fa classify``? Its grid's corner, extended and scored.

``pyro-fa classify`` tunes the peer IVON (Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych,
Cremers, Khan & Moellenhoff 2024, "Variational learning is effective for large deep networks", package
``ivon-opt``) on the validation part over ``Budget.ivon_lrs`` x ``Budget.ivon_hess_inits``; on the digits and
MNIST-1D MLPs its choice sat at the top rate of the earlier grid, {0.05, 0.1, 0.2, 0.4} x {0.03, 0.1, 0.5}, on
most seeds (this benchmark's findings widened ``Budget``'s grid to {0.4, ..., 6.4} x {0.01, ..., 2}, and the
tables were rerun on it). It trains IVON at extra grid points (default: rate in {0.4, 0.8, 1.6} x
``hess_init`` in {0.003, 0.01, 0.03}, the corner beyond the earlier grid's (0.4, 0.03)), with the recipe of :func:`pyro_fa.experiments.classify.baselines.ivon_probs`
(its own training and prediction helpers, the same seeds), and then:

* checks the protocol: every new point that is also in the committed grid must give the committed run's
  validation NLL (``extra[seed]["val_nll"]`` of the ``ivon`` row in the recorded ``results.json``; the runs
  are deterministic), and, where it is the committed choice, its test NLL;
* chooses over the union of the committed grid and the new points by validation NLL (the committed rule),
  and scores the union's choice on the test part (NLL, ECE, by :mod:`pyro_fa.metrics` through the report's
  ``evaluate``) against the committed ``ivon`` row, and its "+T" version (a temperature fitted on the
  validation predictive by :func:`pyro_fa.experiments.classify.posthoc.tempered_rows`, as the committed
  ``ivon+T`` row) against ``ivon+T``;
* prints one table per dataset and the paired differences (union - committed) over seeds, mean +- s.e.

A seed whose union choice is a committed point scores exactly the committed row (difference 0). ``--also``
joins the points of earlier runs (their ``--json`` files) to the union without training them again;
``--datasets digits-8`` scores the digits MLP trained without the classes 8 and 9 the same way.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ivon_grid.py               # digits and MNIST-1D, 5 seeds
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ivon_grid.py --json a.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ivon_grid.py --datasets digits --hess-inits 0.1 0.5 1 2 \
        --also a.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ivon_grid.py --seeds 1 --epochs 2   # smoke test
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time

import torch

from pyro_fa.experiments._io import mean_se
from pyro_fa.experiments.classify import baselines
from pyro_fa.experiments.classify.data import load_classify
from pyro_fa.experiments.classify.methods import Budget
from pyro_fa.experiments.classify.networks import make_network
from pyro_fa.experiments.classify.posthoc import tempered_rows
from pyro_fa.experiments.classify.report import evaluate, paired, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the recorded run of each dataset's MLP: (results.json, its combo key)
COMMITTED = {
    "digits": (os.path.join(ROOT, "docs", "classify", "results.json"), "digits-mlp"),
    "mnist1d": (os.path.join(ROOT, "docs", "classify", "mnist1d-mlp", "results.json"), "mnist1d-mlp"),
    "digits-8": (os.path.join(ROOT, "docs", "classify", "digits-8-mlp", "results.json"), "digits-8-mlp"),
}


def _positive_floats(name):
    def parse(text):
        value = float(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{name} must be finite numbers > 0, got {text!r}")
        return value
    return parse


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def committed_ivon(dataset):
    """The recorded ``ivon`` and ``ivon+T`` rows of ``dataset``'s MLP: ``{seed: {...}}`` with the chosen
    setting, the validation NLL of every committed grid point and the test NLL / ECE of both rows."""
    if dataset not in COMMITTED:
        raise ValueError(f"bench_ivon_grid: dataset must be one of {sorted(COMMITTED)}, got {dataset!r}.")
    path, key = COMMITTED[dataset]
    with open(path) as f:
        record = json.load(f)
    methods = record["combos"][key]["methods"]
    ivon, tempered = methods["ivon"], methods["ivon+T"]
    seeds = record["seeds_per_combo"][key]
    out = {}
    for k, seed in enumerate(seeds):
        extra = ivon["extra"][k]
        out[seed] = {"choice": (extra["lr"], extra["hess_init"]), "val_nll": extra["val_nll"],
                     "nll": ivon["per_seed"]["nll"][k], "ece": ivon["per_seed"]["ece"][k],
                     "nll_T": tempered["per_seed"]["nll"][k], "ece_T": tempered["per_seed"]["ece"][k]}
    return out, record["budget"]


def train_point(make, data, budget, seed, lr, hess_init):
    """One grid point by ``ivon_probs``'s recipe: the validation NLL it ranks by (draws under
    ``manual_seed(seed)``) and the predictive draws ``ivon_probs`` returns when this point is chosen
    (``manual_seed(seed + 1)``), for [validation, test]."""
    ivon = baselines._require("ivon", "bench_ivon_grid")
    defaults = inspect.signature(baselines.ivon_probs).parameters
    x_va, y_va = data.x_val, data.y_val
    with torch.random.fork_rng(devices=[]):
        net, opt = baselines._ivon_train(ivon, make, data.x_train, data.y_train, budget.epochs, budget.batch_size,
                                         lr=lr, seed=seed, hess_init=hess_init, beta2=defaults["beta2"].default,
                                         weight_decay=defaults["weight_decay"].default)
        torch.manual_seed(seed)
        (p_val,) = baselines._ivon_predict(net, opt, [x_va], budget.samples)
        p_bma = p_val.mean(0).gather(1, y_va.to(p_val.device)[:, None]).squeeze(1)
        val_nll = float(-p_bma.clamp_min(torch.finfo(p_bma.dtype).tiny).log().mean())
        torch.manual_seed(seed + 1)
        probs = baselines._ivon_predict(net, opt, [x_va, data.x_test], budget.samples)
    return val_nll, probs


def score(probs, data):
    """Test NLL / ECE of the predictive and of its "+T" version (``tempered_rows``, as the committed run)."""
    plain = evaluate([probs[1]], data.y_test, [])
    tempered = tempered_rows({"ivon": {"probs": probs, "seconds": 0.0}}, data.y_val)["ivon+T"]
    warm = evaluate(tempered["probs"], data.y_test, [])
    return {"nll": plain["nll"], "ece": plain["ece"], "nll_T": warm["nll"], "ece_T": warm["ece"],
            "temperature": float(tempered["extra"]["temperature"])}


def run_dataset(name, seeds, budget, grid, check, earlier=None):
    """Train the new points for every seed; returns the per-seed rows and the protocol checks' failures.
    ``earlier``: ``{seed: {point: numbers}}`` of an earlier run (``--also``), joined to the new points."""
    committed, _ = committed_ivon(name)
    rows, failures = [], []
    for seed in seeds:
        if seed not in committed:
            raise ValueError(f"bench_ivon_grid: seed {seed} of {name} is not in the committed run "
                             f"(seeds {sorted(committed)}).")
        ref = committed[seed]
        data = load_classify(name, seed=seed)
        make = lambda: make_network("mlp", data)  # noqa: E731
        new = {}
        for lr, h in grid:
            t0 = time.perf_counter()
            val_nll, probs = train_point(make, data, budget, seed, lr, h)
            key = repr((lr, h))
            if not all(bool(torch.isfinite(p).all()) for p in probs):  # diverged: never chosen
                new[key] = {"val_nll": math.inf, **{m: math.nan for m in ("nll", "ece", "nll_T", "ece_T")}}
                print(f"  {name} seed {seed} (lr {lr:g}, hess_init {h:g}): diverged (NaN / inf predictive), "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                continue
            new[key] = {"val_nll": val_nll, **score(probs, data)}
            line = (f"  {name} seed {seed} (lr {lr:g}, hess_init {h:g}): val NLL {val_nll:.5f}, test NLL "
                    f"{new[key]['nll']:.4f}, + T {new[key]['nll_T']:.4f}, {time.perf_counter() - t0:.1f} s")
            if check and key in ref["val_nll"]:
                same = val_nll == ref["val_nll"][key]
                line += f"; committed val NLL {ref['val_nll'][key]:.8f}: {'EQUAL' if same else 'DIFFERS'}"
                if not same:
                    failures.append(f"{name} seed {seed} {key}: val NLL {val_nll!r} vs {ref['val_nll'][key]!r}")
                if (lr, h) == tuple(ref["choice"]):  # the committed choice: its test numbers, + T too
                    bad = [m for m in ("nll", "ece", "nll_T", "ece_T")
                           if not math.isclose(new[key][m], ref[m], rel_tol=1e-9, abs_tol=1e-12)]
                    line += (f"; the committed choice: test NLL {ref['nll']:.8f}, + T {ref['nll_T']:.8f} committed: "
                             + ("ALL EQUAL" if not bad else "DIFFER in " + ", ".join(bad)))
                    failures += [f"{name} seed {seed} {key}: test {m} {new[key][m]!r} vs {ref[m]!r}" for m in bad]
            print(line, flush=True)
        for key, numbers in (earlier or {}).get(seed, {}).items():
            new.setdefault(key, numbers)
        # a point of both grids keeps the committed value (the check above: the same number), so the union's
        # choice is either the committed choice or a new point
        union = {**{k: v["val_nll"] for k, v in new.items()}, **ref["val_nll"]}
        choice = min(union, key=union.get)
        best_new = min(new, key=lambda k: new[k]["val_nll"])
        won = choice in new and choice not in ref["val_nll"]
        result = new[choice] if won else {m: ref[m] for m in ("nll", "ece", "nll_T", "ece_T")}
        rows.append({"seed": seed, "committed": repr(tuple(ref["choice"])),
                     "committed_val": ref["val_nll"][repr(tuple(ref["choice"]))], "best_new": best_new,
                     "best_new_val": new[best_new]["val_nll"], "union": choice, "union_val": union[choice],
                     "new_wins": won, **{f"ref_{m}": ref[m] for m in ("nll", "ece", "nll_T", "ece_T")},
                     **{f"union_{m}": result[m] for m in ("nll", "ece", "nll_T", "ece_T")}, "points": new})
    return rows, failures


def report(name, rows):
    """The dataset's table and the paired differences union - committed, as printed lines."""
    lines = [f"\n{name} MLP: IVON, committed grid vs its union with the new points",
             "| seed | committed (val NLL) | best new (val NLL) | union's choice | test NLL committed -> union "
             "| ECE | + T: NLL | + T: ECE |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['committed']} ({r['committed_val']:.4f}) | {r['best_new']} "
                     f"({r['best_new_val']:.4f}) | {r['union']}{' (new)' if r['new_wins'] else ''} | "
                     f"{r['ref_nll']:.4f} -> {r['union_nll']:.4f} | {r['ref_ece']:.4f} -> {r['union_ece']:.4f} | "
                     f"{r['ref_nll_T']:.4f} -> {r['union_nll_T']:.4f} | {r['ref_ece_T']:.4f} -> "
                     f"{r['union_ece_T']:.4f} |")
    lines.append(f"new point chosen on {sum(r['new_wins'] for r in rows)} of {len(rows)} seeds")
    for metric in ("nll", "ece", "nll_T", "ece_T"):
        diff, se = paired([r[f"union_{metric}"] for r in rows], [r[f"ref_{metric}"] for r in rows])
        ref_mean, _ = mean_se([r[f"ref_{metric}"] for r in rows])
        lines.append(f"paired {metric.replace('_T', ' + T'):>7} union - committed: {diff:+.4f} +- {se:.4f} "
                     f"(committed mean {ref_mean:.4f}): {verdict(diff, se)}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "mnist1d"], choices=list(COMMITTED))
    parser.add_argument("--seeds", type=_positive_int, default=5, help="seeds 0 .. SEEDS-1 (default 5)")
    parser.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help="training epochs (default: Budget's, the committed run's; fewer skip the checks)")
    parser.add_argument("--lrs", nargs="+", type=_positive_floats("--lrs"), default=[0.4, 0.8, 1.6])
    parser.add_argument("--hess-inits", nargs="+", type=_positive_floats("--hess-inits"),
                        default=[0.003, 0.01, 0.03])
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--also", nargs="+", default=[], metavar="JSON",
                        help="earlier runs' --json files: their points join the union (not retrained)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = Budget() if args.epochs is None else Budget(epochs=args.epochs)
    grid = [(lr, h) for lr in args.lrs for h in args.hess_inits]
    t_start = time.perf_counter()
    out, failures = {}, []
    for name in args.datasets:
        _, recorded = committed_ivon(name)
        check = all(recorded[k] == getattr(budget, k) for k in ("epochs", "batch_size", "samples"))
        if not check:
            print(f"{name}: epochs / batch size / samples differ from the committed run's "
                  f"({recorded['epochs']}, {recorded['batch_size']}, {recorded['samples']}): no protocol check, "
                  "and the comparison below means nothing", flush=True)
        earlier = {}
        for path in args.also:
            with open(path) as f:
                for row in json.load(f).get(name, []):
                    earlier.setdefault(row["seed"], {}).update(row["points"])
        rows, bad = run_dataset(name, range(args.seeds), budget, grid, check, earlier)
        out[name], failures = rows, failures + bad
        print("\n".join(report(name, rows)), flush=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; budget: {budget.epochs} epochs, batch "
          f"{budget.batch_size}, {budget.samples} draws; new grid {grid}"
          + (f", with the points of {args.also}" if args.also else ""))
    print("protocol check: " + ("every shared point's committed numbers reproduced" if not failures else
                                "FAILED: " + "; ".join(failures)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
