"""Tables of FactorIVON's rows against IVON's and the deep ensemble's from ``pyro-fa classify`` results:
mean ± s.e. over seeds of NLL, accuracy, ECE and seconds, and paired differences over seeds.

    PYTHONPATH=. python benchmarks/factor_ivon_paired.py RESULTS.json [RESULTS.json ...]

Several files (runs of other seeds with the same budget) are pooled by seed.
"""
import json
import math
import sys

ROWS = ("ivon", "ivon+T", "factor-ivon", "factor-ivon+T", "ensemble", "ensemble+T", "factor-ivon-ensemble",
        "factor-ivon-ensemble+T")
PAIRS = (("factor-ivon", "ivon"), ("factor-ivon+T", "ivon+T"), ("factor-ivon-ensemble", "ensemble"),
         ("factor-ivon-ensemble+T", "ensemble+T"), ("factor-ivon-ensemble+T", "ivon+T"))
METRICS = ("nll", "accuracy", "ece")


def mean_se(values):
    n = len(values)
    m = sum(values) / n
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return m, se


def pooled(paths):
    out = {}
    for path in paths:
        result = json.load(open(path))
        for key, combo in result["combos"].items():
            for row, r in combo["methods"].items():
                target = out.setdefault(key, {}).setdefault(row, {"seeds": [], **{m: [] for m in METRICS},
                                                                      "seconds": []})
                target["seeds"] += r.get("seeds", list(range(len(r["seconds"]))))
                for m in METRICS:
                    target[m] += r["per_seed"][m]
                target["seconds"] += r["seconds"]
    return out


def main(paths):
    for key, rows in pooled(paths).items():
        print(f"\n### {key}\n")
        print("| row | seeds | NLL | accuracy | ECE | seconds |\n| --- | --- | --- | --- | --- | --- |")
        for row in ROWS:
            if row in rows:
                r = rows[row]
                cells = [f"{mean_se(r[m])[0]:.4f} ± {mean_se(r[m])[1]:.4f}" for m in (*METRICS, "seconds")]
                print(f"| {row} | {len(r['nll'])} | " + " | ".join(cells) + " |")
        print("\nPaired differences A − B over seeds (mean ± s.e.; NLL and ECE: negative favours A; "
              "accuracy: positive favours A); |mean| > 2 s.e. marked *:\n")
        print("| A | B | Δ NLL | Δ accuracy | Δ ECE | Δ seconds |\n| --- | --- | --- | --- | --- | --- |")
        for a, b in PAIRS:
            if a in rows and b in rows:
                cells = []
                for m in (*METRICS, "seconds"):
                    d = [x - y for x, y in zip(rows[a][m], rows[b][m])]
                    mu, se = mean_se(d)
                    cells.append(f"{mu:+.4f} ± {se:.4f}{' *' if abs(mu) > 2 * se else ''}")
                print(f"| {a} | {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
