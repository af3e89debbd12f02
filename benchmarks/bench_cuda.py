"""The library on a CUDA device against the same work on the CPU, measured in one run.

Every workload runs on the CPU (all its cores unless ``--threads``) and on the GPU in the same
process, on the same data, and prints the GPU's speed-up, the GPU against a physical reference on
the GPU where one applies, and the largest difference between the two devices' results (the
device must not change the answer beyond float32 round-off):

* ``online-em``: one ``OnlineFactorAnalysis`` update (method "em", float32) at D = 10^6 and 10^7,
  K = 20, as a multiple of two D x K matrix-vector products on the same device (the least an
  update must read; whole periods of ``m_step_every`` updates, so that the M-step's share is in), and the
  GPU memory it adds as a multiple of D*K*4 bytes;
* ``swag``: an SGD step of a 784-1000-200-10 MLP (987 210 weights) with SWAG-EM collecting every
  step and every 10th, against the bare step on the same device;
* ``predictive``: ``SWAG.predict_proba`` on 2 000 inputs, sampled networks (30 draws) and the
  linearised (GLM) probit predictive;
* ``laplace``: ``FactorLaplace.fit`` (K = 20; the randomized fit and online EM on the GGN stream) on a
  40-256-256-10 MLP (D = 79 114) and 4 000 points, then its GLM probit predictive;
* ``vifa``: a ``BayesianNetwork`` SVI step (``AutoLowRankFactorGuide`` + ``FactorELBO``, K = 10) on
  an 8-1000-1000-1 regression network (about 10^6 weights), 512 points;
* ``sklearn``: ``pyro_fa.sklearn.FactorAnalysis.fit`` on 20 000 x 500 data, K = 10, against
  scikit-learn's ``FactorAnalysis`` (CPU) on the same data.

    python benchmarks/bench_cuda.py                   # every workload (needs a CUDA device)
    python benchmarks/bench_cuda.py --only online-em laplace
    python benchmarks/bench_cuda.py --device cpu      # the CPU against itself: a dry run of the script

A workload that fails prints its traceback and the others still run; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
from torch import nn

WORKLOADS = ("online-em", "swag", "predictive", "vifa", "sklearn", "laplace")
#: problem sizes; ``--quick`` (a smoke run of the script) divides them
SIZE = {"dims": (1_000_000, 10_000_000), "hidden": 256, "n_laplace": 4000, "width": 1000, "n_fa": 20000, "d_fa": 500}
QUICK = {"dims": (100_000,), "hidden": 32, "n_laplace": 512, "width": 100, "n_fa": 2000, "d_fa": 50}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats, warmup=2, mean=False):
    """Median (or mean) seconds of ``repeats`` calls after ``warmup`` untimed ones, the device synchronised
    around each."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times) if mean else statistics.median(times)


def _max_diff(a, b):
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def online_em(devices, repeats):
    from pyro_fa import OnlineFactorAnalysis

    K = 20
    for D in SIZE["dims"]:
        row = {}
        for dev in devices:
            g = torch.Generator().manual_seed(0)
            xs = [torch.randn(D, generator=g).to(dev) for _ in range(4)]
            F, v = torch.randn(D, K, generator=g).to(dev), torch.randn(K, generator=g).to(dev)
            ref = _time(lambda: (F.T @ xs[0], F @ v), dev, repeats)
            del F
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            fa = OnlineFactorAnalysis(D, K, method="em", warmup=K, seed=0, dtype=torch.float32, device=dev)
            for i in range(K + 2):
                fa.update(xs[i % 4] + 0.01 * i)
            count = [0]

            def step(fa=fa, xs=xs):
                fa.update(xs[count[0] % 4])
                count[0] += 1

            # the M-step lands on every m_step_every-th update (10th at D = 10^6, 100th at 10^7): whole periods
            period = fa.fitter.m_step_interval(fa.dim)
            t = _time(lambda: [step() for _ in range(period)], dev, max(1, repeats // 10), warmup=1) / period
            mem = ""
            if torch.device(dev).type == "cuda":
                mem = f", GPU memory added {(torch.cuda.max_memory_allocated() - base) / (D * K * 4):.2f} x D*K*4 bytes"
            row[dev] = (t, fa.cov_factor.detach().cpu().double(), fa.cov_diag.detach().cpu().double())
            print(f"  online EM D={D:>8} {dev:>4}: update {t * 1e3:8.2f} ms = {t / ref:5.2f} x two mat-vecs on "
                  f"the same device ({ref * 1e3:.2f} ms){mem}")
            del fa, xs
        if len(row) == 2:
            (tc, fc, pc), (tg, fg, pg) = row[devices[0]], row[devices[1]]
            # F is fitted up to a rotation: compare F F^T (by K x K products) and psi
            ffd = (fc.T @ fc).square().sum() + (fg.T @ fg).square().sum() - 2 * (fc.T @ fg).square().sum()
            rel = float(ffd.clamp_min(0).sqrt() / (fc.T @ fc).norm())
            print(f"  online EM D={D:>8}: GPU speed-up {tc / tg:.1f}x; relative difference of F F^T {rel:.1e}, of "
                  f"psi {float((pc - pg).norm() / pc.norm()):.1e}")


def _mlp():
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 200), nn.ReLU(), nn.Linear(200, 10))


def swag(devices, repeats):
    from pyro_fa import SWAG

    for dev in devices:
        torch.manual_seed(0)
        x, y = torch.randn(128, 784, device=dev), torch.randint(0, 10, (128,), device=dev)
        result = {}
        for every in (None, 1, 10):
            net = _mlp().to(dev)
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            if every is not None:
                s = SWAG(net, rank=20, method="em", start_after=0, collect_every=every, warmup=20, seed=0)
                s.attach(opt)

            def step(net=net, opt=opt):
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()

            for _ in range(30):  # past the warm-up: the timed collections are full updates
                step()
            # the mean over whole periods of 10 steps: a collection lands on one step in 10
            result[every] = _time(step, dev, 10 * max(2, repeats // 2), warmup=0, mean=True)
        bare = result[None]
        print(f"  SWAG-EM {dev:>4}: bare SGD step {bare * 1e3:.2f} ms; collecting every step "
              f"{result[1] / bare:.2f}x, every 10th {result[10] / bare:.2f}x the bare step")


def _trained_swag(dev):
    from pyro_fa import SWAG

    g = torch.Generator().manual_seed(0)  # the same data and initial weights on every device
    x, y = torch.randn(2000, 64, generator=g).to(dev), torch.randint(0, 10, (2000,), generator=g).to(dev)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    s = SWAG(net, rank=20, method="em", start_after=50, collect_every=2, warmup=20, seed=0)
    s.attach(opt)
    for _ in range(150):
        i = torch.randint(0, 2000, (64,), generator=g).to(dev)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[i]), y[i]).backward()
        opt.step()
    return s, x


def predictive(devices, repeats):
    out = {}
    for dev in devices:
        s, x = _trained_swag(dev)
        runs = {
            "nn, 30 draws": lambda: s.predict_proba(x, num_samples=30, generator=torch.Generator().manual_seed(0)),
            "glm probit": lambda: s.predict_proba(x, pred_type="glm", link_approx="probit"),
        }
        for name, fn in runs.items():
            t = _time(fn, dev, repeats)
            out[(dev, name)] = (t, fn())
            print(f"  predict_proba {name:>12} {dev:>4}: {t * 1e3:8.2f} ms")
    if len(devices) == 2:
        for name in ("nn, 30 draws", "glm probit"):
            (tc, pc), (tg, pg) = out[(devices[0], name)], out[(devices[1], name)]
            print(f"  predict_proba {name:>12}: GPU speed-up {tc / tg:.1f}x; largest difference {_max_diff(pc, pg):.1e}")


def laplace(devices, repeats):
    from pyro_fa.laplace import FactorLaplace

    g = torch.Generator().manual_seed(0)
    n, h = SIZE["n_laplace"], SIZE["hidden"]
    x = torch.randn(n, 40, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    torch.manual_seed(0)
    net0 = nn.Sequential(nn.Linear(40, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))
    res = {}
    for fit in ("randomized", "online"):
        for dev in devices:
            net = _copy(net0).to(dev)
            loader = [(x[i:i + 256].to(dev), y[i:i + 256].to(dev)) for i in range(0, n, 256)]
            la = FactorLaplace(net, "classification", rank=20, curvature_fit=fit, seed=0)
            _sync(dev)
            t0 = time.perf_counter()
            la.fit(loader)
            _sync(dev)
            t = time.perf_counter() - t0
            p = la.predict_proba(x[:1000].to(dev), pred_type="glm", link_approx="probit")
            res[(fit, dev)] = (t, p)
            print(f"  FactorLaplace fit ({fit:>10}) {dev:>4}: {t:7.2f} s (D = {la.dim}, K = 20, N = {n})")
        if len(devices) == 2:
            (tc, pc), (tg, pg) = res[(fit, devices[0])], res[(fit, devices[1])]
            print(f"  FactorLaplace fit ({fit:>10}): GPU speed-up {tc / tg:.1f}x; largest difference of the GLM "
                  f"probit probabilities {_max_diff(pc, pg):.1e}")


def _copy(net):
    import copy

    return copy.deepcopy(net)


def vifa(devices, repeats):
    import pyro
    from pyro.infer import SVI
    from pyro.optim import Adam

    from pyro_fa import FactorELBO, GaussianPrior
    from pyro_fa.nn import BayesianNetwork

    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 8, generator=g)
    y = torch.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.1 * torch.randn(512, generator=g)
    res = {}
    for dev in devices:
        pyro.clear_param_store()
        torch.manual_seed(0)
        w = SIZE["width"]
        net = nn.Sequential(nn.Linear(8, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
        bnn = BayesianNetwork(net.to(dev), GaussianPrior(1.0), "gaussian", noise_scale=0.1, rank=10)
        svi = SVI(bnn.model, bnn.guide, Adam({"lr": 1e-3}), FactorELBO())
        xd, yd = X.to(dev), y.to(dev)
        t = _time(lambda: svi.step(xd, yd), dev, repeats)
        res[dev] = t
        print(f"  VIFA SVI step {dev:>4}: {t * 1e3:8.2f} ms (D = {bnn.guide.loc.numel()}, K = 10, N = 512)")
    if len(devices) == 2:
        print(f"  VIFA SVI step: GPU speed-up {res[devices[0]] / res[devices[1]]:.1f}x")


def sklearn(devices, repeats):
    import numpy as np
    from sklearn.decomposition import FactorAnalysis as SkFA

    from pyro_fa.sklearn import FactorAnalysis

    rng = np.random.default_rng(0)
    n, d = SIZE["n_fa"], SIZE["d_fa"]
    W = rng.normal(size=(d, 10))
    X = (rng.normal(size=(n, 10)) @ W.T + rng.normal(size=(n, d)) * rng.uniform(1, 3, d)).astype(np.float32)
    t0 = time.perf_counter()
    sk = SkFA(10, random_state=0).fit(X)
    t_sk = time.perf_counter() - t0
    print(f"  scikit-learn FactorAnalysis.fit (CPU): {t_sk:.2f} s, score {sk.score(X):.4f}")
    for dev in devices:
        est = FactorAnalysis(10, random_state=0, device=dev)
        est.fit(X)  # warm-up (CUDA context, kernels)
        t = _time(lambda: est.fit(X), dev, max(1, repeats // 5), warmup=0)
        print(f"  pyro_fa.sklearn.FactorAnalysis.fit {dev:>4}: {t:.3f} s = {t_sk / t:.1f}x faster than "
              f"scikit-learn; score {est.score(X):.4f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="the device compared with the CPU (default cuda)")
    p.add_argument("--only", nargs="+", choices=WORKLOADS, help="only these workloads (default all)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's: every core)")
    p.add_argument("--quick", action="store_true", help="small problems: a smoke run of the script")
    args = p.parse_args(argv)
    if args.quick:
        SIZE.update(QUICK)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (torch {torch.__version__})")
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu", args.device] if args.device != "cpu" else ["cpu"]
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "-"
    print(f"torch {torch.__version__}; CPU threads {torch.get_num_threads()}; {args.device}: {name}")
    failed = []
    for w in args.only or WORKLOADS:
        print(f"[{w}]", flush=True)
        t0 = time.perf_counter()
        try:
            globals()[w.replace("-", "_")](devices, args.repeats)
        except Exception:  # report and go on: one broken workload must not hide the others' numbers
            traceback.print_exc()
            failed.append(w)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
