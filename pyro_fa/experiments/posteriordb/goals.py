"""The three goals ``pyro-fa posteriordb`` judges, computed from its unit records (medians over seeds).

* **G1**: on at least ``G1_SHARE`` of the posteriors, our best factor-analysis method (``Method.ours``) reaches
  a median debiased W1 no worse than the best Pyro guide's (``Method.peer``, any family, any checkpoint) with at
  most a tenth of that guide's gradient evaluations. The Pyro guide's cost is the fewest gradient evaluations at
  which any Pyro guide's median curve comes within the tie of its best value.
* **G2**: on every posterior, our guide (``Method.guide``: the factor guide, or its Pathfinder-initialised form)
  is never worse than ``G2_FACTOR`` times Pyro's ``auto-lowrank`` (same rank) at the same gradient evaluations:
  each point of our median curve against ``auto-lowrank``'s first checkpoint with at least as many gradient
  evaluations (its last where none has). One of our guides passing all its points passes the posterior.
* **G3**: k̂ < 0.7 (median over seeds, final fit) on at least as many posteriors as the best baseline: the best
  of our methods' counts against the best of Pyro's guides'.

G1 also reports the paired difference of the two chosen points (ours minus the Pyro guide's debiased W1, seed by
seed over the seeds both have, each at the same position of its curve as the chosen median point): its mean and
standard error, so that a pass or a fail can be read against the seeds' scatter.

"No worse" allows a tie of ``TIE`` times the posterior's W1 floor: the debiased W1 is 0 in expectation for an
exact fit and scatters by a fraction of the floor, so values closer than that are not told apart.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional

G1_SHARE = 0.6
G1_COST_RATIO = 0.1
G2_FACTOR = 1.1
G2_PEER = "auto-lowrank"
KHAT_USABLE = 0.7
TIE = 0.1


def median(values) -> float:
    vals = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not vals:
        return float("nan")
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])


def _ok(records, name, method):
    return [r for r in records if r["posterior"] == name and r["method"] == method and not r.get("error")]


def _curve_points(record) -> List[dict]:
    return record.get("curve") or [{"step": 0, "grad_evals": record["grad_evals"], "scores": record["scores"]}]


def median_curve(records: List[dict], name: str, method: str) -> List[dict]:
    """The method's curve on ``name``: per checkpoint (by position), the medians over seeds of the gradient
    evaluations and of every score; sorted by gradient evaluations."""
    ok = _ok(records, name, method)
    if not ok:
        return []
    size = min(len(_curve_points(r)) for r in ok)
    out = []
    for i in range(size):
        pts = [_curve_points(r)[i] for r in ok]
        keys = set().union(*(p["scores"] for p in pts))
        out.append({"step": pts[0].get("step", 0), "grad_evals": median([p["grad_evals"] for p in pts]),
                    **{k: median([p["scores"].get(k) for p in pts]) for k in keys}})
    return sorted(out, key=lambda p: p["grad_evals"])


def floor(records: List[dict], name: str) -> float:
    """The posterior's median W1 floor over its units."""
    return median([r["scores"].get("w1_floor") for r in records if r["posterior"] == name and not r.get("error")])


def _points(records, name, methods) -> List[tuple]:
    return [(m, p["grad_evals"], p["w1_debiased"]) for m in methods for p in median_curve(records, name, m)
            if math.isfinite(p.get("w1_debiased", float("nan")))]


def _per_seed(records: List[dict], name: str, method: str, grad_evals: float) -> Dict[int, float]:
    """Seed -> debiased W1 at the position of ``method``'s median curve whose gradient evaluations are
    ``grad_evals`` (the median curve is built position by position)."""
    ok = _ok(records, name, method)
    if not ok:
        return {}
    size = min(len(_curve_points(r)) for r in ok)
    medians = [median([_curve_points(r)[i]["grad_evals"] for r in ok]) for i in range(size)]
    i = min(range(size), key=lambda j: abs(medians[j] - grad_evals))
    return {r["seed"]: _curve_points(r)[i]["scores"].get("w1_debiased") for r in ok}


def paired_difference(records: List[dict], name: str, ours: tuple, peer: tuple) -> Optional[tuple]:
    """(mean, standard error, number of seeds) of ours minus peer's debiased W1 over the seeds both have, each
    point a (method, gradient evaluations, W1) of :func:`goal_g1`; None with fewer than two shared seeds."""
    a, b = (_per_seed(records, name, p[0], p[1]) for p in (ours, peer))
    diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))
             if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs)), len(diffs)


def goal_g1(records: List[dict], name: str, roles: Mapping) -> Optional[dict]:
    """G1 on one posterior: ``passed``, the Pyro point to beat (``peer``: method, gradient evaluations, median
    debiased W1), ``ours`` (our cheapest point that qualifies, else our best) and ``paired`` (the paired
    difference ours minus peer: mean, standard error, seeds; None with fewer than two shared seeds); None
    without both sides."""
    present = list(dict.fromkeys(r["method"] for r in records if r["posterior"] == name))
    peers = _points(records, name, [m for m in present if m in roles and roles[m].peer])
    ours = _points(records, name, [m for m in present if m in roles and roles[m].ours])
    if not peers or not ours:
        return None
    tie = TIE * abs(floor(records, name))
    best = min(w for _, _, w in peers)
    peer = min((p for p in peers if p[2] <= best + tie), key=lambda p: (p[1], p[2]))
    good = [p for p in ours if p[2] <= best + tie and p[1] <= G1_COST_RATIO * peer[1]]
    chosen = min(good, key=lambda p: (p[1], p[2])) if good else min(ours, key=lambda p: (p[2], p[1]))
    return {"passed": bool(good), "peer": peer, "ours": chosen,
            "paired": paired_difference(records, name, chosen, peer)}


def _peer_at(curve: List[dict], grad_evals: float) -> dict:
    later = [p for p in curve if p["grad_evals"] >= grad_evals]
    return later[0] if later else curve[-1]


def goal_g2(records: List[dict], name: str, roles: Mapping) -> Optional[dict]:
    """G2 on one posterior: ``passed``, and per guide method its worst point (``worst``: method, gradient
    evaluations, our W1, the peer's W1) and whether all its points pass; None without both sides."""
    peer = [p for p in median_curve(records, name, G2_PEER) if math.isfinite(p.get("w1_debiased", float("nan")))]
    present = list(dict.fromkeys(r["method"] for r in records if r["posterior"] == name))
    guides = [m for m in present if m in roles and roles[m].guide]
    if not peer or not guides:
        return None
    tie = TIE * abs(floor(records, name))
    per_method = {}
    for m in guides:
        worst, passed = None, True
        curve = median_curve(records, name, m)
        for p in curve:
            w, ref = p.get("w1_debiased", float("nan")), _peer_at(peer, p["grad_evals"])["w1_debiased"]
            ok = math.isfinite(w) and w <= ref + (G2_FACTOR - 1) * abs(ref) + tie
            excess = (w - ref) if math.isfinite(w) else math.inf
            if worst is None or excess > worst[4]:
                worst = (m, p["grad_evals"], w, ref, excess)
            passed = passed and ok
        per_method[m] = {"passed": passed and bool(curve), "worst": worst[:4] if worst else None}
    best = min(per_method, key=lambda m: (not per_method[m]["passed"], per_method[m]["worst"][2]
                                          if per_method[m]["worst"] else math.inf))
    return {"passed": any(v["passed"] for v in per_method.values()), "method": best, **per_method[best]}


def khat_medians(records: List[dict], name: str) -> Dict[str, float]:
    """Median k̂ (final fit) over seeds, per method with a finite one."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in records if r["posterior"] == name):
        k = median([r["scores"].get("khat") for r in _ok(records, name, m)])
        if math.isfinite(k):
            out[m] = k
    return out


def goal_g3(records: List[dict], roles: Mapping) -> dict:
    """G3 over all posteriors: per method the posteriors with k̂ < 0.7, the best count of ours and of Pyro's
    guides, ``passed``, and per posterior the best k̂ of each side."""
    names = list(dict.fromkeys(r["posterior"] for r in records))
    counts: Dict[str, int] = {}
    per_posterior = {}
    for name in names:
        k = khat_medians(records, name)
        for m, v in k.items():
            counts[m] = counts.get(m, 0) + (v < KHAT_USABLE)
        side = {s: min(((v, m) for m, v in k.items() if m in roles and getattr(roles[m], s)), default=None)
                for s in ("ours", "peer")}
        per_posterior[name] = side
    best = {s: max(((c, m) for m, c in counts.items() if m in roles and getattr(roles[m], s)), default=(0, None))
            for s in ("ours", "peer")}
    return {"counts": counts, "ours": best["ours"], "peer": best["peer"],
            "passed": best["ours"][0] >= best["peer"][0], "per_posterior": per_posterior}


def goals(records: List[dict], roles: Optional[Mapping] = None) -> dict:
    """G1, G2 (per posterior, and overall) and G3, from the unit records; ``roles``: method name -> object with
    ``peer``, ``ours`` and ``guide`` (default the registry :data:`~.methods.METHODS`)."""
    if roles is None:
        from pyro_fa.experiments.posteriordb.methods import METHODS as roles
    names = list(dict.fromkeys(r["posterior"] for r in records))
    g1 = {n: goal_g1(records, n, roles) for n in names}
    g2 = {n: goal_g2(records, n, roles) for n in names}
    judged1 = [v for v in g1.values() if v is not None]
    judged2 = [v for v in g2.values() if v is not None]
    share = sum(v["passed"] for v in judged1) / len(judged1) if judged1 else float("nan")
    return {"g1": g1, "g2": g2, "g3": goal_g3(records, roles),
            "g1_share": share, "g1_passed": bool(judged1) and share >= G1_SHARE,
            "g2_passed": bool(judged2) and all(v["passed"] for v in judged2),
            "g2_count": (sum(v["passed"] for v in judged2), len(judged2))}
