"""NeuTra NUTS with AutoLowRankFactorGuide against plain NUTS on funnel-shaped targets, over several seeds.

Targets (latent dimension D = 5, or 10 with ``--full``):

* ``funnel``: Neal's funnel, y ~ N(0, 3^2), x_i | y ~ N(0, e^y), i = 1..D-1 (Neal 2003, §8). A
  Gaussian guide makes NeuTra an affine preconditioner only, which cannot straighten the funnel's
  neck (Hoffman et al. 2019 use normalising flows for it); this row shows what that buys or costs.
* ``mapped funnel``: the same funnel seen through a fixed ill-conditioned linear map,
  theta = diag(s) (I + (c - 1) U Uᵀ) u with U of shape (D, 3) orthonormal (a random rotation),
  c = 30 and s log-spaced over [1, 10]: three directions of the parameters 30 times wider than
  the rest, on coordinate scales a decade apart, a low-rank-plus-diagonal geometry (condition
  number about 10^4-10^5), as when a hierarchical model's parameters are correlated.

Samplers, all ``pyro.infer.NUTS`` with the same settings (step size adapted by dual averaging to
an acceptance of 0.8, mass matrix adapted in warm-up, ``max_tree_depth``, JIT-compiled potential,
the same initial-point rule, the same warm-up and number of draws):

* ``plain NUTS, diag``: Pyro's default, a diagonal mass matrix;
* ``plain NUTS, dense``: ``full_mass=True``, the dense mass matrix that Pyro's docs suggest for
  correlated posteriors (a linear preconditioner learnt in warm-up, without any SVI);
* ``NeuTra NUTS, ours``: NUTS with a diagonal mass matrix on the model reparameterised by
  ``NeuTraReparam`` with an ``AutoLowRankFactorGuide`` (rank 3) first fitted by SVI (the recipe of
  Pyro's ``examples/neutra.py``);
* ``NeuTra NUTS, Pyro AutoMVN``: the same with Pyro's ``AutoMultivariateNormal`` (full rank),
  fitted by the same SVI (Adam, 8 particles, learning rate 0.05 decayed tenfold). Pyro's
  ``AutoLowRankMultivariateNormal`` cannot be used: it has no ``get_transform``, which
  ``NeuTraReparam`` needs.

The default run (a few minutes on an idle core) runs plain diagonal NUTS and ours on both
targets and dense NUTS on the mapped funnel; ``--pyro-mvn`` adds Pyro's guide, ``--full`` runs
every sampler on both targets with D = 10, 500 warm-up + 1000 draws, max_tree_depth 10 and
2000 SVI steps over 5 seeds.

Printed per target: means over the seeds of the effective sample size (Pyro's
``effective_sample_size``, one chain) of the funnel's scale y and its minimum over the funnel's
coordinates (y, x), gradient evaluations per draw (warm-up included), seconds of MCMC (warm-up,
JIT compilation and sampling) and of the SVI fit, min ESS per second of MCMC and per second of
MCMC plus fit, min ESS per 1000 gradients (independent of the machine's load), divergent
transitions, the mean and sd of y (exactly 0 and 3). Then the ratios against plain diagonal NUTS
(geometric means over seeds).

Run:  .venv/bin/python benchmarks/bench_neutra.py [--pyro-mvn] [--full] [--seeds N]
"""
from __future__ import annotations

import argparse
import math
import platform
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal
from pyro.infer.mcmc.util import initialize_model
from pyro.infer.reparam import NeuTraReparam
from pyro.ops.stats import effective_sample_size
from pyro.optim import ClippedAdam
from torch.distributions import constraints

from pyro_fa import AutoLowRankFactorGuide

SAMPLERS = ("plain NUTS, diag", "plain NUTS, dense", "NeuTra NUTS, ours (rank 3)", "NeuTra NUTS, Pyro AutoMVN")


class _Funnel(dist.TorchDistribution):
    """Neal's funnel over (y, x_1..x_{D-1}), seen through an invertible matrix ``A``: theta = A u."""

    arg_constraints = {}
    support = constraints.real_vector

    def __init__(self, A: torch.Tensor, validate_args=None):
        self.A = A
        self._logdet = torch.linalg.slogdet(A)[1]
        super().__init__(event_shape=A.shape[-1:], validate_args=validate_args)

    def to_funnel(self, theta):
        return torch.linalg.solve(self.A, theta.unsqueeze(-1)).squeeze(-1)

    def sample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        y = 3 * torch.randn(shape[:-1] + (1,), dtype=self.A.dtype)
        x = torch.exp(y / 2) * torch.randn(shape[:-1] + (shape[-1] - 1,), dtype=self.A.dtype)
        return torch.cat([y, x], -1) @ self.A.mT

    def log_prob(self, theta):
        u = self.to_funnel(theta)
        y, x = u[..., 0], u[..., 1:]
        return (dist.Normal(0.0, 3.0).log_prob(y)
                + dist.Normal(0.0, torch.exp(y / 2).unsqueeze(-1)).log_prob(x).sum(-1) - self._logdet)


def neal_map(dim):
    return torch.eye(dim)


def low_rank_map(dim, seed=0):
    """diag(s) (I + (c - 1) U Uᵀ): three directions 30 times wider, coordinate scales over a decade."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(dim, 3, generator=g))
    s = torch.logspace(0, 1, dim)
    return s.unsqueeze(-1) * (torch.eye(dim) + (30.0 - 1.0) * U @ U.T)


def _model(A):
    target = _Funnel(A)

    def model():
        pyro.sample("theta", target)

    return model, target.to_funnel


def fit_guide(guide_cls, model, steps, seed, **kwargs):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = guide_cls(model, **kwargs)
    elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=0)
    svi = SVI(model, guide, ClippedAdam({"lr": 0.05, "lrd": 0.1 ** (1 / steps)}), elbo)
    t0 = time.perf_counter()
    for _ in range(steps):
        svi.step()
    return guide, time.perf_counter() - t0


def run_nuts(model, args, seed, full_mass=False):
    """NUTS from a counted, JIT-compiled potential; returns draws, seconds, gradients, divergences."""
    pyro.set_rng_seed(seed)
    t0 = time.perf_counter()
    init, potential_fn, transforms, _ = initialize_model(model, max_plate_nesting=0, jit_compile=True,
                                                         skip_jit_warnings=True)
    calls = [0]

    def counted(z):
        calls[0] += 1
        return potential_fn(z)

    kernel = NUTS(potential_fn=counted, full_mass=full_mass, max_tree_depth=args.max_tree_depth)
    mcmc = MCMC(kernel, num_samples=args.samples, warmup_steps=args.warmup, initial_params=init,
                transforms=transforms, disable_progbar=True)
    mcmc.run()
    seconds = time.perf_counter() - t0
    divergences = sum(len(v) for v in mcmc.diagnostics()["divergences"].values())
    return mcmc.get_samples(), seconds, calls[0], divergences


def run_neutra(model, guide, args, seed):
    for p in guide.parameters():  # a fitted guide is a constant of the warped model; with parameters that
        p.requires_grad_(False)   # require grad, the JIT-traced potential fails ("Unsupported value kind: Tensor")
    neutra = NeuTraReparam(guide)
    samples, seconds, grads, div = run_nuts(poutine.reparam(model, config=lambda _: neutra), args, seed)
    (shared,) = [v for k, v in samples.items() if k.endswith("_shared_latent")]  # named after the first latent site
    with torch.no_grad():
        return neutra.transform_sample(shared), seconds, grads, div


def one_seed(A, args, seed, samplers):
    """One row per sampler: (u draws of shape (S, D), MCMC s, fit s, gradients, divergences)."""
    model, to_funnel = _model(A)
    rows = {}
    for label, full_mass in ((SAMPLERS[0], False), (SAMPLERS[1], True)):
        if label not in samplers:
            continue
        samples, t, grads, div = run_nuts(model, args, seed, full_mass=full_mass)
        rows[label] = (to_funnel(samples["theta"]), t, 0.0, grads, div)
    for label, cls, kwargs in ((SAMPLERS[2], AutoLowRankFactorGuide, {"rank": 3}),
                               (SAMPLERS[3], AutoMultivariateNormal, {})):
        if label not in samplers:
            continue
        guide, t_fit = fit_guide(cls, model, args.svi_steps, seed, **kwargs)
        samples, t, grads, div = run_neutra(model, guide, args, seed)
        rows[label] = (to_funnel(samples["theta"]), t, t_fit, grads, div)
    return rows


def _mean(xs):
    return sum(xs) / len(xs)


def _geomean(xs):
    return math.exp(_mean([math.log(max(x, 1e-12)) for x in xs]))


def report(name, per_seed, args):
    samplers = list(per_seed[0])
    stats = {label: [] for label in samplers}
    for rows in per_seed:
        for label, (u, t, t_fit, grads, div) in rows.items():
            e = effective_sample_size(u.detach().unsqueeze(0), chain_dim=0, sample_dim=1)
            stats[label].append(dict(ess_y=float(e[0]), ess_min=float(e.min()), t=t, t_fit=t_fit,
                                     grads=grads / (args.warmup + args.samples), div=div,
                                     mean_y=float(u[:, 0].mean()), sd_y=float(u[:, 0].std()),
                                     per_s=float(e.min()) / t, per_s_fit=float(e.min()) / (t + t_fit),
                                     per_kgrad=1000 * float(e.min()) / grads))
    print(f"\n## {name} (D = {args.dim}): {args.warmup} warm-up + {args.samples} draws, "
          f"max_tree_depth {args.max_tree_depth}, SVI {args.svi_steps} steps, means over {len(per_seed)} seeds")
    keys = ("ess_y", "ess_min", "grads", "t", "t_fit", "per_s", "per_s_fit", "per_kgrad", "div", "mean_y", "sd_y")
    print("| sampler | ESS(y) | min ESS | grads/draw | MCMC s | fit s | min ESS/s | min ESS/s incl. fit | "
          "min ESS/1k grads | divergences | mean y (0) | sd y (3) |")
    print("| --- |" + " ---: |" * len(keys))
    for label in samplers:
        m = {k: _mean([s[k] for s in stats[label]]) for k in keys}
        print(f"| {label} | {m['ess_y']:.0f} | {m['ess_min']:.0f} | {m['grads']:.0f} | {m['t']:.1f} | "
              f"{m['t_fit']:.1f} | {m['per_s']:.1f} | {m['per_s_fit']:.1f} | {m['per_kgrad']:.2f} | {m['div']:.1f} | "
              f"{m['mean_y']:+.2f} | {m['sd_y']:.2f} |")
    base = stats[SAMPLERS[0]]
    for label in samplers[1:]:
        ratio = {k: _geomean([s[k] / b[k] for s, b in zip(stats[label], base)])
                 for k in ("per_s", "per_s_fit", "per_kgrad")}
        print(f"{label} : plain diag, min ESS/s {ratio['per_s']:.2f}x (incl. fit {ratio['per_s_fit']:.2f}x), "
              f"per gradient {ratio['per_kgrad']:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="D = 10, longer chains, 5 seeds, every sampler on both targets (well over 10x the time)")
    parser.add_argument("--pyro-mvn", action="store_true", help="add NeuTra with Pyro's AutoMultivariateNormal")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, 5 with --full)")
    args = parser.parse_args()
    if args.full:
        args.dim, args.warmup, args.samples, args.svi_steps, args.max_tree_depth, n_seeds = 10, 500, 1000, 2000, 10, 5
    else:
        args.dim, args.warmup, args.samples, args.svi_steps, args.max_tree_depth, n_seeds = 5, 150, 250, 400, 6, 3
    n_seeds = args.seeds or n_seeds
    neal = [SAMPLERS[0], SAMPLERS[2]] + ([SAMPLERS[1]] if args.full else [])
    mapped = list(SAMPLERS[:3])
    if args.full or args.pyro_mvn:
        neal, mapped = neal + [SAMPLERS[3]], mapped + [SAMPLERS[3]]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, {platform.processor() or platform.machine()}, "
          f"one CPU thread, seeds 0..{n_seeds - 1}")
    t0 = time.perf_counter()
    for name, A, samplers in (("Neal's funnel", neal_map(args.dim), neal),
                              ("funnel through a low-rank-plus-diagonal linear map", low_rank_map(args.dim), mapped)):
        report(name, [one_seed(A, args, seed, [s for s in SAMPLERS if s in samplers]) for seed in range(n_seeds)], args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
