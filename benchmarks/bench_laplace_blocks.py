"""Time and peak memory of FactorLaplace with a rank per layer: the factor held by blocks against the dense layout.

A deep MLP (``--depth`` hidden layers of ``--width`` units, 64 inputs, 10 classes, tanh; D = 742 922 at the
defaults 12 x 256), float32, CPU, on ``--n`` random examples, one rank per layer (``--rank``, 20: 13 blocks, 260
columns in all). Three stages, each timed and its peak resident memory (VmHWM, reset before the stage) taken over
the resident memory before it:

* ``fit``: ``FactorLaplace(net, "classification", rank=[20] * 13).fit(...)`` (each block by ``"randomized"``, two
  passes);
* ``marglik``: ``optimize_prior_precision("marglik", n_steps=--steps)``, one capacitance and log-determinant and
  its gradient per step;
* ``glm``: ``predict_proba`` (GLM, probit) of a batch of ``--batch`` inputs.

Layouts, each in its own process:

* ``block``: this tree, each block's F_b (D_b, K_b) held on its own, the posterior a
  ``BlockLowRankPrecisionNormal`` (:math:`O(\\sum_b D_bK_b^2)`), the GLM predictive's J F_b from the Jacobian;
* ``dense``: the layout before the blocks were kept apart, emulated in this tree: after the same fit, F formed as
  the dense D x 260 matrix with zeros off the blocks and handed to an int-rank FactorLaplace (its fit time and
  peak include forming it), whose posterior and predictive are the one-rank code (:math:`O(D(\\sum_b K_b)^2)`,
  260 forward-mode products per example);
* ``dense-checkout`` (with ``--dense-checkout PATH``): the block worker run with ``PYTHONPATH=PATH``, a checkout
  whose FactorLaplace stores F dense itself (a commit before the blocks were held apart).

Printed: each stage's seconds and peak MiB per layout, the ratios dense / block measured in the same run, and the
largest differences of the layouts' results (log marginal likelihood, chosen prior precision, probabilities).

    OMP_NUM_THREADS=1 python benchmarks/bench_laplace_blocks.py
    OMP_NUM_THREADS=1 python benchmarks/bench_laplace_blocks.py --dense-checkout ../main
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


class _Stage:
    """Seconds and the resident MiB added at the peak over the start of a ``with`` block (the classify command's
    ``ResidentPeak``: garbage collected and the heap trimmed first, ``VmHWM`` reset to ``VmRSS``)."""

    def __init__(self, out: dict, name: str):
        self.out, self.name = out, name

    def __enter__(self):
        from pyro_fa.experiments.classify.posthoc import ResidentPeak

        self.peak, self.t = ResidentPeak(), time.perf_counter()

    def __exit__(self, *exc):
        mib = self.peak.added_mib()
        self.out[self.name] = {"seconds": time.perf_counter() - self.t,
                               "peak_mib": float("nan") if mib is None else mib}


def _dense_layout(la, FactorLaplace):
    """The same fit in the dense layout: an int-rank FactorLaplace holding blockdiag(F_b), D x sum(K_b)."""
    state = {k: v for k, v in la.state_dict().items() if not k.startswith("block_")}
    state["cov_factor"] = la.cov_factor  # formed here, once
    dense = FactorLaplace(la.model, "classification", rank=la.rank, chunk_size=la.chunk_size)
    dense.load_state_dict(state, assign=True)
    return dense


def worker(layout: str, args) -> dict:
    import torch
    from torch import nn

    from pyro_fa.laplace import FactorLaplace

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(64, args.width), nn.Tanh()]
    for _ in range(args.depth - 1):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(args.width, 10))
    D = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(args.n, 64, generator=g), torch.randint(10, (args.n,), generator=g)
    x_test = torch.randn(args.batch, 64, generator=g)
    batches = [(X[i:i + 64], y[i:i + 64]) for i in range(0, args.n, 64)]
    ranks = [args.rank] * (args.depth + 1)
    kw = dict(rank=ranks, chunk_size=args.chunk_size)
    FactorLaplace(net, "classification", **kw).fit([(X[:4], y[:4])])  # lazy imports and allocator pools
    out = {"layout": layout, "D": D, "blocks": len(ranks), "width": sum(ranks)}
    with _Stage(out, "fit"):
        la = FactorLaplace(net, "classification", **kw).fit(batches)
        if layout == "dense":
            la = _dense_layout(la, FactorLaplace)
    out["factor_numbers"] = sum(b.numel() for k, b in la.named_buffers() if "factor" in k)
    with _Stage(out, "marglik"):
        chosen = la.optimize_prior_precision("marglik", n_steps=args.steps)
    with _Stage(out, "glm"):
        probs = la.predict_proba(x_test)
    out["lml"] = float(la.log_marginal_likelihood())
    out["prior_precision"] = chosen.tolist()
    out["probs"] = probs.reshape(-1).tolist()
    out["posterior"] = type(la.get_posterior()).__name__
    return out


def _run(layout: str, argv: list, pythonpath=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, __file__, "--worker", layout, *argv], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--dense-checkout", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("worker", "dense_checkout")]
    runs = [("block", None), ("dense", None)]
    if args.dense_checkout:
        runs.append(("dense-checkout", os.path.abspath(args.dense_checkout)))
    results = {}
    for name, path in runs:
        r = _run("block" if name == "dense-checkout" else name, argv, path)
        if isinstance(r, str):
            print(f"{name}: failed: {r}")
            continue
        results[name] = r
        print(f"{name:<15} D={r['D']} blocks={r['blocks']} columns={r['width']} factor numbers held="
              f"{r['factor_numbers']:,} posterior={r['posterior']}", flush=True)
    if "block" not in results:
        return
    ours = results["block"]
    stages = ("fit", "marglik", "glm")
    print(f"\n{'layout':<24}" + "".join(f"{s + ' s':>12}{s + ' MiB':>13}" for s in stages))
    for name, r in results.items():
        print(f"{name:<24}" + "".join(f"{r[s]['seconds']:>12.2f}{r[s]['peak_mib']:>13.1f}" for s in stages))
    for name, r in results.items():
        if name == "block":
            continue
        ratios = "".join(f"{r[s]['seconds'] / ours[s]['seconds']:>12.2f}"
                         f"{r[s]['peak_mib'] / max(ours[s]['peak_mib'], 1.0):>13.2f}" for s in stages)
        print(f"{name + ' / block':<24}" + ratios)
        dp = max(abs(a - b) for a, b in zip(r["probs"], ours["probs"]))
        dd = max(abs(a - b) / b for a, b in zip(r["prior_precision"], ours["prior_precision"]))
        print(f"  {name} vs block: |log marglik difference| {abs(r['lml'] - ours['lml']):.2e} (of "
              f"{ours['lml']:.6g}), prior precision relative {dd:.2e}, probabilities {dp:.2e}; factor numbers "
              f"held {r['factor_numbers'] / ours['factor_numbers']:.1f}x")


if __name__ == "__main__":
    main()
