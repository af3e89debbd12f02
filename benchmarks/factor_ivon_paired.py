"""Tables of FactorIVON's rows against IVON's and the deep ensemble's from ``pyro-fa classify`` results:
mean ± s.e. over seeds of NLL, accuracy, ECE and seconds, and paired differences over seeds; then the same
paired differences for every OOD AUROC the rows share (``auroc_<set>``: by the predictive entropy,
``auroc_mi_<set>``: by the mutual information, sampled rows only).

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
                for m, values in r["per_seed"].items():
                    if m.startswith("auroc"):
                        target.setdefault(m, []).extend(values)
    return out


def _paired(a, b):
    d = [x - y for x, y in zip(a, b)]
    mu, se = mean_se(d)
    return f"{mu:+.4f} ± {se:.4f}{' *' if abs(mu) > 2 * se else ''}"


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
                cells = [_paired(rows[a][m], rows[b][m]) for m in (*METRICS, "seconds")]
                print(f"| {a} | {b} | " + " | ".join(cells) + " |")
        ood = sorted({m for r in rows.values() for m in r if m.startswith("auroc")})
        if ood:
            print("\nOOD AUROC: A's mean, B's mean and the paired difference A − B (positive favours A; * beyond 2 s.e.):\n")
            print("| A | B | AUROC | A | B | Δ |\n| --- | --- | --- | --- | --- | --- |")
            for a, b in PAIRS:
                for m in ood:
                    if a in rows and b in rows and m in rows[a] and m in rows[b]:
                        print(f"| {a} | {b} | {m[len('auroc_'):]} | {mean_se(rows[a][m])[0]:.4f} | "
                              f"{mean_se(rows[b][m])[0]:.4f} | {_paired(rows[a][m], rows[b][m])} |")


if __name__ == "__main__":
    main(sys.argv[1:])
