r"""The UCI Bayesian-neural-network regression benchmark on the standard splits.

Protocol (Hernández-Lobato & Adams 2015; the splits of Gal & Ghahramani 2016):
for each dataset, each of its 20 standard 90 % / 10 % splits (5 for protein), a
ReLU network with one or two hidden layers of 50 units (100 for protein, the
benchmark's ``n_hidden.txt``) and a Gaussian likelihood with a learned noise
scale; inputs and target standardised on the training part; test RMSE and test
log-likelihood of the Bayesian model average in the original units of y, mean
± standard error over the splits.

Methods, all run by the same batched trainer (:mod:`pyro_fa.nn.batched`: R fits of
one network as one batch of tensors, checked against the Pyro classes in the tests),
with the same search budget:

* ``vifa`` / ``vippca``: :class:`~pyro_fa.AutoLowRankFactorGuide` (diagonal /
  isotropic noise, rank 10, ``init_scale`` 0.01) with :class:`~pyro_fa.FactorELBO`,
  under a Gaussian prior (precision α) or a Laplace prior of the same variance;
* ``autonormal``, ``lowrank``: Pyro's ``AutoNormal`` and
  ``AutoLowRankMultivariateNormal`` (rank 10) with ``Trace_ELBO``, Gaussian
  prior, ``init_scale`` 0.01, means started as ``nn.Linear`` starts its weights;
* ``swag-em``, ``swag-sga``, ``swag``, ``multiswag``: a MAP fit (AutoDelta,
  Gaussian prior), then minibatch SGD whose iterates feed :class:`~pyro_fa.SWAG`
  (online EM, online SGA, classic SWAG; rank 10); MultiSWAG mixes 5 SWAG-EM
  posteriors trained from different initialisations;
* ``factor-ivon``: the 1×50 network trained by :class:`~pyro_fa.optim.FactorIVON`'s update (rank 10), a phase's
  fits (grid x tuning splits, then the final splits) as one :class:`~pyro_fa.optim.BatchedFactorIVON` batch, the
  noise scale learned by Adam, prior precision x rate x initial Hessian x Hessian decay searched as the others'
  search theirs (halving the settings at 1/4 and 1/2 of the steps), a diverged final fit run again at half the rate
  (:mod:`pyro_fa.experiments.uci.factor_ivon`);
* ``ivon``: the same column with the optimizer at rank 0, IVON's update (the peer for the low-rank part);
* ``mcdropout``: MC dropout as Gal & Ghahramani (2016) ran it on UCI (dropout on the input and hidden layer,
  rate x model precision searched, weight decay from the prior length-scale; all fits of a stage as one batch;
  :mod:`pyro_fa.experiments.uci.mc_dropout`).

Hyperparameter search (never on the test split): the training part of each of
the first few splits is cut at random into 80 % sub-training and 20 % validation
parts (re-standardised on the sub-training part); as many splits as it takes for
the validation parts to hold 300 points together, at most 5 (``--tune-splits``
fixes the number): Yacht 5, Boston 4, Energy 3, Concrete and Wine 2, Kin8nm,
Naval, Power and Protein 1. The chosen values are reused on every split, so some
test points of the later splits lie in the tuning splits' training parts (the
reuse of a few splits' search that keeps the run within two hours on 2 cores);
no split's own test part is ever seen before its one evaluation. Every
configuration of the grid — prior precision α ∈ {0.01, 0.1, 1, 10}, Adam learning
rate ∈ {0.003, 0.01} for one hidden layer and 0.003 for two; for VIPPCA, whose
isotropic σ is a hyperparameter in Jiang (2023), learning rate 0.003 and σ ∈ {0.01,
0.03} instead (``Budget(ppca_scales=(None, 0.01, 0.03))`` adds a learned σ) — is
trained on every tuning split, with Adam's learning rate following a half cosine
from its initial value to zero over the 10 000 steps, and the validation
log-likelihood (32 posterior draws) is recorded every
``steps / 20`` steps (the search stops early once its best checkpoint lies in
the first third of the steps run, after at least a quarter of them); the
configuration and step count with the best mean validation log-likelihood are
chosen (for SWAG: the MAP fit's, then the SGD
learning rate of the collection phase ∈ {0.001, 0.003, 0.01} by SWAG-EM's validation
log-likelihood). Then every split is trained on its whole training part with the
chosen values, for the chosen number of steps on the same rate schedule (the
schedule depends on the step alone, so a fit stopped at the chosen step has
followed the rates the search saw), and evaluated once on its test part (100
posterior draws). The
noise scale is learned in every method. Full-batch training for datasets of up
to 1 000 training points, batches of 500 above (the likelihood scaled by N / 500).
SWAG's collection phase: about one collection per epoch, 100 in all, of SGD with
batches of 32 on the squared error plus weight decay (the loss in units of the
noise variance, which stays at its MAP value).

``pyro-fa uci --quick`` runs yacht, 2 splits, five methods and a smaller grid
(one tuning split, 1 500 steps) in about 15 seconds on one core.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from pyro_fa.datasets import UCI_DATASETS, list_uci, load_uci, uci_n_splits
from pyro_fa.experiments._io import OutputFolder, atomic_write_json, check_device, mean_se, pay_lazy_imports, \
    positive_int, progress_bar
from pyro_fa.experiments.uci.protocol import (DEFAULT_METHODS, METHODS, QUICK_METHODS, SWAG_METHODS, Budget,
                                               Method, SplitData, evaluate, final_data, heldout_ll, n_tune_splits,
                                               run_vi, train, tuning_data)
from pyro_fa.experiments.uci.fidelity import (HMC_NAME, fidelity_tables, find_references, reference_key,
                                               score_reference)
from pyro_fa.experiments.uci.swag_family import run_swag
from pyro_fa.experiments.uci.factor_ivon import run_factor_ivon, run_ivon
from pyro_fa.experiments.uci.mc_dropout import run_mc_dropout
from pyro_fa.experiments.uci.results import _legacy_path, _run_key, _same_run, _unit_key, _unit_path, _units, read_unit

#: the subcommand's one-line help, which `pyro-fa` reads without importing this module
HELP = ("The UCI Bayesian-neural-network benchmark: VIFA / VIPPCA vs Pyro's guides and SWAG on the standard "
        'splits.')

__all__ = ["Budget", "DEFAULT_METHODS", "METHODS", "Method", "QUICK_METHODS", "SWAG_METHODS", "SplitData",
           "add_arguments", "evaluate", "final_data", "heldout_ll", "keep_freed_memory", "n_tune_splits", "read_unit",
           "report", "run", "run_swag", "run_unit", "run_vi", "train", "tuning_data"]

#: the methods not trained by :func:`run_vi` (BatchedVI): ``Method.family`` -> the unit's runner
RUNNERS = {"factor-ivon": run_factor_ivon, "ivon": run_ivon, "mcdropout": run_mc_dropout}

# ----------------------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    parser.add_argument("--data-dir", default=None,
                        help="UCI data folder (default: $PYRO_FA_DATA, else the download cache; yacht is bundled)")
    parser.add_argument("--datasets", nargs="+", default=None, choices=list_uci(), metavar="NAME",
                        help=f"datasets to run (default: all nine; quick: yacht); one of {', '.join(list_uci())}")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), metavar="METHOD",
                        help=f"methods to run (default: all; quick: {' '.join(QUICK_METHODS)}); "
                             f"one of {', '.join(METHODS)}")
    parser.add_argument("--splits", type=int, default=None,
                        help="use the first N standard splits (default: all, 20 or 5; quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="most Adam steps of a fit (default 10000; quick 1500)")
    parser.add_argument("--tune-splits", type=int, default=None,
                        help="splits whose training parts carry the search (default: enough for 300 validation "
                             "points, at most 5; quick 1)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="datasets run in parallel processes (default 1)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument("--report-only", action="store_true",
                        help="only rebuild the table and figures from the result files of earlier runs")
    parser.add_argument("--hmc-reference", default=None, metavar="DIR",
                        help="score every 1x50 method's test predictive against the HMC references in DIR "
                             "(<dataset>-split<s>.pt of pyro-fa hmc-reference) on the splits that have one")
    parser.add_argument("--fresh", action="store_true",
                        help="recompute units whose result file exists (default: reuse those of the same budget, "
                             "seed, splits and, for the SWAG family, methods; unreadable ones are trained again)")


def _budget(args) -> Budget:
    b = Budget.quick() if args.quick else Budget()
    if args.steps is not None:
        if args.steps < b.checkpoints:
            raise SystemExit(f"pyro-fa uci: --steps must be >= {b.checkpoints}, got {args.steps}.")
        b.steps = args.steps
    if args.tune_splits is not None:
        if args.tune_splits < 1:
            raise SystemExit(f"pyro-fa uci: --tune-splits must be >= 1, got {args.tune_splits}.")
        b.tune_splits = args.tune_splits
    return b


def _load_splits(name: str, n: Optional[int], data_dir, device) -> list:
    try:
        total = uci_n_splits(name, data_dir)
        count = total if n is None else n
        if not 1 <= count <= total:
            raise SystemExit(f"pyro-fa uci: --splits must be in 1..{total} for {name!r}, got {n}.")
        return [load_uci(name, s, data_dir=data_dir, dtype=torch.float32, device=device) for s in range(count)]
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"pyro-fa uci: {err}") from err


def run_unit(dataset: str, unit: str, method_names: Sequence[str], budget: Budget, splits_n: Optional[int], data_dir,
             device: str, seed: int, threads: int, out_dir: str, progress: bool = True,
             hmc_reference: Optional[str] = None) -> dict:
    """One VI method, or the SWAG family, on one dataset; writes ``<out_dir>/units/<dataset>__<unit>__<key>.json``
    (see :func:`_unit_path`). With ``hmc_reference`` (a folder), the splits that have a reference there are
    scored against it (:mod:`pyro_fa.experiments.uci.fidelity`) into the record's ``fidelity``."""
    from dataclasses import asdict

    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    keep_freed_memory()
    splits = _load_splits(dataset, splits_n, data_dir, device)
    if budget.tune_splits is not None and budget.tune_splits > len(splits):
        raise SystemExit(f"pyro-fa uci: --tune-splits must be at most the {len(splits)} splits run, "
                         f"got {budget.tune_splits}.")
    references = _references(hmc_reference, dataset, splits)
    fidelity: dict = {}
    pay_lazy_imports()
    bar = progress_bar(desc=f"{dataset}: {unit}", unit="step", enabled=progress, leave=False)
    t0, c0 = time.perf_counter(), time.process_time()
    if unit == "swag-family":
        results = run_swag([METHODS[m] for m in method_names if METHODS[m].swag is not None], splits, budget, seed,
                           bar.update, references, fidelity)
    else:
        runner = RUNNERS.get(METHODS[unit].family, run_vi)
        results = {unit: runner(METHODS[unit], splits, budget, seed, bar.update, references, fidelity)}
    bar.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for r in results.values():
        r["seconds"] = wall / len(results)
    first = next(iter(results.values()))
    ll, rmse = mean_se(first["ll"]), mean_se(first["rmse"])
    tqdm.write(f"{dataset:>9} {unit:<22} test LL {ll[0]:7.3f} ± {ll[1]:.3f}   RMSE {rmse[0]:7.3f} ± {rmse[1]:.3f}"
               f"   {wall:6.0f} s")
    key = _unit_key(_run_key(budget, splits_n, seed), dataset, unit, method_names, reference_key(references))
    record = {"dataset": dataset, "unit": unit, "key": key, "n_splits": len(splits), "budget": asdict(budget),
              "seed": seed, "device": str(device), "threads": threads, "wall_seconds": wall, "cpu_seconds": cpu,
              "methods": results}
    if references:
        fidelity[HMC_NAME] = score_reference(final_data(splits), splits, references, seed, budget.test_samples)
        record["fidelity"] = fidelity
    atomic_write_json(_unit_path(out_dir, key), record)
    return record


def _references(directory, dataset: str, splits) -> dict:
    """The HMC references of ``directory`` for these splits (none without a folder); SystemExit on a mismatch."""
    if directory is None:
        return {}
    try:
        return find_references(directory, dataset, splits)
    except ValueError as err:
        raise SystemExit(str(err)) from err


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep freed blocks of up to 32 MiB for reuse instead of returning them to the system.

    Each training step allocates and frees tensors of a few MiB (a 2×50 network's D × K factors of 40
    replicas are 4.7 MiB). By default glibc maps such blocks afresh and unmaps them on free, so every step
    pays the page faults of first touching them again; keeping them halves the cost of a fresh
    element-wise op on one core. The numbers computed are the same. Returns whether the settings took
    (False off glibc, e.g. on macOS, where nothing is changed).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def _worker(kwargs):
    run_unit(**kwargs)
    return kwargs["dataset"], kwargs["unit"]


def _exit_with_parent(parent_pid: int, every: float = 1.0) -> None:
    """Pool initializer: the worker exits as soon as the ``pyro-fa uci`` process that started it is gone.

    A pool's workers outlive a parent that is killed (``kill``, an out-of-memory kill, a
    closed session) and would go on training, and writing unit files, for hours.
    """
    import threading

    def watch():
        while True:
            time.sleep(every)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _amount(seconds: float, prefix: str = "") -> str:
    """A duration as the report prints it: hours to two decimals from six minutes on, whole seconds below
    (a quick run's 0.004 hours would print as 0.00); ``prefix`` names the kind, e.g. "CPU-"."""
    return f"{seconds / 3600:.2f} {prefix}hours" if seconds >= 360 else f"{seconds:.0f} {prefix}seconds"


def report(out_dir: str, budget: Budget, names: Sequence[str], methods: Optional[Sequence[str]] = None,
           splits_n: Optional[int] = None, seed: int = 0, data_dir=None, hmc_keys: Optional[dict] = None) -> dict:
    """Aggregate the unit files of this budget, seed and splits: results.json, table.md, ll.png, rmse.png.

    Unreadable or stray ``*.json`` files in ``units/`` are ignored with a warning. Where several SWAG-family
    files of the run match (runs with other ``--methods``), the one of ``methods`` wins, and the one scored
    against ``hmc_keys`` (dataset -> :func:`~pyro_fa.experiments.uci.fidelity.reference_key`) wins over one
    that was not. Scores against HMC references go to the tables' fidelity column and section.
    """
    from dataclasses import asdict

    from pyro_fa.experiments.uci import report as rep
    from pyro_fa.experiments._io import atomic_savefig, atomic_write_text

    out = Path(out_dir)
    run_key = _run_key(budget, splits_n, seed)
    hmc_keys = hmc_keys or {}
    wanted = [_unit_key(run_key, d, u, methods, hmc_keys.get(d)) for d, u in _units(names, methods or [])]
    records = []
    for path in sorted((out / "units").glob("*.json")):
        record = read_unit(path, data_dir)
        if record is None or record["dataset"] not in names:
            continue
        if {k: record["key"].get(k) for k in run_key} != run_key:
            continue
        records.append((record["key"] in wanted, path.name, record))
    results, meta, fidelity = {}, {}, {}
    for is_wanted, _, record in sorted(records, key=lambda r: (not r[0], r[1])):
        got = results.setdefault(record["dataset"], {})
        new = {k: v for k, v in record["methods"].items() if is_wanted or k not in got}
        if not new:
            continue
        got.update(new)
        scored = fidelity.setdefault(record["dataset"], {})
        for name, per_split in record.get("fidelity", {}).items():  # the columns taken, and MAP's, HMC's rows
            if name in new or name not in record["methods"]:
                scored.setdefault(name, per_split)
        m = meta.setdefault(record["dataset"], {"n_splits": record["n_splits"], "cpu_seconds": 0.0,
                                                "cuda_wall_seconds": 0.0, "devices": []})
        # a cell trained on a GPU spends its process time mostly waiting for kernels: count its wall time apart
        if str(record["device"]).startswith("cuda"):
            m["cuda_wall_seconds"] += record["wall_seconds"]
        else:
            m["cpu_seconds"] += record["cpu_seconds"]
        if record["device"] not in m["devices"]:
            m["devices"].append(record["device"])
    order = {n: i for i, n in enumerate(METHODS)}
    results = {ds: dict(sorted(r.items(), key=lambda kv: order.get(kv[0], 99))) for ds, r in results.items()}
    if not results:
        raise SystemExit(f"pyro-fa uci: no results of this budget in {out / 'units'} (the same --quick, "
                         "--steps, --tune-splits, --splits and --seed); run without --report-only first.")
    labels = {n: m.label for n, m in METHODS.items()}
    checks = rep.bar_checks(results)
    text = ["# UCI regression benchmark", "", __doc__.split("\n\n", 1)[1].strip(), "",
            "## Test log-likelihood (mean ± s.e. over splits, per point, original units; higher is better)", "",
            rep.summary_table(results, "ll"), "",
            "## Test RMSE (original units; lower is better)", "", rep.summary_table(results, "rmse"), "",
            "## Every method, with Jiang (2023)'s number for the same method and the time per split", "",
            rep.results_table(results, labels, fidelity), "", "## Published anchors (1×50)", "",
            rep.published_table(), ""]
    if any(fidelity.values()):
        text += ["## Fidelity to HMC (`--hmc-reference`)", "", fidelity_tables(fidelity, labels), ""]
    summary = rep.bar_summary(checks)
    if summary and budget != Budget():
        summary += ("\n\n(The bar is set for the full run, `pyro-fa uci`; this run's budget is smaller, so these "
                    "rows only show the checks.)")
    if summary:
        text += ["## The bar", "", summary, ""]
    atomic_write_text(out / "table.md", "\n".join(text))
    atomic_write_json(out / "results.json", {"budget": asdict(budget), "datasets": meta, "results": results,
                                             "fidelity": fidelity,
                                             "bar": checks, "published": rep.PUBLISHED, "paper": rep.PAPER})
    import matplotlib.pyplot as plt

    for metric in ("ll", "rmse"):
        fig = rep.figure(results, labels, metric)
        atomic_savefig(fig, out / f"{metric}.png", dpi=110)
        plt.close(fig)
    print()
    print(rep.results_table(results, labels, fidelity))
    if any(fidelity.values()):
        print()
        print(fidelity_tables(fidelity, labels))
    print()
    print(rep.summary_table(results, "ll"))
    if summary:
        print()
        print(summary)
    cpu = sum(m["cpu_seconds"] for m in meta.values())
    gpu = sum(m["cuda_wall_seconds"] for m in meta.values())
    print(f"\ncompute: {_amount(cpu, 'CPU-')} in the cells trained on the CPU (single-threaded units: about "
          f"{_amount(cpu / 2)} on 2 cores)" + (f"; {_amount(gpu)} of wall time in the cells trained on CUDA "
                                               "(several at once)" if gpu else ""))
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'll.png'}, {out / 'rmse.png'}")
    return {"results": results, "bar": checks}


def run(args) -> int:
    budget = _budget(args)
    names = args.datasets or (["yacht"] if args.quick else list(DATASET_ORDER))
    methods = args.methods or list(QUICK_METHODS if args.quick else DEFAULT_METHODS)
    splits = args.splits if args.splits is not None else (2 if args.quick else None)
    check_device(args.device, "pyro-fa uci")
    out = Path(args.output_dir)
    if args.report_only and not (out / "units").is_dir():
        raise SystemExit(f"pyro-fa uci: no results of this budget in {out / 'units'}; run without "
                         "--report-only first.")
    with OutputFolder(out, "pyro-fa uci", subfolders=("units",)):
        return _run_locked(args, budget, names, methods, splits)


def _run_locked(args, budget: Budget, names: List[str], methods: List[str], splits: Optional[int]) -> int:
    where = (f"{budget.tune_splits} split(s)" if budget.tune_splits else
             f"the first splits that hold {budget.val_points} validation points (at most {budget.max_tune_splits})")
    print(f"pyro-fa uci: {len(names)} dataset(s) x {len(methods)} method(s); {'quick' if args.quick else 'full'} "
          f"budget: up to {budget.steps} steps, search on {where}, "
          f"precision {list(budget.precisions)}, lr {list(budget.lrs)} (2x50: {list(budget.deep_lrs)}; VIPPCA: sigma "
          f"{['learned' if v is None else v for v in budget.ppca_scales]} at lr {budget.ppca_lr})")
    hmc = getattr(args, "hmc_reference", None)
    # every reference checked against its split's test set before any training
    hmc_keys = {d: reference_key(_references(hmc, d, _load_splits(d, splits, args.data_dir, "cpu")))
                for d in dict.fromkeys(names)} if hmc is not None else {}
    if not args.report_only:
        todo = []
        run_key = _run_key(budget, splits, args.seed)
        for dataset, unit in _units(names, methods):
            key = _unit_key(run_key, dataset, unit, methods, hmc_keys.get(dataset))
            done = [p for p in (_unit_path(args.output_dir, key), _legacy_path(args.output_dir, dataset, unit))
                    if not args.fresh and p.is_file() and _same_run(read_unit(p, args.data_dir), key)]
            if done:
                print(f"{dataset:>9} {unit:<22} done before: {done[0]}")
                continue
            todo.append(dict(dataset=dataset, unit=unit, method_names=methods, budget=budget, splits_n=splits,
                             data_dir=args.data_dir, device=args.device, seed=args.seed, threads=args.threads,
                             out_dir=args.output_dir, progress=not args.no_progress and args.jobs == 1,
                             hmc_reference=hmc))
        if args.jobs == 1:
            for kw in todo:
                run_unit(**kw)
        elif todo:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"), initializer=_exit_with_parent,
                                     initargs=(os.getpid(),)) as pool:
                futures = [pool.submit(_worker, kw) for kw in todo]
                bar = progress_bar(total=len(futures), desc="units", enabled=not args.no_progress)
                for f in as_completed(futures):
                    f.result()
                    bar.update()
                bar.close()
    report(args.output_dir, budget, names, methods, splits, args.seed, args.data_dir, hmc_keys)
    return 0


#: the order datasets are run in: the costly ones first, so that parallel jobs end together
DATASET_ORDER = ("protein", "wine", "concrete", "naval", "power", "kin8nm", "energy", "boston", "yacht")
assert sorted(DATASET_ORDER) == list_uci() == sorted(UCI_DATASETS)
