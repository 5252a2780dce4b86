r"""Two forward passes through one DDP model before one backward: a GAN discriminator with
BatchNorm scores real, then fake samples, and one loss is backpropagated through both.

    # fine on torch >= 2.12
    torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py
    # the error of 2.6-2.11
    torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers inplace
    # fix 1
    torchrun --standalone --nproc_per_node=2 \
        debugging/two_forwards.py --buffers inplace --forward concat
    # fix 2
    torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers local

At the start of every forward DDP copies rank 0's buffers (BatchNorm's running mean and
variance) into every rank's model. Up to torch 2.11 that copy was an in-place write
autograd could see, so the second forward changed a tensor that the first one had saved for
backward, and backward failed with "one of the variables needed for gradient computation
has been modified by an inplace operation". Since 2.12 DDP hides the write from autograd.
`--buffers inplace` turns DDP's copy off and does it the old way (an in-place broadcast
before each forward), so the error shows on any version. See debugging/README.md.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import field, load_config
from common.launcher import choose_backend, detect_launcher
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class TwoForwardsConfig:
    """A GAN discriminator step through DDP: two forwards (real, fake), one backward."""

    forward: str = field(
        "separate",
        "separate: D(real), then D(fake); concat: one D(cat([real, fake]))",
        choices=("separate", "concat"),
    )
    buffers: str = field(
        "ddp",
        "ddp: DDP syncs BatchNorm's buffers (default); inplace: synced in place, as DDP "
        "did up to torch 2.11; local: not synced (broadcast_buffers=False)",
        choices=("ddp", "inplace", "local"),
    )
    steps: int = field(3, "discriminator steps", min=1)
    timeout_s: float = field(30.0, "process-group timeout", min=1.0)
    output_dir: str = field("runs/two_forwards", "where summary.json goes")


def sync_buffers_in_place(module, inputs):
    """What DDP did at the start of each forward up to torch 2.11: broadcast
    rank 0's buffers, then copy them into each rank's buffers in place, a
    write that autograd records (it bumps the tensor's version)."""
    with torch.no_grad():
        for buffer in module.buffers():
            received = buffer.clone()
            dist.broadcast(received, src=0)
            buffer.copy_(received)


def train(cfg, launch):
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    # nccl where this torch has it (Linux GPUs); gloo on CPUs and on Windows and macOS
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
    torch.manual_seed(0)
    generator = nn.Linear(4, 8).to(device)  # stands in for G; only the discriminator step is shown
    discriminator = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.LeakyReLU(0.2), nn.Linear(32, 1)
    ).to(device)
    if cfg.buffers == "inplace":
        discriminator.register_forward_pre_hook(sync_buffers_in_place)
    # Fix 2: no buffer sync in forward, broadcast_buffers=False
    # (each rank keeps its own BatchNorm statistics).
    # torch >= 2.13 names it forward_sync_buffers=False
    # and warns (FutureWarning) about the old name.
    no_buffer_sync = {} if cfg.buffers == "ddp" else {"broadcast_buffers": False}
    model = DDP(
        discriminator,
        device_ids=[device.index] if device.type == "cuda" else None,
        **no_buffer_sync,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    noise = torch.Generator().manual_seed(launch.rank)  # each rank its own batches
    for step in range(1, cfg.steps + 1):
        real = (torch.randn(16, 8, generator=noise) + 1.0).to(device)
        # no gradient into G here
        fake = generator(torch.randn(16, 4, generator=noise).to(device)).detach()
        if cfg.forward == "concat":  # fix 1: one forward, so one buffer sync, over both halves
            real_scores, fake_scores = model(torch.cat([real, fake])).split([len(real), len(fake)])
        else:
            real_scores = model(real)
            fake_scores = model(fake)  # the second forward: DDP syncs the buffers again first
        loss = F.binary_cross_entropy_with_logits(
            real_scores, torch.ones_like(real_scores)
        ) + F.binary_cross_entropy_with_logits(fake_scores, torch.zeros_like(fake_scores))
        optimizer.zero_grad(set_to_none=True)
        # with --buffers inplace and two forwards: "modified by an inplace operation"
        loss.backward()
        optimizer.step()
        if launch.rank == 0:
            print(f"step {step} discriminator loss {loss.item():.4f}", flush=True)
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            forward=cfg.forward,
            buffers=cfg.buffers,
            final_loss=loss.item(),
            torch_version=torch.__version__,
            replica_checksums=checksums,
        )
        print(f"done: {cfg.forward} forward(s), buffers {cfg.buffers}", flush=True)
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record  # under torchrun, a failing rank's exception and traceback show in torchrun's summary
def main():
    cfg = load_config(TwoForwardsConfig)
    train(cfg, detect_launcher())


if __name__ == "__main__":
    main()
