"""Run under torchrun: the common mistakes of accumulation under DDP, shown with DDP itself.

    torchrun --standalone --nproc_per_node=2 tests/grad_accum_worker.py

Counts the all-reduces with tests/ddp_probe.py's counting communication hook (1 bucket: a tiny
model): DDP decides in forward() whether the coming backward all-reduces. Then: syncing on the first
micro-batch leaves the replicas' gradients different; zeroing the gradients between micro-batches
keeps only the last one's; clipping after every micro-batch misses the large batch's clipped
gradient; and with BatchNorm, accumulated micro-batches do not give the large batch's gradient (a
model without does).
"""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

# before any process group: torch.distributed.nn would otherwise keep the group alive past
# destroy_process_group() (common/launcher.py explains)
import torch.distributed.nn  # noqa: F401
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ddp_probe import counting_allreduce_hook, counts  # noqa: E402


def print0(text):
    if dist.get_rank() == 0:
        print(text, flush=True)


def main():
    # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo")
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
    rank_data = [
        torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + i))
        for i in range(2)
    ]
    for label, synced in (("last", 1), ("first", 0)):
        model.zero_grad()
        for i, x in enumerate(rank_data):
            with model.no_sync() if i != synced else nullcontext():
                (model(x).sum() / 2).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grads)
        print0(
            f"sync on the {label} micro-batch: gradients identical on all ranks: "
            f"{all(torch.equal(g, gathered[0]) for g in gathered)}"
        )

    # zero_grad between the micro-batches of a window: only the last micro-batch's gradient is left.
    def window_gradient(model, zero_in_between: bool) -> torch.Tensor:
        model.zero_grad()
        for i, x in enumerate(rank_data):
            if zero_in_between:
                model.zero_grad()
            with model.no_sync() if i != len(rank_data) - 1 else nullcontext():
                (model(x).sum() / len(rank_data)).backward()
        return model.module.weight.grad.clone()

    zeroed, accumulated = window_gradient(model, True), window_gradient(model, False)
    model.zero_grad()
    (model(rank_data[-1]).sum() / len(rank_data)).backward()
    last_only = model.module.weight.grad
    print0(
        "zero_grad between micro-batches: equals the last micro-batch's alone: "
        f"{torch.equal(zeroed, last_only)}, "
        f"equals the accumulated window: {torch.allclose(zeroed, accumulated)}"
    )

    # Gradient clipping under accumulation: on the window's all-reduced gradient only. The
    # reference: one process's clipped gradient of the mean over all ranks' micro-batches.
    max_norm = 0.1  # well below these gradients' norm
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.module.state_dict())
    for rank in range(dist.get_world_size()):
        for i in range(len(rank_data)):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            (reference(x).sum() / (len(rank_data) * dist.get_world_size())).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    large_batch = torch.cat([p.grad.flatten() for p in reference.parameters()])
    for label, every_micro_batch in (
        ("on the sync step only", False),
        ("after every micro-batch", True),
    ):
        model.zero_grad()
        for i, x in enumerate(rank_data):
            sync = i == len(rank_data) - 1
            with model.no_sync() if not sync else nullcontext():
                (model(x).sum() / len(rank_data)).backward()
            if sync or every_micro_batch:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        clipped = torch.cat([p.grad.flatten() for p in model.parameters()])
        print0(
            f"clip {label}: equals the large batch's clipped gradient: "
            f"{torch.allclose(clipped, large_batch, rtol=1e-5, atol=1e-7)}"
        )

    # Accumulation equals the large batch only without
    # BatchNorm (which normalizes each micro-batch on its own).
    # One process's view, no DDP needed: 2 micro-batches of 4 accumulated vs one batch of 8.
    batch = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(5)) * 2 + 1
    for label, norm in (
        ("BatchNorm", torch.nn.BatchNorm2d(3)),
        ("no BatchNorm", torch.nn.Identity()),
    ):
        torch.manual_seed(1)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 3, 3), norm, torch.nn.Flatten(), torch.nn.Linear(12, 2)
        )
        net(batch).pow(2).mean().backward()
        large = torch.cat([p.grad.flatten() for p in net.parameters()])
        net.zero_grad()
        for half in batch.split(4):
            (net(half).pow(2).mean() / 2).backward()
        accumulated = torch.cat([p.grad.flatten() for p in net.parameters()])
        print0(
            f"accumulation vs the large batch, {label}: relative difference "
            f"{((accumulated - large).norm() / large.norm()).item():.1e}"
        )
    # the DDP model (and the output whose graph it made) hold the process group
    del model, out
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
