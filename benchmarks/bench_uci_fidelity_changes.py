"""Cheap changes to the factor-analysis posteriors of ``pyro-fa uci`` and their distance to HMC on one split.

Reads the hyperparameters a ``pyro-fa uci --hmc-reference`` run chose (its unit files: never chosen on the split
scored here), retrains the final fit of one split (one replica, the chosen configuration and steps) and scores
variants of the posterior against that split's HMC reference (:mod:`pyro_fa.experiments.uci.fidelity`, the
competition's W1 in standardised y, the moments' W2, the split's test LL):

* VIFA (``--vi``): the guide's rank (``--ranks``), the scale of its deviations from the mean (``--scales``:
  theta = loc + sqrt(s) (theta - loc)), and the prior precision of the HMC reference instead of its own choice;
* SWAG online EM: the scale (``--swag-scales``; 0, the SWA mean, always) and the rank (``--ranks``).

Usage::

    python benchmarks/bench_uci_fidelity_changes.py --run /work/fid_runs/boston --dataset boston --split 0 \\
        --references /work/hmc_refs/boston-L100
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from pyro_fa.datasets import load_uci
from pyro_fa.experiments.uci.fidelity import find_references
from pyro_fa.experiments.uci.protocol import METHODS, Budget, _spec, _vi_model, evaluate, final_data, train
from pyro_fa.experiments.uci.swag_family import _map_then_collect, _swag_predict


def _choices(run: Path, dataset: str) -> dict:
    out = {}
    for path in sorted((run / "units").glob(f"{dataset}__*.json")):
        record = json.loads(path.read_text())
        for name, res in record["methods"].items():
            out[name] = {**res["choice"], "scale": res.get("scale")}
    return out


def _score(ref, means, nv, data, seed):
    """means (S, 1, M), nv (1, 1) or (S, 1, 1): the distances and the test LL."""
    var = nv.expand(means.shape[0], 1, 1) if nv.dim() == 3 else nv.unsqueeze(0).expand(means.shape[0], 1, 1)
    d = ref.score(means[:, 0], var[:, 0, 0], seed)
    d["ll"] = float(evaluate(means, var, data)["ll"][0])
    return d


def vi_variants(name, choice, d, ref, args, budget):
    data = final_data([d])
    out = []
    for rank in args.ranks:
        for precision in dict.fromkeys([choice["precision"], ref.precision]):
            b = Budget(rank=rank)
            gen = torch.Generator().manual_seed(args.seed)
            cpu_gen = torch.Generator().manual_seed(args.seed)
            torch.manual_seed(args.seed)
            spec = _spec(METHODS[name], [d])
            start = time.perf_counter()
            model = _vi_model(METHODS[name], spec, [{**choice, "precision": precision}], b, cpu_gen, data.x, 1)
            train(model, data, choice["steps"], budget, gen)
            seconds = time.perf_counter() - start
            p = model.params()
            theta = model._family.rsample(model, p, budget.test_samples, torch.Generator().manual_seed(args.seed + 2))
            nv = model.likelihood_scale(p).pow(2).unsqueeze(-1).detach()
            for s in args.scales:
                th = p["loc"] + math.sqrt(s) * (theta - p["loc"])
                with torch.no_grad():
                    means = model.mlp.forward(th, data.x_eval)
                out.append({"method": name, "rank": rank, "precision": precision, "scale": s, "seconds": seconds,
                            **_score(ref, means, nv, data, args.seed + 7919 * d.split)})
    return out


def swag_variants(choice, d, ref, args, budget):
    data = final_data([d])
    out = []
    for rank in args.ranks:
        b = Budget(rank=rank, swag_warmup=max(Budget.swag_warmup, rank))  # online EM needs rank <= warm-up
        gen = torch.Generator().manual_seed(args.seed)
        cpu_gen = torch.Generator().manual_seed(args.seed)
        torch.manual_seed(args.seed)
        spec = _spec(METHODS["swag-em-1x50"], [d])
        timings: dict = {}
        swags, model = _map_then_collect(spec, data, choice["precision"], choice["lr"], choice["steps"],
                                         choice["swag_lr"], b, ["em"], range(1), cpu_gen, gen, None, timings)
        for s in sorted({0.0, *args.swag_scales}):
            swags["em"][0].scale = s
            means, nv = _swag_predict(swags["em"], model, data, [[0]], budget.test_samples,
                                      torch.Generator().manual_seed(args.seed + 2))
            out.append({"method": "swag-em-1x50", "rank": rank, "precision": choice["precision"], "scale": s,
                        "seconds": timings["map"] + timings["collect"], "map_seconds": timings["map"],
                        **_score(ref, means, nv, data, args.seed + 7919 * d.split)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="the output folder of a pyro-fa uci run (its choices)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--references", required=True)
    parser.add_argument("--vi", nargs="*", default=["vifa-gaussian-1x50"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[10, 30])
    parser.add_argument("--scales", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--swag-scales", nargs="+", type=float, default=[1.0, 10.0, 100.0, 1000.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = Budget()
    d = load_uci(args.dataset, args.split, dtype=torch.float32)
    ref = find_references(args.references, args.dataset, [d])[args.split]
    choices = _choices(Path(args.run), args.dataset)
    print(f"{args.dataset} split {args.split}: HMC alpha {ref.precision}, noise {ref.noise:.3f}")
    print(f"{'method':<22} {'rank':>4} {'alpha':>6} {'scale':>6} {'W1':>7} {'W2':>7} {'test LL':>8} {'s':>6}")
    rows = []
    jobs = [lambda name=name: vi_variants(name, choices[name], d, ref, args, budget) for name in args.vi]
    jobs.append(lambda: swag_variants(choices["swag-em-1x50"], d, ref, args, budget))
    for job in jobs:
        for r in job():
            rows.append(r)
            print(f"{r['method']:<22} {r['rank']:>4} {r['precision']:>6g} {r['scale']:>6g} {r['w1']:7.4f} "
                  f"{r['w2']:7.4f} {r['ll']:8.3f} {r['seconds']:6.1f}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
