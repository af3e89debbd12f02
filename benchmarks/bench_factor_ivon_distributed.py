"""Data-parallel FactorIVON: step time, bytes all-reduced and state per rank at world size 1 and 2.

    OMP_NUM_THREADS=1 python benchmarks/bench_factor_ivon_distributed.py [--rank 10] [--batch 128] [--update-every 10]

A 784-1000-200-10 MLP (D = 987,210), cross-entropy on a fixed global minibatch of ``--batch`` rows, FactorIVON at
rank K. Four runs, each in processes of its own (spawned, one thread each): one process without a group (the
reference); two processes without a group, each on half of the minibatch (no communication: what running two
replicas side by side costs on this machine, memory bandwidth shared); a gloo group of one process; and a gloo
group of two processes, each rank on half of the minibatch (``process_group=``). Reported per step after ``--warm``
untimed steps: the wall time of the whole step (draw, forward, backward, ``step()``; between barriers in a group),
the optimizer's part (``step()``, its all-reduces included) and the time inside the averager's collectives (the
transfer and the wait for the other rank), the collectives and bytes all-reduced (the averager's counters), and one
all-reduce of a D-vector alone; per rank: the bytes of every tensor the optimizer holds between steps (state, the
factorisation's and the draw's kept buffers). The runs go in ``--repeats`` rounds; each is reported from its round
of least median step time (the least disturbed on a shared machine). The last line checks that the two-rank run
ends where the reference does.
"""
import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 200), nn.ReLU(), nn.Linear(200, 10))


def held_bytes(opt) -> int:
    """Bytes of the distinct storages the optimizer keeps between steps."""
    tensors = [v for v in opt.state.values() if torch.is_tensor(v)]
    tensors += list(opt._factor_buffers.values()) + list(opt._scratch_buffers.values())
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run(rank, world_size, init_file, args, out_dir, grouped):
    torch.set_num_threads(1)
    if grouped:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
    from pyro_fa.optim import FactorIVON

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(10, (args.batch,), generator=g)
    share = args.batch // world_size
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    net = _mlp()
    opt = FactorIVON(net.parameters(), lr=0.1, ess=60000.0, hess_init=0.1, weight_decay=1e-4, rank=args.rank,
                     update_every=args.update_every, process_group=dist.group.WORLD if grouped else None)
    barrier = dist.barrier if grouped else (lambda: None)
    inside = [0.0]  # seconds inside the averager's collectives
    if grouped:
        collective = opt._averager._collective

        def timed(fn, buf):
            t0 = time.perf_counter()
            collective(fn, buf)
            inside[0] += time.perf_counter() - t0

        opt._averager._collective = timed

    def one_step():
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(args.warm):
        one_step()
    c0, b0 = (opt._averager.n_collectives, opt._averager.bytes_reduced) if grouped else (0, 0)
    inside[0] = 0.0
    steps, parts = [], []
    for _ in range(args.steps):
        barrier()
        t0 = time.perf_counter()
        parts.append(one_step())
        barrier()
        steps.append(time.perf_counter() - t0)
    c1, b1 = (opt._averager.n_collectives, opt._averager.bytes_reduced) if grouped else (0, 0)
    comm = 0.0
    if grouped:
        vector = torch.zeros(opt.dim)
        barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(vector)
        comm = (time.perf_counter() - t0) / 10
    result = dict(rank=rank, dim=opt.dim, rows=len(x), step=statistics.median(steps),
                  mean_step=statistics.mean(steps), part=statistics.median(parts), inside=inside[0] / args.steps,
                  collectives=(c1 - c0) / args.steps, bytes=(b1 - b0) / args.steps, comm=comm, held=held_bytes(opt),
                  mean=opt.get_posterior().loc)
    torch.save(result, os.path.join(out_dir, f"{world_size}_{int(grouped)}_{rank}.pt"))
    if grouped:
        dist.destroy_process_group()


def launch(world_size, args, grouped=True):
    out = tempfile.mkdtemp()
    mp.spawn(run, args=(world_size, os.path.join(out, "store"), args, out, grouped), nprocs=world_size)
    return [torch.load(os.path.join(out, f"{world_size}_{int(grouped)}_{r}.pt")) for r in range(world_size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--update-every", type=int, default=10)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs = (("no group", 1, False), ("2 processes, no group", 2, False), ("world size 1", 1, True),
            ("world size 2", 2, True))
    best = {}
    for _ in range(args.repeats):
        for label, ws, grouped in runs:
            ranks = launch(ws, args, grouped)
            if label not in best or max(r["step"] for r in ranks) < max(r["step"] for r in best[label]):
                best[label] = ranks
    rows = [(label, r) for label, _, _ in runs for r in best[label]]
    D = rows[0][1]["dim"]
    print(f"MLP 784-1000-200-10, D = {D:,}, K = {args.rank}, update_every = {args.update_every}, global batch "
          f"{args.batch}, float32, gloo on the CPU, one thread per process, {args.warm} warm + {args.steps} timed "
          f"steps, the best of {args.repeats} rounds; load average {load:.1f} before, {os.getloadavg()[0]:.1f} "
          f"after, on {os.cpu_count()} cores")
    print("| run | rank | rows | median step (ms) | mean step (ms) | median step() (ms) | in collectives (ms, mean) "
          "| collectives / step | bytes all-reduced / step | / (4 D) | one D-vector all-reduce (ms) | held MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in rows:
        print(f"| {label} | {r['rank']} | {r['rows']} | {1e3 * r['step']:.1f} | {1e3 * r['mean_step']:.1f} | "
              f"{1e3 * r['part']:.1f} | {1e3 * r['inside']:.1f} | {r['collectives']:.2f} | {r['bytes']:,.0f} | "
              f"{r['bytes'] / (4 * D):.2f} | {1e3 * r['comm']:.2f} | {r['held'] / 2**20:.1f} |")
    ref = rows[0][1]
    two = [r for label, r in rows if label == "world size 2"]
    lone = [r for label, r in rows if label == "2 processes, no group"]
    one = [r for label, r in rows if label == "world size 1"][0]

    def ratio(key, over):
        return max(r[key] for r in two) / max(r[key] for r in over)

    print(f"ratio world size 2 / no group: median step {ratio('step', [ref]):.3f}, mean step "
          f"{ratio('mean_step', [ref]):.3f}, step() {ratio('part', [ref]):.3f}, held bytes per rank "
          f"{ratio('held', [ref]):.3f}; world size 2 / 2 processes without a group: median step "
          f"{ratio('step', lone):.3f}, step() {ratio('part', lone):.3f}; bytes all-reduced per step, world size 2 / 1: "
          f"{two[0]['bytes'] / max(one['bytes'], 1):.3f}")
    gap = float((two[0]["mean"] - ref["mean"]).abs().max())
    same = all(torch.equal(r["mean"], two[0]["mean"]) for r in two)
    print(f"final mean, world size 2 vs no group: max |difference| {gap:.2e} (max |mean| "
          f"{float(ref['mean'].abs().max()):.2f}); identical on every rank: {same}")


if __name__ == "__main__":
    main()
