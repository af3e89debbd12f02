"""One fit of a ``pyro-fa posteriordb`` method on ``big_logistic`` (D = 5 000): CPU and wall seconds, the process's
peak RSS, and, where the reference file is found, the command's scores (W1, debiased W1, moment errors).

One method per process (``ru_maxrss`` is the process's high-water mark)::

    python benchmarks/bench_big_logistic.py METHOD [--steps 200] [--lr 0.02] [--reference-dir FOLDER]

``--compare A B [C ...]`` runs each method in its own process, one after the other, and prints the table and the
ratios of every method to the last one (CPU seconds, and peak RSS above the process's size before the fit: the
memory the fit itself adds, the data and the libraries being common to all)::

    python benchmarks/bench_big_logistic.py --compare pathfinder factor-guide auto-mvn --reference-dir FOLDER

Results: benchmarks/results/big_logistic.md.
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def fit_one(args):
    from pyro_fa.experiments.posteriordb import big
    from pyro_fa.experiments.posteriordb.methods import METHODS, Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import StandInPosterior

    torch.set_num_threads(1)
    config = big.BigLogisticConfig()
    data = big.make_data(config)
    post = StandInPosterior(big.NAME, big.make_model(data), config.dim, torch.zeros(0, config.dim),
                            lambda z: big.log_density(data, z))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0, c0 = time.perf_counter(), time.process_time()
    fit = fit_method(args.method, post, Budget(steps=args.steps, rank=args.rank, num_draws=1000), seed=0,
                     lr=args.lr if METHODS[args.method].tuned else None)
    rec = {"method": args.method, "steps": args.steps, "wall_seconds": time.perf_counter() - t0,
           "cpu_seconds": time.process_time() - c0,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_fit_mib": rss0,
           "grad_evals": fit.grad_evals, "density_evals": fit.density_evals}
    if args.reference_dir is not None:
        from pyro_fa.experiments.posteriordb.command import score

        rec["scores"] = score(fit, big.load_big_logistic(args.reference_dir), seed=0)
    return rec


def compare(args):
    recs = []
    for method in args.compare:
        cmd = [sys.executable, __file__, method, "--steps", str(args.steps), "--rank", str(args.rank),
               "--lr", str(args.lr)]
        if args.reference_dir is not None:
            cmd += ["--reference-dir", args.reference_dir]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        recs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"done: {method}", file=sys.stderr, flush=True)
    base = recs[-1]

    def added(r):
        return r["peak_rss_mib"] - r["rss_before_fit_mib"]

    print(f"big_logistic (D = 5 000), {args.steps} SVI steps at Adam {args.lr} for the guides, rank {args.rank}; "
          f"ratios to "
          f"{base['method']}")
    print("| method | CPU s | wall s | peak RSS MiB | added by the fit MiB | gradient evals | debiased W1 | "
          "CPU ratio | added memory ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in recs:
        w1 = r.get("scores", {}).get("w1_debiased", float("nan"))
        print(f"| {r['method']} | {r['cpu_seconds']:.1f} | {r['wall_seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{added(r):.0f} | {r['grad_evals']} | {w1:.3g} | {r['cpu_seconds'] / base['cpu_seconds']:.4f} | "
              f"{added(r) / max(added(base), 1e-9):.4f} |")


def main():
    from pyro_fa.experiments.posteriordb.methods import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", nargs="?", choices=sorted(METHODS))
    parser.add_argument("--compare", nargs="+", choices=sorted(METHODS), metavar="METHOD",
                        help="run each method in its own process; ratios to the last")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.02, help="Adam's rate for the SVI methods (default 0.02)")
    parser.add_argument("--reference-dir", default=None, help="the folder of big_logistic_reference.pt")
    args = parser.parse_args()
    if (args.method is None) == (args.compare is None):
        parser.error("give one METHOD or --compare METHOD [METHOD ...]")
    if args.compare is not None:
        compare(args)
    else:
        print(json.dumps(fit_one(args)))


if __name__ == "__main__":
    main()
