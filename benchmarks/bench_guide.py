"""Benchmark AutoLowRankFactorGuide + FactorELBO against Pyro's guides, all measured in one run.

For Bayesian MLPs (1x50 and 2x50 on a UCI-sized regression problem, N=512, 8
inputs; a wide 8-1000-1000-1 network with about 10^6 weights), same model,
same rank, full-batch SVI with Adam:

* time per SVI step of ours (FactorELBO) / Pyro's AutoLowRankMultivariateNormal
  (Trace_ELBO) / AutoNormal (Trace_ELBO), and the ratios ours : Pyro low-rank;
* steps needed to reach a target loss (1x50 network);
* the total variance of the gradient w.r.t. the guide's parameters under
  FactorELBO and under Trace_ELBO (same guide, same point).

Run:  .venv/bin/python benchmarks/bench_guide.py [--quick]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal, init_to_value
from pyro.optim import Adam

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, GaussianPrior


def make_problem(hidden, N=512, D_in=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D_in, generator=g)
    y = torch.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(N, generator=g)
    layers, d = [], D_in
    torch.manual_seed(seed)
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.Tanh()]
        d = h
    layers.append(torch.nn.Linear(d, 1))
    bnn = GaussianPrior(1.0).bayesianize(torch.nn.Sequential(*layers))

    def model(X, y):
        out = bnn(X).squeeze(-1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("y", dist.Normal(out, 0.1), obs=y)

    n_weights = sum(v.numel() for v in bnn.initial_values.values())
    return model, bnn.initial_values, X, y, n_weights


def make_guide(kind, model, init_values, rank):
    init = init_to_value(values=init_values)
    if kind == "ours":
        return AutoLowRankFactorGuide(model, rank=rank, init_loc_fn=init, init_scale=0.01), FactorELBO()
    if kind == "pyro_lowrank":
        return AutoLowRankMultivariateNormal(model, rank=rank, init_loc_fn=init, init_scale=0.01), Trace_ELBO()
    return AutoNormal(model, init_loc_fn=init, init_scale=0.01), Trace_ELBO()


def step_times(kinds, problem, rank, steps, lr=1e-3):
    """Median seconds per SVI step of each kind, steps interleaved round-robin so load drifts hit all alike."""
    model, init_values, X, y, _ = problem
    pyro.clear_param_store()
    svis = {}
    for kind in kinds:
        guide, elbo = make_guide(kind, model, init_values, rank)  # distinct class names: no param clash
        svi = SVI(model, guide, Adam({"lr": lr}), elbo)
        for _ in range(3):
            svi.step(X, y)
        svis[kind] = svi
    times = {kind: [] for kind in kinds}
    for _ in range(steps):
        for kind in kinds:
            t0 = time.perf_counter()
            svis[kind].step(X, y)
            times[kind].append(time.perf_counter() - t0)
    return {kind: statistics.median(v) for kind, v in times.items()}


def steps_to_target(kind, problem, rank, max_steps, target, lr=0.01, window=25):
    model, init_values, X, y, _ = problem
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide, elbo = make_guide(kind, model, init_values, rank)
    svi = SVI(model, guide, Adam({"lr": lr}), elbo)
    losses = []
    for t in range(max_steps):
        losses.append(svi.step(X, y))
        if t >= window and sum(losses[-window:]) / window <= target:
            return t + 1, losses
    return None, losses


def gradient_variance(problem, rank, draws=50, train_steps=0):
    model, init_values, X, y, _ = problem
    pyro.clear_param_store()
    pyro.set_rng_seed(2)
    guide, _ = make_guide("ours", model, init_values, rank)
    if train_steps:
        svi = SVI(model, guide, Adam({"lr": 0.01}), FactorELBO())
        for _ in range(train_steps):
            svi.step(X, y)
    out = {}
    for name, elbo in (("FactorELBO", FactorELBO()), ("Trace_ELBO", Trace_ELBO())):
        grads = []
        for _ in range(draws):
            guide.zero_grad()
            elbo.differentiable_loss(model, guide, X, y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in guide.parameters()]))
        grads = torch.stack(grads)
        out[name] = float(grads.var(0).sum())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rank", type=int, default=10)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    configs = [("1x50", (50,), 40), ("2x50", (50, 50), 40), ("wide 8-1000-1000-1", (1000, 1000), 8)]
    if args.quick:
        configs = configs[:2]
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, threads {torch.get_num_threads()}, rank {args.rank}")
    print("\n## SVI step time (median), full batch N=512")
    print("| network | weights | ours + FactorELBO (ms) | Pyro low-rank + Trace_ELBO (ms) | AutoNormal + Trace_ELBO (ms) "
          "| ours / Pyro low-rank | ours / AutoNormal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, hidden, steps in configs:
        problem = make_problem(hidden)
        t = step_times(("ours", "pyro_lowrank", "autonormal"), problem, args.rank, steps)
        print(f"| {label} | {problem[4]} | {1e3 * t['ours']:.2f} | {1e3 * t['pyro_lowrank']:.2f} | "
              f"{1e3 * t['autonormal']:.2f} | {t['ours'] / t['pyro_lowrank']:.2f} | {t['ours'] / t['autonormal']:.2f} |")

    problem = make_problem((50,))
    max_steps = 600 if args.quick else 2000
    _, ref = steps_to_target("pyro_lowrank", problem, args.rank, max_steps, target=-math.inf)
    target = sum(ref[-50:]) / 50
    print(f"\n## Steps to reach Pyro low-rank's final loss ({target:.1f}, mean of its last 50 of {max_steps} steps), "
          "1x50, Adam lr 0.01, 25-step running mean")
    for kind in ("ours", "pyro_lowrank"):
        n, _ = steps_to_target(kind, problem, args.rank, max_steps, target)
        print(f"- {kind}: {n if n is not None else f'> {max_steps}'}")

    print("\n## Total gradient variance w.r.t. the guide's parameters (our guide, 1x50, 50 draws)")
    for train_steps in (0, 300 if args.quick else 1000):
        v = gradient_variance(problem, args.rank, train_steps=train_steps)
        print(f"- after {train_steps} steps: FactorELBO {v['FactorELBO']:.4g}, Trace_ELBO {v['Trace_ELBO']:.4g}, "
              f"ratio {v['FactorELBO'] / v['Trace_ELBO']:.3f}")


if __name__ == "__main__":
    main()
