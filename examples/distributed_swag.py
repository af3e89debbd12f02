"""Sharded SWAG on a DistributedDataParallel MLP.

    .venv/bin/torchrun --nproc_per_node 2 examples/distributed_swag.py          # gloo on CPUs, nccl on GPUs

(from the repository root after ``make setup``: ``torchrun``, torch's launcher, is in ``.venv/bin``;
plain ``torchrun`` works once ``source .venv/bin/activate`` has run.)

Every rank trains the same replicated MLP on its share of the data (DDP all-reduces the
gradients). ``SWAG(ddp_model, ...)`` sees the DDP wrapper and shards the posterior over
its process group: each rank collects only its rows of the flattened weights, once per
step, so the posterior's memory per rank is D*K/W numbers instead of D*K. Predictions
draw whole weight vectors (a shared latent draw, each rank's rows gathered) and agree
on every rank.
"""
import argparse
import gc
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import SWALR

from pyro_fa import SWAG
from pyro_fa.distributed import shard_bounds


def make_data(n, generator):
    x = torch.randn(n, 8, generator=generator)
    y = torch.sin(2 * x[:, :1]) + 0.5 * x[:, 1:2] ** 2 - x[:, 2:3] * x[:, 3:4] + 0.1 * torch.randn(n, 1, generator=generator)
    return x, y


def state_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if torch.is_tensor(t))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--swa-epochs", type=int, default=10, help="last epochs, collected at a constant rate")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rank", type=int, default=10, help="K, the number of factors")
    parser.add_argument("--method", default="em", choices=["em", "sga", "swag"])
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    g = torch.Generator().manual_seed(0)
    x, y = make_data(4096, g)
    x_test, y_test = make_data(1024, g)
    lo, hi = shard_bounds(x.shape[0], world, rank)  # this rank's share of the training data
    x, y = x[lo:hi].to(device), y[lo:hi].to(device)
    x_test, y_test = x_test.to(device), y_test.to(device)

    torch.manual_seed(0)  # DDP broadcasts rank 0's initial weights anyway
    net = torch.nn.Sequential(torch.nn.Linear(8, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 64
    steps_per_epoch = math.ceil(x.shape[0] / batch)
    pretrain = (args.epochs - args.swa_epochs) * steps_per_epoch
    # DDP detected: the posterior is sharded over DDP's process group (collect once, not world-size times)
    swag = SWAG(model, rank=args.rank, method=args.method, start_after=pretrain, collect_every=1,
                warmup=max(args.rank, steps_per_epoch), seed=0)
    swag.attach(opt)
    swa_sched = SWALR(opt, swa_lr=0.02, anneal_epochs=1)

    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(epoch)).to(device)
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
        if epoch >= args.epochs - args.swa_epochs - 1:
            swa_sched.step()
    train_s = time.perf_counter() - t0

    with torch.no_grad():
        rmse_last = float((net(x_test) - y_test).pow(2).mean().sqrt())
        with swag.sampled_weights(swag.loc):  # the SWA mean: this rank's rows, gathered
            rmse_swa = float((net(x_test) - y_test).pow(2).mean().sqrt())
        preds = swag.predictive_samples(x_test, num_samples=20, generator=torch.Generator(device).manual_seed(1))
        mean, std = preds.mean(0), preds.std(0)
        rmse_bma = float((mean - y_test).pow(2).mean().sqrt())
        noise = 0.1
        nll = float(0.5 * math.log(2 * math.pi) + (0.5 * (std ** 2 + noise ** 2).log()
                    + 0.5 * (mean - y_test) ** 2 / (std ** 2 + noise ** 2)).mean())
    # every rank ran the same sampled networks
    gathered = [torch.empty_like(mean) for _ in range(world)]
    dist.all_gather(gathered, mean)
    agree = all(torch.equal(gathered[0], m) for m in gathered)

    posterior = swag.fa if args.method != "swag" else swag
    mem = torch.tensor([float(state_bytes(posterior))], device=device)
    mems = [torch.empty_like(mem) for _ in range(world)]
    dist.all_gather(mems, mem)
    if rank == 0:
        sh = swag.sharding
        print(f"world size {world} ({dist.get_backend()}), D = {swag.dim} weights, K = {args.rank}, "
              f"method {args.method!r}")
        print(f"rows per rank: {[hi - lo for lo, hi in sh.bounds]}; posterior state per rank: "
              + ", ".join(f"{float(m) / 2**20:.2f} MiB" for m in mems)
              + f" (one process would hold {sum(float(m) for m in mems) / 2**20:.2f} MiB)")
        print(f"collected {swag.n_collected} vectors in {train_s:.1f} s of training; "
              f"{sh.n_collectives} collectives, {sh.bytes_reduced / 2**10:.1f} KiB reduced")
        print(f"test RMSE: last iterate {rmse_last:.4f}, SWA {rmse_swa:.4f}, SWAG model average {rmse_bma:.4f}; "
              f"SWAG NLL {nll:.4f} (noise sd {noise})")
        print(f"predictions identical on all ranks: {agree}")
    # free the cyclic garbage (DDP's) while the process group lives: collected at exit, after
    # destroy_process_group, it can abort the process (torch 2.13, gloo)
    gc.collect()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("the ranks' predictions differ")


if __name__ == "__main__":
    main()
