"""Run under torchrun (2 ranks, gloo): 04_syncbn's
CpuSyncBatchNorm at module level; rank 0 prints one JSON line.

    torchrun --standalone --nproc_per_node=2 tests/syncbn_worker.py

CpuSyncBatchNorm on 2 ranks x half batch vs plain BatchNorm in this process on the
full batch (forward output, DDP-averaged gradients, running statistics, over 3 SGD
steps); plain BatchNorm on 2 ranks for contrast; whether the running statistics
are the same on every rank; and the number of all-reduces in train and eval mode.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# before any process group: torch.distributed.nn would otherwise keep the group alive past
# destroy_process_group() (common/launcher.py explains)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "04_syncbn"))

from cpu_sync_batchnorm import CpuSyncBatchNorm, convert_to_cpu_sync_batchnorm  # noqa: E402

from common.models import SmallCNN  # noqa: E402

STEPS, FULL_BATCH = 3, 16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def buffers(model: nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if "running" in k}


def math_checks() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = SmallCNN(in_channels=3, num_classes=5, width=4, norm="batch")
    reference = copy.deepcopy(base)  # one process, full batch, plain BatchNorm
    synced = DDP(convert_to_cpu_sync_batchnorm(copy.deepcopy(base)))
    plain = DDP(copy.deepcopy(base))  # plain BatchNorm under DDP: local statistics
    models = {"reference": reference, "sync": synced, "plain": plain}
    optimizers = {
        k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()
    }
    worst = {
        "sync": {"output": 0.0, "grad": 0.0, "running_stats": 0.0, "params": 0.0},
        "plain": {"output": 0.0, "grad": 0.0, "running_stats": 0.0, "params": 0.0},
    }
    shard = slice(rank * FULL_BATCH // world, (rank + 1) * FULL_BATCH // world)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)  # the same full batch on every rank
        x = torch.randn(FULL_BATCH, 3, 8, 8, generator=generator) * 2 + 0.5
        y = torch.randint(0, 5, (FULL_BATCH,), generator=generator)
        outputs = {}
        for name, model in models.items():
            inputs, labels = (x, y) if name == "reference" else (x[shard], y[shard])
            outputs[name] = model(inputs)
            optimizers[name].zero_grad()
            F.cross_entropy(outputs[name], labels).backward()
        ref_grads = [p.grad for p in reference.parameters()]
        for name in ("sync", "plain"):
            w = worst[name]
            w["output"] = max(
                w["output"], relative(outputs[name].detach(), outputs["reference"][shard].detach())
            )
            grads = [p.grad for p in models[name].module.parameters()]
            # All gradients as one vector: a conv bias before BatchNorm has a gradient of ~0, whose
            # own relative error means nothing.
            w["grad"] = max(
                w["grad"],
                relative(
                    torch.cat([g.flatten() for g in grads]),
                    torch.cat([r.flatten() for r in ref_grads]),
                ),
            )
        for optimizer in optimizers.values():
            optimizer.step()
        for name in ("sync", "plain"):
            w = worst[name]
            ref_buffers, own = buffers(reference), buffers(models[name].module)
            w["running_stats"] = max(
                [w["running_stats"]] + [relative(own[k], ref_buffers[k]) for k in ref_buffers]
            )
    # Eval mode normalizes with the running statistics: after
    # synchronized updates they are the same on every rank
    # (bitwise); plain BatchNorm's, updated from each rank's own batch, are not.
    identical_running_stats = {}
    for name in ("sync", "plain"):
        mine = torch.cat([v.double().flatten() for v in buffers(models[name].module).values()])
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        identical_running_stats[name] = all(torch.equal(every[0], other) for other in every)
    for name in ("sync", "plain"):
        own = dict(models[name].module.named_parameters())
        worst[name]["params"] = max(relative(own[k], p) for k, p in reference.named_parameters())
        worst[name] = {k: max_over_ranks(v) for k, v in worst[name].items()}

    # Count the all-reduces the synchronized layers issue,
    # on the unwrapped model (as evaluate() uses it).
    module = synced.module
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        x = torch.randn(FULL_BATCH // world, 3, 8, 8)
        module.train()
        out = module(x)
        train_forward = len(calls)
        out.sum().backward()
        train_backward = len(calls) - train_forward
        module.eval()
        before = len(calls)
        if rank == 0:  # rank 0 alone: a collective here would have no partner on rank 1
            with torch.no_grad():
                module(x)
        eval_forward = len(calls) - before
    finally:
        dist.all_reduce = real_all_reduce
    dist.barrier()
    layers = sum(isinstance(m, CpuSyncBatchNorm) for m in module.modules())
    return dict(
        worst=worst,
        identical_running_stats=identical_running_stats,
        sync_layers=layers,
        train_forward_all_reduces=train_forward,
        train_backward_all_reduces=train_backward,
        eval_forward_all_reduces=eval_forward,
    )


def main():
    # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo")
    result = math_checks()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
