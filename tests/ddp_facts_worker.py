"""Run under torchrun (2 ranks, gloo): what the READMEs say DDP does, seen in the installed torch.
Each rank prints one line `RESULT <rank> <json>`.

    torchrun --standalone --nproc_per_node=2 tests/ddp_facts_worker.py

- the wrap: ranks built with different weights and buffers hold rank 0's after DDP(...) (and keep
  their own with init_sync=False, the control);
- at the start of forward DDP broadcasts rank 0's buffers again (not with
  forward_sync_buffers=False, nor
  right after a forward without grad or under no_sync());
- a collective skipped on one rank, with the next one of equal shape and dtype: gloo sums the wrong
  tensors and raises nothing (debugging/README.md, "Hang mid-epoch"; --bug mismatched_collective);
- DDP(static_graph=True) with no_sync() accumulation fails (PyTorch issue 143580), run last: it
  leaves DDP's reducer in a failed state.
"""

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# before any process group: torch.distributed.nn would otherwise keep the group alive past
# destroy_process_group() (common/launcher.py explains)
import torch.distributed.nn  # noqa: F401
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.models import SmallCNN  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


def gathered(value: str) -> list[str]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def set_running_means(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.fill_(value)


def rank_own_model(rank: int) -> nn.Module:
    """A model with BatchNorm buffers, its weights and
    running statistics different on every rank."""
    torch.manual_seed(100 + rank)
    model = SmallCNN(1, 10, width=4, norm="batch")
    set_running_means(model, float(rank))
    return model


def wrap_facts(rank: int) -> dict:
    model = rank_own_model(rank)
    before = (gathered(digest(model.parameters())), gathered(digest(model.buffers())))
    DDP(model)
    after = (gathered(digest(model.parameters())), gathered(digest(model.buffers())))
    control = rank_own_model(rank)
    DDP(control, init_sync=False)
    return {
        "params_before": before[0],
        "buffers_before": before[1],
        "params_after": after[0],
        "buffers_after": after[1],
        "params_without_init_sync": gathered(digest(control.parameters())),
    }


def forward_buffer_facts(rank: int) -> dict:
    """Buffers made different AFTER the wrap, then forwards
    in eval mode (which leave them as they are)."""
    result = {}
    for name, kwargs in (
        ("default", {}),
        ("forward_sync_buffers_false", {"forward_sync_buffers": False}),
    ):
        model = DDP(rank_own_model(0), **kwargs).eval()
        set_running_means(model.module, float(rank) + 5)
        different = gathered(digest(model.module.buffers()))
        with torch.no_grad():
            model(torch.zeros(2, 1, 8, 8))
        after = gathered(digest(model.module.buffers()))
        # A forward without grad (or under no_sync) tells
        # DDP that no gradient sync follows, and the next
        # forward skips the buffer broadcast.
        set_running_means(model.module, float(rank) + 7)
        with torch.no_grad():
            model(torch.zeros(2, 1, 8, 8))
        after_no_grad = gathered(digest(model.module.buffers()))
        # The same after a forward under no_sync() (grad
        # enabled; eval mode, so no backward is needed).
        model2 = DDP(rank_own_model(0), **kwargs).eval()
        with model2.no_sync():
            model2(torch.zeros(2, 1, 8, 8))
        set_running_means(model2.module, float(rank) + 9)
        model2(torch.zeros(2, 1, 8, 8))
        result[name] = {
            "before_forward": different,
            "after_forward": after,
            "after_a_forward_after_no_grad": after_no_grad,
            "after_a_forward_after_no_sync": gathered(digest(model2.module.buffers())),
        }
    return result


def static_graph_with_no_sync() -> str:
    """PyTorch issue 143580: the very first micro-batch inside no_sync() with static_graph=True."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2), static_graph=True)
    try:
        with model.no_sync():
            model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()  # the window's last micro-batch: all-reduces
    except RuntimeError as e:
        return f"RuntimeError: {str(e).splitlines()[0]}"
    return "no error"


def skipped_all_reduce_of_equal_shapes(rank: int) -> dict:
    """As demo_bugs.py --bug mismatched_collective, with one float each: rank 1
    skips the loss's all-reduce, so its count meets rank 0's loss. Rank 1 then
    calls one more all-reduce, which meets rank 0's count (no one waits)."""
    loss, count = torch.tensor([1.0 + rank]), torch.tensor([10.0 * (rank + 1)])
    if rank != 1:
        dist.all_reduce(loss)
    dist.all_reduce(count)
    if rank != 1:
        return {"loss": loss.item(), "count": count.item()}
    extra = torch.tensor([0.0])
    dist.all_reduce(extra)
    return {"count": count.item(), "extra": extra.item()}


def main():
    warnings.simplefilter("ignore", FutureWarning)
    # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {
        "wrap": wrap_facts(rank),
        "forward": forward_buffer_facts(rank),
        "equal_shapes_mismatch": skipped_all_reduce_of_equal_shapes(rank),
    }
    dist.barrier()
    result["static_graph_no_sync"] = static_graph_with_no_sync()
    # One write per line (both ranks print; a print() under
    # PYTHONUNBUFFERED writes the text and the newline
    # separately, and the two ranks' lines could interleave).
    sys.stdout.write(f"RESULT {rank} {json.dumps(result)}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
