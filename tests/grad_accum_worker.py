"""Run under torchrun: the common mistakes of accumulation under DDP, shown with DDP itself.

    torchrun --standalone --nproc_per_node=2 tests/grad_accum_worker.py

Counts the all-reduces with tests/ddp_probe.py's counting communication hook (1 bucket: a tiny
model): DDP decides in forward() whether the coming backward all-reduces. Then: syncing on the
first micro-batch leaves the replicas' gradients different; an extra division by the world size
shrinks the gradient.
"""

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ddp_probe import counting_allreduce_hook, counts  # noqa: E402


def print0(text):
    if dist.get_rank() == 0:
        print(text, flush=True)


def main():
    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, counting_allreduce_hook)
    x = torch.randn(8, 4)
    model(x).sum().backward()  # a first synchronized pass (DDP rebuilds its buckets after it)

    before = counts["buckets"]
    with model.no_sync():
        model(x).sum().backward()
    print0(f"forward+backward inside no_sync: {counts['buckets'] - before} all-reduces")

    before = counts["buckets"]
    out = model(x)  # the mistake: forward outside no_sync
    with model.no_sync():
        out.sum().backward()
    print0(f"forward outside, backward inside no_sync: {counts['buckets'] - before} all-reduces")

    # Which micro-batch syncs: each rank gets its own data, 2 micro-batches per step.
    rank_data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + i))
                 for i in range(2)]
    for label, synced in (("last", 1), ("first", 0)):
        model.zero_grad()
        for i, x in enumerate(rank_data):
            with model.no_sync() if i != synced else nullcontext():
                (model(x).sum() / 2).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grads)
        print0(f"sync on the {label} micro-batch: gradients identical on all ranks: "
               f"{all(torch.equal(g, gathered[0]) for g in gathered)}")

    # An extra division by the world size: DDP already averages.
    model.zero_grad()
    (model(rank_data[0]).sum() / dist.get_world_size()).backward()
    wrong = model.module.weight.grad.clone()
    model.zero_grad()
    model(rank_data[0]).sum().backward()
    ratio = (wrong.norm() / model.module.weight.grad.norm()).item()
    print0(f"extra division by world size: gradient x {ratio:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # then skip interpreter shutdown: with gloo it can abort a finished run (debugging/README.md)
    os._exit(0)
