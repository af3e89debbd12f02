r"""The result folder of ``pyro-fa classify``: one file per unit (dataset × network × seed), and the refusal to
replace another run's results.

The methods of one seed share MAP's prior-precision grid, the SWAG trajectory and VIFA's learning rate, so a
unit is one dataset × network × seed with every method of the run. Its file,
``units/<dataset>-<network>__seed<seed>__<hash of its key>.json`` (:func:`pyro_fa.experiments._io.unit_path`,
as ``pyro-fa uci`` names its units), is written as soon as the seed is done; the key holds everything its
results depend on (:data:`UNIT_PROTOCOL`, the budget, methods, seed, subset, device and a reused prior
precision). A run that finds the file of a unit it needs, with its key, reuses it: an interrupted run (Ctrl-C,
a crash) loses only the seed in progress. The first seed's predictive probabilities (for the figures and
``predictions.pt``) go beside its unit, in ``<unit>.pt``.

A run refuses a folder whose ``results.json`` another run wrote (another budget or methods, fewer seeds, or
merged folders): its files would be replaced. The same run again, or one over more seeds or datasets, goes on
(reusing the units). ``results.json`` records what made it (``run``).

Every row of a unit records, in its ``extra``, the CPU kernels it was computed with (:func:`cpu_kernels`), and
``results.json`` lists those of all its rows (``kernels``, :func:`kernels_of`). On the CPU a seed's numbers are
reproducible bit for bit under the same code, torch and kernels, but the kernels are chosen per machine: ATen's
vectorised operations use the widest instruction set the CPU has (AVX-512 or AVX2), and so do oneDNN's
convolutions, and the sums they make are grouped differently. On MNIST-1D a change in the last bit of one
training input, or of one sum, grows over the 150 epochs of Adam into a different network, so a table computed
on a machine with AVX2 kernels is reproduced on one with AVX-512 only under the same kernels:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import List, Optional

import torch

from pyro_fa._files import atomic_write_bytes
from pyro_fa.experiments._io import atomic_write_json, read_record, unit_path

#: bumped whenever a change to the methods changes what a unit computes: older unit files are then not reused
UNIT_PROTOCOL = 1
#: what every unit file holds
_UNIT_FIELDS = {"key": dict, "record": dict, "rows": dict}
#: the environment variables that cap oneDNN's instruction set (the convolutions' kernels), the newer name first
_ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: :func:`kernels_of` for a row written before the rows recorded their kernels
NOT_RECORDED = "not recorded"


def cpu_kernels() -> str:
    """The CPU kernels this process computes with: torch's version, ATen's instruction set and oneDNN's cap.

    ATen's set is :func:`torch.backends.cpu.get_cpu_capability` (the CPU's widest unless
    ``ATEN_CPU_CAPABILITY`` lowers it before torch loads); oneDNN (the convolutions) uses the CPU's widest
    unless ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``) caps it.

    Returns
    -------
    str
        ``"torch <version>, ATen <set>, <oneDNN's variable>=<value>"``, or ``"..., ONEDNN_MAX_CPU_ISA unset"``.

    Examples
    --------
    >>> cpu_kernels().startswith("torch ")
    True
    """
    cap = next((f"{v}={os.environ[v]}" for v in _ONEDNN_ISA_VARIABLES if os.environ.get(v)),
               f"{_ONEDNN_ISA_VARIABLES[0]} unset")
    return f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, {cap}"


def kernels_of(combos: dict) -> List[str]:
    """The kernels (:func:`cpu_kernels`) that the rows of ``combos`` record per seed in their ``extra``.

    Parameters
    ----------
    combos : dict
        Dataset × network -> its combo, as in ``results.json`` (rows under ``"methods"``).

    Returns
    -------
    list of str
        The distinct values, sorted; :data:`NOT_RECORDED` among them where a seed of a row records none.
    """
    return sorted({e.get("kernels", NOT_RECORDED) if isinstance(e, dict) else NOT_RECORDED
                   for combo in combos.values() for row in combo["methods"].values() for e in row.get("extra", [])})


def unit_key(run: dict, dataset: str, network: str, seed: int) -> dict:
    """Everything the unit of ``dataset`` × ``network`` × ``seed`` depends on: the run's key (:func:`run_key`,
    without its seeds and datasets) and the unit's own."""
    shared = {k: v for k, v in run.items() if k not in ("combos", "seeds", "prior_precisions")}
    prior = (run.get("prior_precisions") or {}).get(f"{dataset}-{network}", {}).get(str(seed))
    return json.loads(json.dumps({"protocol": UNIT_PROTOCOL, **shared, "dataset": dataset, "network": network,
                                  "seed": seed, "prior_precision": prior}))


def run_key(budget: dict, combos, methods, seeds, subset, device, prior_precisions) -> dict:
    """What a training run is (JSON-normalised; its methods in any order run alike): recorded in its
    ``results.json`` as ``run``."""
    return json.loads(json.dumps({"budget": budget, "combos": [list(c) for c in combos], "methods": sorted(methods),
                                  "seeds": list(seeds), "subset": subset, "device": str(device),
                                  "prior_precisions": prior_precisions}))


def path_of(out_dir, key: dict) -> Path:
    return unit_path(out_dir, key, f"{key['dataset']}-{key['network']}__seed{key['seed']}")


def read_done(out_dir, key: dict, with_probs: bool) -> Optional[dict]:
    """The unit of ``key`` written by an earlier run into ``out_dir``, or None when it is not there (or is
    unreadable, with a warning, or lacks the probabilities ``with_probs`` asks for): it is computed again."""
    path = path_of(out_dir, key)
    if not path.is_file():
        return None
    unit = read_record(path, _UNIT_FIELDS, "pyro-fa classify", "unit file",
                       "its seed, if this run asks for it, is trained again.")
    if unit is None or unit["key"] != key:
        return None
    if with_probs:
        try:
            unit["probs"] = torch.load(path.with_suffix(".pt"))
        except Exception:  # missing or unreadable: the unit is computed again
            return None
    return unit


def write_unit(out_dir, key: dict, record: dict, rows: dict, probs=None) -> Path:
    """Write one unit (its probabilities first, so that a unit file always has them where it needs them)."""
    path = path_of(out_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if probs is not None:
        buffer = io.BytesIO()
        torch.save(probs, buffer)
        atomic_write_bytes(path.with_suffix(".pt"), buffer.getvalue())
    atomic_write_json(path, {"key": key, "record": record, "rows": rows})
    return path


def _extends(old, new) -> bool:
    """Whether the run ``new`` reports everything ``old`` did: the same run, or a training run of the same
    budget, methods, subset and device over more seeds or datasets (whose units it reuses)."""
    if old == new:
        return True
    if not (isinstance(old, dict) and isinstance(new, dict) and "budget" in old and "budget" in new):
        return False
    same = ("budget", "methods", "subset", "device")
    if any(old.get(k) != new.get(k) for k in same) or not set(old["seeds"]) <= set(new["seeds"]):
        return False
    if not all(c in new["combos"] for c in old["combos"]):
        return False
    old_prior, new_prior = old.get("prior_precisions"), new.get("prior_precisions")
    if (old_prior is None) != (new_prior is None):
        return False
    return old_prior is None or all(new_prior.get(k, {}).get(s) == v for k, by_seed in old_prior.items()
                                    for s, v in by_seed.items())


def refuse_to_replace(out_dir, run: dict, flag: str = "--output-dir") -> None:
    """Refuse ``out_dir`` when it holds the ``results.json`` of another run than ``run`` (which would replace it).

    Raises
    ------
    SystemExit
        Naming the folder and what made its results.
    """
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        return
    try:
        held = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        held = None
    if isinstance(held, dict) and _extends(held.get("run"), json.loads(json.dumps(run))):
        return  # the same run again, or with more seeds or datasets: its results are kept in the new ones
    raise SystemExit(f"pyro-fa classify: {flag} {str(out_dir)!r} already holds the results of another run ({path}), "
                     "which this run would replace; choose another --output-dir, or remove its results.json to "
                     "replace them.")
