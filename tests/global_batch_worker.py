"""Run on 2 ranks (gloo, torchrun's variables): DDP with local batch 16 against one process with the
global batch of 32, on the same digits, in the same process. Rank 0 prints one line
`RESULT <json>`: per case, how many parameters end outside `--rtol` (with atol 1e-7, as
tests/results.py's assert_same_params), the largest ||ddp - one|| / ||one|| over the
parameter tensors, and how far the first step's loss (DDP: the mean of the ranks') is from the one
process's.

    torchrun --standalone --nproc_per_node=2 tests/global_batch_worker.py --rtol 1e-5

Cases: SGD (README.md: the result equals one process), SGD with dropout (each rank draws its own
masks), Adam and RMSprop (they divide by running gradient sizes: rounding differences in a small
gradient become full-sized steps).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# before the process group: torch.distributed.nn would otherwise keep it alive past
# destroy_process_group() (common/launcher.py explains)
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common.data import digits  # noqa: E402
from common.models import SmallCNN  # noqa: E402

LOCAL_BATCH, STEPS = 16, 8
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
}
CASES = {  # name: (optimizer, dropout)
    "sgd": ("sgd", False),
    "sgd_dropout": ("sgd", True),
    "adam": ("adam", False),
    "rmsprop": ("rmsprop", False),
}


def build(dropout: bool) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights for both
    model = SmallCNN(1, 10)
    if dropout:
        model.classifier.insert(3, nn.Dropout(0.5))
    return model


def compare(ddp_params, one_params, rtol: float) -> tuple[int, float]:
    outside, worst = 0, 0.0
    for a, b in zip(ddp_params, one_params):
        a, b = a.detach().double(), b.detach().double()
        outside += int(((a - b).abs() > 1e-7 + rtol * b.abs()).sum())
        worst = max(worst, ((a - b).norm() / b.norm()).item())
    return outside, worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rtol", type=float, required=True)
    rtol = parser.parse_args().rtol
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    images, labels = digits().train.tensors
    global_batch = LOCAL_BATCH * world_size
    result = {}
    for case, (optimizer_name, dropout) in CASES.items():
        model = DDP(build(dropout))
        one = build(dropout)
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        one_optimizer = OPTIMIZERS[optimizer_name](one.parameters())
        # as in the lessons: each rank its own random draws after the wrap (rank 0's: seed + 0)
        torch.manual_seed(1 + rank)
        first_losses = None
        for step in range(STEPS):
            start = step * global_batch
            x, y = images[start : start + global_batch], labels[start : start + global_batch]
            mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            loss = F.cross_entropy(model(x[mine]), y[mine])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            one_loss = F.cross_entropy(one(x), y)
            one_optimizer.zero_grad(set_to_none=True)
            one_loss.backward()
            one_optimizer.step()
            if first_losses is None:
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)  # every rank calls it
                first_losses = (mean_loss.item() / world_size, one_loss.item())
        outside, worst = compare(model.module.parameters(), one.parameters(), rtol)
        result[case] = dict(
            outside=outside,
            relative_difference=worst,
            first_loss_difference=abs(first_losses[0] - first_losses[1]),
        )
        del model
    if rank == 0:
        print("RESULT", json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
