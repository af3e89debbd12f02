"""Float32 soak test: many online updates at large D stay finite with positive variances.

    python benchmarks/soak_float32.py --dim 1000000 --updates 10000 --method em

The stream is a random walk around a fixed point with low-rank structure and
small isotropic noise, the shape of late SGD iterates.
"""
from __future__ import annotations

import argparse
import time

import torch

from pyro_fa import OnlineFactorAnalysis


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1_000_000)
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--updates", type=int, default=10_000)
    p.add_argument("--method", default="em", choices=["em", "sga"])
    p.add_argument("--scale", type=float, default=1e-3, help="standard deviation of the iterates")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    D, K = args.dim, args.rank
    basis = torch.randn(D, K, generator=g) * (args.scale / K**0.5)
    centre = torch.randn(D, generator=g)
    fa = OnlineFactorAnalysis(D, K, method=args.method, seed=0, dtype=torch.float32)
    t0 = time.perf_counter()
    checks = sorted({args.updates // 10 * i for i in range(1, 11)})
    for t in range(1, args.updates + 1):
        x = centre + basis @ torch.randn(K, generator=g) + 0.1 * args.scale * torch.randn(D, generator=g)
        fa.update(x)
        if t in checks:
            F, psi = fa.cov_factor, fa.cov_diag
            ok = bool(torch.isfinite(F).all() and torch.isfinite(psi).all() and (psi > 0).all())
            total = float(psi.sum() + F.pow(2).sum())
            truth = float(basis.pow(2).sum() + D * (0.1 * args.scale) ** 2)
            print(f"{t:>7} updates  finite and psi > 0: {ok}  total variance / truth: {total / truth:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if not ok:
                raise SystemExit("non-finite state")


if __name__ == "__main__":
    main()
