"""Time of an SVI step of AutoLowRankFactorGuide against Pyro's AutoLowRankMultivariateNormal on posteriordb ports.

For every ported posterior (``pyro_fa.experiments.posteriordb``) three SVI setups at the same rank (Pyro's
default, round(sqrt(D))), Adam(lr=1e-3), the same initialisation (``init_to_median_or_zero``):

* ``pyro``: ``AutoLowRankMultivariateNormal`` + ``Trace_ELBO``;
* ``factor``: ``AutoLowRankFactorGuide`` + ``FactorELBO``;
* ``jit``: ``AutoLowRankFactorGuide`` + ``JitFactorELBO``.

Each setup is warmed up (``--warmup`` steps, the compiling call included), then ``--steps`` steps are timed,
``--repeats`` times, the three setups interleaved within every repeat; the median time per step is reported
with the ratios ours / Pyro (below 1: ours is faster). Run with one thread:

    OMP_NUM_THREADS=1 PYRO_FA_POSTERIORDB=/work/shared/data/posteriordb \\
        python benchmarks/bench_guide_posteriordb.py [--steps 50] [--repeats 5] [--budget 20] [--only NAME ...]

Slow models (an ARMA or ODE likelihood) get fewer timed steps: about ``--budget`` seconds per posterior.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import time
import warnings

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal
from pyro.optim import Adam

from pyro_fa import AutoLowRankFactorGuide, FactorELBO, JitFactorELBO
from pyro_fa.experiments.posteriordb.loader import init_to_median_or_zero, load_posterior
from pyro_fa.experiments.posteriordb.ports import PORTS


def _setups(model) -> dict:
    """name -> (guide class, ELBO factory)."""
    return {
        "pyro": (AutoLowRankMultivariateNormal, Trace_ELBO),
        "factor": (AutoLowRankFactorGuide, FactorELBO),
        "jit": (AutoLowRankFactorGuide, JitFactorELBO),
    }


def _make(model, guide_cls, elbo_cls, prefix: str):
    guide = guide_cls(model, init_loc_fn=init_to_median_or_zero)
    guide._pyro_name = prefix  # keep the three guides' parameters apart in the param store
    return SVI(model, guide, Adam({"lr": 1e-3}), elbo_cls())


def time_posterior(name: str, steps: int, repeats: int, warmup: int, budget: float):
    post = load_posterior(name)
    pyro.clear_param_store()
    torch.manual_seed(0)
    svis = {k: _make(post.model, g, e, f"bench_{k}") for k, (g, e) in _setups(post.model).items()}
    for svi in svis.values():
        for _ in range(warmup):
            svi.step()
    t0 = time.perf_counter()
    svis["pyro"].step()
    per_step = time.perf_counter() - t0
    steps = max(2, min(steps, int(budget / (len(svis) * repeats * per_step))))  # slow models: fewer steps
    times = {k: [] for k in svis}
    for _ in range(repeats):
        for k, svi in svis.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                svi.step()
            times[k].append((time.perf_counter() - t0) / steps)
    return post.dim, steps, {k: statistics.median(v) for k, v in times.items()}


def _too_slow(signum, frame):
    raise TimeoutError("over --timeout seconds (warm-up and compilation included)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--skip", nargs="*", default=[], help="posteriors left out (e.g. the ODE ports, slow)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per posterior before it is skipped")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timed steps per posterior, about")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    names = [n for n in (args.only or list(PORTS)) if n not in set(args.skip)]
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, threads {torch.get_num_threads()}, "
          f"{args.steps} steps x {args.repeats} repeats (median)")
    print("| posterior | D | steps | Pyro ms/step | FactorELBO ms/step | JitFactorELBO ms/step | factor / Pyro | jit / Pyro |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = {"factor": [], "jit": []}
    for name in names:
        signal.signal(signal.SIGALRM, _too_slow)
        signal.alarm(args.timeout)
        try:
            dim, steps, t = time_posterior(name, args.steps, args.repeats, args.warmup, args.budget)
        except Exception as err:  # a port the guides cannot run (reported, not timed)
            print(f"| {name} | - | - | failed: {type(err).__name__}: {str(err)[:80]} | | | | |", flush=True)
            continue
        finally:
            signal.alarm(0)
        rf, rj = t["factor"] / t["pyro"], t["jit"] / t["pyro"]
        ratios["factor"].append(rf)
        ratios["jit"].append(rj)
        print(f"| {name} | {dim} | {steps} | {1e3 * t['pyro']:.2f} | {1e3 * t['factor']:.2f} | {1e3 * t['jit']:.2f} | "
              f"{rf:.2f} | {rj:.2f} |", flush=True)
    for k, v in ratios.items():
        if v:
            print(f"{k} / Pyro: median {statistics.median(v):.2f}, max {max(v):.2f} over {len(v)} posteriors")


if __name__ == "__main__":
    main()
