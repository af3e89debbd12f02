"""Metrics, tables, bar checks and figures of the classification benchmark (``pyro-fa classify``)."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch
from torch import Tensor

from pyro_fa import metrics
from pyro_fa.experiments._io import markdown_table, mean_se

LABELS = {
    "map": "MAP (Adam)", "ensemble": "Deep ensemble (5)", "dropout": "MC dropout", "swa": "SWA",
    "swag": "SWAG (classic)", "swag-em": "SWAG-EM", "multiswag": "MultiSWAG-EM (5)", "vifa": "VIFA (ours)",
    "autonormal": "Pyro AutoNormal", "lowrank": "Pyro AutoLowRankMVN", "laplace": "laplace-torch (LL KFAC)",
    "ivon": "IVON",
}
#: test accuracy reported by Greydanus (2020) for MNIST-1D
PAPER_ACCURACY = {("mnist1d", "mlp"): 0.68, ("mnist1d", "cnn"): 0.94}
METRICS = ("accuracy", "nll", "ece", "brier")


def evaluate(probs: Sequence[Tensor], targets: Tensor, ood_names: Sequence[str]) -> Dict[str, float]:
    """Accuracy, NLL, ECE (15 bins), Brier on the test part, and OOD AUROC by predictive entropy per OOD set.

    ``probs`` is ``[test, *ood]``, each of shape (N, C) (or (S, N, C)); all computed by :mod:`pyro_fa.metrics`.
    """
    p = probs[0].double()
    out = {
        "accuracy": float(metrics.accuracy(p, targets)),
        "nll": float(metrics.negative_log_likelihood(p, targets)),
        "ece": float(metrics.expected_calibration_error(p, targets, n_bins=15)),
        "brier": float(metrics.brier_score(p, targets)),
    }
    h_in = metrics.predictive_entropy(p)
    for name, q in zip(ood_names, probs[1:]):
        out[f"auroc_{name}"] = float(metrics.ood_auroc(h_in, metrics.predictive_entropy(q.double())))
    return out


def _fmt(values: List[float], digits: int = 3, scale: float = 1.0) -> str:
    m, se = mean_se([v * scale for v in values])
    if math.isnan(m):
        return ""
    return f"{m:.{digits}f}" if math.isnan(se) else f"{m:.{digits}f} ± {se:.{digits}f}"


def combo_table(combo: dict) -> str:
    """One dataset × network: a row per method, mean ± s.e. over seeds."""
    ood = combo["ood"]
    header = ["method", "accuracy %", "NLL", "ECE", "Brier", *[f"AUROC {o}" for o in ood], "seconds"]
    rows = []
    for name, r in combo["methods"].items():
        s = r["per_seed"]
        rows.append([LABELS.get(name, name), _fmt(s["accuracy"], 1, 100), _fmt(s["nll"]), _fmt(s["ece"]),
                     _fmt(s["brier"]), *[_fmt(s[f"auroc_{o}"], 2) for o in ood], _fmt(r["seconds"], 1)])
    return markdown_table(header, rows)


def _mean(combo, method, metric) -> float:
    return mean_se(combo["methods"][method]["per_seed"][metric])[0]


#: printed under the bars of a run smaller than the full one (``--quick``, fewer epochs or seeds)
SMALL_RUN_NOTE = ("(The bars are set for the full run, `pyro-fa classify`: 150 epochs, 3 seeds. This run is smaller "
                  "(e.g. --quick), so its rows only show the checks at work; a \"NOT met\" here says nothing about "
                  "the bar.)")


def versus(a: float, b: float, digits: int = 3, most: int = 6) -> str:
    """``"a vs b"`` with enough decimals to tell ``a`` from ``b`` (from ``digits`` up to ``most``).

    Examples
    --------
    >>> versus(0.0612, 0.0598, 2)
    '0.061 vs 0.060'
    >>> versus(0.25, 0.25, 2)
    '0.25 vs 0.25'
    """
    d = digits
    while d < most and f"{a:.{d}f}" == f"{b:.{d}f}" and a != b:
        d += 1
    return f"{a:.{d}f} vs {b:.{d}f}"


def _auroc_versus(a: float, b: float, name_a: str, name_b: str) -> str:
    """:func:`versus` for two AUROCs, saying which lie below chance (0.5: the in-distribution inputs look *more*
    uncertain than the OOD ones)."""
    below = [who for who, v in ((name_a, a), (name_b, b)) if v < 0.5]
    note = "" if not below else f" ({'both' if len(below) == 2 else below[0]} below chance, 0.5)"
    return versus(a, b, 2) + note


def bar_checks(combos: Dict[str, dict]) -> List[dict]:
    """The benchmark's bars per dataset × network, on the means over seeds (see ``pyro-fa classify``'s docstring)."""
    checks = []
    for key, combo in combos.items():
        have = combo["methods"]

        def add(check, ok, detail):
            checks.append({"combo": key, "check": check, "ok": bool(ok), "detail": detail})

        if "swag-em" in have:
            for other in ("swa", "map"):
                if other in have:
                    for metric in ("nll", "ece"):
                        a, b = _mean(combo, "swag-em", metric), _mean(combo, other, metric)
                        add(f"SWAG-EM {metric.upper()} < {LABELS[other]}", a < b, versus(a, b))
            if "map" in have:
                for o in combo["ood"]:
                    a, b = _mean(combo, "swag-em", f"auroc_{o}"), _mean(combo, "map", f"auroc_{o}")
                    add(f"SWAG-EM OOD AUROC ({o}) > MAP", a > b, _auroc_versus(a, b, "SWAG-EM", "MAP"))
        ours = [m for m in ("multiswag", "vifa") if m in have]
        if ours and "map" in have:
            acc_map = _mean(combo, "map", "accuracy")
            close = [m for m in ours if _mean(combo, m, "accuracy") >= acc_map - 0.005]
            pool = close or ours
            best = min(pool, key=lambda m: _mean(combo, m, "nll"))
            acc = _mean(combo, best, "accuracy")
            add(f"{LABELS[best]} accuracy within 0.5 points of MAP", acc >= acc_map - 0.005,
                f"{100 * acc:.1f} % vs {100 * acc_map:.1f} %")
            for peer in ("laplace", "ivon", "dropout"):
                if peer in have:
                    for metric in ("nll", "ece"):
                        a, b = _mean(combo, best, metric), _mean(combo, peer, metric)
                        add(f"{LABELS[best]} {metric.upper()} < {LABELS[peer]}", a < b, versus(a, b))
            if "ensemble" in have:
                a, b = _mean(combo, best, "nll"), _mean(combo, "ensemble", "nll")
                add(f"(stretch) {LABELS[best]} NLL < deep ensemble", a < b, versus(a, b))
    return checks


def bar_summary(checks: List[dict]) -> str:
    rows = [[c["combo"], c["check"], c["detail"], "met" if c["ok"] else "NOT met"] for c in checks]
    return markdown_table(["dataset × network", "check (means over seeds)", "ours vs other", "bar"], rows)


def reliability_figure(combos: Dict[str, dict], probs: Dict[str, Dict[str, List[Tensor]]],
                       targets: Dict[str, Tensor], n_bins: int = 15):
    """Reliability diagrams of the first seed: accuracy vs confidence per bin, a row per dataset × network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(probs)
    methods = list(dict.fromkeys(m for k in keys for m in probs[k]))
    fig, axes = plt.subplots(len(keys), len(methods), figsize=(1.9 * len(methods), 2.0 * len(keys)), squeeze=False,
                             sharex=True, sharey=True)
    edges = torch.linspace(0, 1, n_bins + 1)
    for i, key in enumerate(keys):
        for j, m in enumerate(methods):
            ax = axes[i][j]
            ax.plot([0, 1], [0, 1], color="0.6", lw=0.8)
            if m in probs[key]:
                p = probs[key][m][0].double()
                conf, pred = p.max(-1)
                correct = (pred == targets[key]).double()
                idx = (torch.ceil(conf * n_bins) - 1).clamp(0, n_bins - 1).long()
                count = torch.zeros(n_bins, dtype=p.dtype).index_add_(0, idx, torch.ones_like(conf))
                acc = torch.zeros(n_bins, dtype=p.dtype).index_add_(0, idx, correct) / count.clamp_min(1)
                mask = count > 0
                ax.bar(edges[:-1][mask].numpy(), acc[mask].numpy(), width=1 / n_bins, align="edge", color="C0", alpha=0.8,
                       edgecolor="k", lw=0.3)
                ece = combos[key]["methods"][m]["per_seed"]["ece"][0]
                ax.text(0.04, 0.88, f"ECE {ece:.3f}", fontsize=7, transform=ax.transAxes)
            if i == 0:
                ax.set_title(LABELS.get(m, m), fontsize=7)
            if j == 0:
                ax.set_ylabel(f"{key}\naccuracy", fontsize=7)
            if i == len(keys) - 1:
                ax.set_xlabel("confidence", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.tight_layout()
    return fig


def entropy_figure(combos: Dict[str, dict], probs: Dict[str, Dict[str, List[Tensor]]]):
    """Histograms of the predictive entropy on the test part and on each OOD set (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(probs)
    methods = list(dict.fromkeys(m for k in keys for m in probs[k]))
    fig, axes = plt.subplots(len(keys), len(methods), figsize=(1.9 * len(methods), 1.9 * len(keys)), squeeze=False,
                             sharex=True)
    bins = torch.linspace(0, math.log(10), 31).tolist()
    for i, key in enumerate(keys):
        names = ["test", *combos[key]["ood"]]
        for j, m in enumerate(methods):
            ax = axes[i][j]
            if m in probs[key]:
                for k, (name, p) in enumerate(zip(names, probs[key][m])):
                    h = metrics.predictive_entropy(p.double()).numpy()
                    ax.hist(h, bins=bins, histtype="step" if k else "stepfilled", alpha=1 if k else 0.4,
                            color=f"C{k}", label=name, density=True)
            if i == 0:
                ax.set_title(LABELS.get(m, m), fontsize=7)
            if j == 0:
                ax.set_ylabel(key, fontsize=7)
                ax.legend(fontsize=5)
            if i == len(keys) - 1:
                ax.set_xlabel("predictive entropy (nats)", fontsize=6)
            ax.tick_params(labelsize=6)
            ax.set_yticks([])
    fig.tight_layout()
    return fig
