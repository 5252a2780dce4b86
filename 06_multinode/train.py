"""06 - multi-node DDP: the same script under every launcher, and a banner that shows the mapping.

The training loop is 01's. What changes across nodes is only who starts the processes and
how they find rank 0 (common.launcher reads torchrun, srun, mpiexec/PALS, Open MPI and
MPICH variables). So the one new thing here is the placement table: every rank sends
(host, rank, local rank, device) to rank 0, which prints it before training. A glance at it
catches the classic first-launch mistakes: each node forming its own world, two ranks on
one GPU, or everything silently running on one host.

Run (CPU; two "nodes" on this machine, c10d rendezvous on 127.0.0.1):
    torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29400 \
        --rdzv_id=demo 06_multinode/train.py        # in two terminals
    mpiexec -n 2 python 06_multinode/train.py        # Open MPI or MPICH
    srun -N2 --ntasks-per-node=4 python 06_multinode/train.py   # inside a Slurm allocation
Job files for Slurm and PBS are in jobs/; run 06_multinode/comm_check.py first on a new allocation.
"""

import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, load_config
from common.data import load_datasets
from common.dist import cleanup_distributed, setup_distributed
from common.entry import run
from common.models import build_model
from common.report import (StepTimer, TensorBoard, all_reduce_sums, banner, print0,
                           replica_checksums, write_summary)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact distributed evaluation: each rank sums loss and correct answers over its own
    disjoint slice of the test set; one all-reduce of (sums, count) gives the global metric.

    `model` is the unwrapped module (model.module): the DDP wrapper could run collectives
    in forward, and ranks may hold different numbers of test batches.
    """
    model.eval()
    loss_sum = correct = count = 0.0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        count += len(labels)
    loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], device)
    return loss_sum / count, correct / count, int(count)


def gather_placement(ctx):
    """Collective: (host, rank, local rank, device) of every rank, in rank order, on every rank."""
    mine = {"host": socket.gethostname(), "rank": ctx.rank, "local_rank": ctx.local_rank,
            "device": str(ctx.device)}
    placement = [None] * ctx.world_size
    dist.all_gather_object(placement, mine)
    return placement


def print_placement(placement):
    """Rank 0: one line per rank, and the problems a glance would find."""
    print0(f"{'rank':>5} {'local':>5}  {'host':<24} device")
    for p in placement:
        print0(f"{p['rank']:>5} {p['local_rank']:>5}  {p['host']:<24} {p['device']}")
    hosts = sorted({p["host"] for p in placement})
    print0(f"{len(placement)} ranks on {len(hosts)} host(s): {', '.join(hosts)}")
    seen = {}
    for p in placement:
        if p["device"] != "cpu":
            key = (p["host"], p["device"])
            if key in seen:
                print0(f"WARNING: ranks {seen[key]} and {p['rank']} share {p['device']} on {p['host']}")
            seen[key] = p["rank"]


def main(argv=None):
    cfg = load_config(TrainConfig, argv)  # bad keys/types fail here, before any process group
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device)
    try:
        train(cfg, ctx)
    finally:
        cleanup_distributed()


def train(cfg, ctx):
    start_time = time.perf_counter()
    device = ctx.device
    torch.manual_seed(cfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)

    # Data: the sampler gives each rank a disjoint 1/world_size of the (shuffled) training set.
    data = load_datasets(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.download, ctx.rank)
    train_sampler = DistributedSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank,
                                       shuffle=True, seed=cfg.seed)
    loader_options = dict(num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
                          persistent_workers=cfg.num_workers > 0)
    # shuffle=False here: shuffling is the sampler's job (it must be the same on every rank).
    train_loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=train_sampler, **loader_options)
    # Evaluation: a strided slice per rank covers every test sample exactly once. (DistributedSampler
    # would pad the last ranks with repeated samples and count them twice.)
    test_shard = Subset(data.test, range(ctx.rank, len(data.test), ctx.world_size))
    test_loader = DataLoader(test_shard, batch_size=cfg.batch_size, **loader_options)

    # Model: move to this rank's device first, then wrap. DDP broadcasts rank 0's weights
    # and registers the hooks that all-reduce gradients during backward.
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)

    steps_per_epoch = len(train_loader)
    placement = gather_placement(ctx)  # every rank takes part; rank 0 prints
    banner(ctx, cfg, **{"data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, "
                                       f"{steps_per_epoch} steps/epoch), test {len(data.test)}"})
    print_placement(placement)
    tensorboard = TensorBoard(Path(cfg.output_dir) / "tensorboard")
    output_dir = Path(cfg.output_dir)
    timer = StepTimer(device)
    step = 0
    train_loss = float("nan")
    images_per_s = data_wait = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        model.train()
        timer.reset()
        loss_sum = seen = 0.0
        for images, labels in timer.iterate(train_loader):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) gradients here, overlapped with backward
            optimizer.step()
            step += 1
            loss_sum += loss.item() * len(labels)
            seen += len(labels)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                total_loss, total_seen = all_reduce_sums([loss_sum, seen], device)
                images_per_s, data_wait = timer.global_rates()
                print0(f"epoch {epoch + 1} step {step} loss {total_loss / total_seen:.4f} "
                       f"images/s {images_per_s:.0f} data-wait {100 * data_wait:.1f}%")
                tensorboard.scalars(step, **{"train/loss": total_loss / total_seen, "perf/images_per_s": images_per_s})
            if step == cfg.max_steps:
                break
        total_loss, total_seen = all_reduce_sums([loss_sum, seen], device)
        train_loss = total_loss / total_seen
        images_per_s, data_wait = timer.global_rates()
        eval_loss, eval_acc, eval_count = evaluate(model.module, test_loader, device)
        print0(f"epoch {epoch + 1} done: train loss {train_loss:.4f}, eval loss {eval_loss:.4f}, "
               f"eval accuracy {eval_acc:.4f} ({eval_count} images), images/s {images_per_s:.0f}, "
               f"data-wait {100 * data_wait:.1f}%")
        tensorboard.scalars(epoch + 1, **{"eval/loss": eval_loss, "eval/accuracy": eval_acc})
        if step == cfg.max_steps:
            break

    # Every rank computes a checksum of its replica (a collective); rank 0 writes the files.
    checksums = replica_checksums(model)
    if ctx.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), output_dir / "model.pt")  # no "module." prefix
    tensorboard.close()
    write_summary(output_dir, world_size=ctx.world_size, launcher=ctx.info.launcher, backend=ctx.backend,
                  scheduler=ctx.info.scheduler, master_addr=ctx.info.master_addr,
                  master_port=ctx.info.master_port, placement=placement,
                  device=str(device), local_batch_size=cfg.batch_size,
                  global_batch_size=cfg.batch_size * ctx.world_size, lr=cfg.lr, epochs=epoch + 1, steps=step,
                  final_train_loss=train_loss, eval_loss=eval_loss, eval_accuracy=eval_acc,
                  eval_samples=eval_count, images_per_second=images_per_s, data_wait_fraction=data_wait,
                  replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1,
                  wall_time_s=time.perf_counter() - start_time)
    print0(f"eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}")


if __name__ == "__main__":
    run(main)
