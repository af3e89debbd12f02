"""BatchAndMatch (pBaM) against single-path Pathfinder on the stand-in ``gaussian_linreg`` and the shipped
posteriordb posteriors: debiased W1 to the reference draws and gradient evaluations, a few seeds.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_batch_match.py [--seeds 3] [--grad-evals 800 2000]  # the first budget also runs from Pathfinder

Prints one markdown table (mean over seeds, the spread in brackets); results go to benchmarks/results/.
"""
import argparse
import time

import numpy as np
import torch

from pyro_fa.experiments.posteriordb.loader import available_posteriors, load_posterior
from pyro_fa.experiments.posteriordb.standins import gaussian_linreg
from pyro_fa.infer import BatchAndMatch, Pathfinder
from pyro_fa.metrics.transport import debiased_wasserstein1

torch.set_num_threads(1)


def _scalar(post):
    def log_density(z):
        return post.log_density(z.unsqueeze(0))[0]
    return log_density


def run(post, seeds, budgets, rank, batch_size, num_draws):
    D = post.dim
    ref = post.reference.numpy()
    rows = {}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        pf = Pathfinder(log_density=_scalar(post), dim=D).fit(generator=gen)
        z = pf.sample(num_draws, generator=gen).numpy()
        rows.setdefault("pathfinder", []).append((debiased_wasserstein1(z, ref, seed=seed)["w1_debiased"],
                                                  pf.num_grad_evals_, pf.num_density_evals_,
                                                  time.perf_counter() - t0))
        # BaM started from Pathfinder's mean, at its smallest marginal s.d. (the grad evals of both counted)
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        q = pf.get_posterior()
        bam = BatchAndMatch(log_density=_scalar(post), dim=D, rank=min(rank, D), batch_size=batch_size,
                            max_grad_evals=budgets[0], init_loc=q.mean, init_scale=float(q.stddev.min())
                            ).fit(generator=gen)
        z = bam.sample(num_draws, generator=gen).numpy()
        rows.setdefault(f"pathfinder+bam-{budgets[0]}", []).append(
            (debiased_wasserstein1(z, ref, seed=seed)["w1_debiased"], pf.num_grad_evals_ + bam.num_grad_evals_,
             pf.num_density_evals_, time.perf_counter() - t0 + rows["pathfinder"][-1][3]))
        for budget in budgets:
            gen = torch.Generator().manual_seed(seed)
            t0 = time.perf_counter()
            bam = BatchAndMatch(log_density=_scalar(post), dim=D, rank=min(rank, D), batch_size=batch_size,
                                max_grad_evals=budget).fit(generator=gen)
            z = bam.sample(num_draws, generator=gen).numpy()
            rows.setdefault(f"bam-{budget}", []).append((debiased_wasserstein1(z, ref, seed=seed)["w1_debiased"],
                                                         bam.num_grad_evals_, bam.num_density_evals_,
                                                         time.perf_counter() - t0))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--grad-evals", type=int, nargs="+", default=[800, 2000])
    p.add_argument("--rank", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-draws", type=int, default=1000)
    a = p.parse_args()
    posts = [gaussian_linreg()] + [load_posterior(name) for name in available_posteriors()]
    print("| posterior | D | method | debiased W1 | grad evals | density evals | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for post in posts:
        rows = run(post, range(a.seeds), a.grad_evals, a.rank, a.batch_size, a.num_draws)
        for method, vals in rows.items():
            v = np.array(vals)
            w = v[:, 0]
            print(f"| {post.name} | {post.dim} | {method} | {w.mean():.3f} [{w.min():.3f}, {w.max():.3f}] | "
                  f"{v[:, 1].mean():.0f} | {v[:, 2].mean():.0f} | {v[:, 3].mean():.1f} |", flush=True)


if __name__ == "__main__":
    main()
