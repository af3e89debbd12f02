r"""The result folder of ``pyro-fa uci``: one file per unit (dataset × VI method, or dataset × SWAG family).

A unit's file is named ``<dataset>__<unit>__<hash of its key>.json``; the key holds
everything its results depend on (:data:`UNIT_PROTOCOL`, the budget, seed, splits, dataset
and, for the SWAG family, its methods), so runs of other budgets share the folder. Files
written before units were keyed (``<dataset>__<unit>.json``, e.g. the recorded units of the online documentation's *UCI* page) get
their key from their content. Unreadable or stray files are ignored with a warning. The folder itself
(checked before any training, locked against a second run, cleared of a killed run's ``.part`` files) is
:class:`pyro_fa.experiments._io.OutputFolder`, as for every ``pyro-fa`` subcommand.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from pyro_fa.datasets import uci_n_splits
from pyro_fa.experiments._io import read_record, unit_path
from pyro_fa.experiments.uci.protocol import METHODS, Budget


def _units(names: Sequence[str], method_names: Sequence[str]) -> List[Tuple[str, str]]:
    """(dataset, unit) pairs in the order of ``names``; a unit is a VI method or "swag-family"."""
    vi = [m for m in method_names if METHODS[m].swag is None]
    swag = [m for m in method_names if METHODS[m].swag is not None]
    units = vi + (["swag-family"] if swag else [])
    return [(d, u) for d in dict.fromkeys(names) for u in units]


#: bumped whenever a change to the protocol changes what a unit computes: older unit files are then not reused.
#: 1: the protocol of the unit files without a ``key`` (named ``<dataset>__<unit>.json``), still read.
UNIT_PROTOCOL = 1
#: how the SWAG family's scales are chosen (:func:`pyro_fa.predictive.select_scale`'s default rule): part of its key
SWAG_SCALE_SELECTION = "gated (paired), the mean a candidate; MultiSWAG on its own mixtures"
#: unit -> how its fits are run, part of its key where it changed since units were keyed (older files not reused)
_FACTOR_IVON_REVISION = ("batched; the search stops early and halves its settings at 1/4 and 1/2 of the steps; prior "
                         "precision searched, grid 0.1-0.4 x 1-100 x Hessian decay 0.99999, 0.9995; finite blow-ups "
                         "frozen, diverged final fits run again at half the rate (3 times at most), then recorded")
UNIT_REVISIONS = {"factor-ivon-1x50": _FACTOR_IVON_REVISION, "ivon-1x50": _FACTOR_IVON_REVISION}
#: what every unit file holds (a file without them is not a unit, and is ignored with a warning); files
#: written since units are keyed also hold ``key`` (see :func:`_unit_key`)
_UNIT_FIELDS = {"dataset": str, "unit": str, "n_splits": int, "budget": dict, "seed": int, "device": str,
                "wall_seconds": (int, float), "cpu_seconds": (int, float), "methods": dict}
#: what a unit file may hold: ``key`` (since units are keyed), ``fidelity`` (scored against HMC references)
_OPTIONAL_FIELDS = {"key": dict, "fidelity": dict}


def _run_key(budget: Budget, splits_n: Optional[int], seed: int) -> dict:
    """What determines a unit's results besides its dataset and methods (JSON-normalised)."""
    import json
    from dataclasses import asdict

    return json.loads(json.dumps({"protocol": UNIT_PROTOCOL, "budget": asdict(budget), "seed": seed,
                                  "splits": splits_n}))


def _unit_key(run_key: dict, dataset: str, unit: str, method_names: Sequence[str],
              hmc_reference: Optional[dict] = None) -> dict:
    """Everything a unit's results depend on: the run's key, the dataset and the unit's methods (the SWAG
    family's columns share their fits, so its set of methods is part of its key; its scales are chosen on
    validation by :data:`SWAG_SCALE_SELECTION`, so SWAG units from before that choice are not reused), and the
    HMC references it is scored against where there are any (split -> file digest,
    :func:`pyro_fa.experiments.uci.fidelity.reference_key`; a unit without them keeps its key)."""
    methods = sorted(m for m in method_names if METHODS[m].swag is not None) if unit == "swag-family" else [unit]
    key = {**run_key, "dataset": dataset, "unit": unit, "methods": methods}
    if hmc_reference:
        key["hmc_reference"] = dict(hmc_reference)
    if unit in UNIT_REVISIONS:
        key["revision"] = UNIT_REVISIONS[unit]
    return {**key, "scale_selection": SWAG_SCALE_SELECTION} if unit == "swag-family" else key


def _unit_path(out_dir, key: dict) -> Path:
    """``<out_dir>/units/<dataset>__<unit>__<hash of the key>.json``: runs of other budgets, seeds, splits or
    SWAG method sets keep their own files in the same folder (:func:`pyro_fa.experiments._io.unit_path`)."""
    return unit_path(out_dir, key, f"{key['dataset']}__{key['unit']}")


def _legacy_path(out_dir, dataset: str, unit: str) -> Path:
    """Where unit files were written before their names carried their key."""
    return Path(out_dir) / "units" / f"{dataset}__{unit}.json"


def _legacy_key(record: dict, data_dir=None) -> dict:
    """The key of a unit file written before units were keyed (protocol 1): its splits are "all" (None) when
    it holds every standard split of its dataset, or when that count cannot be read here."""
    import json

    splits: Optional[int] = record["n_splits"]
    try:
        if uci_n_splits(record["dataset"], data_dir) == splits:
            splits = None
    except (OSError, ValueError, KeyError):
        splits = None
    methods = sorted(record["methods"]) if record["unit"] == "swag-family" else [record["unit"]]
    return json.loads(json.dumps({"protocol": 1, "budget": record["budget"], "seed": record["seed"],
                                  "splits": splits, "dataset": record["dataset"], "unit": record["unit"],
                                  "methods": methods}))


def read_unit(path, data_dir=None) -> Optional[dict]:
    """The record of a unit file, or None (with a warning naming the file) when it is not a readable unit
    file: empty, truncated, not JSON, not UTF-8, or a JSON file of another kind. A file written before
    units were keyed gets its key from its content (:func:`_legacy_key`)."""
    record = read_record(path, _UNIT_FIELDS, "pyro-fa uci", "unit file",
                         "its unit, if this run asks for it, is trained again.", optional=_OPTIONAL_FIELDS)
    if record is not None and "key" not in record:
        record["key"] = _legacy_key(record, data_dir)
    return record


def _same_run(record: Optional[dict], key: dict) -> bool:
    return record is not None and record.get("key") == key
