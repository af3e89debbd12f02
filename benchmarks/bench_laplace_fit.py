"""Fit time and peak memory of FactorLaplace against laplace-torch on the ``pyro-fa classify`` MNIST-1D MLP.

The network is the MNIST-1D reference MLP of ``pyro-fa classify`` (:class:`ResidualMLP`, 40 inputs, two hidden
layers of 100 with a residual, 10 classes: D = 15 210 weights), float32, CPU, one thread, at its random
initial weights (the fit's cost does not depend on the weights), on synthetic data of MNIST-1D's shape: 4000
training points of 40 features, 10 classes, batches of 256 (as ``pyro-fa classify`` passes them). Each method
runs in its own process, fits once on 8 examples (lazy imports, allocator pools), then resets the peak resident
memory (VmHWM) and fits on all the data; printed are the fit time and the peak memory added by the fit over the
resident memory before it, each also as a ratio to FactorLaplace's, measured in one run:

* ``factor``: ``FactorLaplace(net, "classification", rank=20).fit(loader)``, all weights, exact GGN vectors, the
  default curvature fit (the scatter sketch refitted by batch FA, one pass), and the posterior's variances;
* ``factor-rand``: the same with ``curvature_fit="randomized"`` (randomized range finder and Nyström
  approximation of the uncentred moment, 2 passes, refitted by batch FA);
* ``factor-em``: the same with ``curvature_fit="online"`` (online EM, 1 pass);
* ``kron-ll``: laplace-torch's ``Laplace(net, "classification", subset_of_weights="last_layer",
  hessian_structure="kron")`` (its default in ``pyro-fa classify``) and its posterior precision;
* ``diag``: ``Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag")`` and its
  posterior variances.

FactorLaplace's time is also split into the curvature vectors (``torch.func``) and the factor-analysis fit.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_fit.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_laplace_fit.py --n 1000 --methods factor kron-ll
"""
from __future__ import annotations

import argparse
import json
import os
import time

from bench_laplace_memory import _reset_peak, _rss_kib, _rss_peak_kib, run_worker  # run as a script from here

METHODS = ("factor", "factor-rand", "factor-em", "kron-ll", "diag")


def worker(method: str, n: int, rank: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_fa.experiments.classify.networks import ResidualMLP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = ResidualMLP(40, 10).eval()
    D = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(n, 40, generator=g), torch.randint(10, (n,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=256)
    warm = DataLoader(TensorDataset(X[:8], y[:8]), batch_size=8)
    split = {}
    if method.startswith("factor"):
        from pyro_fa.laplace import FactorLaplace, curvature

        fit = {"factor": {}, "factor-em": dict(curvature_fit="online", num_passes=1),
               "factor-rand": dict(curvature_fit="randomized")}[method]
        la = FactorLaplace(net, "classification", rank=rank, **fit)
        inner = curvature.curvature_vectors
        spent = [0.0]

        def timed(*args, **kwargs):  # the time in torch.func's curvature vectors, the rest is the FA fit
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            spent[0] += time.perf_counter() - t0
            return out

        import pyro_fa.laplace.laplace as module

        module.curvature_vectors = timed
    else:
        from laplace import Laplace

        subset, structure = ("last_layer", "kron") if method == "kron-ll" else ("all", "diag")
        la = Laplace(net, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(warm)
    import gc

    gc.collect()
    _reset_peak()  # the peak from here on
    base = _rss_kib()
    if method.startswith("factor"):
        spent[0] = 0.0
    t = time.perf_counter()
    la.fit(loader)
    if method.startswith("factor"):
        la.get_posterior().variance  # the posterior is usable: the capacitance and the variances are formed
        split = {"curvature_s": spent[0]}
    elif method == "kron-ll":
        la.posterior_precision
    else:
        la.posterior_variance
    seconds = time.perf_counter() - t
    return {"method": method, "D": D, "seconds": seconds, "peak_mib": (_rss_peak_kib() - base) / 1024, **split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="training points (default 4000, MNIST-1D's)")
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--worker", metavar="METHOD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.rank)))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; N = {args.n}, K = {args.rank}, one thread, float32, CPU")
    print(f"{'method':<10} {'D':>7} {'fit s':>8} {'curv. s':>8} {'peak MiB':>9} {'time / ours':>12} {'memory / ours':>14}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ours = None
    for method in args.methods:
        r = run_worker(__file__, ["--worker", method, "--n", str(args.n), "--rank", str(args.rank)], env)
        if isinstance(r, str):
            print(f"{method:<10} failed: {r}")
            continue
        if method == "factor":
            ours = r
        ratio_t = f"{r['seconds'] / ours['seconds']:.3f}" if ours else "-"
        ratio_m = f"{r['peak_mib'] / ours['peak_mib']:.3f}" if ours and ours["peak_mib"] >= 1 else "-"
        curv = f"{r['curvature_s']:.2f}" if "curvature_s" in r else "-"
        print(f"{method:<10} {r['D']:>7} {r['seconds']:>8.2f} {curv:>8} {r['peak_mib']:>9.1f} {ratio_t:>12} "
              f"{ratio_m:>14}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
