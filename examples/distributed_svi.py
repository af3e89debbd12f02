"""Data-parallel SVI with AutoLowRankFactorGuide + FactorELBO.

    .venv/bin/torchrun --nproc_per_node 2 examples/distributed_svi.py

(from the repository root after ``make setup``: ``torchrun``, torch's launcher, is in ``.venv/bin``;
plain ``torchrun`` works once ``source .venv/bin/activate`` has run.)

Bayesian linear regression, whose exact posterior is known. Every rank holds the whole
guide and its share of the data; ``pyro.plate("data", N, subsample=idx)`` scales its
likelihood by N / len(idx), so its ELBO estimates the full-data ELBO, and
``AllReduceOptim`` averages the gradients over the ranks before each Adam step.
"""
import gc

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist

from pyro_fa import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.distributed import AllReduceOptim, local_indices

ALPHA, BETA = 1.0, 4.0


def model(x, y, idx, n):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[-1]), ALPHA ** -0.5).to_event(1))
    with pyro.plate("data", n, subsample=idx):
        pyro.sample("y", dist.Normal((w * x).sum(-1), BETA ** -0.5), obs=y)


def main():
    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    N, D = 1000, 5
    X = torch.randn(N, D, generator=g)
    y = X @ torch.randn(D, generator=g) + BETA ** -0.5 * torch.randn(N, generator=g)
    idx = local_indices(N)  # this rank's contiguous share

    pyro.set_rng_seed(100 + rank)  # independent Monte Carlo draws per rank: W times the particles
    guide = AutoLowRankFactorGuide(model, rank=D, init_scale=0.01)
    optim = AllReduceOptim(pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.996}))
    svi = pyro.infer.SVI(model, guide, optim, FactorELBO(num_particles=4))
    for step in range(800):
        loss = svi.step(X[idx], y[idx], idx, N)
    q = guide.get_posterior()
    S = torch.linalg.inv(ALPHA * torch.eye(D) + BETA * X.T @ X)
    m = BETA * S @ X.T @ y
    if rank == 0:
        z = (q.loc.detach() - m) / S.diagonal().sqrt()
        ratio = q.covariance_matrix.detach().diagonal() / S.diagonal()
        print(f"world size {tdist.get_world_size()}, {N} points ({len(idx)} on this rank), last loss {loss:.1f}")
        print(f"posterior mean - exact, in exact posterior sds: {[round(float(v), 3) for v in z]}")
        print(f"posterior variances / exact: {[round(float(v), 3) for v in ratio]}")
        print(f"all-reduces: {optim.n_collectives} ({optim.bytes_reduced / 2**10:.1f} KiB)")
    gc.collect()  # cyclic garbage holding gloo work: freed before the process group goes (see distributed_swag.py)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
