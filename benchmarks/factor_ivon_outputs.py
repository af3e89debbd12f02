"""Seeded FactorIVON runs (K = 10, a 784-100-10 MLP, 30 steps, float32 and float64, update_every 1 and 10): save the
final state, or compare it with a saved one, to show that a change to the implementation is rounding-level only.

    PYTHONPATH=. python benchmarks/factor_ivon_outputs.py save before.pt      # on the old code
    PYTHONPATH=. python benchmarks/factor_ivon_outputs.py compare before.pt   # on the new code
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from pyro_fa.optim import FactorIVON


def run() -> dict:
    torch.set_num_threads(1)
    out = {}
    for dtype in (torch.float32, torch.float64):
        for T in (1, 10):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10)).to(dtype)
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(128, 784, generator=g).to(dtype), torch.randint(10, (128,), generator=g)
            opt = FactorIVON(net.parameters(), lr=0.1, ess=60000.0, hess_init=0.1, weight_decay=1e-4, rank=10,
                             update_every=T)
            draws = []
            for t in range(30):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    nn.functional.cross_entropy(net(x), y).backward()
                    if t % 7 == 0:
                        draws.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
                opt.step()
            q = opt.get_posterior()
            out[f"{dtype}-T{T}"] = dict(mean=q.loc, diag=q.prec_diag, factor=q.prec_factor, hess=opt.state["hess"],
                                        basis=opt.state["basis"], eig=opt.state["eigvals"], draws=torch.stack(draws))
    return out


def compare(new: dict, old: dict) -> None:
    for key in old:
        tol = 1e-5 if "float32" in key else 1e-12
        ok, worst = True, 0.0
        for name, before in old[key].items():
            after = new[key][name]
            if name in ("basis", "factor"):  # eigenvectors: the sign is arbitrary
                after, before = after.abs(), before.abs()
            scale = float(before.abs().max())
            ok &= torch.allclose(after, before, rtol=0, atol=tol * scale)
            worst = max(worst, float((after - before).abs().max()) / scale)
        print(f"{key}: allclose(rtol=0, atol={tol:g} max|before|) {ok}; max |after - before| / max|before| {worst:.1e}")


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "save":
        torch.save(run(), path)
    else:
        compare(run(), torch.load(path))
