"""The fidelity-to-HMC views of ``pyro-fa classify``'s report: the rows sorted by total variation to HMC, and
the figure of that total variation against cost (:mod:`~pyro_fa.experiments.classify.fidelity` computes the
scores; this module draws on the report's labels, so that neither imports the other's importer)."""
from __future__ import annotations

import math

from pyro_fa.experiments._io import markdown_table, mean_se
from pyro_fa.experiments.classify import report as rep
from pyro_fa.experiments.classify.fidelity import _cell, _values
from pyro_fa.experiments.classify.report import label

#: the smallest total variation drawn on the figure's log axis (the reference against itself scores 0)
_TV_FLOOR = 1e-4


def fidelity_table(combo: dict) -> str:
    """Rows with a total variation to HMC, best first: agreement, TV, NLL, accuracy, seconds, MAP trainings."""
    rows = []
    for name, r in combo["methods"].items():
        tv = _values(r, "hmc_total_variation")
        if tv:
            rows.append((mean_se(tv)[0], name, r))
    if not rows:
        return ""
    out = [[label(name), _cell(_values(r, "hmc_agreement"), 3), _cell(_values(r, "hmc_total_variation"), 3),
            _cell(r["per_seed"]["nll"], 3), _cell([100 * a for a in r["per_seed"]["accuracy"]], 1),
            _cell(r["seconds"], 1), _cell(_values(r, "map_trainings"), 1)] for _, name, r in sorted(rows, key=lambda t: t[0])]
    return markdown_table(["method", "agreement w. HMC", "TV to HMC", "NLL", "accuracy %", "seconds",
                           "MAP trainings"], out)


def fidelity_figure(key: str, combo: dict):
    """Total variation to HMC (log y) against cost in MAP trainings (log x), one point per row, mean ± s.e. over seeds;
    None when no row holds both. Ours (factor-analysis posteriors) blue, tuned peers red, the rest grey; open
    markers: "+T", joined to their row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    pts = {}
    for name, r in combo["methods"].items():
        tv, cost = _values(r, "hmc_total_variation"), _values(r, "map_trainings")
        if tv and cost:  # log y: a TV of 0 (the reference itself) is drawn at the floor
            pts[name] = (mean_se(cost), (max(mean_se(tv)[0], _TV_FLOOR), mean_se(tv)[1]))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 5.4))
    for name, ((c, cse), (tv, tse)) in pts.items():
        ours, peer, tempered = rep._is_ours(name), rep._is_peer(name), name.endswith("+T")
        color = "C0" if ours else ("C3" if peer else "0.5")
        ax.errorbar(c, tv, xerr=0 if math.isnan(cse) else cse, yerr=0 if math.isnan(tse) else min(tse, 0.9 * tv),
                    fmt="o" if ours else "s", mfc="none" if tempered else color, color=color, ms=5, lw=0.8)
        base = rep._base(name)
        if tempered and base in pts:
            ax.plot([pts[base][0][0], c], [pts[base][1][0], tv], color=color, lw=0.5, alpha=0.6)
        elif not tempered:
            ax.annotate(rep.label(name), (c, tv), fontsize=6, xytext=(3, 2), textcoords="offset points",
                        color=color if color != "0.5" else "0.3")
    for x in (1, 5):  # one training; five (a deep ensemble's, a grid's)
        ax.axvline(x, color="0.85", lw=0.6, zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("cost (multiples of one MAP training; log scale)", fontsize=8)
    ax.set_ylabel("total variation to HMC's predictive (lower is better; log scale)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(f"{key}: fidelity to HMC against cost, mean ± s.e. over seeds\n(blue: ours, red: tuned peers, "
                 "grey: baselines; open: + temperature, joined to its row)", fontsize=8)
    fig.tight_layout()
    return fig
