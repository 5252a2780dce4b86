r"""A small GAN under DDP: two trained models, two DDP wraps, two optimizers.

The generator G turns noise into 8x8 images; the discriminator D tells them from the embedded
handwritten digits (common.data). Each trained model has its own DDP wrap, so each has its own
gradient all-reduce, and its own optimizer. Every rank runs, in the same order each step: the D
step (D on real images and on G's output, detached), then the G step (D on G's output, the gradient
flowing back through D into G).

    torchrun --standalone --nproc_per_node=2 08_several_models/gan.py
    # without .detach() in the D step: the G step's backward fails (README)
    torchrun --standalone --nproc_per_node=2 08_several_models/gan.py --no-detach

See 08_several_models/README.md.
"""

import dataclasses
import sys
import time
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
from torch.utils.data import DataLoader, DistributedSampler

from common.config import field, load_config
from common.data import digits
from common.launcher import choose_backend, detect_launcher
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class GanConfig:
    """A small GAN on the embedded digits: G and D, each in its own DDP wrap."""

    epochs: int = field(20, "passes over the training set", min=1)
    max_steps: int = field(0, "stop after this many steps in total (0: no limit)", min=0)
    local_batch_size: int = field(32, "real images per rank per step", min=1)
    lr: float = field(2e-4, "Adam learning rate of both models", min=0.0)
    latent_dim: int = field(16, "size of G's noise input", min=1)
    detach: bool = field(
        True, "detach G's output in the D step (--no-detach: the mistake, see the README)"
    )
    seed: int = field(0, "init and shuffle seed (same on every rank); noise: seed + rank", min=0)
    timeout_s: float = field(60.0, "seconds a collective may wait for the other ranks", min=1.0)
    output_dir: str = field("runs/gan", "where summary.json goes")
    log_every: int = field(50, "print a progress line every N steps", min=1)


def build_generator(latent_dim):
    return nn.Sequential(
        nn.Linear(latent_dim, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 64),
        # pixels in [-1, 1], as common.data scales the digits
        nn.Tanh(),
        nn.Unflatten(1, (1, 8, 8)),
    )


def build_discriminator():
    # one logit: real (> 0) or generated (< 0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 1),
    )


def train(cfg, launch):
    start_time = time.perf_counter()
    # as in 01: one GPU per process, else CPU (gloo)
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    # nccl where this torch has it (Linux GPUs); gloo on CPUs and on Windows and macOS
    backend = choose_backend(device)
    if device.type == "cuda":
        # before the process group, so its collectives use this device
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    # Same initial weights on every rank (and DDP broadcasts rank 0's at each wrap).
    torch.manual_seed(cfg.seed)

    # The embedded digits (labels unused); each rank a disjoint shard, shuffled alike.
    data = digits()
    train_sampler = DistributedSampler(
        data.train,
        num_replicas=launch.world_size,
        rank=launch.rank,
        shuffle=True,
        seed=cfg.seed,
    )
    train_loader = DataLoader(data.train, batch_size=cfg.local_batch_size, sampler=train_sampler)

    # Two trained models: each its own DDP wrap (its own gradient all-reduce), its own optimizer.
    device_ids = [device.index] if device.type == "cuda" else None
    generator = DDP(build_generator(cfg.latent_dim).to(device), device_ids=device_ids)
    discriminator = DDP(build_discriminator().to(device), device_ids=device_ids)
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=cfg.lr, betas=(0.5, 0.999))
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=cfg.lr, betas=(0.5, 0.999))
    # From here on each rank draws its own noise.
    torch.manual_seed(cfg.seed + launch.rank)

    if launch.rank == 0:
        print(
            f"launcher {launch.launcher}, {backend} on {device}, world size "
            f"{launch.world_size}, batch {cfg.local_batch_size} x {launch.world_size}",
            flush=True,
        )
    step = 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        for real, _ in train_loader:
            real = real.to(device)
            ones = torch.ones(len(real), 1, device=device)
            zeros = torch.zeros(len(real), 1, device=device)
            fake = generator(torch.randn(len(real), cfg.latent_dim, device=device))

            # D step: real images -> 1, generated -> 0. detach(): D's loss stops at G's output.
            # Without it this backward runs on into G's graph: G's DDP all-reduces G's
            # gradients here too, and G's graph is freed, which the G step needs again.
            fake_for_d = fake.detach() if cfg.detach else fake
            d_loss = F.binary_cross_entropy_with_logits(
                discriminator(real), ones
            ) + F.binary_cross_entropy_with_logits(discriminator(fake_for_d), zeros)
            d_optimizer.zero_grad(set_to_none=True)
            # D's DDP all-reduces D's gradients here
            d_loss.backward()
            d_optimizer.step()

            # G step: make D score G's output as real; the gradient flows through D into G.
            g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            g_optimizer.zero_grad(set_to_none=True)
            # G's DDP all-reduces G's gradients here (and D's DDP D's, which the next
            # D step's zero_grad discards: d_optimizer does not step on them)
            g_loss.backward()
            g_optimizer.step()
            step += 1
            if launch.rank == 0 and step % cfg.log_every == 0:
                print(
                    f"epoch {epoch + 1} step {step} D loss {d_loss.item():.4f} "
                    f"G loss {g_loss.item():.4f} (rank 0's batch)",
                    flush=True,
                )
            if step == cfg.max_steps:
                break
        if step == cfg.max_steps:
            break

    # Every replica's checksums, of G and of D, on every rank: collectives, every rank calls them.
    g_checksums = [None] * launch.world_size
    dist.all_gather_object(g_checksums, parameter_checksum(generator))
    d_checksums = [None] * launch.world_size
    dist.all_gather_object(d_checksums, parameter_checksum(discriminator))
    # This rank's last losses, averaged over the ranks: every rank calls it.
    losses = torch.stack([d_loss.detach(), g_loss.detach()]) / launch.world_size
    dist.all_reduce(losses)
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            launcher=launch.launcher,
            backend=backend,
            epochs=epoch + 1,
            steps=step,
            final_d_loss=losses[0].item(),
            final_g_loss=losses[1].item(),
            wall_time_s=time.perf_counter() - start_time,
            generator_checksums=g_checksums,
            discriminator_checksums=d_checksums,
            generators_identical=len(set(g_checksums)) == 1,
            discriminators_identical=len(set(d_checksums)) == 1,
        )
    # Release both DDP models (each holds the process group) before destroying the group.
    del generator, discriminator
    dist.destroy_process_group()


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input: one "error:" line, exit code 2
    cfg = load_config(GanConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    train(cfg, launch)


if __name__ == "__main__":
    main()
