"""The fidelity goals of ``pyro-fa classify --hmc-reference`` on one seed, judged over test points.

Reads a classify run (its results.json, with the fidelity columns, and the unit probabilities of the seed) and
the HMC reference it was scored against; prints a markdown table (method, agreement, TV, NLL, accuracy, seconds,
MAP trainings, raw and + T) and the two goals, each comparison the paired difference of per-point total
variations over the test points (mean ± standard error; "lower" when it is more than two standard errors below
zero). With one seed the standard error is over test points, not seeds: it says whether the difference is
larger than the test set's noise, not whether it would hold on another training run.

    python benchmarks/bench_classify_fidelity.py RUN_DIR REF_DIR [--dataset digits] [--network mlp] [--seed 0]
"""
import argparse
import json
import math
from pathlib import Path

import torch

from pyro_fa.experiments._io import markdown_table
from pyro_fa.experiments.classify import fidelity as fid
from pyro_fa.experiments.classify.report import PEER_ROWS, label

#: single factor-analysis posteriors (one trajectory / fit each): the first goal's rows
SINGLE_FA = ("swag-em", "swag-em-glm", "vifa", "factor-laplace", "factor-laplace-grid", "factor-laplace-lin")
#: every factor-analysis posterior of the run (the second goal's "ours")
ALL_FA = SINGLE_FA + ("multiswag", "multiswag-glm")
#: the first goal's peers: IVON and laplace-torch's KFAC (last layer, all weights)
GOAL1_PEERS = ("ivon", "laplace", "laplace-grid", "laplace-kron")
ONE_TRAINING = 1.5  # "the cost of one training run": at most this many MAP trainings
FIVE = 5.0


def _base(name):
    return name.split("+")[0]


def per_point_tv(p, q):
    return 0.5 * (p.double() - q.double()).abs().sum(-1)


def paired(a, b):
    d = a - b
    return float(d.mean()), float(d.std(unbiased=True) / math.sqrt(d.numel()))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("ref")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--network", default="mlp")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    key = f"{a.dataset}-{a.network}"
    ref = fid.load_reference(Path(a.ref) / fid.REFERENCE_FILE.format(dataset=a.dataset, seed=a.seed))
    combo = json.loads((Path(a.run) / "results.json").read_text())["combos"][key]
    unit = next((Path(a.run) / "units").glob(f"{key}__seed{a.seed}__*.pt"))
    probs = {name: p[0] for name, p in torch.load(unit)["probs"].items()}
    rows = {}
    for name, r in combo["methods"].items():
        i = r.get("seeds", list(range(len(r["seconds"])))).index(a.seed)
        e = r["extra"][i]
        rows[name] = {"agreement": e.get("hmc_agreement"), "tv": e.get("hmc_total_variation"),
                      "nll": r["per_seed"]["nll"][i], "accuracy": r["per_seed"]["accuracy"][i],
                      "seconds": r["seconds"][i], "cost": e.get("map_trainings"),
                      "points": per_point_tv(probs[name], ref.probs)}
    order = sorted(rows, key=lambda n: rows[n]["tv"])
    fmt = lambda v, d: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    print(markdown_table(["method", "agreement w. HMC", "TV to HMC (± s.e. over test points)", "NLL", "accuracy %",
                          "seconds", "MAP trainings"],
                         [[label(n), fmt(rows[n]["agreement"], 3),
                           f"{rows[n]['tv']:.4f} ± {float(rows[n]['points'].std() / math.sqrt(rows[n]['points'].numel())):.4f}",
                           fmt(rows[n]["nll"], 4), fmt(100 * rows[n]["accuracy"], 1), fmt(rows[n]["seconds"], 1),
                           fmt(rows[n]["cost"], 2)] for n in order]))

    def compare(ours, peers, title):
        print(f"\n{title}")
        if not ours:
            print("no row of ours qualifies")
            return
        best = min(ours, key=lambda n: rows[n]["tv"])
        print(f"our best: {label(best)}, TV {rows[best]['tv']:.4f}, {rows[best]['cost']:.2f} MAP trainings")
        verdicts = []
        for p in peers:
            d, se = paired(rows[best]["points"], rows[p]["points"])
            v = "tie" if abs(d) <= max(2 * se, 1e-6) else ("lower" if d < 0 else "higher")
            verdicts.append(v)
            print(f"- vs {label(p)} (TV {rows[p]['tv']:.4f}, {rows[p]['cost']:.2f} MAP trainings): "
                  f"paired diff {d:+.4f} ± {se:.4f}: {v}")
        print("goal " + ("MET" if verdicts and all(v == "lower" for v in verdicts) else "NOT met"))

    cheap_single = [n for n in rows if _base(n) in SINGLE_FA and rows[n]["cost"] <= ONE_TRAINING]
    compare(cheap_single, [n for n in rows if _base(n) in GOAL1_PEERS],
            f"Goal 1: a single FA posterior at <= {ONE_TRAINING} MAP trainings vs IVON and laplace-torch's KFAC "
            "(raw and + T, any cost)")
    for fam in ("swag-em", "vifa", "factor-laplace"):
        fam_rows = [n for n in rows if _base(n).startswith(fam) and _base(n) in SINGLE_FA]
        compare(fam_rows, [n for n in rows if _base(n) in GOAL1_PEERS],
                f"Goal 1, {fam} at its own cost ({', '.join('%.2f' % rows[n]['cost'] for n in fam_rows)} MAP trainings)")
    ours5 = [n for n in rows if _base(n) in ALL_FA and rows[n]["cost"] <= FIVE]
    peers5 = [n for n in rows if _base(n) in PEER_ROWS and rows[n]["cost"] <= FIVE]
    compare(ours5, peers5, f"Goal 2: our best FA posterior at <= {FIVE:g} MAP trainings vs every peer at <= {FIVE:g}")


if __name__ == "__main__":
    main()
