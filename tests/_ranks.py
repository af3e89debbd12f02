"""Running a test scenario in spawned torch.distributed processes (the distributed tests share it)."""
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def run_ranks(entry, args, world_size, out_dir, timeout, what="the ranks"):
    """Run ``entry(rank, *args)`` in ``world_size`` spawned processes and return what each saved to
    ``out_dir/rank{r}.pt``, in rank order; a run past ``timeout`` seconds (a hang) kills them and fails the test."""
    ctx = mp.start_processes(entry, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{what}: the ranks did not finish within {timeout} s (a hang)")
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
