"""09 - what each rank holds under DDP and under FSDP2, measured, and a plan for any model size.

The measurement builds the model, wraps it with DDP or shards it as train.py does, trains one step
with Adam on a random batch, then adds up the bytes of the tensors this rank holds: parameters,
gradients and optimizer state (a DTensor counts its local shard). Tensors are as large on a GPU as
on a CPU, so a CPU run measures what a GPU would hold for them. Activations, buffers and DDP's
gradient buckets are not counted. The plan does the same arithmetic for a model of any size.

    torchrun --standalone --nproc_per_node=2 09_fsdp2/memory.py
    python 09_fsdp2/memory.py --plan-billions 7 --gpu-gb 80
"""

import dataclasses
import math
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import MODELS, TrainConfig, field, load_config
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from train import shard  # the sharding is train.py's, unchanged

# bytes a parameter, in float32: its value, its gradient, Adam's two running averages
BYTES = dict(parameters=4, gradients=4, optimizer=8)


@dataclasses.dataclass
class MemoryConfig(TrainConfig):
    model: str = field("resnet18", "network", choices=MODELS)
    plan_billions: float = field(
        0, "plan for a model of this many billion parameters, on no GPU (0: measure)", min=0
    )
    gpu_gb: float = field(80, "the plan's GPU memory, in GB (10^9 bytes)", min=1)
    activations_gb: float = field(
        0, "the plan's activations per GPU, in GB (measure your own)", min=0
    )


def local_bytes(tensors) -> int:
    """The bytes of these tensors that this rank holds: a DTensor's local shard."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def held_after_one_step(model, device) -> dict:
    """This rank's bytes of parameters, gradients and Adam's state after one step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.randn(2, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (2,), device=device)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    parameters = list(model.parameters())
    return dict(
        parameters=local_bytes(parameters),
        gradients=local_bytes(p.grad for p in parameters),
        optimizer=local_bytes(
            value
            for state in optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        ),
    )


def row(world_size: int, wrap: str, held: dict, ddp_total: int) -> str:
    mib = [held[part] / 2**20 for part in BYTES]
    share = sum(held[part] for part in BYTES) / ddp_total
    cells = "".join(f"{value:>12.1f}" for value in mib)
    return f"{world_size:>5}  {wrap:<6}{cells}{sum(mib):>9.1f}{share:>10.0%}"


def held_by_each_rank(wrap: str, cfg: MemoryConfig, launch, device) -> list[dict]:
    """Every rank's bytes under `wrap` (DDP or FSDP2), on every rank. The model, which holds the
    process group, is released on return, before the next one is built."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, 10, 3, 32).to(device)
    if wrap == "DDP":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        shard(model, MixedPrecisionPolicy(), choose_backend(device))
    held = held_after_one_step(model, device)
    # Every rank's bytes, on every rank: a collective, so every rank calls it.
    every = [None] * launch.world_size
    dist.all_gather_object(every, held)
    return every


def measure(cfg: MemoryConfig, launch) -> None:
    """DDP's row, then FSDP2's, each of the rank holding most; rank 0 prints them."""
    # as in 01
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    backend = choose_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    if launch.rank == 0:
        print(f"{cfg.model}, Adam, float32: MiB held by the rank holding most, after one step")
        parts = "".join(f"{part:>12}" for part in BYTES)
        print(f"world  wrap  {parts}    total  of DDP's", flush=True)
    for wrap in ("DDP", "FSDP2"):
        every = held_by_each_rank(wrap, cfg, launch, device)
        largest = max(every, key=lambda h: sum(h[part] for part in BYTES))
        if wrap == "DDP":
            ddp_total = sum(largest[part] for part in BYTES)
        if launch.rank == 0:
            print(row(launch.world_size, wrap, largest, ddp_total), flush=True)
    dist.destroy_process_group()


def plan(cfg: MemoryConfig) -> None:
    """Parameters, gradients and Adam's state in float32 for `plan_billions`: whether DDP fits
    the GPU, and from which world size FSDP2 does."""
    count = cfg.plan_billions * 1e9
    per_parameter = sum(BYTES.values())
    state_gb = count * per_parameter / 1e9
    room = cfg.gpu_gb - cfg.activations_gb
    print(
        f"{count:,.0f} parameters, float32 with Adam: {per_parameter} bytes a parameter "
        f"({BYTES['parameters']} weights, {BYTES['gradients']} gradients, "
        f"{BYTES['optimizer']} optimizer state) = {state_gb:,.1f} GB"
    )
    print(f"GPU {cfg.gpu_gb:g} GB, activations {cfg.activations_gb:g} GB: {room:g} GB left")
    if room <= 0:
        print("neither fits: the activations alone fill the GPU")
        return
    fits = "fits" if state_gb <= room else "does not fit"
    print(f"DDP: {state_gb:,.1f} GB on every GPU: {fits}")
    ranks = max(1, math.ceil(state_gb / room))
    print(
        f"FSDP2: {state_gb:,.1f} GB / world size: fits from {ranks} GPUs "
        f"({state_gb / ranks:,.1f} GB each)"
    )


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    cfg = load_config(MemoryConfig)  # bad input: one "error:" line, exit code 2
    if cfg.plan_billions:
        plan(cfg)
        return
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    measure(cfg, detect_launcher())


if __name__ == "__main__":
    main()
