"""Pathfinder's L-BFGS history J on posteriordb posteriors: the debiased W1 of the single-path Gaussian to the
reference draws (1 000 draws, `pyro-fa posteriordb`'s own score), its smallest marginal s.d. ratio, k-hat, gradient
evaluations and ELBO, median over seeds, for each J.

    python benchmarks/bench_pathfinder_history.py --data-dir .../posteriordb --histories 6 20 \\
        --posteriors nes1972-nes arK-arK [--seeds 4]

Results: benchmarks/results/pathfinder_history.md.
"""
import argparse

import numpy as np
import torch


def main():
    from pyro_fa.experiments.posteriordb import load_posterior
    from pyro_fa.experiments.posteriordb.command import score
    from pyro_fa.experiments.posteriordb.methods import Point
    from pyro_fa.infer import Pathfinder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--posteriors", nargs="+", required=True)
    parser.add_argument("--histories", nargs="+", type=int, default=[6, 20])
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| posterior | D | J | debiased W1 | min s.d. ratio | k-hat | gradient evals | ELBO |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.posteriors:
        post = load_posterior(name, data_dir=args.data_dir)
        dim = post.reference.shape[1]
        for J in args.histories:
            rows = []
            for seed in range(args.seeds):
                gen = torch.Generator().manual_seed(seed)
                pf = Pathfinder(log_density=post.log_density, dim=dim, history_size=J, num_draws_per_path=1000)
                pf.fit(generator=gen)
                z = pf.best_.draw(1000, gen)[0]
                s = score(Point(0, 0, 0, z.detach().double(), pf.best_.log_prob(z).detach().double()), post, seed=seed)
                rows.append((s["w1_debiased"], s["min_sd_ratio"], s["khat"], pf.num_grad_evals_, float(pf.elbo_)))
            m = np.median(np.array(rows), axis=0)
            print(f"| {name} | {dim} | {J} | {m[0]:.4f} | {m[1]:.2f} | {m[2]:.2f} | {m[3]:.0f} | {m[4]:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
