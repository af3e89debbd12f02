"""Merging runs of ``pyro-fa classify``: ``--merge`` (runs of other seeds or datasets into one report),
``--rows-from`` (rows rerun for some seeds) and ``--prior-precision-from`` (MAP's choice read from an earlier run).

Every value is lined up with the seed it ran on; a folder that is not a run of ``pyro-fa classify`` is refused in
one line naming the flag, the folder and the file.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from pyro_fa.experiments.classify.methods import ROW_ONLY_FIELDS, Budget
from pyro_fa.experiments._io import mean_se

__all__ = ["merge_results", "prior_precisions_from"]


def prior_precisions_from(folder, budget: Budget, combos: Sequence[tuple], seeds: Sequence[int]) -> Dict[str, dict]:
    """MAP's chosen prior precision, ``{"<dataset>-<network>": {seed: value}}``, from an earlier run in ``folder``.

    Raises
    ------
    SystemExit
        When ``folder`` holds no results, ran under another budget (beyond the grids of
        :data:`~pyro_fa.experiments.classify.methods.ROW_ONLY_FIELDS`), or lacks MAP's row for one of ``seeds``.
    """
    ((result, _),) = _read_runs([folder], "--prior-precision-from")
    _row_only_diff(result, Path(folder), json.loads(json.dumps(asdict(budget))), "--prior-precision-from",
                   "this one")
    out: Dict[str, dict] = {}
    for dataset, network in combos:
        key = f"{dataset}-{network}"
        rows = _row_entries(result, key, Path(folder), "--prior-precision-from") if key in result["combos"] else {}
        held = rows.get("map", {})  # seed -> MAP's values, lined up by seed
        lack = [s for s in seeds if s not in held]
        if lack:
            raise SystemExit(f"pyro-fa classify: --prior-precision-from {folder} holds no MAP row of {key} for "
                             f"seed(s) {lack} (it holds {sorted(held) if held else 'none'}).")
        try:
            out[key] = {s: float(held[s]["extra"]["prior_precision"]) for s in seeds}
        except (KeyError, TypeError, ValueError) as err:
            raise SystemExit(f"pyro-fa classify: --prior-precision-from {str(folder)!r}: {Path(folder) / 'results.json'} "
                             f"holds no prior precision of MAP's row of {key} ({type(err).__name__}: {err}).") from None
    return out


def _read_runs(dirs: Sequence, flag: str = "--merge") -> list:
    """``[(results, folder)]`` of the runs in ``dirs``, each refused in one line naming ``flag``, the folder and
    the file when it is not a results.json written by ``pyro-fa classify``."""
    return [(_read_results(Path(d), flag), Path(d)) for d in dirs]


#: what a results.json of ``pyro-fa classify`` holds (checked before a merge reads it)
_RESULT_FIELDS = {"budget": dict, "seeds": list, "combos": dict}


def _read_results(folder: Path, flag: str) -> dict:
    path = folder / "results.json"
    if not path.is_file():
        unfinished = (folder / "units").is_dir() and any((folder / "units").glob("*.json"))
        raise SystemExit(f"pyro-fa classify: {flag} needs folders written by pyro-fa classify, got {str(folder)!r} "
                         "without results.json" + ("; it holds the seeds of an unfinished run: run its command "
                                                   "again to finish it." if unfinished else "."))
    try:
        result = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(result, dict):
            raise ValueError(f"a JSON {type(result).__name__}, not an object")
        missing = [k for k, t in _RESULT_FIELDS.items() if not isinstance(result.get(k), t)]
        if missing:
            raise ValueError(f"no valid {', '.join(missing)}")
        for key, combo in result["combos"].items():
            if not isinstance(combo, dict) or not isinstance(combo.get("methods"), dict):
                raise ValueError(f"no valid methods of {key}")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SystemExit(f"pyro-fa classify: {flag} {str(folder)!r}: {path} is not a results.json written by "
                         f"pyro-fa classify ({str(err).splitlines()[0] if str(err) else type(err).__name__}).") from None
    return result


def _read_predictions(folder: Path, flag: str) -> Optional[dict]:
    """The ``predictions.pt`` of a run (None where it kept none), refused in one line when unreadable."""
    path = folder / "predictions.pt"
    if not path.is_file():
        return None
    try:
        saved = torch.load(path)
        if not isinstance(saved, dict) or not isinstance(saved.get("probs"), dict) \
                or not isinstance(saved.get("targets"), dict):
            raise ValueError("not a dict of probs and targets")
    except Exception as err:  # torch.load raises pickle's, zipfile's and its own errors alike
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"pyro-fa classify: {flag} {str(folder)!r}: {path} is not a predictions.pt written by "
                         f"pyro-fa classify ({first}); remove it to merge without its figures.") from None
    return saved


def _row_only_diff(result: dict, folder: Path, base: dict, flag: str = "--rows-from",
                   against: str = "the merged runs") -> None:
    """Refuse a ``rows_from`` run whose budget differs from the merged runs' in more than :data:`ROW_ONLY_FIELDS`."""
    other = sorted(k for k in set(base) | set(result["budget"])
                   if result["budget"].get(k) != base.get(k) and k not in ROW_ONLY_FIELDS)
    if other:
        got = "; ".join(f"{k}={result['budget'].get(k)!r} against {base.get(k)!r}" for k in other)
        raise SystemExit(f"pyro-fa classify: {flag} {folder} ran under another budget than {against} ({got}); only "
                         f"the grids of single rows ({', '.join(ROW_ONLY_FIELDS)}) may differ.")


def _combo_seeds(result: dict, key: str) -> List[int]:
    """The seeds a run holds of ``key`` (``seeds_per_combo``, else the run's seeds)."""
    return list(result.get("seeds_per_combo", {}).get(key, result["seeds"]))


def _row_entries(result: dict, key: str, folder: Path, flag: str) -> Dict[str, Dict[int, dict]]:
    """``row -> {seed: {"scores", "seconds", "extra"}}`` of one dataset × network of one run: each value lined up
    with the seed it ran on (a row's ``seeds``; the run's seeds of ``key`` for rows written without them)."""
    out: Dict[str, Dict[int, dict]] = {}
    try:
        run_seeds = _combo_seeds(result, key)
        for name, m in result["combos"][key]["methods"].items():
            seeds, n = list(m.get("seeds", run_seeds)), len(m["seconds"])
            extra = m.get("extra") or [{}] * n
            if len(seeds) != n or len(extra) != n or any(len(v) != n for v in m["per_seed"].values()):
                raise ValueError(f"the row {name!r} of {key} holds {n} value(s) for seed(s) {seeds}")
            out[name] = {int(sd): {"scores": {k: v[i] for k, v in m["per_seed"].items()}, "seconds": m["seconds"][i],
                                   "extra": extra[i]} for i, sd in enumerate(seeds)}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise SystemExit(f"pyro-fa classify: {flag} {str(folder)!r}: {folder / 'results.json'} is not a results.json "
                         f"written by pyro-fa classify ({type(err).__name__}: {err}).") from None
    return out


def _row_only_values(rows: dict, origin: dict, base: dict) -> dict:
    """The merged value of each field of :data:`ROW_ONLY_FIELDS`: the one every row it governs ran under.

    ``origin[(key, row, field)]`` maps a seed to the value (as JSON) the row of that seed ran under (the merged
    runs' own where absent). Refuses rows of one field left under two values.
    """
    out = {}
    for f, governed in ROW_ONLY_FIELDS.items():
        values: Dict[str, List[str]] = {}
        for key, combo in rows.items():
            for name, by_seed in combo.items():
                if (name[:-2] if name.endswith("+T") else name) in governed:
                    ran = origin.get((key, name, f), {})
                    for s in by_seed:
                        values.setdefault(ran.get(s, json.dumps(base.get(f))), []).append(f"{name!r} of {key}")
        if len(values) > 1:
            where = "; ".join(f"{f}={v}: {', '.join(sorted(set(w)))}" for v, w in values.items())
            raise SystemExit(f"pyro-fa classify: --rows-from leaves rows of one grid under two values ({where}); "
                             "rerun them for every merged seed under one budget.")
        if values:
            out[f] = json.loads(next(iter(values)))
    return out


def merge_results(dirs: Sequence, rows_from: Sequence = ()) -> dict:
    """Merge the ``results.json`` / ``predictions.pt`` of earlier runs (written into one report by
    :func:`pyro_fa.experiments.classify.command.merge_runs`).

    The runs may hold different seeds of a dataset × network or different datasets, and different rows: every
    value is lined up with the seed it ran on, so a row one run lacks holds only the seeds of the runs that
    made it (the table names its seeds; comparisons pair two rows over the seeds both hold). The bars and
    figures are recomputed over the merged seeds. The figures of the first seed come from the run holding the
    smallest seed. All runs must share one budget.

    ``rows_from``: runs whose rows go into the same seeds of the merged runs, replacing rows of the same name
    (a few rows rerun after a change, e.g. ``--methods swa swag-em``, without rerunning the rest). Every seed
    they hold must be among the merged runs', no two of them may bring the same seed of a row, and a row they
    add must cover every merged seed of its dataset × network (from one or several of them). Their budget is
    the merged runs' but for the grids of single rows
    (:data:`~pyro_fa.experiments.classify.methods.ROW_ONLY_FIELDS`, e.g. IVON's): a row rerun on a wider grid
    replaces the row for every merged seed, and the merged budget records the grid it ran on.

    Returns
    -------
    dict
        ``combos``, ``bar`` (the checks), ``budget``, ``seeds``, ``seeds_of``, ``probs``, ``targets``, ``devices``:
        what :func:`~pyro_fa.experiments.classify.command.write_report` writes.

    Raises
    ------
    SystemExit
        When a folder holds no readable results, the budgets differ (beyond a row's grid, for ``rows_from``), a
        seed of a dataset × network appears twice, a run of ``rows_from`` holds a seed not merged, two of them
        bring the same seed of a row, one adds a row for only some seeds, or the rows of one grid are left
        under two of its values.
    """
    from pyro_fa.experiments.classify import report as rep

    runs = _read_runs(dirs)
    extra_runs = _read_runs(rows_from, "--rows-from")
    runs.sort(key=lambda r: min(r[0]["seeds"], default=0))
    budgets = {json.dumps(r["budget"], sort_keys=True) for r, _ in runs}
    if len(budgets) > 1:
        raise SystemExit(f"pyro-fa classify: --merge needs runs of one budget, got {len(budgets)} different ones.")
    base = runs[0][0]["budget"]
    for result, folder in extra_runs:
        _row_only_diff(result, folder, base)
    rows: Dict[str, Dict[str, Dict[int, dict]]] = {}  # key -> row -> seed -> values
    meta: Dict[str, dict] = {}
    held: Dict[str, Dict[int, Path]] = {}  # key -> seed -> the run holding it
    probs0, targets0 = {}, {}
    for result, folder in runs:
        saved = _read_predictions(folder, "--merge")
        for key, combo in result["combos"].items():
            run_seeds = _combo_seeds(result, key)
            twice = sorted(set(run_seeds) & set(held.get(key, {})))
            if twice:
                raise SystemExit(f"pyro-fa classify: --merge got seed(s) {twice} of {key} twice (in {str(folder)!r} "
                                 f"and {str(held[key][twice[0]])!r}).")
            held.setdefault(key, {}).update({sd: folder for sd in run_seeds})
            meta.setdefault(key, {k: v for k, v in combo.items() if k != "methods"})
            for name, entries in _row_entries(result, key, folder, "--merge").items():
                rows.setdefault(key, {}).setdefault(name, {}).update(entries)
            if key not in probs0 and saved is not None and key in saved["probs"]:
                probs0[key], targets0[key] = saved["probs"][key], saved["targets"][key]
    merged_rows = {key: set(r) for key, r in rows.items()}
    origin: Dict[tuple, Dict[int, str]] = {}
    brought: Dict[tuple, Path] = {}
    for result, folder in extra_runs:
        saved = _read_predictions(folder, "--rows-from")
        for key in result["combos"]:
            run_seeds = _combo_seeds(result, key)
            missing = sorted(set(run_seeds) - set(held.get(key, {})))
            if missing:
                raise SystemExit(f"pyro-fa classify: --rows-from {folder} holds seed(s) {missing} of {key}, which "
                                 f"the merged runs do not (they hold {sorted(held.get(key, {}))}).")
            for name, entries in _row_entries(result, key, folder, "--rows-from").items():
                for sd, values in entries.items():
                    if (key, name, sd) in brought:
                        raise SystemExit(f"pyro-fa classify: --rows-from {str(brought[key, name, sd])!r} and "
                                         f"{str(folder)!r} both hold seed {sd} of the row {name!r} of {key}; "
                                         "give one of them.")
                    brought[key, name, sd] = folder
                    rows[key].setdefault(name, {})[sd] = values
                    for f in ROW_ONLY_FIELDS:
                        origin.setdefault((key, name, f), {})[sd] = json.dumps(result["budget"].get(f))
            if saved is not None and key in saved["probs"] and run_seeds and min(run_seeds) == min(held[key]):
                probs0.setdefault(key, {}).update(saved["probs"][key])
                targets0.setdefault(key, saved["targets"][key])  # where the merged runs kept no predictions
    for key, combo in rows.items():
        for name, by_seed in combo.items():
            lack = sorted(set(held[key]) - set(by_seed))
            if lack and name not in merged_rows[key]:
                raise SystemExit(f"pyro-fa classify: the row {name!r} of {key} added by --rows-from lacks seed(s) "
                                 f"{lack}; a new row needs every merged seed, {sorted(held[key])}.")
    b = {**base, **_row_only_values(rows, origin, base)}
    b = {k: tuple(v) if isinstance(v, list) else v for k, v in b.items()}
    b.setdefault("map_select", "nll")  # runs from before the tempered choice of MAP's prior precision
    combos = {key: {**meta[key], "methods": {name: _row(by_seed) for name, by_seed in combo.items()}}
              for key, combo in rows.items()}
    seeds_of = {key: sorted(held[key]) for key in combos}
    seeds = sorted({s for v in seeds_of.values() for s in v})
    checks = rep.bar_checks(combos)
    devices = sorted({d for r, _ in runs + extra_runs for d in r.get("devices", ["cpu"])})
    return {"combos": combos, "bar": checks, "budget": Budget(**b), "seeds": seeds, "seeds_of": seeds_of,
            "probs": probs0, "targets": targets0, "devices": devices}


def _row(by_seed: Dict[int, dict]) -> dict:
    """A row of results.json from its values per seed: lists in order of seed, with the seeds, means and s.e."""
    seeds = sorted(by_seed)
    entries = [by_seed[s] for s in seeds]
    names = [k for k in entries[0]["scores"] if all(k in e["scores"] for e in entries)]
    per_seed = {k: [e["scores"][k] for e in entries] for k in names}
    return {"per_seed": per_seed, "seconds": [e["seconds"] for e in entries], "extra": [e["extra"] for e in entries],
            "seeds": seeds, "mean": {k: mean_se(v)[0] for k, v in per_seed.items()},
            "se": {k: mean_se(v)[1] for k, v in per_seed.items()}}
