"""Cost of one training step of one UCI fit: the public batched trainer (``pyro_fa.nn``) vs Pyro's SVI loop.

The same model (1×50 ReLU network by default, ``--hidden 50,50`` for 2×50;
Gaussian prior, learned noise, full batch of a Boston split, float32, one
thread) trained by

* ``pyro.infer.SVI`` with ``AutoLowRankFactorGuide`` + ``FactorELBO`` (and with
  Pyro's ``AutoLowRankMultivariateNormal`` / ``AutoNormal`` + ``Trace_ELBO``), one
  fit at a time, as a Pyro user writes it;
* ``BatchedVI`` + ``fit_batched`` (``pyro_fa.nn.batched``, what ``pyro-fa uci`` and
  ``BayesianNetwork.fit_many`` use): R fits in one batch of tensors.

Prints milliseconds per fit-step and the ratio, measured in one run (``--repeats`` takes
the fastest of several timings of each, which a shared machine needs)::

    python benchmarks/bench_uci_trainer.py [--replicas 16] [--steps 200] [--hidden 50,50] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoNormal

from pyro_fa import AutoLowRankFactorGuide, FactorELBO
from pyro_fa.datasets import load_uci
from pyro_fa.nn import BatchedMLP, BatchedVI, fit_batched


def pyro_step_ms(spec, x, y, make_guide, elbo, steps):
    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(spec.dim), 1.0).to_event(1))
        noise = pyro.param("noise", torch.tensor(1.0), constraint=dist.constraints.positive)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(spec.forward(w, x.unsqueeze(0)).squeeze(0), noise), obs=y)

    pyro.clear_param_store()
    svi = SVI(model, make_guide(model), pyro.optim.Adam({"lr": 3e-3}), elbo)
    for _ in range(5):
        svi.step(x, y)
    t = time.perf_counter()
    for _ in range(steps):
        svi.step(x, y)
    return (time.perf_counter() - t) / steps * 1e3


def batched_step_ms(spec, x, y, family, replicas, steps):
    """One fit_batched call of ``steps`` full-batch steps on R replicas (each with its own copy of the data, as in
    ``pyro-fa uci``), per replica and step; a first short call pays the one-time costs (imports, allocator)."""
    vi = BatchedVI(spec, family, "gaussian", torch.ones(replicas), 3e-3, generator=torch.Generator().manual_seed(0),
                   dtype=x.dtype)
    xs, ys = x.expand(replicas, -1, -1).contiguous(), y.expand(replicas, -1).contiguous()
    fit_batched(vi, xs, ys, 5)
    t = time.perf_counter()
    fit_batched(vi, xs, ys, steps)
    return (time.perf_counter() - t) / steps / replicas * 1e3


def _widths(text: str):
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers such as 50,50, got {text!r}")
    return widths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16, help="fits per batch (the search's 8 configs x 2 splits)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=_widths, default=(50,),
                        help="hidden widths, comma-separated: 50 (1x50) or 50,50 (2x50)")
    parser.add_argument("--repeats", type=int, default=1, help="time each side this many times, keep the fastest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    os.environ.setdefault("PYRO_FA_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "uci"))
    d = load_uci("boston", 0, dtype=torch.float32)
    spec = BatchedMLP(d.x_train.shape[1], args.hidden)
    print(f"Boston split 0: N = {d.x_train.shape[0]}, {spec}, full batch, one thread, R = {args.replicas}")
    print(f"{'guide':<34} {'Pyro SVI ms/step':>17} {'batched ms/fit-step':>20} {'speed-up':>9}")
    cases = [
        ("AutoLowRankFactorGuide + FactorELBO", lambda m: AutoLowRankFactorGuide(m, rank=10, init_scale=0.01), FactorELBO(), "fa"),
        ("AutoLowRankMVN + Trace_ELBO", lambda m: AutoLowRankMultivariateNormal(m, rank=10, init_scale=0.01),
         Trace_ELBO(), "lowrank"),
        ("AutoNormal + Trace_ELBO", lambda m: AutoNormal(m, init_scale=0.01), Trace_ELBO(), "normal"),
    ]
    for label, make_guide, elbo, family in cases:
        a = min(pyro_step_ms(spec, d.x_train, d.y_train, make_guide, elbo, args.steps) for _ in range(args.repeats))
        b = min(batched_step_ms(spec, d.x_train, d.y_train, family, args.replicas, args.steps)
                for _ in range(args.repeats))
        print(f"{label:<34} {a:17.2f} {b:20.3f} {a / b:8.1f}x")


if __name__ == "__main__":
    main()
