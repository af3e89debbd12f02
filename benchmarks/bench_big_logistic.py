"""One fit of a ``pyro-fa posteriordb`` method on ``big_logistic`` (D = 5 000): CPU and wall seconds, the process's
peak RSS, and, where the reference file is found, the command's scores (W1, debiased W1, moment errors).

One method per process (``ru_maxrss`` is the process's high-water mark)::

    python benchmarks/bench_big_logistic.py METHOD [--steps 200] [--reference-dir FOLDER]

Results: benchmarks/results/big_logistic.md.
"""
import argparse
import json
import resource
import time

import torch


def main():
    from pyro_fa.experiments.posteriordb import big
    from pyro_fa.experiments.posteriordb.methods import METHODS, Budget, fit_method
    from pyro_fa.experiments.posteriordb.standins import StandInPosterior

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", choices=sorted(METHODS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--reference-dir", default=None, help="the folder of big_logistic_reference.pt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = big.BigLogisticConfig()
    data = big.make_data(config)
    post = StandInPosterior(big.NAME, big.make_model(data), config.dim, torch.zeros(0, config.dim),
                            lambda z: big.log_density(data, z))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0, c0 = time.perf_counter(), time.process_time()
    fit = fit_method(args.method, post, Budget(steps=args.steps, rank=args.rank, num_draws=1000), seed=0)
    rec = {"method": args.method, "steps": args.steps, "wall_seconds": time.perf_counter() - t0,
           "cpu_seconds": time.process_time() - c0,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_fit_mib": rss0,
           "grad_evals": fit.grad_evals, "density_evals": fit.density_evals}
    if args.reference_dir is not None:
        from pyro_fa.experiments.posteriordb.command import score

        rec["scores"] = score(fit, big.load_big_logistic(args.reference_dir), seed=0)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
