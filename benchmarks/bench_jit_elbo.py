"""Speed-up of the compiled JitFactorELBO over FactorELBO, measured in one run (and Pyro's JitTrace_ELBO beside it).

Two small models, AutoLowRankFactorGuide, Adam, full-batch SVI:

* ``regression``: Bayesian linear regression, N=200, 5 inputs, a LogNormal noise scale;
* ``hierarchical``: eight-schools-like, 8 groups with a per-group effect in a plate, a global mean and a
  LogNormal group scale (the per-group prior depends on latents: Monte Carlo, as Trace_ELBO).

For each ELBO the script warms up (the compiling call included), then times ``--steps`` SVI steps,
``--repeats`` times, and prints the median steps/s and the ratios jit : eager. Speed-ups are Python
overhead saved, so they are largest on small models.

Run:  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_jit_elbo.py [--steps 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.optim import Adam

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, JitFactorELBO


def regression_problem(N=200, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g)
    y = X @ torch.randn(D, generator=g) + 0.5 * torch.randn(N, generator=g)

    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(X.shape[-1]), 1.0).to_event(1))
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal((w * X).sum(-1), s), obs=y)

    return model, (X, y)


def hierarchical_problem():
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])

    def model(y, sigma):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.LogNormal(1.0, 1.0))
        with pyro.plate("schools", y.shape[0]):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    return model, (y, sigma)


def steps_per_second(model, args, elbo, steps, repeats, warmup=20):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoLowRankFactorGuide(model, rank=2)
    svi = SVI(model, guide, Adam({"lr": 0.01}), elbo)
    for _ in range(warmup):
        svi.step(*args)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            svi.step(*args)
        rates.append(steps / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # the JIT tracer's warnings
    elbos = {
        "FactorELBO": lambda: FactorELBO(),
        "JitFactorELBO": lambda: JitFactorELBO(ignore_jit_warnings=True),
        "Trace_ELBO": lambda: Trace_ELBO(),
        "JitTrace_ELBO": lambda: JitTrace_ELBO(ignore_jit_warnings=True),
    }
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, {torch.get_num_threads()} thread(s), "
          f"{opts.steps} steps x {opts.repeats} repeats, median steps/s")
    print(f"{'model':<14}" + "".join(f"{name:>15}" for name in elbos) + f"{'ours jit:eager':>16}{'Pyro jit:eager':>16}")
    for name, problem in (("regression", regression_problem), ("hierarchical", hierarchical_problem)):
        model, args = problem()
        rate = {k: steps_per_second(model, args, make(), opts.steps, opts.repeats) for k, make in elbos.items()}
        print(f"{name:<14}" + "".join(f"{rate[k]:>15.0f}" for k in elbos)
              + f"{rate['JitFactorELBO'] / rate['FactorELBO']:>15.2f}x"
              + f"{rate['JitTrace_ELBO'] / rate['Trace_ELBO']:>15.2f}x")


if __name__ == "__main__":
    main()
