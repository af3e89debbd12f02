r"""Fidelity of ``pyro-fa classify``'s predictives to a full-batch HMC reference (``--hmc-reference DIR``).

``pyro-fa hmc-reference --tasks digits`` writes, for the digits MLP of this benchmark and split (seed) ``s``,
``<DIR>/digits-split<s>.pt`` (the test-set predictive of HMC's draws) and a ``.json`` of its diagnostics. For
every dataset × seed of a run whose ``<DIR>/<dataset>-split<seed>.pt`` exists, each row's test predictive (the
model average, raw and "+T") is scored against the reference's, as Izmailov, Vikram, Hoffman & Wilson (2021)
and the NeurIPS 2021 approximate-inference competition score them: the agreement of the most probable classes
and the mean total variation (:func:`pyro_fa.metrics.agreement`, :func:`~pyro_fa.metrics.total_variation`).
The reference must be of the run: the same test points in the same order, the same network (the shapes of its
weights) and the prior precision MAP chose (every method's prior); otherwise the run is refused naming what
differs (:func:`check_reference`, :func:`check_precision`).

Beside them, each row's cost as a multiple of one MAP training (its seconds over MAP's grid's seconds divided
by the grid's size) and, where the deep ensemble's size curve is in the run (its test NLL at 1..M members, which
units written before it was recorded lack), the deep-ensemble equivalent of its NLL (Ashukha et al. 2020,
:func:`pyro_fa.metrics.deep_ensemble_equivalent`). Per seed these go into the row's ``extra``
(:data:`EXTRA_KEYS`), so that ``--merge`` carries them with their seed.

References
----------
P. Izmailov, S. Vikram, M. D. Hoffman & A. G. Wilson (2021), *What are Bayesian neural network posteriors
really like?*, ICML.
A. G. Wilson, P. Izmailov, M. D. Hoffman et al. (2022), *Evaluating approximate inference in Bayesian deep
learning*, NeurIPS 2021 Competitions and Demonstrations Track, PMLR 176.
A. Ashukha, A. Lyzhov, D. Molchanov & D. Vetrov (2020), *Pitfalls of in-domain uncertainty estimation and
ensembling in deep learning*, ICLR.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from pyro_fa.experiments._io import mean_se

#: the row whose members make the deep ensemble's size curve
ENSEMBLE_ROW = "ensemble"
#: the row whose seconds (its prior-precision grid) measure one MAP training
MAP_ROW = "map"
#: the reference file of a dataset and seed in ``--hmc-reference DIR``
REFERENCE_FILE = "{dataset}-split{seed}.pt"
#: what this module adds to a row's ``extra`` of a seed
EXTRA_KEYS = ("hmc_agreement", "hmc_total_variation", "map_trainings", "dee_nll")
#: table columns: (header, key in ``extra``, digits)
COLUMNS = (("agreement w. HMC", "hmc_agreement", 3), ("TV to HMC", "hmc_total_variation", 3),
           ("DEE (NLL)", "dee_nll", 2), ("MAP trainings", "map_trainings", 1))
#: the smallest total variation the figure draws (log scale)
#: relative tolerance of the checks of a reference's recorded test scores against this run's test part
_SCORE_RTOL = 1e-6


def size_curve(members: Tensor, targets: Tensor) -> List[float]:
    """The test NLL of the deep ensemble of its first 1, 2, ..., M members (``members``: (M, N, C)), for the deep
    ensemble equivalent (:func:`pyro_fa.metrics.deep_ensemble_equivalent`)."""
    from pyro_fa.metrics import negative_log_likelihood

    m = members.double()
    return [float(negative_log_likelihood(m[:k].mean(0), targets)) for k in range(1, m.shape[0] + 1)]


def digest_of(x: Tensor, y: Tensor) -> str:
    """SHA-256 of inputs (as float64) and labels (as int64), in order: one string names a data part."""
    import hashlib

    h = hashlib.sha256()
    h.update(x.detach().double().cpu().contiguous().numpy().tobytes())
    h.update(y.detach().long().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def parameter_shapes(net: torch.nn.Module) -> List[List[int]]:
    """The shapes of a network's weights, in order (what a reference records of its architecture)."""
    return [list(p.shape) for p in net.parameters()]


@dataclass
class Reference:
    """An HMC reference of one dataset and seed, read by :func:`load_reference`.

    ``probs`` is the reference's test predictive (N, C), float64; ``precision``, ``shapes`` (or only ``dim``) and
    ``digest`` (or the reference's own test ``scores``) and ``train_digest`` (where recorded) are what :func:`check_reference` compares with a run;
    ``diagnostics`` is the ``.json`` beside the file (R-hat, ESS, the chains' agreement).
    """

    path: Path
    probs: Tensor
    precision: Optional[float] = None
    shapes: Optional[List[List[int]]] = None
    dim: Optional[int] = None
    digest: Optional[str] = None
    train_digest: Optional[str] = None
    scores: dict = field(default_factory=dict)
    diagnostics: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """The diagnostics a report names (JSON): chains, draws, R-hat, ESS, divergences, the chains' agreement."""
        d = self.diagnostics
        pairs = list((d.get("between_chains") or {}).values())
        out = {"file": str(self.path), "precision": self.precision}
        for k in ("chains", "draws_per_chain", "rhat_max", "rhat_ok", "ess_min", "total_seconds", "mass"):
            if k in d:
                out[k] = d[k]
        if "divergences" in d:
            out["divergences"] = sum(d["divergences"])
        for k in ("agreement", "total_variation"):
            vals = [p[k] for p in pairs if k in p]
            if vals:
                out[f"between_chains_{k}_min" if k == "agreement" else f"between_chains_{k}_max"] = (
                    min(vals) if k == "agreement" else max(vals))
        return out


def _refuse(path, text: str) -> SystemExit:
    return SystemExit(f"pyro-fa classify: --hmc-reference {path}: {text}")


def load_reference(path) -> Reference:
    """The reference in ``path`` (a ``.pt`` of ``pyro-fa hmc-reference``) and the diagnostics in its ``.json``.

    Raises
    ------
    SystemExit
        When the file is unreadable, not a classification reference, or its probabilities are not (N, C).
    """
    path = Path(path)
    try:
        saved = torch.load(path, weights_only=True)
        probs = saved["reference"].get("probs")
    except Exception as err:  # torch.load raises pickle's, zipfile's and its own errors alike
        raise _refuse(path, f"not a reference written by pyro-fa hmc-reference ({type(err).__name__}: "
                            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}).") from None
    if saved.get("likelihood") != "classification" or not isinstance(probs, Tensor) or probs.dim() != 2:
        raise _refuse(path, f"must be a classification reference with test probabilities (N, C), got likelihood "
                            f"{saved.get('likelihood')!r} and {type(probs).__name__} of shape "
                            f"{tuple(getattr(probs, 'shape', ()))!r}.")
    diag: dict = {}
    if path.with_suffix(".json").is_file():
        try:
            diag = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError) as err:
            raise _refuse(path, f"its diagnostics {path.with_suffix('.json')} are not JSON ({err}).") from None
    checks = saved.get("checks") or {}
    precision = checks.get("precision", diag.get("precision"))
    return Reference(path=path, probs=probs.double(), precision=None if precision is None else float(precision),
                     shapes=checks.get("parameter_shapes"), dim=diag.get("dim"), digest=checks.get("test_digest"),
                     train_digest=checks.get("train_digest"),
                     scores=dict(diag.get("scores") or {}), diagnostics=diag)


def _test_part_differences(ref: Reference, x_test: Tensor, y_test: Tensor, num_classes: int) -> List[str]:
    from pyro_fa.metrics import accuracy, negative_log_likelihood

    n, c = ref.probs.shape
    if n != y_test.shape[0]:
        return [f"its test predictive has {n} points, this run's test part {y_test.shape[0]}"]
    if c != num_classes:
        return [f"its test predictive has {c} classes, this run's data {num_classes}"]
    if ref.digest is not None:
        ours = digest_of(x_test, y_test)
        return [] if ours == ref.digest else [f"its test part (SHA-256 {ref.digest[:12]}...) is not this run's "
                                              f"({ours[:12]}...): other points or another order"]
    if "nll" in ref.scores and "accuracy" in ref.scores:  # references written before the digest was recorded
        nll, acc = float(negative_log_likelihood(ref.probs, y_test)), float(accuracy(ref.probs, y_test))
        if math.isclose(nll, ref.scores["nll"], rel_tol=_SCORE_RTOL) and math.isclose(acc, ref.scores["accuracy"],
                                                                                       rel_tol=_SCORE_RTOL):
            return []
        return [f"its test NLL / accuracy on this run's test labels are {nll:.6g} / {acc:.6g}, its diagnostics "
                f"record {ref.scores['nll']:.6g} / {ref.scores['accuracy']:.6g}: other test labels or another order"]
    return ["it records neither a digest of its test part nor its test scores, so the test parts cannot be "
            "compared"]


def _network_differences(ref: Reference, net: torch.nn.Module) -> List[str]:
    shapes = parameter_shapes(net)
    if ref.shapes is not None:
        return [] if [list(s) for s in ref.shapes] == shapes else [
            f"its network's weight shapes are {ref.shapes}, this run's {shapes}"]
    dim = sum(p.numel() for p in net.parameters())
    if ref.dim is not None:
        return [] if int(ref.dim) == dim else [f"its network has {ref.dim} weights, this run's {dim}"]
    return ["it records neither its network's weight shapes nor their number"]


def check_reference(ref: Reference, data, net: torch.nn.Module) -> None:
    """Refuse a reference that is not of this run's data (``data``, a
    :class:`~pyro_fa.experiments.classify.data.ClassifyData`: its test part's points, order and classes, and its
    training part where the reference records its digest) and network ``net``.

    Raises
    ------
    SystemExit
        Naming the file and every difference found.
    """
    diffs = _test_part_differences(ref, data.x_test, data.y_test, data.num_classes)
    if ref.train_digest is not None and ref.train_digest != digest_of(data.x_train, data.y_train):
        diffs.append("its training part is not this run's (another seed's validation cut?)")
    diffs += _network_differences(ref, net)
    if ref.precision is None:
        diffs.append("it records no prior precision")
    if diffs:
        raise _refuse(ref.path, "not a reference of this run: " + "; ".join(diffs) + ".")


def check_precision(ref: Reference, precision: Optional[float], where: str) -> None:
    """Refuse a reference whose prior precision is not the one this run's MAP chose for ``where``.

    Raises
    ------
    SystemExit
        When they differ, or ``precision`` is None (the run made no MAP row, so its choice is unknown).
    """
    if precision is None:
        raise _refuse(ref.path, f"this run's prior precision of {where} is unknown (no map row): add map to "
                                "--methods, or give --prior-precision-from.")
    if not math.isclose(float(precision), ref.precision, rel_tol=1e-9):
        raise _refuse(ref.path, f"not a reference of this run: its prior precision is {ref.precision!r}, this "
                                f"run's MAP chose {float(precision)!r} for {where}.")


def find_references(folder, combos: Sequence[tuple], seeds: Sequence[int]) -> Dict[tuple, Path]:
    """``{(dataset, seed): path}`` of the references in ``folder`` for the run's datasets and seeds.

    Raises
    ------
    SystemExit
        When ``folder`` is not a folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"pyro-fa classify: --hmc-reference must be a folder of pyro-fa hmc-reference, got "
                         f"{str(folder)!r}, which is not a folder.")
    found = {}
    for dataset in dict.fromkeys(d for d, _ in combos):
        for seed in seeds:
            path = folder / REFERENCE_FILE.format(dataset=dataset, seed=seed)
            if path.is_file():
                found[(dataset, seed)] = path
    return found


def fidelity(probs: Tensor, ref: Reference) -> Dict[str, float]:
    """Agreement and total variation of a test predictive (N, C), or draws (S, N, C), to the reference's."""
    from pyro_fa.metrics import agreement, total_variation

    p = probs.double()
    return {"hmc_agreement": float(agreement(p, ref.probs)), "hmc_total_variation": float(total_variation(p, ref.probs))}


def seed_extras(rows: dict, test_probs: Optional[Dict[str, Tensor]], ref: Optional[Reference],
                grid_size: int) -> Dict[str, dict]:
    """Per row of one seed (``rows``: name -> {"scores", "seconds", "extra"}), what :data:`EXTRA_KEYS` adds:
    the fidelity to ``ref`` (with ``test_probs``: name -> its test predictive), its cost in MAP trainings (MAP's
    grid of ``grid_size`` trainings timed by the map row) and the deep-ensemble equivalent of its NLL (where the
    ensemble row holds its size curve)."""
    from pyro_fa.metrics import deep_ensemble_equivalent

    one = rows[MAP_ROW]["seconds"] / grid_size if MAP_ROW in rows else None
    curve = rows.get(ENSEMBLE_ROW, {}).get("extra", {}).get("size_curve_nll")
    out: Dict[str, dict] = {}
    for name, r in rows.items():
        more = {}
        if ref is not None and test_probs is not None and name in test_probs:
            more.update(fidelity(test_probs[name], ref))
        if one is not None and one > 0:
            more["map_trainings"] = r["seconds"] / one
        if curve and math.isfinite(r["scores"].get("nll", math.nan)):
            more["dee_nll"] = deep_ensemble_equivalent(r["scores"]["nll"], curve, higher_is_better=False)
        out[name] = more
    return out


def _values(row: dict, key: str) -> List[float]:
    return [e[key] for e in row.get("extra", []) if isinstance(e, dict) and isinstance(e.get(key), (int, float))]


def _cell(values: List[float], digits: int) -> str:
    if not values:
        return ""
    m, se = mean_se(values)
    if math.isinf(m):
        return "> M"  # better than the whole measured ensemble curve
    return f"{m:.{digits}f}" if math.isnan(se) else f"{m:.{digits}f} ± {se:.{digits}f}"


def columns(combo: dict) -> List[tuple]:
    """The columns of :data:`COLUMNS` this dataset × network's table shows: the fidelity ones when the run had
    a reference folder (empty cells where no reference covered the seed), the others where a row holds values."""
    shown = []
    for header, key, digits in COLUMNS:
        has = any(_values(r, key) for r in combo["methods"].values())
        if has or (key.startswith("hmc_") and "hmc_reference" in combo):
            shown.append((header, key, digits))
    return shown


def cells(combo: dict, name: str, shown: List[tuple]) -> List[str]:
    """The cells of row ``name`` for the columns ``shown`` (mean ± s.e. over the seeds holding a value)."""
    return [_cell(_values(combo["methods"][name], key), digits) for _, key, digits in shown]


def notes(combo: dict) -> str:
    """What the report says under a table of these columns: the references used and their diagnostics, and
    which columns are left out and why."""
    lines = []
    ref = combo.get("hmc_reference")
    if ref is not None:
        every = sorted({s for r in combo["methods"].values() for s in r.get("seeds", [])})
        if ref.get("seeds") and every and len(ref["seeds"]) < len(every):
            lines.append(f"Agreement and TV to HMC are over seed(s) {ref['seeds']} only (the other columns over "
                         f"{every}).")
        if not ref.get("seeds"):
            lines.append(f"Fidelity to HMC: no reference in {ref['dir']} for this dataset and these seeds "
                         f"({REFERENCE_FILE.format(dataset=combo['dataset'], seed='<seed>')}); its columns are empty.")
        for seed, s in sorted((ref.get("diagnostics") or {}).items()):
            lines.append(f"Fidelity to HMC, seed {seed}: {s['file']} ({s.get('chains')} chains × "
                         f"{s.get('draws_per_chain')} draws, prior precision {s.get('precision')}; R-hat max "
                         f"{s.get('rhat_max', float('nan')):.3f}{'' if s.get('rhat_ok') else ' (NOT below 1.05)'}, "
                         f"ESS min {s.get('ess_min', float('nan')):.0f}, divergences {s.get('divergences')}, "
                         f"between chains agreement >= {s.get('between_chains_agreement_min', float('nan')):.3f} "
                         f"and TV <= {s.get('between_chains_total_variation_max', float('nan')):.3f}).")
    if not any(_values(r, "dee_nll") for r in combo["methods"].values()):
        lines.append("DEE (deep-ensemble equivalent of the NLL) left out: the run holds no deep ensemble's size "
                     "curve (no ensemble row, or units written before the curve was recorded).")
    if not any(_values(r, "map_trainings") for r in combo["methods"].values()):
        lines.append("MAP trainings left out: no row holds its cost in MAP trainings (no map row to time one MAP "
                     "training, or results written before the cost was recorded).")
    return "\n".join(lines)
