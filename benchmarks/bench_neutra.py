"""NeuTra HMC with AutoLowRankFactorGuide against plain HMC (NUTS) on funnel-shaped targets, in one run.

Targets (latent dimension 10):

* ``funnel``: Neal's funnel, y ~ N(0, 3^2), x_i | y ~ N(0, e^y), i = 1..9 (Neal 2003, §8);
* ``funnel-correlated``: the same funnel seen through a fixed ill-conditioned linear map,
  theta = A (y, x) (condition number 100, random rotation), as when a hierarchical
  model's parameters are correlated and on different scales.

For each: plain NUTS (Pyro's defaults: step size and diagonal mass matrix adapted in warm-up)
on the model, and NUTS on the model reparameterised by ``NeuTraReparam`` with an
``AutoLowRankFactorGuide`` (rank 3) first fitted by SVI (Hoffman et al. 2019; the recipe of
Pyro's ``examples/neutra.py``). Printed: effective sample size (Pyro's
``effective_sample_size``) of the funnel's scale y and the minimum over the original
coordinates, per second of MCMC (warm-up + sampling), and per second including the guide's
SVI fit; divergent transitions; the ratio NeuTra : plain.

Run:  .venv/bin/python benchmarks/bench_neutra.py [--quick] [--seed 0]
"""
from __future__ import annotations

import argparse
import math
import time

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.reparam import NeuTraReparam
from pyro.ops.stats import effective_sample_size
from pyro.optim import ClippedAdam

from pyro_fa import AutoLowRankFactorGuide

DIM = 10


def funnel():
    y = pyro.sample("y", dist.Normal(0.0, 3.0))
    pyro.sample("x", dist.Normal(y.new_zeros(DIM - 1), torch.exp(y / 2).unsqueeze(-1)).to_event(1))


def _funnel_log_density(u):
    y, x = u[..., 0], u[..., 1:]
    return dist.Normal(0.0, 3.0).log_prob(y) + dist.Normal(0.0, torch.exp(y / 2).unsqueeze(-1)).log_prob(x).sum(-1)


def make_correlated(seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(DIM, DIM, generator=g))
    A = Q @ torch.diag(torch.logspace(0, 2, DIM)) @ Q.T  # condition number 100
    logdet = torch.linalg.slogdet(A)[1]

    def model():
        theta = pyro.sample("theta", dist.ImproperUniform(dist.constraints.real, (), (DIM,)))
        u = torch.linalg.solve(A, theta.unsqueeze(-1)).squeeze(-1)
        pyro.factor("funnel", _funnel_log_density(u) - logdet)

    def to_funnel(samples):
        return torch.linalg.solve(A, samples["theta"].unsqueeze(-1)).squeeze(-1)

    return model, to_funnel


def _coords(samples):
    return torch.cat([samples["y"].reshape(-1, 1), samples["x"].reshape(-1, DIM - 1)], -1)


def ess(u):
    """Per-coordinate effective sample size of one chain, u of shape (S, D)."""
    return effective_sample_size(u.unsqueeze(0), chain_dim=0, sample_dim=1)


def run_nuts(model, warmup, samples, seed):
    pyro.set_rng_seed(seed)
    mcmc = MCMC(NUTS(model), num_samples=samples, warmup_steps=warmup, disable_progbar=True)
    t0 = time.perf_counter()
    mcmc.run()
    seconds = time.perf_counter() - t0
    divergences = sum(len(v) for v in mcmc.diagnostics()["divergences"].values())
    return mcmc.get_samples(), seconds, divergences


def fit_guide(model, steps, seed):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoLowRankFactorGuide(model, rank=3)
    svi = SVI(model, guide, ClippedAdam({"lr": 0.01, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO(num_particles=8,
                                                                                           vectorize_particles=True))
    t0 = time.perf_counter()
    for _ in range(steps):
        svi.step()
    return guide, time.perf_counter() - t0


def compare(name, model, to_funnel, args):
    plain, t_plain, div_plain = run_nuts(model, args.warmup, args.samples, args.seed)
    guide, t_svi = fit_guide(model, args.svi_steps, args.seed)
    neutra = NeuTraReparam(guide)
    warped, t_neutra, div_neutra = run_nuts(poutine.reparam(model, config=lambda _: neutra), args.warmup,
                                            args.samples, args.seed)
    u_plain = to_funnel(plain)
    (shared,) = [v for k, v in warped.items() if k.endswith("_shared_latent")]  # named after the first latent site
    u_neutra = to_funnel(neutra.transform_sample(shared))
    rows = []
    for label, u, t_mcmc, t_extra, div in (("plain NUTS", u_plain, t_plain, 0.0, div_plain),
                                           ("NeuTra NUTS (ours, rank 3)", u_neutra, t_neutra, t_svi, div_neutra)):
        e = ess(u.detach())
        rows.append((label, float(e[0]), float(e.min()), t_mcmc, t_extra, div, float(u[:, 0].mean()), float(u[:, 0].std())))
    print(f"\n## {name}: {args.warmup} warm-up + {args.samples} draws, SVI {args.svi_steps} steps")
    print("| sampler | ESS(y) | min ESS | MCMC s | SVI s | ESS(y)/s | min ESS/s | min ESS/s incl. SVI | divergences | "
          "mean y (0) | sd y (3) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, ey, emin, tm, tx, div, my, sy in rows:
        print(f"| {label} | {ey:.0f} | {emin:.0f} | {tm:.1f} | {tx:.1f} | {ey / tm:.1f} | {emin / tm:.1f} | "
              f"{emin / (tm + tx):.1f} | {div} | {my:+.2f} | {sy:.2f} |")
    (_, ey0, em0, tm0, _, _, _, _), (_, ey1, em1, tm1, tx1, _, _, _) = rows
    print(f"NeuTra : plain, min ESS/s {em1 / tm1 / (em0 / tm0):.2f}x (incl. SVI {em1 / (tm1 + tx1) / (em0 / tm0):.2f}x), "
          f"ESS(y)/s {ey1 / tm1 / (ey0 / tm0):.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer draws (a smoke run; ESS estimates are noisy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.warmup, args.samples, args.svi_steps = (150, 200, 600) if args.quick else (500, 1000, 3000)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, one CPU thread, seed {args.seed}")
    compare("Neal's funnel", funnel, _coords, args)
    model, to_funnel = make_correlated(args.seed)
    compare("funnel through an ill-conditioned linear map", model, to_funnel, args)


if __name__ == "__main__":
    main()
