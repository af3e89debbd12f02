"""Metrics, tables, bar checks and figures of the classification benchmark (``pyro-fa classify``)."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from pyro_fa import metrics
from pyro_fa.experiments._io import markdown_table, mean_se
from pyro_fa.experiments.classify import fidelity as fid

LABELS = {
    "map": "MAP (Adam)", "ensemble": "Deep ensemble (5)", "dropout": "MC dropout", "swa": "SWA",
    "swag": "SWAG (classic)", "swag-em": "SWAG-EM", "multiswag": "MultiSWAG-EM (5)", "vifa": "VIFA (ours)",
    "autonormal": "Pyro AutoNormal", "lowrank": "Pyro AutoLowRankMVN", "laplace": "laplace-torch (LL KFAC, marglik)",
    "laplace-grid": "laplace-torch (LL KFAC, val. grid)", "laplace-diag": "laplace-torch (all, diag, marglik)",
    "laplace-kron": "laplace-torch (all, KFAC, marglik)", "laplace-full": "laplace-torch (all, full, marglik)",
    "ivon": "IVON", "swag-em-glm": "SWAG-EM, GLM probit", "multiswag-glm": "MultiSWAG-EM (5), GLM probit",
    "factor-laplace": "FactorLaplace (ours, marglik)", "factor-laplace-grid": "FactorLaplace (ours, val. grid)",
    "factor-laplace-lin": "FactorLaplace (ours, lin. marglik)",
    "factor-ivon": "FactorIVON (ours)", "factor-ivon-ensemble": "FactorIVON ensemble (ours, 5)",
}
#: our factor-analysis posteriors (rows added for other predictives keep these prefixes)
OURS = ("swag-em", "multiswag", "vifa", "factor-laplace", "factor-ivon")
#: the tuned peers "ours" is held against
PEER_ROWS = ("ensemble", "dropout", "laplace", "laplace-grid", "laplace-diag", "laplace-kron", "laplace-full", "ivon")
#: test accuracy reported by Greydanus (2020) for MNIST-1D
PAPER_ACCURACY = {("mnist1d", "mlp"): 0.68, ("mnist1d", "cnn"): 0.94}
METRICS = ("accuracy", "nll", "ece", "brier")


def _base(name: str) -> str:
    """The row without its "+T" (temperature) suffix."""
    return name.split("+")[0]


def _is_ours(name: str) -> bool:
    return any(_base(name) == o or _base(name).startswith(o + "-") for o in OURS)


def _is_peer(name: str) -> bool:
    return _base(name) in PEER_ROWS


def label(name: str) -> str:
    """The table's name of a row (``"<row>+T"``: the row's label with "+ T")."""
    return LABELS.get(_base(name), _base(name)) + (" + T" if name.endswith("+T") else "")


def evaluate(probs: Sequence[Tensor], targets: Tensor, ood_names: Sequence[str]) -> Dict[str, float]:
    """Accuracy, NLL, ECE (15 bins), Brier on the test part, and OOD AUROCs per OOD set.

    ``probs`` is ``[test, *ood]``, each of shape (N, C), or draws (S, N, C) whose mean is the predictive.
    ``auroc_<set>`` scores by the predictive entropy; for draws also ``auroc_mi_<set>`` by the mutual
    information between label and weights (the epistemic part). All computed by :mod:`pyro_fa.metrics`.
    """
    p_all = probs[0].double()
    sampled = p_all.dim() == 3
    p = p_all.mean(0) if sampled else p_all
    out = {
        "accuracy": float(metrics.accuracy(p, targets)),
        "nll": float(metrics.negative_log_likelihood(p, targets)),
        "ece": float(metrics.expected_calibration_error(p, targets, n_bins=15)),
        "brier": float(metrics.brier_score(p, targets)),
    }
    h_in = metrics.predictive_entropy(p)
    mi_in = metrics.mutual_information(p_all) if sampled else None
    for name, q in zip(ood_names, probs[1:]):
        q = q.double()
        out[f"auroc_{name}"] = float(metrics.ood_auroc(h_in, metrics.predictive_entropy(q)))
        if sampled:
            out[f"auroc_mi_{name}"] = float(metrics.ood_auroc(mi_in, metrics.mutual_information(q)))
    return out


def paired(a: Sequence[float], b: Sequence[float]) -> Tuple[float, float]:
    """Mean and standard error over seeds of the paired differences ``a - b`` (same seeds, same splits)."""
    return mean_se([x - y for x, y in zip(a, b)])


def verdict(diff: float, se: float, lower_is_better: bool = True) -> str:
    """``"better"`` / ``"worse"`` (for ``a`` in ``a - b``) when ``|diff| > 2 se``, else ``"tie"``.

    One seed (no standard error) is always a tie.

    Examples
    --------
    >>> verdict(-0.10, 0.02), verdict(-0.03, 0.02), verdict(0.1, float("nan"))
    ('better', 'tie', 'tie')
    """
    if math.isnan(se) or abs(diff) <= 2 * se:
        return "tie"
    return "better" if (diff < 0) == lower_is_better else "worse"


def _fmt(values: List[float], digits: int = 3, scale: float = 1.0) -> str:
    m, se = mean_se([v * scale for v in values])
    if math.isnan(m):
        return ""
    return f"{m:.{digits}f}" if math.isnan(se) else f"{m:.{digits}f} ± {se:.{digits}f}"


def _chosen(extra: List[dict]) -> str:
    """The values chosen on validation, over seeds (e.g. ``pp 10 ×4, 30``), and a Laplace fit's peak resident
    memory added (``fit_peak_mib``, mean over the seeds that measured it: ``fit peak 120 MiB``)."""
    keys = {"prior_precision": "pp", "dropout": "p", "lr": "lr", "hess_init": "h0", "scale": "scale",
            "swag_lr": "swag lr"}
    parts = []
    for key, short in keys.items():
        vals = [e[key] for e in extra if isinstance(e.get(key), (int, float))]
        if vals:
            counts: Dict[str, int] = {}
            for v in vals:
                counts[f"{v:.3g}"] = counts.get(f"{v:.3g}", 0) + 1
            parts.append(f"{short} " + ", ".join(k if c == 1 else f"{k} ×{c}" for k, c in counts.items()))
    peaks = [e["fit_peak_mib"] for e in extra if isinstance(e.get("fit_peak_mib"), (int, float))]
    if peaks:
        parts.append(f"fit peak {sum(peaks) / len(peaks):.0f} MiB")
    return "; ".join(parts)


def combo_table(combo: dict) -> str:
    """One dataset × network: a row per method, mean ± s.e. over seeds; AUROC by entropy / by mutual information."""
    ood = combo["ood"]
    more = fid.columns(combo)  # fidelity to HMC, deep-ensemble equivalent, cost in MAP trainings
    header = ["method", "accuracy %", "NLL", "ECE", "Brier", *[f"AUROC {o} (H / MI)" for o in ood], "seconds",
              *[h for h, _, _ in more], "chosen on validation"]
    rows = []
    every = sorted({sd for name in combo["methods"] for sd in row_seeds(combo, name)})
    for name, r in combo["methods"].items():
        s = r["per_seed"]
        held = row_seeds(combo, name)
        aurocs = [_fmt(s[f"auroc_{o}"], 2) + (f" / {_fmt(s[f'auroc_mi_{o}'], 2)}" if f"auroc_mi_{o}" in s else "")
                  for o in ood]
        fewer = f" (seed(s) {', '.join(map(str, held))} of {len(every)})" if len(held) < len(every) else ""
        rows.append([label(name) + fewer, _fmt(s["accuracy"], 1, 100), _fmt(s["nll"]), _fmt(s["ece"]),
                     _fmt(s["brier"]), *aurocs, _fmt(r["seconds"], 1), *fid.cells(combo, name, more),
                     _chosen(r.get("extra", []))])
    return markdown_table(header, rows)


def norms_line(combo: dict) -> str:
    """The median input norms of the test part and each OOD set."""
    norms = combo.get("norms") or {}
    return "Median input norm: " + ", ".join(f"{k} {v:.2f}" for k, v in norms.items()) + "." if norms else ""


def _mean(combo, method, metric) -> float:
    return mean_se(combo["methods"][method]["per_seed"][metric])[0]


def _seeds(combo, method, metric) -> List[float]:
    return combo["methods"][method]["per_seed"][metric]


#: printed under the bars of a run smaller than the full one (``--quick``, fewer epochs or seeds)
SMALL_RUN_NOTE = ("(The bars are set for the full run, `pyro-fa classify`: 150 epochs, 5 seeds, every grid. This run "
                  "is smaller (e.g. --quick), so its rows only show the checks at work; a \"NOT met\" here says "
                  "nothing about the bar.)")


#: printed by ``--quick`` instead of the bars (they are in its table.md, under :data:`SMALL_RUN_NOTE`)
QUICK_BARS_NOTE = ("Bars: not judged on a quick run (12 epochs, one seed, no grids); they are set for the full run, "
                   "`pyro-fa classify` (150 epochs, 5 seeds, every grid). This run's {n} checks are in {table}.")


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


def row_seeds(combo, method) -> List[int]:
    """The seeds of a row's values, in order (its ``seeds``; for rows written without them, 0, 1, ...)."""
    m = combo["methods"][method]
    n = len(m["seconds"]) if "seconds" in m else len(next(iter(m["per_seed"].values()), []))
    return list(m.get("seeds", range(n)))


def _aligned(combo, a: str, b: str, metric: str) -> Tuple[List[float], List[float], List[int]]:
    """The values of rows ``a`` and ``b`` over the seeds both hold, lined up by seed, and those seeds."""
    xa = dict(zip(row_seeds(combo, a), _seeds(combo, a, metric)))
    xb = dict(zip(row_seeds(combo, b), _seeds(combo, b, metric)))
    common = [s for s in xa if s in xb]
    return [xa[s] for s in common], [xb[s] for s in common], common


def _paired_detail(combo, a: str, b: str, metric: str, lower_is_better: bool = True) -> Tuple[str, str]:
    """``("a vs b; diff ± se", verdict)`` over the seeds both ran (named when fewer than either row holds)."""
    xa, xb, common = _aligned(combo, a, b, metric)
    if not common:
        return f"no seed in common ({row_seeds(combo, a)} against {row_seeds(combo, b)})", "tie"
    d, se = paired(xa, xb)
    digits = 2 if metric.startswith("auroc") else 3
    text = versus(mean_se(xa)[0], mean_se(xb)[0], digits)
    text += f"; paired diff {d:+.{digits + 1}f}" + ("" if math.isnan(se) else f" ± {se:.{digits + 1}f}")
    if len(common) < max(len(row_seeds(combo, a)), len(row_seeds(combo, b))):
        text += f" (over seed(s) {common} only)"
    return text, verdict(d, se, lower_is_better)


def front(combo: dict, ood: str) -> List[str]:
    """Methods on the front of (test NLL, OOD AUROC by entropy on ``ood``): no other row has both a lower NLL
    and a higher AUROC (means over seeds)."""
    pts = {m: (_mean(combo, m, "nll"), _mean(combo, m, f"auroc_{ood}")) for m in combo["methods"]}
    return [m for m, (n, a) in pts.items()
            if not any(n2 < n and a2 > a for m2, (n2, a2) in pts.items() if m2 != m)]


def bar_checks(combos: Dict[str, dict]) -> List[dict]:
    """The benchmark's bars per dataset × network (see ``docs/classify.md``).

    Each check is ``{"combo", "check", "ok", "verdict", "detail"}``: ``verdict`` is ``"met"`` / ``"NOT met"``,
    and for comparisons ``"tie"`` when the paired difference over seeds is within twice its standard error.
    """
    checks = []
    for key, combo in combos.items():
        have = combo["methods"]

        def add(check, ok, detail, tie=False):
            checks.append({"combo": key, "check": check, "ok": bool(ok) and not tie, "detail": detail,
                           "verdict": "tie" if tie else ("met" if ok else "NOT met")})

        paper = combo.get("paper_accuracy")
        if paper and "map" in have:
            acc = _mean(combo, "map", "accuracy")
            add("MAP accuracy within 1 point of Greydanus (2020)", acc >= paper - 0.01,
                f"{100 * acc:.1f} % vs {100 * paper:.0f} %")
        for em_row, swa_row, name in (("swag-em", "swa", "SWAG-EM NLL never > 1 % above SWA's on a seed"),
                                      ("swag-em+T", "swa+T", "SWAG-EM + T NLL never > 1 % above SWA + T's on a seed")):
            # the "+T" rows' scale: chosen by the tempered validation NLL
            if em_row in have and swa_row in have:
                em, swa, common = _aligned(combo, em_row, swa_row, "nll")
                if not common:
                    continue
                worst = max(a / b - 1 for a, b in zip(em, swa))
                fewer = len(common) < max(len(row_seeds(combo, em_row)), len(row_seeds(combo, swa_row)))
                add(name, worst <= 0.01,
                    f"worst seed {100 * worst:+.1f} %; mean ratio {mean_se([a / b for a, b in zip(em, swa)])[0]:.3f}"
                    + (f" (over seed(s) {common} only)" if fewer else ""))
        if "swag-em" in have and "map" in have:
            for o in combo["ood"]:
                text, v = _paired_detail(combo, "swag-em", "map", f"auroc_{o}", lower_is_better=False)
                add(f"SWAG-EM OOD AUROC ({o}) > MAP", v == "better", text, tie=v == "tie")
        ours = [m for m in have if _is_ours(m)]
        if not ours:
            continue
        best = min(ours, key=lambda m: _mean(combo, m, "nll"))
        for peer in [p for p in have if _is_peer(p)]:
            for metric in ("nll", "ece"):
                text, v = _paired_detail(combo, best, peer, metric)
                add(f"{label(best)} {metric.upper()} < {label(peer)}", v == "better", text, tie=v == "tie")
        if "map" in have:
            for o in combo["ood"]:
                text, v = _paired_detail(combo, best, "map", f"auroc_{o}", lower_is_better=False)
                add(f"{label(best)} OOD AUROC ({o}) > MAP", v == "better", text, tie=v == "tie")
        for o in combo["ood"]:
            on = front(combo, o)
            fa = [m for m in on if _is_ours(m)]
            add(f"a factor-analysis posterior on the NLL / AUROC ({o}) front", bool(fa),
                "front: " + ", ".join(label(m) for m in on))
    return checks


def bar_summary(checks: List[dict]) -> str:
    rows = [[c["combo"], c["check"], c["detail"], c.get("verdict", "met" if c["ok"] else "NOT met")] for c in checks]
    return markdown_table(["dataset × network", "check (over seeds; paired where two rows)", "ours vs other", "bar"],
                          rows)


def front_figure(key: str, combo: dict):
    """Test NLL against OOD AUROC (by entropy), mean ± s.e. over seeds, one panel per OOD set: the trade-off front.

    Ours (factor-analysis posteriors) in blue, the tuned peers in red, MAP / SWA / SWAG / Pyro's guides in grey;
    open markers: with a temperature ("+T").
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ood = combo["ood"]
    fig, axes = plt.subplots(1, len(ood), figsize=(5.0 * len(ood), 4.6), squeeze=False)
    for ax, o in zip(axes[0], ood):
        pts = {}
        for m in combo["methods"]:
            nll, nse = mean_se(_seeds(combo, m, "nll"))
            au, ase = mean_se(_seeds(combo, m, f"auroc_{o}"))
            pts[m] = (nll, au)
            color = "C0" if _is_ours(m) else ("C3" if _is_peer(m) else "0.5")
            ax.errorbar(nll, au, xerr=0 if math.isnan(nse) else nse, yerr=0 if math.isnan(ase) else ase,
                        fmt=("o" if _is_ours(m) else "s"), mfc="none" if m.endswith("+T") else color, color=color,
                        ms=4, lw=0.8)
            if m.endswith("+T") and _base(m) in pts:  # a thin line from the row to its "+T" version
                ax.plot([pts[_base(m)][0], nll], [pts[_base(m)][1], au], color=color, lw=0.4, alpha=0.6)
            elif not m.endswith("+T"):
                ax.annotate(label(m), (nll, au), fontsize=5.5, xytext=(3, 2), textcoords="offset points",
                            color=color if color != "0.5" else "0.3")
        ax.axhline(0.5, color="0.8", lw=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%.2g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("test NLL (lower is better; log scale)", fontsize=8)
        ax.set_ylabel(f"OOD AUROC by entropy, {o} (higher is better)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{key}: in-distribution NLL vs OOD detection, mean ± s.e. over seeds (blue: ours, red: tuned "
                 "peers, grey: baselines; open: + temperature, joined to its row)", fontsize=8)
    fig.tight_layout()
    return fig


def reliability_figure(combos: Dict[str, dict], probs: Dict[str, Dict[str, List[Tensor]]],
                       targets: Dict[str, Tensor], n_bins: int = 15):
    """Reliability diagrams of the first seed: accuracy vs confidence per bin, a row per dataset × network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(probs)
    methods = list(dict.fromkeys(m for k in keys for m in probs[k] if "+" not in m))  # the "+T" rows: see the tables
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
                ax.set_title(label(m), fontsize=7)
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
    methods = list(dict.fromkeys(m for k in keys for m in probs[k] if "+" not in m))
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
                ax.set_title(label(m), fontsize=7)
            if j == 0:
                ax.set_ylabel(key, fontsize=7)
                ax.legend(fontsize=5)
            if i == len(keys) - 1:
                ax.set_xlabel("predictive entropy (nats)", fontsize=6)
            ax.tick_params(labelsize=6)
            ax.set_yticks([])
    fig.tight_layout()
    return fig
