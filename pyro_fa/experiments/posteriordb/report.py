"""``pyro-fa posteriordb``'s report: a table per posterior, the goals table, and the curves' figure."""
from __future__ import annotations

import math
from typing import List

from pyro_fa.experiments._io import markdown_table
from pyro_fa.experiments.posteriordb.goals import KHAT_USABLE, goals, median, median_curve

HEADER = ["method", "W1 debiased (IQR)", "W1", "W1 floor", "max mean err (sd)", "sd ratio min-max", "k-hat",
          "grad evals", "seconds (CPU)", "lr (tuning grad evals, s)", "failed"]


def _quartiles(values):
    import numpy as np

    vals = [v for v in values if v is not None and math.isfinite(v)]
    return tuple(np.percentile(vals, [25, 75])) if vals else (float("nan"), float("nan"))


def _lr_cell(rs) -> str:
    lrs = [r.get("lr") for r in rs if r.get("lr") is not None]
    if not lrs:
        return "-"
    tuning = rs[0].get("tuning")
    cell = f"{lrs[0]:g}"
    if tuning:
        cell += f" ({tuning['grad_evals']}, {tuning['seconds']:.0f})"
    return cell


def posterior_table(records: List[dict], name: str) -> str:
    """Final fits, medians over seeds, ranked by the debiased W1."""
    rows = []
    for method in dict.fromkeys(r["method"] for r in records if r["posterior"] == name):
        rs = [r for r in records if r["posterior"] == name and r["method"] == method]
        ok = [r for r in rs if not r.get("error")]
        med = {k: median([r["scores"].get(k) for r in ok]) for k in
               ("w1", "w1_debiased", "w1_floor", "max_mean_error", "min_sd_ratio", "max_sd_ratio", "khat")}
        q1, q3 = _quartiles([r["scores"].get("w1_debiased") for r in ok])
        rows.append((med["w1_debiased"], [
            method, f"{med['w1_debiased']:.3g} ({q1:.3g} to {q3:.3g})", f"{med['w1']:.3g}", f"{med['w1_floor']:.3g}",
            f"{med['max_mean_error']:.3g}", f"{med['min_sd_ratio']:.2f}-{med['max_sd_ratio']:.2f}",
            f"{med['khat']:.2f}", f"{median([r['grad_evals'] for r in ok]):.0f}",
            f"{median([r['seconds'] for r in ok]):.2f} ({median([r.get('cpu_seconds') for r in ok]):.2f})",
            _lr_cell(rs), f"{len(rs) - len(ok)}/{len(rs)}"]))
    rows.sort(key=lambda t: (math.isnan(t[0]), t[0]))
    seeds = len({r["seed"] for r in records if r["posterior"] == name})
    return (f"### {name}\n\nFinal fits, medians over {seeds} seeds, ranked by the debiased W1 (IQR: its "
            "quartiles over seeds).\n\n" + markdown_table(HEADER, [r for _, r in rows]))


def _pt(p) -> str:
    return f"{p[0]} {p[2]:.3g} @ {p[1]:.0f}"


def _paired(p) -> str:
    return "" if p is None else f"; paired diff {p[0]:.3g} ± {p[1]:.2g} ({p[2]} seeds)"


def goals_table(records: List[dict], roles=None) -> str:
    """G1, G2 and G3 per posterior and overall (:mod:`~pyro_fa.experiments.posteriordb.goals`)."""
    g = goals(records, roles)
    rows = []
    for name in g["g1"]:
        g1, g2, g3 = g["g1"][name], g["g2"][name], g["g3"]["per_posterior"][name]
        c1 = "n/a" if g1 is None else (("pass" if g1["passed"] else "fail")
                                       + f": ours {_pt(g1['ours'])} vs Pyro {_pt(g1['peer'])}" + _paired(g1["paired"]))
        c2 = "n/a" if g2 is None or g2["worst"] is None else (
            ("pass" if g2["passed"] else "fail") + f": {g2['method']} worst {g2['worst'][2]:.3g} vs "
            f"auto-lowrank {g2['worst'][3]:.3g} @ {g2['worst'][1]:.0f}")
        c3 = " vs ".join("-" if g3[s] is None else f"{g3[s][1]} {g3[s][0]:.2f}" for s in ("ours", "peer"))
        rows.append([name, c1, c2, c3])
    g3 = g["g3"]
    n2 = g["g2_count"]
    judged1 = any(v is not None for v in g["g1"].values())
    c1 = (f"{'pass' if g['g1_passed'] else 'fail'}: {g['g1_share']:.0%} of posteriors (>= 60%)" if judged1
          else "n/a (no posterior with both sides)")
    c2 = f"{'pass' if g['g2_passed'] else 'fail'}: {n2[0]}/{n2[1]} posteriors" if n2[1] else "n/a (no guide curves)"
    rows.append(["**all**", c1, c2,
                 f"{'pass' if g3['passed'] else 'fail'}: ours {g3['ours'][1]} {g3['ours'][0]} vs Pyro "
                 f"{g3['peer'][1]} {g3['peer'][0]} posteriors with k-hat < {KHAT_USABLE}"])
    return ("### Goals\n\nG1: our best factor-analysis method's median debiased W1 (method, value @ gradient "
            "evaluations) against the best Pyro guide's, with at most a tenth of its gradient evaluations, and their "
            "paired difference over seeds (ours minus Pyro's: mean ± standard error). G2: our "
            "guide against auto-lowrank at the same gradient evaluations (its worst point). G3: the lowest median "
            "k-hat, ours vs Pyro's guides.\n\n" + markdown_table(["posterior", "G1", "G2", "G3 k-hat"], rows))


def figure(records: List[dict], path) -> None:
    """Median debiased W1 against gradient evaluations (log x), every method's curve, a panel per posterior."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    from pyro_fa.experiments._io import atomic_savefig

    names = list(dict.fromkeys(r["posterior"] for r in records))
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 4.5 * cols), 3.5 * rows + 0.9), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in records))
    colours = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    for ax, name in zip(axes.flat, names):
        for m in methods:
            pts = [(p["grad_evals"], p.get("w1_debiased")) for p in median_curve(records, name, m)]
            pts = [(g, w) for g, w in pts if g > 0 and w is not None and math.isfinite(w)]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, lw=1, color=colours[m], label=m)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("gradient evaluations")
        ax.set_ylabel("debiased W1 (median)")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=8)
    fig.tight_layout(rect=(0, 0.2 / rows, 1, 1))
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
