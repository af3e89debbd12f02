r"""The three tables of the revrand technical report, with pyro_fa's random-feature linear models.

Steinberg, Tiao, McCalman, Reid & O'Callaghan, *revrand: technical report*, CSIRO Data61: Table 2
(Boston housing), Table 3 (handwritten digits 3 vs 5) and Table 4 (large-scale regression). Ours:
the standard linear model (SLM, :class:`~pyro_fa.linear_model.StandardLinearModel`, exact posterior,
evidence-maximised hyperparameters, float64) and the generalised linear model (GLM,
:class:`~pyro_fa.linear_model.GeneralizedLinearModel`, factor-analysis posterior of rank 10 from
:class:`~pyro_fa.AutoLowRankFactorGuide` and :class:`~pyro_fa.FactorELBO` with 4 vectorised
particles, Adam from rate 0.03 decaying to 0.003, float32), both on random Fourier features of the
RBF kernel (:class:`~pyro_fa.basis.RandomFourierBasis`). Hyperparameters as in
:mod:`pyro_fa.experiments.revrand.models`: random starts scored by the log evidence (SLM) and a
grid of prior precisions scored by the ELBO (GLM), on the training data only; the basis length
scales start at the median distance between training inputs. Each test fold is seen once.

* **Table 2**, Boston housing (506 rows, 13 inputs, the UCI data of ``pyro_fa.datasets``): 5-fold
  cross-validation (``KFold``, shuffled, seeded), inputs and target standardised on each training
  fold; R² and the mean standardised log loss (MSLL, Rasmussen & Williams 2006, eq. 2.34) on each
  held-out fold, mean (s.d.) over folds as the report prints them. SLM: 400 RBF components with one
  length scale per input (ARD) plus a linear basis, 100 random starts, L-BFGS; GLM: 100 ARD
  components plus a linear basis, Gaussian likelihood, 5 000 full-batch SVI steps, prior precision
  from {3, 10, 30}. Peers (scikit-learn, in the same folds): a GP with the report's kernel
  (amplitude·ARD RBF + amplitude·dot product + white noise, amplitudes and length scales started at
  1) fitted by its marginal likelihood (best of 2 optimisations), a random forest of 40 trees, an
  RBF SVR with C and width from a 5-fold grid search on the training fold.
* **Table 3**, digits 3 vs 5. The report used USPS (16×16, 767 training / 773 test images), which is
  not available offline; we use scikit-learn's bundled 8×8 digits (183 threes, 182 fives) with
  stratified 5-fold cross-validation and score the pooled out-of-fold predictions (each image
  predicted once). GLM: Bernoulli likelihood, 800 RBF components (isotropic length scale), 3 000
  full-batch steps, prior precision from {0.01, 0.1, 1}. Peers: logistic regression on the GLM's
  random features at its initial length scale (C by 5-fold CV of the log-loss), an RBF SVC with
  Platt probabilities (C and width by grid search), a GP classifier (Laplace, amplitude·RBF,
  marginal likelihood), a random forest of 40 trees.
* **Table 4**, large-scale regression. The report used SARCOS (44 484 training rows), not available
  offline; we use UCI protein (``protein-tertiary-structure``, standard split 0: 41 157 training and
  4 573 test rows, 9 inputs), so the report's SARCOS numbers are printed for reference only. SMSE
  and MSLL of the GLM with 256, 512, 1 024 and 2 048 ARD RBF components (6 000 SVI steps of
  minibatches of 256, about 37 epochs; prior precision 1, the variance of the standardised target),
  beside the SD row: an exact scikit-learn GP (amplitude·ARD RBF + white noise, marginal likelihood,
  best of 2 optimisations) on one random training subset of each size. The report ran its GLM for
  10⁶ steps of batches of 10.

The bars: on Boston, the SLM's R² ≥ 0.90 and MSLL ≤ −1.5 (the report's SLM), the GLM better than
the report's GLM in both (R² > 0.8411, MSLL < −0.9209); on digits, the GLM's log-loss at most the GP
classifier's; on protein, the GLM's MSLL below the GP subset's of the same size at every size.

``pyro-fa revrand --quick`` runs every table on a small budget (2 folds, few components and steps, a
protein subset of 1 500 / 500 rows) in under 10 seconds on one core; its numbers are not the
report's protocol.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from pyro_fa.experiments._io import OutputFolder, atomic_write_json, atomic_write_text, check_device, int_in_range, \
    positive_int, progress_bar

#: the subcommand's one-line help, which `pyro-fa` reads without importing this module
HELP = ('Steinberg et al., revrand technical report, Tables 2-4: random-feature SLM and GLM (FA posterior) vs '
        "scikit-learn's GPs, SVMs and random forests on Boston, digits 3 vs 5 and UCI protein.")

TABLES = ("2", "3", "4")
#: the UCI datasets a table reads (Table 3 uses scikit-learn's bundled digits)
UCI_NEEDED = {"2": "boston", "4": "protein"}


#: printed under the bars of a run whose budget is not the full one (e.g. ``--quick``)
SMALL_RUN_NOTE = ("(The bars are set for the full run, `pyro-fa revrand`; this run's budget differs (e.g. --quick), "
                  "so its rows only show the checks at work: a \"NOT met\" here says nothing about the bar.)")


@dataclass
class Budget:
    """Sizes and steps of one run (``Budget()`` is the full run, ``Budget.quick()`` the smoke run)."""

    folds: int = 5
    slm_components: int = 400
    slm_starts: int = 100
    slm_iter: int = 100
    glm_components: int = 100
    digits_components: int = 800
    components: Tuple[int, ...] = (256, 512, 1024, 2048)
    steps: int = 5000
    digits_steps: int = 3000
    large_steps: int = 6000
    large_batch: int = 256
    lr: float = 0.03
    rank: int = 10
    particles: int = 4
    priors: Tuple[float, ...] = (3.0, 10.0, 30.0)
    digits_priors: Tuple[float, ...] = (0.01, 0.1, 1.0)
    large_priors: Tuple[float, ...] = (1.0,)
    gp_restarts: int = 1
    gp_maxiter: int = 15000
    sd_subsets: int = 1
    large_rows: Optional[int] = None
    large_test_rows: Optional[int] = None
    n_samples: int = 1000
    glm_dtype: torch.dtype = field(default=torch.float32)

    @classmethod
    def quick(cls) -> "Budget":
        return cls(folds=2, slm_components=50, slm_starts=5, slm_iter=15, glm_components=20, digits_components=50,
                   components=(16, 32), steps=150, digits_steps=150, large_steps=150, large_batch=128, priors=(1.0,),
                   digits_priors=(0.1,), gp_restarts=0, gp_maxiter=20, large_rows=1500, large_test_rows=500,
                   n_samples=200)

    def record(self) -> dict:
        out = asdict(self)
        out["glm_dtype"] = str(self.glm_dtype).replace("torch.", "")
        return out


def add_arguments(parser) -> None:
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES, metavar="N",
                        help="tables of the report to reproduce (default: 2 3 4)")
    parser.add_argument("--folds", type=int_in_range(2, 10), default=None,
                        help="cross-validation folds of Tables 2 and 3 (default 5; quick 2)")
    parser.add_argument("--components", type=positive_int, nargs="+", default=None, metavar="N",
                        help="Table 4: GLM components and GP subset sizes (default 256 512 1024 2048)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="SVI steps of every GLM fit (default 5000, 3000 and 6000 in Tables 2, 3 and 4)")
    parser.add_argument("--data-dir", default=None,
                        help="UCI data folder for Tables 2 (boston) and 4 (protein) (default: $PYRO_FA_DATA, else "
                             "the download cache)")
    parser.add_argument("--device", default="cpu", help="torch device of our models, e.g. cuda (default cpu)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch and BLAS threads (default 1; threads that spin on a loaded machine cost more "
                             "than they give)")


def budget_from_args(args) -> Budget:
    b = Budget.quick() if args.quick else Budget()
    if args.folds is not None:
        b = replace(b, folds=args.folds)
    if args.components is not None:
        b = replace(b, components=tuple(sorted(set(args.components))))
    if args.steps is not None:
        b = replace(b, steps=args.steps, digits_steps=args.steps, large_steps=args.steps)
    return b


def check_data(tables, data_dir=None) -> None:
    """Refuse, in one line and before any work, a run whose tables need UCI data that cannot be found.

    Tables 2 and 4 read UCI boston and protein (:mod:`pyro_fa.datasets`: ``data_dir``, else ``$PYRO_FA_DATA``,
    else the download cache, filled from the network where it can be).

    Raises
    ------
    SystemExit
        Naming ``PYRO_FA_DATA`` / ``--data-dir`` and the tables that need the data.
    """
    from pyro_fa.datasets import uci_n_splits

    need = {t: UCI_NEEDED[t] for t in sorted(tables) if t in UCI_NEEDED}
    for table, name in need.items():
        try:
            uci_n_splits(name, data_dir)
        except (OSError, ValueError) as err:
            which = " and ".join(f"{t} ({n})" for t, n in need.items())
            reason = str(err).split(". ", 1)[0]  # what failed; the rest of the loader's message is the advice below
            raise SystemExit(f"pyro-fa revrand: Table{'s' if len(need) > 1 else ''} {which} need"
                             f"{'' if len(need) > 1 else 's'} the UCI data, and {name} was not found ({reason}). "
                             f"Set PYRO_FA_DATA or pass --data-dir to a folder of the UCI benchmark "
                             "layout (see pyro_fa/data/uci/README.md), or run --tables 3 alone.") from None


def _units(tables, b: Budget) -> int:
    """Fits the progress bar counts: per fold (or size) the GLM's prior grid and each other method."""
    n = 0
    if "2" in tables:
        n += b.folds * (len(b.priors) + 4)
    if "3" in tables:
        n += b.folds * (len(b.digits_priors) + 4)
    if "4" in tables:
        n += len(b.components) * (len(b.large_priors) + b.sd_subsets)
    return n


def run_tables(tables, budget: Budget, seed: int, output_dir, device="cpu", progress: bool = True,
               data_dir=None) -> dict:
    """Run the chosen tables and write ``results.json`` and ``report.md`` to ``output_dir``; returns the results."""
    from tqdm.auto import tqdm

    from pyro_fa.experiments.revrand import report as rep
    from pyro_fa.experiments.revrand import tables as runs

    device = torch.device(device)
    bar = progress_bar(total=_units(tables, budget), desc="revrand", unit="fit", enabled=progress)
    records: Dict[str, dict] = {}
    t0 = time.perf_counter()
    for table in sorted(tables):
        bar.set_description(f"revrand table {table}")
        start = time.perf_counter()
        if table == "2":
            rec = runs.run_boston(budget, seed, device, data_dir, tick=bar.update)
            text = rep.boston_table(rec)
        elif table == "3":
            rec = runs.run_digits(budget, seed, device, tick=bar.update)
            text = rep.digits_table(rec)
        else:
            rec = runs.run_large(budget, seed, device, data_dir, tick=bar.update)
            text = rep.large_table(rec)
        rec["seconds"] = time.perf_counter() - start
        records[table] = rec
        tqdm.write(f"\nTable {table} ({rec['dataset']}, {rec['seconds']:.0f} s):\n{text}")
    bar.close()
    checks = rep.bar_checks(records)
    result = {"budget": budget.record(), "seed": seed, "device": str(device), "tables": records, "bar": checks,
              "seconds": time.perf_counter() - t0}
    write_report(Path(output_dir), result)
    return result


def write_report(out: Path, result: dict) -> None:
    """``results.json`` and ``report.md`` in ``out``, each written atomically."""
    from pyro_fa.experiments.revrand import report as rep

    out.mkdir(parents=True, exist_ok=True)
    tables = result["tables"]
    text = ["# revrand technical report, Tables 2-4, with pyro_fa", "", __doc__.split("\n\n", 1)[1].strip(), "",
            f"Budget: {result['budget']}; seed {result['seed']}; device {result['device']}; "
            f"{result['seconds']:.0f} s in all.", ""]
    titles = {"2": "Table 2: Boston housing ({n[folds]}-fold CV; the report's numbers in their columns)",
              "3": "Table 3: digits 3 vs 5 (scikit-learn 8×8 digits, {n[folds]}-fold CV; the report: USPS)",
              "4": "Table 4: UCI protein, split 0 ({n[train]} training / {n[test]} test rows; the report: SARCOS)"}
    render = {"2": rep.boston_table, "3": rep.digits_table, "4": rep.large_table}
    for key in sorted(tables):
        rec = tables[key]
        text += [f"## {titles[key].format(n=rec['n'])}", "", render[key](rec), "",
                 f"Wall time of the table: {rec['seconds']:.0f} s; the seconds column is per fold (Table 2), "
                 "summed over folds (Table 3) or per fit (Table 4), and includes the GLM's prior grid.", ""]
    text += ["## The bars", "", rep.bar_summary(result["bar"]) if result["bar"] else "(no bar applies)", ""]
    if result["budget"] != Budget().record():
        text += [SMALL_RUN_NOTE, ""]
    atomic_write_text(out / "report.md", "\n".join(text))
    atomic_write_json(out / "results.json", result)


def run(args) -> int:
    device = check_device(args.device, "pyro-fa revrand")
    budget = budget_from_args(args)
    tables = sorted(set(args.tables))
    check_data(tables, args.data_dir)
    with OutputFolder(args.output_dir, "pyro-fa revrand"):
        return _run_locked(args, device, budget, tables)


def _run_locked(args, device, budget: Budget, tables) -> int:
    print(f"pyro-fa revrand: tables {' '.join(tables)}{' (quick)' if args.quick else ''}, device {device}, "
          f"{args.threads} thread(s)")
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(args.threads)
    with threadpool_limits(args.threads):
        result = run_tables(tables, budget, args.seed, args.output_dir, device=device,
                            progress=not args.no_progress, data_dir=args.data_dir)
    from pyro_fa.experiments.revrand import report as rep

    print()
    print(rep.bar_summary(result["bar"]) if result["bar"] else "(no bar applies)")
    if result["bar"] and result["budget"] != Budget().record():
        print(f"\n{SMALL_RUN_NOTE}")
    out = Path(args.output_dir)
    print(f"\n{result['seconds']:.0f} s; wrote {out / 'report.md'}, {out / 'results.json'}")
    return 0
