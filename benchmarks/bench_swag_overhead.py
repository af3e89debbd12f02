"""Training-time overhead of SWAG collection for an MLP with about 10^6 parameters.

For each posterior (ours: online EM and online SGA factor analysis; classic SWAG)
and ``collect_every`` in {1, 10, 100}, the mean time of one optimizer step
(``zero_grad``, forward, backward, ``SGD.step`` and the step hook of
:meth:`pyro_fa.SWAG.attach`) is divided by the mean time of the bare step measured in
the same process (interleaved: bare, then each configuration, then bare again, to
expose drift on a shared machine). The persistent state of each posterior (buffers,
workspaces, SGA's Adam moments, the flattening buffer) is reported as a multiple of
D*K*4 bytes. Each posterior first collects ``rank + 5`` iterates at every step
(untimed, past its warm-up of ``rank`` vectors), so that the timed collections pay the
full post-warm-up cost.

    python benchmarks/bench_swag_overhead.py                 # 784-1000-200-10 MLP, K = 20
    python benchmarks/bench_swag_overhead.py --steps 100 --rank 10
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from pyro_fa import SWAG


def _mlp():
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 200), nn.ReLU(), nn.Linear(200, 10))


def _state_bytes(swag: SWAG) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.data_ptr() not in seen and t.numel() > 1:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    def walk(obj):
        if torch.is_tensor(obj):
            add(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(swag.state_dict())
    add(getattr(swag, "_flat", None))
    if swag.method != "swag":
        add(getattr(swag.fa, "_work", None))
        for v in vars(swag.fa).values():  # other workspaces the fit keeps between updates
            add(v)
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="timed steps per configuration (default 200)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    net = _mlp().to(dev)
    D = sum(q.numel() for q in net.parameters())
    K = args.rank
    x = torch.randn(args.batch, 784, device=dev)
    y = torch.randint(10, (args.batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(opt, steps):
        for _ in range(5):  # warm the allocator and caches
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        sync()
        return (time.perf_counter() - t0) / steps

    def bare():
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        return timed(opt, args.steps)

    bare_times = [bare()]
    results = {"dim": D, "rank": K, "batch": args.batch, "threads": args.threads, "device": str(dev), "runs": []}
    for method in ("em", "sga", "swag"):
        for every in (1, 10, 100):
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            # collect_every grows after the warm-up, which the divergence guard would take for a change of
            # regime; a huge max_deviation keeps its cost (a norm over D per collection) in the timing
            swag = SWAG(net, rank=K, method=method, collect_every=1, warmup=K, seed=0, max_deviation=1e9)
            swag.attach(opt)
            run = {"method": method, "collect_every": every}
            try:
                timed(opt, K + 5 - 5)  # + 5 untimed steps inside timed(): past the warm-up
                swag.collect_every = every
                steps = max(args.steps, 2 * every)
                run.update(step_s=timed(opt, steps), collections=swag.n_collected)
            except RuntimeError as e:  # e.g. a float32 capacitance that lost positive-definiteness
                run.update(step_s=float("nan"), error=f"{type(e).__name__}: {str(e)[:120]}")
            run["state_over_DK4"] = _state_bytes(swag) / (D * K * 4)
            results["runs"].append(run)
            del swag, opt
        bare_times.append(bare())
    b = sum(bare_times) / len(bare_times)
    results["bare_step_s"] = bare_times
    print(f"MLP 784-1000-200-10: D = {D:,} parameters, K = {K}, batch {args.batch}, {args.threads} thread(s), "
          f"{dev}; bare SGD step {1e3 * b:.1f} ms (runs: {', '.join(f'{1e3 * t:.1f}' for t in bare_times)})")
    print("| posterior | collect_every | step time / bare step | state / (D·K·4 bytes) |")
    print("| --- | --- | --- | --- |")
    names = {"em": "ours, online EM", "sga": "ours, online SGA", "swag": "classic SWAG"}
    for r in results["runs"]:
        r["ratio"] = r["step_s"] / b
        ratio = f"{r['ratio']:.2f}" if "error" not in r else f"failed ({r['error'][:60]}...)"
        print(f"| {names[r['method']]} | {r['collect_every']} | {ratio} | {r['state_over_DK4']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
