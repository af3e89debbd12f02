"""pyro_fa.sklearn.FactorAnalysis.fit against sklearn.decomposition.FactorAnalysis.fit.

Synthetic factor-analysis data from Algorithm 4 of seed 000 (N x D, rank K),
both estimators with their defaults and the same ``n_components``; both
log-likelihoods are evaluated the same way (scikit-learn's ``score`` times N)
so the times are compared at (at least) equal log-likelihood. Besides our full
fit (converged to our ``tol``), the time our fit needs to reach scikit-learn's
final log-likelihood is reported: the statistics pass plus the EM iterations
until the log-likelihood first exceeds scikit-learn's.

Usage::

    python benchmarks/bench_sklearn_fit.py            # 20 000 x 500, K = 10 (scikit-learn takes minutes)
    python benchmarks/bench_sklearn_fit.py --quick    # 5 000 x 200, K = 10, seconds
    python benchmarks/bench_sklearn_fit.py --data small-noise   # near-Heywood data: long scikit-learn runs

All ratios printed come from one run in one process, with one torch and one
BLAS thread for both libraries unless ``--threads`` says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

import numpy as np
import torch
from sklearn.decomposition import FactorAnalysis as SKFactorAnalysis

from pyro_fa.experiments.online_fa import generate_fa_model
from pyro_fa.fa.batch import ScatterStatistics, em_from_covariance
from pyro_fa.sklearn import FactorAnalysis


def make_data(n: int, dim: int, rank: int, spectrum, seed: int, kind: str = "alg4") -> np.ndarray:
    """``alg4``: seed 000's Algorithm 4; ``small-noise``: F ~ N(0, 1), psi ~ U(0, 1), so some
    noise variances are near zero and both algorithms converge slowly (near-Heywood cases)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "alg4":
        loc, F, psi = generate_fa_model(dim, rank, spectrum, g)
    else:
        loc = torch.randn(dim, generator=g, dtype=torch.float64)
        F = torch.randn(dim, rank, generator=g, dtype=torch.float64)
        psi = torch.rand(dim, generator=g, dtype=torch.float64)
    h = torch.randn(n, rank, generator=g, dtype=F.dtype)
    e = torch.randn(n, dim, generator=g, dtype=F.dtype)
    return (loc + h @ F.T + e * psi.sqrt()).numpy()


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def time_to_reach(X: np.ndarray, rank: int, target: float, seed: int, method: str, max_iter: int = 20_000) -> tuple:
    """Seconds for our pipeline (statistics + EM, no early stop) to first reach total log-likelihood ``target``.

    A first run finds the iteration count, a second one is timed.
    """

    def run(n_iter, tol):
        x = torch.from_numpy(X)
        stats = ScatterStatistics(X.shape[1], dtype=x.dtype).update(x)
        generator = torch.Generator().manual_seed(seed)
        return em_from_covariance(
            stats.covariance(), rank, X.shape[0], max_iter=n_iter, tol=tol, generator=generator, method=method
        )

    trace = run(max_iter, 1e-7).loglike.numpy()
    reached = np.nonzero(trace >= target)[0]
    if len(reached) == 0:
        return float("nan"), None
    n_iter = int(reached[0]) + 1
    _, seconds = timed(lambda: run(n_iter, -float("inf")))
    return seconds, n_iter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 000 x 200 data instead of 20 000 x 500")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--spectrum", type=float, nargs=2, default=(1.0, 10.0), metavar=("A", "B"))
    parser.add_argument("--data", choices=("alg4", "small-noise"), default="alg4")
    parser.add_argument("--algorithm", choices=("svd", "em"), default="svd", help="our batch algorithm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and BLAS threads for both libraries (default 1; 0 keeps the libraries' defaults, which on a "
        "loaded machine make every small OpenMP/MKL call wait ~10 ms for a descheduled thread)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    n = args.n or (5_000 if args.quick else 20_000)
    dim = args.dim or (200 if args.quick else 500)
    if args.threads:
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(args.threads)
        threadpool_limits(args.threads)

    X = make_data(n, dim, args.rank, args.spectrum, args.seed, args.data)
    # warm up both code paths (imports, thread pools) on small data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SKFactorAnalysis(2, max_iter=3).fit(X[:200, :20])
        FactorAnalysis(2, max_iter=3).fit(X[:200, :20])

    with warnings.catch_warnings(record=True) as sk_warnings:
        warnings.simplefilter("always")
        sk, t_sk = timed(lambda: SKFactorAnalysis(args.rank).fit(X))
    with warnings.catch_warnings(record=True) as our_warnings:
        warnings.simplefilter("always")
        ours, t_ours = timed(lambda: FactorAnalysis(args.rank, algorithm=args.algorithm).fit(X))
    ll_sk = n * sk.score(X)  # exact; sklearn's own loglike_ uses the randomized SVD's residual
    ll_ours = n * ours.score(X)
    t_reach, it_reach = time_to_reach(X, args.rank, ll_sk, ours._seed(), args.algorithm)

    result = {
        "data": {
            "kind": args.data,
            "n_samples": n,
            "n_features": dim,
            "n_components": args.rank,
            "spectrum": list(args.spectrum),
            "seed": args.seed,
        },
        "sklearn": {"seconds": t_sk, "n_iter": sk.n_iter_, "loglike": ll_sk, "converged": not sk_warnings},
        "pyro_fa": {
            "algorithm": args.algorithm,
            "seconds": t_ours,
            "n_iter": ours.n_iter_,
            "loglike": ll_ours,
            "converged": not our_warnings,
        },
        "pyro_fa_to_sklearn_loglike": {"seconds": t_reach, "n_iter": it_reach},
        "speedup_full_fit": t_sk / t_ours,
        "speedup_at_equal_loglike": t_sk / t_reach,
        "loglike_gap_per_sample": (ll_ours - ll_sk) / n,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    what = f"seed 000 Alg. 4, spectrum {list(args.spectrum)}" if args.data == "alg4" else "F ~ N(0,1), psi ~ U(0,1)"
    print(f"FactorAnalysis.fit on {n} x {dim} synthetic FA data ({what}), K = {args.rank}")
    print(f"{'':34s}{'seconds':>10s}{'iterations':>12s}{'total log-likelihood':>24s}")
    print(f"{'scikit-learn (randomized SVD)':34s}{t_sk:10.3f}{sk.n_iter_:12d}{ll_sk:24.3f}")
    print(f"{'pyro_fa (' + args.algorithm + ' on statistics)':34s}{t_ours:10.3f}{ours.n_iter_:12d}{ll_ours:24.3f}")
    print(f"{'pyro_fa, to scikit-learn ll':34s}{t_reach:10.3f}{str(it_reach):>12s}{'>= ' + format(ll_sk, '.3f'):>24s}")
    gap = result["loglike_gap_per_sample"]
    full = result["speedup_full_fit"]
    print(f"speed-up, full fits:               {full:.1f}x  (pyro_fa ll higher by {gap:.2e} per sample)")
    print(f"speed-up, at equal log-likelihood: {result['speedup_at_equal_loglike']:.1f}x")
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
