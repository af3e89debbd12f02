"""Tables, figures and published anchors of the UCI benchmark (``pyro-fa uci``)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from pyro_fa.experiments._io import markdown_table, mean_se

#: display names, in table order
DATASET_LABELS = {
    "boston": "Boston", "concrete": "Concrete", "energy": "Energy", "kin8nm": "Kin8nm", "naval": "Naval",
    "power": "Power", "protein": "Protein", "wine": "Wine", "yacht": "Yacht",
}

#: published results on the same standard splits, 1×50 networks: (RMSE, s.e.), (test LL, s.e.)
#: SLANG and Bayes-by-backprop: Mishkin et al. (2018), authors' results file; MC dropout: Gal & Ghahramani
#: (2016), Table 1.
PUBLISHED = {
    "SLANG": {
        "boston": ((3.21, 0.19), (-2.58, 0.05)), "concrete": ((5.58, 0.19), (-3.13, 0.03)),
        "energy": ((0.64, 0.03), (-1.12, 0.01)), "yacht": ((1.08, 0.06), (-1.88, 0.01)),
    },
    "Bayes-by-backprop": {
        "boston": ((3.43, 0.20), (-2.66, 0.06)), "concrete": ((6.16, 0.13), (-3.25, 0.02)),
        "energy": ((0.97, 0.09), (-1.45, 0.10)), "yacht": ((1.13, 0.06), (-1.56, 0.02)),
    },
    "MC dropout": {
        "boston": ((2.97, 0.19), (-2.46, 0.06)), "concrete": ((5.23, 0.12), (-3.04, 0.02)),
        "energy": ((1.66, 0.04), (-1.99, 0.02)), "yacht": ((1.11, 0.09), (-1.55, 0.03)),
    },
}

#: X. Jiang, *Laplace prior and variational inference probabilistic PCA (VIPPCA)*, report, University of Edinburgh,
#: 2023, Tables 2 (1×50, "SmallNN") and 3 (2×50, "LargeNN"): the same method as ours, (RMSE, s.e.), (LL, s.e.);
#: the tables report NMLL = -LL.
PAPER = {
    "vifa-gaussian-1x50": {
        "energy": ((2.90, 0.06), (-2.53, 0.02)), "boston": ((3.64, 0.23), (-2.66, 0.06)),
        "concrete": ((6.77, 0.09), (-3.34, 0.01)), "yacht": ((2.51, 0.09), (-2.36, 0.06)),
    },
    "vifa-laplace-1x50": {
        "energy": ((2.83, 0.06), (-2.51, 0.03)), "boston": ((3.75, 0.26), (-2.68, 0.07)),
        "concrete": ((6.87, 0.10), (-3.35, 0.01)), "yacht": ((2.58, 0.08), (-2.39, 0.08)),
    },
    "vippca-gaussian-2x50": {
        "energy": ((2.66, 0.11), (-2.43, 0.03)), "boston": ((3.58, 0.23), (-2.70, 0.07)),
        "concrete": ((6.13, 0.10), (-3.32, 0.02)), "yacht": ((2.73, 0.30), (-2.34, 0.03)),
    },
    "vifa-gaussian-2x50": {
        "energy": ((4.20, 0.45), (-3.03, 0.08)), "boston": ((7.36, 0.38), (-3.43, 0.04)),
        "concrete": ((10.37, 1.39), (-3.77, 0.14)), "yacht": ((13.86, 0.43), (-4.01, 0.04)),
    },
    "vippca-laplace-2x50": {
        "energy": ((2.57, 0.11), (-2.40, 0.03)), "boston": ((3.55, 0.20), (-2.63, 0.04)),
        "concrete": ((6.10, 0.14), (-3.29, 0.02)), "yacht": ((2.61, 0.27), (-2.34, 0.03)),
    },
    "vifa-laplace-2x50": {
        "energy": ((5.55, 0.63), (-3.29, 0.07)), "boston": ((8.53, 0.35), (-3.54, 0.03)),
        "concrete": ((16.92, 3.54), (-4.06, 0.11)), "yacht": ((14.00, 0.48), (-4.00, 0.04)),
    },
}
TABLE3 = ("vippca-gaussian-2x50", "vifa-gaussian-2x50", "vippca-laplace-2x50", "vifa-laplace-2x50")
BAR_DATASETS = ("boston", "concrete", "energy", "yacht")


def _fmt(m: float, s: float, digits: int = 2) -> str:
    if not math.isfinite(m):
        return "—"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if math.isfinite(s) else f"{m:.{digits}f}"


def summarise(result: dict) -> Dict[str, Tuple[float, float]]:
    """Mean and standard error over splits of one method's test LL, RMSE and calibration error."""
    return {k: mean_se(result[k]) for k in ("ll", "rmse", "calibration_error")}


def _w1_cell(scored: Dict[str, dict]) -> str:
    """The mean distance to HMC over the splits scored (their number in brackets); empty where none was."""
    w1 = [r["w1"] for r in scored.values() if "w1" in r]
    return f"{sum(w1) / len(w1):.3f} ({len(w1)})" if w1 else ""


def results_table(results: Dict[str, Dict[str, dict]], labels: Dict[str, str],
                  fidelity: Optional[Dict[str, Dict[str, dict]]] = None) -> str:
    """One row per dataset and method: ours, the paper's same method where there is one, the distance to HMC
    where a split was scored (:mod:`pyro_fa.experiments.uci.fidelity`), time per split."""
    rows = []
    fidelity = fidelity or {}
    for ds in DATASET_LABELS:
        for name, res in results.get(ds, {}).items():
            s = summarise(res)
            paper = PAPER.get(name, {}).get(ds)
            lost = res.get("diverged", [])  # splits whose final fit diverged: no score for the method
            lowered = res.get("lowered_lr", {})  # splits whose final fit was run again at a lower rate
            ll = f"diverged on {len(lost)} of {len(res['ll'])} splits" if lost else _fmt(*s["ll"])
            rows.append([
                DATASET_LABELS[ds], labels.get(name, name),
                ll + (f" (rate lowered on {len(lowered)} of {len(res['ll'])} splits)" if lowered else ""),
                _w1_cell(fidelity.get(ds, {}).get(name, {})),
                _fmt(*paper[1]) if paper else "", _fmt(*s["rmse"], digits=3 if s["rmse"][0] < 1 else 2),
                _fmt(*paper[0]) if paper else "",
                "—" if lost else f"{s['calibration_error'][0]:.3f}", len(res["ll"]),
                f"{res['seconds'] / len(res['ll']):.1f}",
            ])
    return markdown_table(["dataset", "method", "test LL (ours)", "W1 to HMC (splits)", "test LL (paper)",
                           "RMSE (ours)", "RMSE (paper)",
                           "calib. error", "splits", "s / split"], rows)


def published_table() -> str:
    rows = []
    for ds in BAR_DATASETS:
        row = [DATASET_LABELS[ds]]
        for name in PUBLISHED:
            (r, rs), (ll, lls) = PUBLISHED[name][ds]
            row += [_fmt(ll, lls), _fmt(r, rs)]
        rows.append(row)
    header = ["dataset"] + [f"{n} {m}" for n in PUBLISHED for m in ("LL", "RMSE")]
    return markdown_table(header, rows)


def _better(ours: Tuple[float, float], other: Tuple[float, float], higher: bool) -> bool:
    """At least as good within one standard error of ours."""
    return ours[0] >= other[0] - ours[1] if higher else ours[0] <= other[0] + ours[1]


def bar_checks(results: Dict[str, Dict[str, dict]]) -> List[dict]:
    """The issue's bar on the four small datasets, where the needed columns exist."""
    checks = []
    for ds in BAR_DATASETS:
        res = results.get(ds, {})
        summ = {n: summarise(r) for n, r in res.items()}
        base = [n for n in ("autonormal-1x50", "lowrank-1x50") if n in summ]
        for vifa in ("vifa-gaussian-1x50", "vifa-laplace-1x50"):
            if vifa not in summ:
                continue
            if base:
                best_ll = max(base, key=lambda n: summ[n]["ll"][0])
                best_rmse = min(base, key=lambda n: summ[n]["rmse"][0])
                checks.append({"dataset": ds, "check": f"{vifa} vs the better Pyro guide (LL: {best_ll}, "
                               f"RMSE: {best_rmse}), within one s.e.",
                               "ok": _better(summ[vifa]["ll"], summ[best_ll]["ll"], True)
                               and _better(summ[vifa]["rmse"], summ[best_rmse]["rmse"], False)})
            slang_rmse, slang_ll = PUBLISHED["SLANG"][ds]
            checks.append({"dataset": ds, "check": f"{vifa} better than SLANG (LL and RMSE)",
                           "ok": summ[vifa]["ll"][0] > slang_ll[0] and summ[vifa]["rmse"][0] < slang_rmse[0]})
        for vippca in ("vippca-gaussian-2x50", "vippca-laplace-2x50"):
            if vippca not in summ:
                continue
            best_ll = max(PAPER[n][ds][1][0] for n in TABLE3)
            best_rmse = min(PAPER[n][ds][0][0] for n in TABLE3)
            checks.append({"dataset": ds, "check": f"{vippca} beats every cell of Jiang (2023) Table 3",
                           "ok": summ[vippca]["ll"][0] > best_ll and summ[vippca]["rmse"][0] < best_rmse})
    return checks


#: the published reference lines of the figures: colours apart from the methods' C0-C2 points and from each
#: other, and a line style and a marker each (at the top end, MC dropout's at the bottom), so that they read apart
#: in grey print and where they overlap
REFERENCE_STYLE = {
    "SLANG": {"color": "black", "ls": "--", "marker": "v", "ms": 6, "markevery": [1]},
    "Bayes-by-backprop": {"color": "#d62728", "ls": ":", "marker": "s", "ms": 5, "markevery": [1]},
    "MC dropout": {"color": "#9467bd", "ls": "-.", "marker": "^", "ms": 6, "markevery": [0]},
}


def figure(results: Dict[str, Dict[str, dict]], labels: Dict[str, str], metric: str):
    """Per-dataset panels: mean ± s.e. over splits of ``metric`` ("ll" or "rmse") for every method."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [ds for ds in DATASET_LABELS if results.get(ds)]
    cols = min(3, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    methods = sorted({m for ds in names for m in results[ds]}, key=lambda m: list(labels).index(m)
                     if m in labels else 99)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 0.32 * len(methods) * rows + 1.2 * rows),
                             squeeze=False)
    for ax, ds in zip(axes.flat, names):
        ys, xs, es, colors = [], [], [], []
        for i, m in enumerate(methods):
            if m not in results[ds]:
                continue
            mean, se = mean_se(results[ds][m][metric])
            if not math.isfinite(mean):  # a method whose final fit diverged on a split: no point to draw
                continue
            ys.append(i)
            xs.append(mean)
            es.append(0 if not math.isfinite(se) else se)
            colors.append("C0" if m.startswith(("vifa", "vippca")) else "C1" if m.startswith(("autonormal", "lowrank"))
                          else "C2")
        ax.errorbar(xs, ys, xerr=es, fmt="none", ecolor="0.3", capsize=2)
        ax.scatter(xs, ys, c=colors, zorder=3, s=18)
        for name, anchors in PUBLISHED.items():
            if ds in anchors:
                v = anchors[ds][1 if metric == "ll" else 0][0]
                # a marker at one end (MC dropout's at the bottom) tells apart lines that nearly coincide, as
                # Yacht's Bayes-by-backprop and MC dropout do
                ax.axvline(v, label=name, lw=1.3, clip_on=False, **REFERENCE_STYLE[name])
        ax.set_yticks(range(len(methods)))
        ax.set_yticklabels([labels.get(m, m) for m in methods], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(DATASET_LABELS[ds], fontsize=10)
        ax.set_xlabel("test log-likelihood (higher is better)" if metric == "ll" else "test RMSE (lower is better)",
                      fontsize=8)
        if ds in PUBLISHED["SLANG"]:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def bar_summary(checks: List[dict]) -> Optional[str]:
    if not checks:
        return None
    rows = [[DATASET_LABELS[c["dataset"]], c["check"], "met" if c["ok"] else "NOT met"] for c in checks]
    return markdown_table(["dataset", "check", "bar"], rows)


#: the columns of the summary tables: ours, Pyro's guides, SWAG
SUMMARY_COLUMNS = ("vifa-gaussian-1x50", "vifa-laplace-1x50", "autonormal-1x50", "lowrank-1x50",
                   "vippca-gaussian-2x50", "vippca-laplace-2x50", "vifa-gaussian-2x50", "swag-em-1x50",
                   "swag-1x50", "multiswag-1x50")
SHORT = {"vifa-gaussian-1x50": "VIFA-G 1×50", "vifa-laplace-1x50": "VIFA-L 1×50", "autonormal-1x50": "AutoNormal 1×50",
         "lowrank-1x50": "AutoLowRankMVN 1×50", "vippca-gaussian-2x50": "VIPPCA-G 2×50",
         "vippca-laplace-2x50": "VIPPCA-L 2×50", "vifa-gaussian-2x50": "VIFA-G 2×50", "swag-em-1x50": "SWAG-EM 1×50",
         "swag-1x50": "SWAG 1×50", "multiswag-1x50": "MultiSWAG 1×50"}


def summary_table(results: Dict[str, Dict[str, dict]], metric: str) -> str:
    """Datasets × main methods for ``metric`` ("ll" or "rmse"), best of ours in bold, published SLANG / MC dropout beside."""
    cols = [c for c in SUMMARY_COLUMNS if any(c in r for r in results.values())]
    rows = []
    for ds in DATASET_LABELS:
        if ds not in results:
            continue
        cells = []
        vals = {c: mean_se(results[ds][c][metric]) for c in cols if c in results[ds]}
        best = (max if metric == "ll" else min)(vals, key=lambda c: vals[c][0]) if vals else None
        for c in cols:
            if c not in vals:
                cells.append("")
                continue
            digits = 3 if metric == "rmse" and vals[c][0] < 1 else 2
            text = _fmt(*vals[c], digits=digits)
            cells.append(f"**{text}**" if c == best else text)
        pub = [_fmt(*PUBLISHED[n][ds][1 if metric == "ll" else 0]) if ds in PUBLISHED[n] else ""
               for n in ("SLANG", "MC dropout")]
        rows.append([DATASET_LABELS[ds]] + cells + pub)
    return markdown_table(["dataset"] + [SHORT[c] for c in cols] + ["SLANG", "MC dropout"], rows)
