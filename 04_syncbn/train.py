"""04 - SyncBatchNorm: batch statistics over the global batch instead of each rank's slice.

Plain BatchNorm under DDP normalizes with the mean and variance of each rank's LOCAL batch:
with a small per-rank batch those statistics are noisy, and the model trains on something
different from the single-process model. SyncBatchNorm all-reduces the per-channel statistics
so every rank normalizes with those of the global batch: 2 ranks x 4 samples behave like 1 x 8.
Convert the model BEFORE wrapping it in DDP. On GPU this is nn.SyncBatchNorm; it refuses CPU
tensors, so on CPU the script selects CpuSyncBatchNorm (cpu_sync_batchnorm.py), the same arithmetic.

By default the script trains twice, plain BatchNorm then synchronized, and compares them.
The performance knobs of 01 (--precision, --channels-last, --compile, --comm-hook, --no-ddp, ...)
apply to each run.

Run (CPU, 2 processes, 4 samples per rank, embedded digits data):
    torchrun --standalone --nproc_per_node=2 04_syncbn/train.py
    torchrun --standalone --nproc_per_node=2 04_syncbn/train.py --batch-norm sync --batch-size 2
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import load_datasets
from common.dist import cleanup_distributed, setup_distributed
from common.entry import run
from common.models import build_model
from common.perf import (AMP_DTYPES, COMM_HOOKS, NoDDP, StepProfiler, check_perf_config, loader_kwargs,
                         perf_settings, unwrap)
from common.report import (StepTimer, TensorBoard, all_reduce_sums, banner, print0,
                           replica_checksums, write_summary)
from cpu_sync_batchnorm import convert_to_cpu_sync_batchnorm  # next to this script


@dataclasses.dataclass
class SyncBNConfig(TrainConfig):
    batch_norm: str = field("compare", "plain: BatchNorm on each rank's batch; sync: synchronized over "
                                       "all ranks; compare: train plain, then sync",
                            choices=("compare", "plain", "sync"))
    batch_size: int = field(4, "samples per rank per step: small, where SyncBatchNorm matters", min=1)
    epochs: int = field(3, "passes over the training set (per run)", min=1)
    lr: float = field(0.01, "learning rate (small: the global batch is small)", min=0.0)


@torch.no_grad()
def evaluate(model, loader, device, channels_last=False):
    """Exact distributed evaluation: each rank sums loss and correct answers over its own
    disjoint slice of the test set; one all-reduce of (sums, count) gives the global metric.

    `model` is the unwrapped module (model.module): the DDP wrapper could run collectives
    in forward, and ranks may hold different numbers of test batches.
    """
    model.eval()
    loss_sum = correct = count = 0.0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        count += len(labels)
    loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], device)
    return loss_sum / count, correct / count, int(count)


def main(argv=None):
    cfg = load_config(SyncBNConfig, argv)  # bad keys/types fail here, before any process group
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device)
    try:
        modes = ["plain", "sync"] if cfg.batch_norm == "compare" else [cfg.batch_norm]
        results = {mode: train(cfg, ctx, mode) for mode in modes}
        write_summary(cfg.output_dir, world_size=ctx.world_size, launcher=ctx.info.launcher,
                      backend=ctx.backend, device=str(ctx.device), local_batch_size=cfg.batch_size,
                      global_batch_size=cfg.batch_size * ctx.world_size, lr=cfg.lr, runs=results,
                      **results[modes[-1]])  # top level: the last run (sync, when comparing)
        print0("\n".join([f"{'batch norm':<32} {'normalizes over':>15} {'train loss':>10} {'eval loss':>9} "
                           f"{'eval acc':>8}"] + [
            f"{r['norm_layer']:<32} {r['normalized_over']:>7} samples {r['final_train_loss']:>10.4f} "
            f"{r['eval_loss']:>9.4f} {r['eval_accuracy']:>8.4f}" for r in results.values()]))
    finally:
        cleanup_distributed()


def train(cfg, ctx, mode):
    """One training run with plain (mode "plain") or synchronized (mode "sync") BatchNorm."""
    start_time = time.perf_counter()
    device = ctx.device
    check_perf_config(cfg, device)  # e.g. bf16 on a GPU without it, --no-ddp with a comm hook: every rank fails alike
    torch.manual_seed(cfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)

    # Data: the sampler gives each rank a disjoint 1/world_size of the (shuffled) training set.
    data = load_datasets(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.download, ctx.rank)
    train_sampler = DistributedSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank,
                                       shuffle=True, seed=cfg.seed)
    # num_workers, pin_memory (GPU only), persistent_workers, prefetch_factor (with workers) from the config.
    loader_options = loader_kwargs(cfg, device)
    # shuffle=False here: shuffling is the sampler's job (it must be the same on every rank).
    train_loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=train_sampler, **loader_options)
    # Evaluation: a strided slice per rank covers every test sample exactly once. (DistributedSampler
    # would pad the last ranks with repeated samples and count them twice.)
    test_shard = Subset(data.test, range(ctx.rank, len(data.test), ctx.world_size))
    test_loader = DataLoader(test_shard, batch_size=cfg.batch_size, **loader_options)

    # Model: move to this rank's device first, then wrap. DDP broadcasts rank 0's weights
    # and registers the hooks that all-reduce gradients during backward.
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size, norm="batch").to(device)
    if mode == "sync":
        # Convert BEFORE torch.compile and the DDP wrap: DDP records the model's modules and parameters
        # when it wraps, and a compiled graph would keep the plain BatchNorm.
        if device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            model = convert_to_cpu_sync_batchnorm(model)  # nn.SyncBatchNorm refuses CPU tensors
    norm_layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    norm_layer = type(norm_layers[0]).__name__
    if cfg.channels_last:  # NHWC: the fast layout for convolutions on tensor cores (inputs follow below)
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:  # compile first, then wrap: DDP's hooks stay outside the compiled graphs
        model = torch.compile(model)
    if cfg.no_ddp:  # baseline without DDP's gradient all-reduce (synchronized BatchNorm still communicates)
        model = NoDDP(model)
    else:
        model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None,
                    bucket_cap_mb=cfg.bucket_cap_mb,  # gradients are all-reduced in buckets of this size
                    gradient_as_bucket_view=cfg.gradient_as_bucket_view,  # .grad points into the bucket
                    static_graph=cfg.static_graph,  # same graph every step: DDP can plan ahead
                    find_unused_parameters=cfg.find_unused_parameters)  # only if some parameters get no grad
        if cfg.comm_hook != "none":  # default_hooks.bf16_compress_hook / fp16_compress_hook
            model.register_comm_hook(state=None, hook=COMM_HOOKS[cfg.comm_hook])
    # Mixed precision: autocast runs the forward pass in bf16/fp16; fp16 also needs a GradScaler,
    # which scales the loss so small gradients do not underflow (a no-op when disabled).
    amp_dtype = AMP_DTYPES[cfg.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)

    steps_per_epoch = len(train_loader)
    normalized_over = cfg.batch_size * (ctx.world_size if mode == "sync" else 1)
    why = {"SyncBatchNorm": "", "BatchNorm2d": ", each rank its own statistics",
           "CpuSyncBatchNorm": ", selected on CPU: nn.SyncBatchNorm is GPU-only (same arithmetic)"}
    banner(ctx, cfg, **{"batch norm": f"{mode}: {len(norm_layers)} x {norm_layer}{why.get(norm_layer, '')}",
                        "statistics over": f"{normalized_over} samples per channel per step"
                                           + (", 1 all-reduce per layer in forward and in backward"
                                              if mode == "sync" else ""),
                        "data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, "
                                       f"{steps_per_epoch} steps/epoch), test {len(data.test)}"})
    output_dir = Path(cfg.output_dir)
    tensorboard = TensorBoard(output_dir / "tensorboard" / mode)
    timer = StepTimer(device)
    profile = StepProfiler(unwrap(model), device, cfg.profile_warmup, cfg.profile_steps)
    step = 0
    train_loss = float("nan")
    images_per_s = data_wait = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        model.train()
        timer.reset()
        loss_sum = seen = 0.0
        profile.epoch_start()
        for images, labels in timer.iterate(train_loader):
            profile.begin()
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=cfg.precision != "fp32"):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients here, overlapped with backward
            profile.backward_done()
            scaler.step(optimizer)  # fp16: unscales, and skips the step if a gradient overflowed
            scaler.update()
            profile.end()
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
        # Evaluation normalizes with the running statistics.
        eval_loss, eval_acc, eval_count = evaluate(model.module, test_loader, device, cfg.channels_last)
        print0(f"epoch {epoch + 1} done: train loss {train_loss:.4f}, eval loss {eval_loss:.4f}, "
               f"eval accuracy {eval_acc:.4f} ({eval_count} images), images/s {images_per_s:.0f}, "
               f"data-wait {100 * data_wait:.1f}%")
        tensorboard.scalars(epoch + 1, **{"eval/loss": eval_loss, "eval/accuracy": eval_acc})
        if step == cfg.max_steps:
            break

    # Every rank computes a checksum of its replica (a collective); rank 0 writes the files.
    checksums = replica_checksums(model)
    profile_summary = profile.summary()  # collective when profiling
    if ctx.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        # The state dict includes the BatchNorm running statistics (rank 0's).
        torch.save(unwrap(model).state_dict(), output_dir / f"model_{mode}.pt")  # no "module."/"_orig_mod." prefix
    tensorboard.close()
    print0(f"{mode}: eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}")
    return dict(norm_layer=norm_layer, norm_layers=len(norm_layers), normalized_over=normalized_over,
                epochs=epoch + 1, steps=step, final_train_loss=train_loss, eval_loss=eval_loss,
                eval_accuracy=eval_acc, eval_samples=eval_count, images_per_second=images_per_s,
                data_wait_fraction=data_wait, replica_checksums=checksums,
                replicas_identical=len(set(checksums)) == 1, wall_time_s=time.perf_counter() - start_time,
                profile=profile_summary, perf=perf_settings(model, scaler, cfg))


if __name__ == "__main__":
    run(main)
