"""01 - the minimal complete DDP training script.

Every process (rank) holds a full replica of the model, reads its own disjoint shard of
each epoch (DistributedSampler), and DDP averages gradients across ranks during
backward(), so all replicas take the same optimizer step and stay identical.

Run (CPU, 2 processes, embedded digits data):
    torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py
The same script runs under `mpiexec -n 2`, `srun`, on GPUs with nccl, and on CIFAR-10:
    torchrun --standalone --nproc_per_node=4 01_basic_ddp/train.py --config 01_basic_ddp/cifar10.yaml
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
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
    banner(ctx, cfg, **{"data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, "
                                       f"{steps_per_epoch} steps/epoch), test {len(data.test)}"})
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
                  device=str(device), local_batch_size=cfg.batch_size,
                  global_batch_size=cfg.batch_size * ctx.world_size, lr=cfg.lr, epochs=epoch + 1, steps=step,
                  final_train_loss=train_loss, eval_loss=eval_loss, eval_accuracy=eval_acc,
                  eval_samples=eval_count, images_per_second=images_per_s, data_wait_fraction=data_wait,
                  replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1,
                  wall_time_s=time.perf_counter() - start_time)
    print0(f"eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}")


if __name__ == "__main__":
    run(main)
