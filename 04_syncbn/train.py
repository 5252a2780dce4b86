"""04 - 01 plus SyncBatchNorm: batch statistics over the global batch instead of each rank's slice.

Plain BatchNorm under DDP normalizes with the mean and variance of each rank's LOCAL batch; with a
small per-rank batch they are noisy, and the model is not the one a single process would train on
the global batch. SyncBatchNorm combines the ranks' per-channel statistics, so 2 ranks x 4 samples
behave like 1 x 8. Convert the model BEFORE the DDP wrap. On GPU: nn.SyncBatchNorm; it refuses CPU
tensors, so on CPU the script uses CpuSyncBatchNorm (cpu_sync_batchnorm.py): the same global
statistics. By default it trains twice, plain then synchronized BatchNorm, and compares them.

    torchrun --standalone --nproc_per_node=2 04_syncbn/train.py
    torchrun --standalone --nproc_per_node=2 04_syncbn/train.py --batch-norm sync \
        --local-batch-size 2
"""

import dataclasses
import os
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
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary
from cpu_sync_batchnorm import convert_to_cpu_sync_batchnorm  # next to this script


@dataclasses.dataclass
class SyncBNConfig(TrainConfig):
    batch_norm: str = field(
        "compare",
        "plain: BatchNorm on each rank's batch; sync: synchronized over all ranks; "
        "compare: train plain, then sync",
        choices=("compare", "plain", "sync"),
    )
    local_batch_size: int = field(
        4, "samples per rank per step; small, where SyncBN matters", min=1
    )
    epochs: int = field(3, "passes over the training set (per run)", min=1)
    lr: float = field(0.01, "learning rate (small: the global batch is small)", min=0.0)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact distributed evaluation: this rank's sums, all-reduced. `model` is the plain module
    (ddp_model.module): ranks may hold different numbers of test batches."""
    model.eval()
    # loss sum, correct, count
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        totals += torch.stack(
            [
                F.cross_entropy(logits, labels, reduction="sum"),
                (logits.argmax(1) == labels).sum(),
                torch.tensor(len(labels), device=device),
            ]
        )
    # Sum over ranks: a collective, so every rank calls it.
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def train(cfg, launch):
    # One GPU per process: the local rank's, or 0 where the site shows each rank only its own;
    # else CPU (gloo).
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
    runs = {}  # compare: plain, then sync, from the same initial weights and the same data order
    for mode in ["plain", "sync"] if cfg.batch_norm == "compare" else [cfg.batch_norm]:
        runs[mode] = fit(cfg, launch, device, mode)
    if launch.rank == 0:
        for r in runs.values():
            print(
                f"{r['norm_layer']:>16} normalizes over {r['normalized_over']} samples: train loss "
                f"{r['final_train_loss']:.4f}, eval loss {r['eval_loss']:.4f}, eval acc "
                f"{r['eval_accuracy']:.4f}"
            )
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            launcher=launch.launcher,
            backend=backend,
            global_batch_size=cfg.local_batch_size * launch.world_size,
            device=str(device),
            local_batch_size=cfg.local_batch_size,
            lr=cfg.lr,
            runs=runs,
            **runs[mode],  # top level: the last run
        )
    dist.destroy_process_group()


def fit(cfg, launch, device, mode):
    """One training run with plain (mode "plain") or synchronized (mode "sync") BatchNorm."""
    start_time = time.perf_counter()
    # Same initial weights on every rank (and DDP broadcasts rank 0's at the wrap).
    torch.manual_seed(cfg.seed)

    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if launch.rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, launch.world_size)
    # Each rank a disjoint 1/world_size of the training set, shuffled alike (seed + epoch).
    train_sampler = DistributedSampler(
        data.train,
        num_replicas=launch.world_size,
        rank=launch.rank,
        shuffle=True,
        seed=cfg.seed,
    )
    train_loader = DataLoader(
        data.train,
        batch_size=cfg.local_batch_size,
        sampler=train_sampler,
        num_workers=cfg.num_workers,
        # not fork(), which can copy a lock that gloo's or NCCL's threads hold (common/data.py)
        multiprocessing_context=worker_start_method(cfg.num_workers),
        pin_memory=device.type == "cuda",
    )
    # A strided slice per rank: every test sample once (DistributedSampler pads with repeats).
    test_shard = Subset(data.test, range(launch.rank, len(data.test), launch.world_size))
    test_loader = DataLoader(
        test_shard,
        batch_size=cfg.local_batch_size,
        num_workers=cfg.num_workers,
        multiprocessing_context=worker_start_method(cfg.num_workers),
    )

    # To this rank's device, then wrap: DDP's hooks all-reduce the gradients in backward().
    model = build_model(
        cfg.model, data.num_classes, data.in_channels, data.image_size, norm="batch"
    )
    model = model.to(device)
    # Convert BEFORE the wrap: DDP records the modules and parameters it wraps.
    if mode == "sync":
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            # nn.SyncBatchNorm refuses CPU tensors
            model = convert_to_cpu_sync_batchnorm(model)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    # From here on each rank its own augmentation and loader worker seeds.
    torch.manual_seed(cfg.seed + launch.rank)

    norm_layers = [type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__]
    # samples per statistic
    normalized_over = cfg.local_batch_size * (launch.world_size if mode == "sync" else 1)
    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        global_batch = cfg.local_batch_size * launch.world_size
        print(
            f"{mode}: {len(norm_layers)} x {norm_layers[0]}, statistics over "
            f"{normalized_over} samples per channel; "
            f"launcher {launch.launcher}, {dist.get_backend()} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} = {global_batch}",
            flush=True,
        )
    step, images_seen = 0, 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        model.train()
        # This rank's loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces (averages) the gradients here: every rank steps alike.
            loss.backward()
            optimizer.step()
            step += 1
            images_seen += len(labels)
            loss_and_count[0] += loss.detach() * len(labels)
            loss_and_count[1] += len(labels)
            if launch.rank == 0 and step % cfg.log_every == 0:
                print(
                    f"epoch {epoch + 1} step {step} loss {loss.item():.4f} (rank 0's batch)",
                    flush=True,
                )
            if step == cfg.max_steps:
                break
        # Sums and counts over all ranks, the exact mean (not a mean of means); every rank calls it.
        dist.all_reduce(loss_and_count)
        train_loss = (loss_and_count[0] / loss_and_count[1]).item()
        eval_loss, eval_acc, eval_count = evaluate(model.module, test_loader, device)
        if launch.rank == 0:
            print(
                f"epoch {epoch + 1} done: train loss {train_loss:.4f}, "
                f"eval loss {eval_loss:.4f}, "
                f"eval accuracy {eval_acc:.4f} ({eval_count} images)",
                flush=True,
            )
        if step == cfg.max_steps:
            break

    # Plain file I/O on one rank; model.module drops DDP's "module." prefix.
    if launch.rank == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        # with running statistics
        torch.save(model.module.state_dict(), Path(cfg.output_dir) / f"model_{mode}.pt")

    elapsed = time.perf_counter() - start_time
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    # The DDP model, which holds the process group, is released when this function returns.
    return dict(
        norm_layer=norm_layers[0],
        norm_layers=len(norm_layers),
        normalized_over=normalized_over,
        # every rank saw as many
        images_per_second=images_seen * launch.world_size / elapsed,
        epochs=epoch + 1,
        steps=step,
        final_train_loss=train_loss,
        eval_loss=eval_loss,
        eval_accuracy=eval_acc,
        eval_samples=eval_count,
        wall_time_s=elapsed,
        replica_checksums=checksums,
    )


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(SyncBNConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
