"""Sharded online FA: communication and memory per rank at world size 1 and 2.

    .venv/bin/python benchmarks/bench_distributed.py [--dim 1000000] [--rank 20] [--method em]

Spawns gloo process groups on the CPU (world size 1, then 2; one thread per process) and
fits ``OnlineFactorAnalysis(dim, rank, process_group=...)`` to a stream of float32
vectors, each rank fed its rows. Reports per update (after the warm-up, M-steps included
at the default ``m_step_every``): wall time, collectives and bytes all-reduced; and per
rank: the fit's state (its ``state_dict`` tensors) and the peak resident memory of the
process above its state before the fit (``VmHWM``). The unsharded fit (no process group, in a
process of its own as well) is the reference.
"""
import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def peak_rss() -> int:
    """Peak resident memory of this process image in bytes (VmHWM: reset at exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def state_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if torch.is_tensor(t))


def run(rank, world_size, init_file, args, out_dir, sharded):
    torch.set_num_threads(1)
    if sharded:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=300))
    from pyro_fa import OnlineFactorAnalysis
    from pyro_fa.distributed import shard_bounds

    D, K = args.dim, args.rank
    lo, hi = shard_bounds(D, world_size, rank) if sharded else (0, D)
    g = torch.Generator().manual_seed(1 + rank)
    pool = 1.0 + 0.01 * torch.randn(8, hi - lo, generator=g)  # a few distinct vectors, cycled
    rss0 = peak_rss()
    t0 = time.perf_counter()
    fa = OnlineFactorAnalysis(D, K, args.method, warmup=args.warmup, seed=0, dtype=torch.float32,
                              process_group=dist.group.WORLD if sharded else None)
    init_s = time.perf_counter() - t0
    for t in range(args.warmup + 1):
        fa.update(pool[t % 8])
    sh = fa._sharding
    c0, b0 = (sh.n_collectives, sh.bytes_reduced) if sh else (0, 0)
    if sharded:
        dist.barrier()
    t0 = time.perf_counter()
    for t in range(args.updates):
        fa.update(pool[t % 8] + 0.001 * (t % 5))
    if sharded:
        dist.barrier()
    per_update = (time.perf_counter() - t0) / args.updates
    c1, b1 = (sh.n_collectives, sh.bytes_reduced) if sh else (0, 0)
    # the collectives alone: an all-reduce of one update's payload
    comm = 0.0
    if sharded and args.updates:
        payload = torch.zeros(int((b1 - b0) / max(c1 - c0, 1) / 8), dtype=torch.float64)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(payload)
        comm = (time.perf_counter() - t0) / 100
    result = dict(rank=rank, rows=hi - lo, state=state_bytes(fa), init_s=init_s, per_update=per_update,
                  collectives=(c1 - c0) / args.updates, bytes=(b1 - b0) / args.updates, comm=comm,
                  rss=peak_rss() - rss0)
    torch.save(result, os.path.join(out_dir, f"{world_size}_{int(sharded)}_{rank}.pt"))
    if sharded:
        dist.destroy_process_group()


def launch(world_size, args, sharded=True):
    out = tempfile.mkdtemp()
    mp.spawn(run, args=(world_size, os.path.join(out, "store"), args, out, sharded), nprocs=world_size)
    return [torch.load(os.path.join(out, f"{world_size}_{int(sharded)}_{r}.pt")) for r in range(world_size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--method", default="em", choices=["em", "sga"])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--updates", type=int, default=40)
    args = parser.parse_args()
    print(f"D = {args.dim:,}, K = {args.rank}, method {args.method!r}, float32 state, gloo on CPU, "
          f"{args.updates} updates after a warm-up of {args.warmup} (M-step every {max(1, args.dim // 100_000)})")
    rows = []
    for label, ws, sharded in (("unsharded", 1, False), ("world size 1", 1, True), ("world size 2", 2, True)):
        for r in launch(ws, args, sharded):
            rows.append((label, r))
    print(f"{'':13} {'rank':>4} {'rows':>9} {'state MiB':>10} {'peak RSS+ MiB':>14} {'init s':>7} "
          f"{'ms/update':>10} {'coll/upd':>9} {'bytes/upd':>10} {'all-reduce ms':>14}")
    for label, r in rows:
        print(f"{label:13} {r['rank']:>4} {r['rows']:>9,} {r['state'] / 2**20:>10.1f} {r['rss'] / 2**20:>14.1f} "
              f"{r['init_s']:>7.2f} {1e3 * r['per_update']:>10.1f} {r['collectives']:>9.2f} {r['bytes']:>10.0f} "
              f"{1e3 * r['comm']:>14.3f}")
    one = [r for label, r in rows if label == "world size 1"][0]
    two = [r for label, r in rows if label == "world size 2"]
    print(f"ratio world size 2 / 1: state per rank {max(r['state'] for r in two) / one['state']:.3f}, "
          f"peak RSS increase per rank {max(r['rss'] for r in two) / max(one['rss'], 1):.3f}, "
          f"time per update {max(r['per_update'] for r in two) / one['per_update']:.3f}, "
          f"bytes all-reduced per update {two[0]['bytes'] / max(one['bytes'], 1):.3f}")


if __name__ == "__main__":
    main()
