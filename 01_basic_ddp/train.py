"""01 - the minimal complete DDP training script.

Every process (rank) holds a full replica of the model, reads its own disjoint shard of
each epoch (DistributedSampler), and DDP averages gradients across ranks during
backward(), so all replicas take the same optimizer step and stay identical.

Run (CPU, 2 processes, embedded digits data):
    torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py
The same script runs under `mpiexec -n 2`, `srun`, on GPUs with nccl, and on CIFAR-10:
    torchrun --standalone --nproc_per_node=4 01_basic_ddp/train.py --config 01_basic_ddp/cifar10.yaml
Performance knobs (mixed precision, channels_last, torch.compile, DDP buckets and
communication hooks, a --no-ddp baseline, the input pipeline) are flags, e.g.
    torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py --precision bf16 --comm-hook bf16_compress
and `--profile-steps 20` writes where a step's time goes into summary.json.
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
from common.perf import (AMP_DTYPES, COMM_HOOKS, NoDDP, StepProfiler, check_perf_config, loader_kwargs,
                         perf_settings, unwrap)
from common.report import (StepTimer, TensorBoard, all_reduce_sums, banner, print0,
                           replica_checksums, write_summary)


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
    cfg = load_config(TrainConfig, argv)  # bad keys/types fail here, before any process group
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device)
    try:
        train(cfg, ctx)
    finally:
        cleanup_distributed()


def train(cfg, ctx):
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
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    if cfg.channels_last:  # NHWC: the fast layout for convolutions on tensor cores (inputs follow below)
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:  # compile first, then wrap: DDP's hooks stay outside the compiled graphs
        model = torch.compile(model)
    if cfg.no_ddp:  # baseline: the same loop without gradient communication (replicas drift apart)
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
    banner(ctx, cfg, **{"data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, "
                                       f"{steps_per_epoch} steps/epoch), test {len(data.test)}"})
    output_dir = Path(cfg.output_dir)
    tensorboard = TensorBoard(output_dir / "tensorboard")
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
        torch.save(unwrap(model).state_dict(), output_dir / "model.pt")  # no "module."/"_orig_mod." prefix
    tensorboard.close()
    write_summary(output_dir, world_size=ctx.world_size, launcher=ctx.info.launcher, backend=ctx.backend,
                  device=str(device), local_batch_size=cfg.batch_size,
                  global_batch_size=cfg.batch_size * ctx.world_size, lr=cfg.lr, epochs=epoch + 1, steps=step,
                  final_train_loss=train_loss, eval_loss=eval_loss, eval_accuracy=eval_acc,
                  eval_samples=eval_count, images_per_second=images_per_s, data_wait_fraction=data_wait,
                  replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1,
                  wall_time_s=time.perf_counter() - start_time, profile=profile_summary,
                  perf=perf_settings(model, scaler, cfg))
    print0(f"eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}")


if __name__ == "__main__":
    run(main)
