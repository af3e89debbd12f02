r"""Linear-regression ensembles from SGD iterates on UCI data: Brownlie (2021) §6.2, Table A.1.

For Energy (heating load), Boston, Concrete and Yacht, 10-fold cross-validation
(inputs standardised with each fold's training statistics, targets in original
units). A linear model (``nn.Linear(d, 1)``) is trained by ``torch.optim.SGD`` on the
mean squared error with weight decay 0.001 and batch size one tenth of the training
set: 500 epochs at learning rate 0.001 (pre-training), then 100 epochs at learning
rate 0.1 during which every iterate feeds three :class:`~pyro_fa.SWAG` posteriors
attached to the optimizer — online EM and online SGA factor analysis (K = 3,
warm-up 100, SGA learning rate 0.001) and classic SWAG (K = 3) as the baseline.
Test MSE of the pre-trained vector, the SWA mean, and 30-sample ensembles
(``SWAG.predict``) is printed beside the thesis's Table A.1.

Bar: our EM-FA ensemble's mean MSE <= the thesis's EM-FA + one standard error on
every dataset.

References
----------
S. Brownlie, *Extending the Bayesian Deep Learning Method MultiSWAG*, MSc thesis,
University of Edinburgh, 2021.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pyro_fa.datasets import load_uci_raw
from pyro_fa.experiments._io import OutputFolder, atomic_savefig, atomic_write_json, markdown_table, mean_se
from pyro_fa.experiments._io import int_in_range, nonnegative_int, positive_int
from pyro_fa.swag.swag import SWAG

#: the subcommand's one-line help, which `pyro-fa` reads without importing this module
HELP = 'Brownlie (2021) Table A.1: pre-trained, SWA, SGA-FA and EM-FA ensembles of linear regression on UCI.'

DATASETS = {"energy": "Energy", "bostonHousing": "Boston", "concrete": "Concrete", "yacht": "Yacht"}
METHODS = ("pretrained", "swa", "sga_fa", "em_fa", "swag")
#: the thesis's cross-validation: 10 folds; ``--folds k`` runs the first k of them
N_FOLDS = 10
#: Table A.1: test MSE, mean and standard error over 10 folds (pre-trained, SWA, SGA-FA, EM-FA)
PAPER = {
    "energy": ((10.13, 0.55), (8.74, 0.54), (8.93, 0.53), (8.73, 0.54)),
    "bostonHousing": ((23.69, 2.25), (23.27, 2.07), (23.69, 2.06), (23.46, 2.06)),
    "concrete": ((112.44, 6.93), (109.83, 6.44), (109.84, 6.30), (109.79, 6.41)),
    "yacht": ((82.43, 7.28), (82.54, 7.27), (83.35, 7.78), (82.83, 7.42)),
}
RANK, NUM_SAMPLES, WEIGHT_DECAY = 3, 30, 1e-3


def add_arguments(parser) -> None:
    parser.add_argument(
        "--data-dir", default=None, help="UCI data folder (default: $PYRO_FA_DATA, else the download cache)"
    )
    parser.add_argument("--datasets", nargs="+", default=None, choices=sorted(DATASETS), help="subset of datasets")
    parser.add_argument(
        "--folds", type=int_in_range(1, N_FOLDS), default=None,
        help=f"folds to run of the {N_FOLDS} (1 to {N_FOLDS}; default {N_FOLDS}; quick: 3)",
    )
    parser.add_argument("--pretrain-epochs", type=nonnegative_int, default=500, help="pre-training epochs at lr 0.001")
    parser.add_argument("--epochs", type=positive_int, default=100, help="collection epochs at lr 0.1 (default 100)")


def _load(name: str, data_dir=None, dtype=torch.float64):
    """All rows of one UCI dataset: inputs (n, d) and target (n,)."""
    try:
        return load_uci_raw(name, data_dir=data_dir, dtype=dtype)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"pyro-fa linreg-ensembles: {err}") from err


def _folds(n: int, k: int, seed: int):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [perm[i::k] for i in range(k)]  # round-robin over a shuffle: sizes differ by at most one


def run_fold(X, y, test_idx, seed, pretrain_epochs, epochs):
    """Train one fold; return the test MSE of each method."""
    mask = torch.ones(len(y), dtype=torch.bool)
    mask[test_idx] = False
    Xtr, ytr, Xte, yte = X[mask], y[mask], X[test_idx], y[test_idx]
    mu, sd = Xtr.mean(0), Xtr.std(0).clamp_min(1e-12)
    Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    n = len(ytr)
    batch = max(1, n // 10)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Linear(X.shape[1], 1).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.001, weight_decay=WEIGHT_DECAY)
    pre_steps = pretrain_epochs * (n // batch)
    swags = {
        "em_fa": SWAG(net, rank=RANK, method="em", start_after=pre_steps, warmup=100, seed=seed),
        "sga_fa": SWAG(net, rank=RANK, method="sga", start_after=pre_steps, warmup=100, lr=1e-3, seed=seed),
        "swag": SWAG(net, rank=RANK, method="swag", start_after=pre_steps),
    }
    for s in swags.values():
        s.attach(opt)

    def epoch():
        perm = torch.randperm(n, generator=g)
        for i in range(n // batch):
            idx = perm[i * batch:(i + 1) * batch]
            opt.zero_grad()
            (net(Xtr[idx]).squeeze(-1) - ytr[idx]).pow(2).mean().backward()
            opt.step()

    for _ in range(pretrain_epochs):
        epoch()
    with torch.no_grad():
        mse = {"pretrained": float((net(Xte).squeeze(-1) - yte).pow(2).mean())}
    for group in opt.param_groups:
        group["lr"] = 0.1
    for _ in range(epochs):
        epoch()
    em = swags["em_fa"]
    with torch.no_grad(), em.sampled_weights(em.loc):
        mse["swa"] = float((net(Xte).squeeze(-1) - yte).pow(2).mean())
    for name, s in swags.items():
        pred = s.predict(Xte, num_samples=NUM_SAMPLES, generator=torch.Generator().manual_seed(seed))
        mse[name] = float((pred.squeeze(-1) - yte).pow(2).mean())
    return mse


def run(args) -> int:
    """Run ``pyro-fa linreg-ensembles`` with the parsed ``args``; the result folder is checked and locked first."""
    with OutputFolder(args.output_dir, "pyro-fa linreg-ensembles"):
        return _run(args)


def _run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = args.datasets or list(DATASETS)
    n_folds = args.folds if args.folds is not None else (3 if args.quick else N_FOLDS)
    out_dir = Path(args.output_dir)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results, rows, bar_ok = {}, [], True
    for name in names:
        X, y = _load(name, args.data_dir)
        folds = _folds(len(y), N_FOLDS, args.seed)[:n_folds]
        per_fold = [run_fold(X, y, idx, args.seed + f, args.pretrain_epochs, args.epochs) for f, idx in enumerate(folds)]
        stats = {m: mean_se([r[m] for r in per_fold]) for m in METHODS}
        paper = dict(zip(("pretrained", "swa", "sga_fa", "em_fa"), PAPER[name]))
        bar = paper["em_fa"][0] + paper["em_fa"][1]
        ok = stats["em_fa"][0] <= bar
        bar_ok &= ok
        results[name] = {"folds": len(per_fold), "ours": stats, "paper": paper, "per_fold": per_fold,
                         "bar": {"threshold": bar, "met": ok}}
        cell = lambda m: f"{stats[m][0]:.2f} ± {stats[m][1]:.2f}" + (  # noqa: E731
            f" ({paper[m][0]:.2f} ± {paper[m][1]:.2f})" if m in paper else "")
        rows.append([DATASETS[name]] + [cell(m) for m in METHODS] + [f"{'yes' if ok else 'NO'} (≤ {bar:.2f})"])
        print(f"{DATASETS[name]}: " + ", ".join(f"{m} {stats[m][0]:.2f}" for m in METHODS), flush=True)
    results["seconds"] = time.perf_counter() - t0
    results["bar_met_everywhere"] = bar_ok
    atomic_write_json(out_dir / "results.json", results)

    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.8), squeeze=False)
    labels = ["Pre-trained", "SWA", "SGA-FA", "EM-FA", "SWAG"]
    for ax, name in zip(axes[0], names):
        st = results[name]["ours"]
        ax.errorbar(range(5), [st[m][0] for m in METHODS], yerr=[st[m][1] for m in METHODS], fmt="o", capsize=4,
                    label="ours")
        pp = results[name]["paper"]
        ax.errorbar([i + 0.15 for i in range(4)], [pp[m][0] for m in METHODS[:4]],
                    yerr=[pp[m][1] for m in METHODS[:4]], fmt="s", capsize=4, alpha=0.6, label="thesis")
        ax.set_xticks(range(5))
        ax.set_xticklabels(labels, rotation=30)
        ax.set(title=DATASETS[name], ylabel="test MSE")
    axes[0][0].legend()
    fig.suptitle(f"Brownlie (2021) Figure 6.3 / Table A.1: linear-regression test MSE ({n_folds} folds, mean ± s.e.)")
    fig.tight_layout()
    atomic_savefig(fig, out_dir / "figure_6_3.png", dpi=100)
    plt.close(fig)

    print(f"\nBrownlie (2021) Table A.1 (test MSE over {n_folds} of {N_FOLDS} folds; ours, thesis in parentheses; mean ± s.e.)")
    print(markdown_table(["dataset", "Pre-trained", "SWA", "SGA-FA", "EM-FA", "classic SWAG (ours only)",
                          "bar: EM-FA ≤ thesis EM-FA + s.e."], rows))
    print(f"\nbar met on every dataset: {bar_ok}")
    print(f"wrote {out_dir}/results.json, figure_6_3.png ({results['seconds']:.0f} s)")
    return 0
