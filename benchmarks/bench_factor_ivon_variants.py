"""Which FactorIVON settings, if any, beat IVON + T on the MNIST-1D MLPs? Variants of rank, refresh and floor.

``pyro-fa classify``'s ``factor-ivon`` row runs :class:`pyro_fa.optim.FactorIVON` at one setting, rank 10 with
its low-rank part refreshed every 10 steps (``update_every=10``) and ``diag_floor=0.25``, and ties IVON + T
(Shen et al. 2024, "Variational learning is effective for large deep networks") on the MNIST-1D MLP and
MNIST-1D-8. This benchmark trains other settings of the same optimizer with the row's recipe
(:func:`pyro_fa.experiments.classify.factor_ivon_rows.factor_ivon_probs`: the IVON row's training loop, cosine
rate, 150 epochs of minibatches of 100, the rate x ``hess_init`` grid chosen by the validation NLL of the model
average of 30 draws), and IVON itself as the same code at rank 0 (FactorIVON at ``rank=0`` is ivon-opt's IVON bit
for bit, tests/test_factor_ivon.py), on the same seeds, splits and minibatch order. Each variant is scored on the
test part raw and "+ T" (a temperature fitted on the validation predictive,
:func:`pyro_fa.experiments.classify.posthoc.tempered_rows`, as the command's "+T" rows), with accuracy, ECE and
OOD AUROC by the predictive entropy; then paired over seeds against IVON (mean +- s.e.; ``*`` beyond two s.e.).

Variants (``--variants``; name ``ivon[-b<beta2>]`` or ``k<rank>-t<update_every>[-f<diag_floor>][-b<beta2>]``):
``ivon`` (rank 0), ``k10-t10`` (the row's setting), ``k10-t1`` (a refresh at every step), ``k30-t10``, ``k3-t10``,
``k10-t10-f0.05`` (a low floor, so that the low-rank part may carry more of the precision); ``-b`` sets the Hessian
decay beta2 (default ivon-opt's 0.99999; a variant at another decay is also paired with IVON at that decay). A variant
run at several decays also gets a row ``<variant>-b*`` whose decay is chosen per seed on validation (the grid's
rule with the decay as one more axis), paired with ``ivon-b*``, IVON's decay chosen the same way.

Each (dataset, variant, seed) is one unit, written to ``--out`` (a JSON per unit) when it finishes; a rerun skips
the units already there, so a stopped run resumes. The grid defaults to the one the committed MNIST-1D tables
narrowed both IVON and FactorIVON to (rate {0.8, 1.6} x ``hess_init`` {0.01, 0.03}, where IVON's full-grid choice
lay on every recorded seed; benchmarks/results/factor_ivon_benchmarks.md).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_factor_ivon_variants.py --out runs/ivon_variants
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_factor_ivon_variants.py --out runs/ivon_variants \\
        --datasets mnist1d-8 --variants ivon k10-t1
    .venv/bin/python benchmarks/bench_factor_ivon_variants.py --out runs/ivon_variants --report   # tables only
    .venv/bin/python benchmarks/bench_factor_ivon_variants.py --out - --low-rank-share 0.8 0.01 \\
        --variants k10-t10 k10-t10-b0.9999                             # the low-rank part's share of the precision
    .venv/bin/python benchmarks/bench_factor_ivon_variants.py --out /tmp/v --seeds 1 --epochs 1 --variants ivon k3-t10
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

from pyro_fa.experiments._io import mean_se, pay_lazy_imports
from pyro_fa.experiments.classify.data import load_classify
from pyro_fa.experiments.classify.factor_ivon_rows import factor_ivon_probs
from pyro_fa.experiments.classify.methods import Budget
from pyro_fa.experiments.classify.networks import make_network
from pyro_fa.experiments.classify.posthoc import tempered_rows
from pyro_fa.experiments.classify.report import evaluate, paired, verdict

DEFAULT_VARIANTS = ("ivon", "k10-t10", "k10-t1", "k30-t10", "k3-t10", "k10-t10-f0.05")
_NAME = re.compile(r"^(?:ivon|k(\d+)-t(\d+)(?:-f([0-9.eE+-]+))?)(?:-b([0-9.eE+-]+))?$")
#: ivon-opt's default Hessian decay, the IVON row's
BETA2 = 0.99999


def parse_variant(name: str) -> dict:
    """``"ivon[-b<beta2>]"`` or ``"k<rank>-t<update_every>[-f<diag_floor>][-b<beta2>]"`` as the keyword
    arguments of :func:`~pyro_fa.experiments.classify.factor_ivon_rows.factor_ivon_probs`.

    >>> parse_variant("ivon")
    {'rank': 0, 'update_every': 1, 'diag_floor': 0.25, 'beta2': 0.99999}
    >>> parse_variant("k10-t1-f0.05-b0.9999")
    {'rank': 10, 'update_every': 1, 'diag_floor': 0.05, 'beta2': 0.9999}
    """
    match = _NAME.match(name)
    if match is None:
        raise SystemExit(f"bench_factor_ivon_variants: a variant must be 'ivon[-b<beta2>]' or 'k<rank>-t<update_every>"
                         f"[-f<diag_floor>][-b<beta2>]', got {name!r}.")
    rank, every, floor, beta2 = match.groups()
    floor = float(floor) if floor else 0.25
    beta2 = float(beta2) if beta2 else BETA2
    if not 0 < floor <= 1 or (every is not None and int(every) < 1) or not 0 < beta2 < 1:
        raise SystemExit(f"bench_factor_ivon_variants: {name!r}: update_every must be >= 1, the floor in (0, 1] and "
                         f"beta2 in (0, 1).")
    return {"rank": int(rank or 0), "update_every": int(every or 1), "diag_floor": floor, "beta2": beta2}


def same_beta2_ivon(variant: str) -> str:
    """The IVON variant at ``variant``'s Hessian decay (``"ivon"``, ``"ivon-b<beta2>"`` or, for a decay chosen on
    validation, ``"ivon-b*"``)."""
    match = re.search(r"-b([0-9.eE+-]+|\*)$", variant)
    return f"ivon-b{match.group(1)}" if match else "ivon"


def base_of(variant: str) -> str:
    """The variant without its Hessian decay: ``"k10-t10-b0.9999"`` -> ``"k10-t10"``."""
    return re.sub(r"-b[0-9.eE+-]+$", "", variant)


def decay_chosen_on_validation(units: dict, variants, seeds) -> dict:
    """``{(base + "-b*", seed): unit}``: for each variant run at more than one Hessian decay, per seed the decay
    whose grid reached the least validation NLL (the grid's own rule, with the decay as one more axis); only
    seeds where every decay of the base has its unit."""
    chosen = {}
    bases = {}
    for v in variants:
        bases.setdefault(base_of(v), []).append(v)
    for base, members in bases.items():
        if len(members) < 2:
            continue
        for s in seeds:
            if all((m, s) in units for m in members):
                best = min(members, key=lambda m: min(units[m, s]["val_nll"].values()))
                chosen[f"{base}-b*", s] = {**units[best, s], "variant": best}
    return chosen


def run_unit(dataset: str, variant: str, seed: int, args) -> dict:
    """Train one variant on one seed (its whole grid), score it raw and + T."""
    torch.set_default_dtype(torch.float32)
    data = load_classify(dataset, seed)
    ood_names = list(data.ood)
    inputs = [data.x_val, data.x_test, *data.ood.values()]
    info: dict = {}
    t0 = time.process_time()
    probs = factor_ivon_probs(lambda: make_network("mlp", data), (data.x_train, data.y_train),
                              (data.x_val, data.y_val), inputs, args.epochs, Budget.batch_size, seed, Budget.samples,
                              lr_grid=args.lrs, hess_init_grid=args.hess_inits, info=info,
                              **parse_variant(variant))[0]
    cpu = time.process_time() - t0
    tempered = tempered_rows({"ivon": {"probs": probs, "seconds": cpu}}, data.y_val)["ivon+T"]
    scores = {"raw": evaluate(probs[1:], data.y_test, ood_names),
              "T": evaluate(tempered["probs"], data.y_test, ood_names)}
    return {"dataset": dataset, "variant": variant, "seed": seed, "epochs": args.epochs, "lrs": list(args.lrs),
            "hess_inits": list(args.hess_inits), "cpu_seconds": cpu, "seconds_grid": info["seconds_grid"],
            "chosen": {"lr": info["lr"], "hess_init": info["hess_init"]}, "val_nll": info["val_nll"],
            "temperature": tempered["extra"]["temperature"], "scores": scores,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def low_rank_share(dataset: str, variant: str, seed: int, lr: float, hess_init: float, epochs: int) -> dict:
    r"""How much of FactorIVON's precision its low-rank part holds after the row's training at one grid point:
    the quantiles over weights of :math:`\mathrm{rowsq}(U)_d / (h_d + \delta)` (before the floor's shrinking), the
    diagonal h against ``hess_init``, and the sketch's eigenvalues."""
    import functools
    import types

    from pyro_fa.experiments.classify import baselines
    from pyro_fa.optim import FactorIVON

    torch.set_default_dtype(torch.float32)
    data = load_classify(dataset, seed)
    kw = parse_variant(variant)
    optimizer = types.SimpleNamespace(IVON=functools.partial(FactorIVON, rank=kw["rank"],
                                                             update_every=kw["update_every"],
                                                             diag_floor=kw["diag_floor"]))
    with torch.random.fork_rng():
        _, opt = baselines._ivon_train(optimizer, lambda: make_network("mlp", data), data.x_train, data.y_train, epochs,
                                       Budget.batch_size, lr=lr, seed=seed, hess_init=hess_init, beta2=kw["beta2"],
                                       weight_decay=1e-4)
    h, ev = opt.state["hess"], opt.state["eigvals"]
    share = (opt.state["basis"] * ev.clamp_min(0).sqrt()[:, None]).square().sum(0) / (h + 1e-4)
    q = torch.tensor([0.5, 0.99])
    return {"steps": int(opt.state["step"]), "share_median": float(share.quantile(q[0])),
            "share_99": float(share.quantile(q[1])), "share_max": float(share.max()),
            "above_floor": float((share > 1 - kw["diag_floor"]).double().mean()),
            "h_median": float(h.median()), "h_max": float(h.max()), "eigvals": [float(v) for v in ev]}


def unit_path(out: str, dataset: str, variant: str, seed: int) -> str:
    return os.path.join(out, f"{dataset}__{variant}__seed{seed}.json")


def report(out: str, datasets, variants, seeds, baseline: str = "ivon") -> str:
    """Markdown tables: per variant mean +- s.e. over seeds, and paired differences against ``baseline`` (IVON
    as ivon-opt's defaults configure it) and, for a variant at another Hessian decay, against IVON at that
    decay too (``vs``)."""
    lines = []
    for ds in datasets:
        units = {}
        for v in variants:
            for s in seeds:
                path = unit_path(out, ds, v, s)
                if os.path.exists(path):
                    with open(path) as fh:
                        units[v, s] = json.load(fh)
        if not units:
            continue
        tuned = decay_chosen_on_validation(units, variants, seeds)
        units.update(tuned)
        names = list(variants) + list(dict.fromkeys(v for v, _ in tuned))
        lines += [f"### {ds}", "", "| variant | seeds | NLL | NLL + T | accuracy | ECE + T | CPU s (grid) | chosen |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for v in names:
            us = [units[v, s] for s in seeds if (v, s) in units]
            if not us:
                continue
            cell = lambda key, part: "{:.4f} ± {:.4f}".format(*mean_se([u["scores"][part][key] for u in us]))
            chosen = ", ".join(f"({u['chosen']['lr']:g}, {u['chosen']['hess_init']:g}"
                               + (f", {parse_variant(u['variant'])['beta2']:g})" if v.endswith("-b*") else ")")
                               for u in us)
            cpu = mean_se([u["cpu_seconds"] for u in us])[0]
            lines.append(f"| {v} | {len(us)} | {cell('nll', 'raw')} | {cell('nll', 'T')} | {cell('accuracy', 'raw')} "
                         f"| {cell('ece', 'T')} | {cpu:.0f} | {chosen} |")
        ood = sorted(k for k in next(iter(units.values()))["scores"]["T"] if k.startswith("auroc_"))
        head = ["Δ NLL", "Δ NLL + T", "Δ accuracy"] + [f"Δ {k} + T" for k in ood] + ["CPU ratio"]
        lines += ["", "Paired over seeds, variant − IVON (* beyond two s.e.):", "",
                  "| variant | vs | seeds | " + " | ".join(head) + " |", "| --- " * (len(head) + 3) + "|"]
        pairs = [(v, b) for v in names for b in dict.fromkeys([baseline, same_beta2_ivon(v)]) if v != b]
        for v, b in pairs:
            common = [s for s in seeds if (v, s) in units and (b, s) in units]
            if not common:
                continue
            cells = []
            for key, part, lower in [("nll", "raw", True), ("nll", "T", True), ("accuracy", "raw", False)] + \
                                    [(k, "T", False) for k in ood]:
                d, se = paired([units[v, s]["scores"][part][key] for s in common],
                               [units[b, s]["scores"][part][key] for s in common])
                star = " *" if verdict(d, se, lower) != "tie" else ""
                cells.append(f"{d:+.4f} ± {se:.4f}{star}")
            ratio = sum(units[v, s]["cpu_seconds"] for s in common) / sum(units[b, s]["cpu_seconds"] for s in common)
            lines.append(f"| {v} | {b} | {len(common)} | " + " | ".join(cells) + f" | {ratio:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder of the units (one JSON each; a rerun resumes)")
    parser.add_argument("--datasets", nargs="+", default=["mnist1d"], choices=["mnist1d", "mnist1d-8", "digits"])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--epochs", type=int, default=Budget.epochs)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.8, 1.6])
    parser.add_argument("--hess-inits", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument("--report", action="store_true", help="print the tables of the units there; train nothing")
    parser.add_argument("--low-rank-share", nargs=2, type=float, metavar=("LR", "HESS_INIT"),
                        help="train each variant once (the first dataset and seed) at this grid point and print how "
                             "much of the precision its low-rank part holds; nothing is written")
    args = parser.parse_args(argv)
    for v in args.variants:
        parse_variant(v)
    if args.seeds < 1 or args.epochs < 1:
        raise SystemExit(f"bench_factor_ivon_variants: --seeds and --epochs must be >= 1, got {args.seeds}, "
                         f"{args.epochs}.")
    seeds = list(range(args.seed, args.seed + args.seeds))
    if args.low_rank_share:
        for v in args.variants:
            got = low_rank_share(args.datasets[0], v, seeds[0], *args.low_rank_share, args.epochs)
            print(f"{v}: after {got['steps']} steps, rowsq(U) / (h + delta) median {got['share_median']:.3g}, 99 % "
                  f"{got['share_99']:.3g}, max {got['share_max']:.3g}, above 1 - floor {got['above_floor']:.2%}; "
                  f"h median {got['h_median']:.3g} (hess_init {args.low_rank_share[1]:g}), max {got['h_max']:.3g}; "
                  f"eigenvalues {got['eigvals'][0]:.3g} .. {got['eigvals'][-1]:.3g}", flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        pay_lazy_imports()  # torch's one-time optimizer import, out of the first unit's seconds
        for ds in args.datasets:
            for s in seeds:
                for v in args.variants:
                    path = unit_path(args.out, ds, v, s)
                    if os.path.exists(path):
                        continue
                    t0 = time.perf_counter()
                    unit = run_unit(ds, v, s, args)
                    tmp = path + ".tmp"
                    with open(tmp, "w") as fh:
                        json.dump(unit, fh, indent=1)
                    os.replace(tmp, path)
                    print(f"{ds} {v} seed {s}: NLL {unit['scores']['raw']['nll']:.4f}, + T "
                          f"{unit['scores']['T']['nll']:.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
    print(report(args.out, args.datasets, args.variants, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
