"""03 - gradient accumulation under DDP, with no_sync().

One optimizer step sees `accum_steps` micro-batches per rank: effective batch =
local batch x world size x accum_steps. Gradients of the micro-batches add up in .grad;
inside `model.no_sync()` DDP skips the all-reduce, so only the last micro-batch of each
window communicates (once per optimizer step instead of once per micro-batch).
A DDP communication hook counts the gradient all-reduces to show it. The performance knobs of
01 work here too; with --comm-hook the counting hook hands each bucket to the compression hook,
and with --precision fp16 the GradScaler scales every micro-batch but steps once per window.

Run (CPU, 2 processes, embedded digits data; 2 x 8 x 4 = effective batch 64):
    torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --batch-size 8 --accum-steps 4
Or give the effective batch and let the script derive the accumulation steps:
    torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --batch-size 8 \
        --global-batch-size 256 --scale-lr --warmup-steps 20
"""

import dataclasses
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import load_datasets
from common.dist import cleanup_distributed, setup_distributed
from common.entry import run
from common.errors import ConfigError
from common.models import build_model
from common.perf import (AMP_DTYPES, COMM_HOOKS, NoDDP, StepProfiler, check_perf_config, loader_kwargs,
                         perf_settings, unwrap)
from common.report import (StepTimer, TensorBoard, all_reduce_sums, banner, print0,
                           replica_checksums, write_summary)


@dataclasses.dataclass
class AccumConfig(TrainConfig):
    accum_steps: int = field(1, "micro-batches per rank per optimizer step (gradient accumulation)", min=1)
    global_batch_size: int = field(0, "effective batch per optimizer step; if set, accum_steps is derived "
                                      "as global / (batch_size x world size) (0: use accum_steps)", min=0)
    use_no_sync: bool = field(True, "skip the gradient all-reduce on all but the last micro-batch (DDP no_sync)")
    scale_lr: bool = field(False, "linear LR scaling: lr x effective batch / base_batch_size")
    base_batch_size: int = field(32, "the batch size that --lr was tuned for (used with --scale-lr)", min=1)
    warmup_steps: int = field(0, "optimizer steps of linear LR warmup up to the (scaled) lr (0: none)", min=0)


def accumulation_steps(cfg, world_size):
    """accum_steps, or derived from global_batch_size = batch_size x world size x accum_steps."""
    if not cfg.global_batch_size:
        return cfg.accum_steps
    per_pass = cfg.batch_size * world_size
    if cfg.global_batch_size % per_pass:
        raise ConfigError(
            f"global_batch_size {cfg.global_batch_size} is not divisible by batch_size {cfg.batch_size} x "
            f"world size {world_size} = {per_pass}: use a multiple of {per_pass} or change batch_size")
    derived = cfg.global_batch_size // per_pass
    if cfg.accum_steps not in (1, derived):
        raise ConfigError(f"accum_steps {cfg.accum_steps} contradicts global_batch_size {cfg.global_batch_size} "
                          f"(= {cfg.batch_size} x {world_size} x {derived}): give only one of them")
    return derived


def counting_allreduce_hook(counter, bucket):
    """DDP communication hook: the all-reduce (average) of one gradient bucket, counted.

    DDP takes one hook, so with --comm-hook this one wraps the compression hook: count, then
    hand the bucket to counter["compress"] (e.g. fp16_compress_hook) instead of the default.
    """
    counter["all_reduces"] += 1  # one per bucket
    counter["passes"] += bucket.is_last()  # one per backward that communicates
    communicate = counter.get("compress") or allreduce_hook
    return communicate(None, bucket)  # None: the default process group


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
    cfg = load_config(AccumConfig, argv)  # bad keys/types fail here, before any process group
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device)
    try:
        train(cfg, ctx)
    finally:
        cleanup_distributed()


def train(cfg, ctx):
    start_time = time.perf_counter()
    device = ctx.device
    check_perf_config(cfg, device)  # e.g. bf16 on a GPU without it, --no-ddp with a comm hook: every rank fails alike
    accum_steps = accumulation_steps(cfg, ctx.world_size)  # every rank checks alike, so all fail alike
    if cfg.static_graph and cfg.use_no_sync and accum_steps > 1:
        raise ConfigError("static_graph: DDP(static_graph=True) fails inside no_sync() (PyTorch issue 143580): "
                          "drop --static-graph, or accumulate with --no-use-no-sync")
    effective_batch = cfg.batch_size * ctx.world_size * accum_steps
    peak_lr = cfg.lr * effective_batch / cfg.base_batch_size if cfg.scale_lr else cfg.lr
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
    counter = {"all_reduces": 0, "passes": 0, "compress": COMM_HOOKS[cfg.comm_hook]}  # None: plain all-reduce
    if cfg.no_ddp:  # baseline: the same loop without gradient communication (no_sync() is a no-op)
        model = NoDDP(model)
    else:
        model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None,
                    bucket_cap_mb=cfg.bucket_cap_mb,  # gradients are all-reduced in buckets of this size
                    gradient_as_bucket_view=cfg.gradient_as_bucket_view,  # .grad points into the bucket
                    static_graph=cfg.static_graph,  # same graph every step: DDP can plan ahead
                    find_unused_parameters=cfg.find_unused_parameters)  # only if some parameters get no grad
        # Called once per gradient bucket: counts, then all-reduces (compressed with --comm-hook).
        model.register_comm_hook(counter, counting_allreduce_hook)
    # Mixed precision: autocast runs the forward pass in bf16/fp16; fp16 also needs a GradScaler,
    # which scales the loss so small gradients do not underflow (a no-op when disabled).
    amp_dtype = AMP_DTYPES[cfg.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)

    samples_per_rank = len(train_sampler)  # per epoch; equal on every rank (the sampler pads)
    micro_batches = len(train_loader)
    steps_per_epoch = -(-micro_batches // accum_steps)  # the last window of an epoch may be shorter
    lr_text = (f"{cfg.lr} x {effective_batch} / {cfg.base_batch_size} = {peak_lr:g} (linear scaling)"
               if cfg.scale_lr else f"{cfg.lr} (not scaled; --scale-lr scales it with the batch)")
    if cfg.warmup_steps:
        lr_text += f", linear warmup over {cfg.warmup_steps} steps from {peak_lr / cfg.warmup_steps:g}"
    banner(ctx, cfg, **{
        "batch": f"local {cfg.batch_size} x world {ctx.world_size} x accum {accum_steps} = effective "
                 f"{effective_batch} per optimizer step",
        "learning rate": lr_text,
        "gradient sync": "no_sync on all but the last micro-batch" if cfg.use_no_sync
                         else "every micro-batch (--no-use-no-sync)",
        "data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, {micro_batches} "
                      f"micro-batches = {steps_per_epoch} steps/epoch), test {len(data.test)}"})
    output_dir = Path(cfg.output_dir)
    tensorboard = TensorBoard(output_dir / "tensorboard")
    timer = StepTimer(device)
    profile = StepProfiler(unwrap(model), device, cfg.profile_warmup, cfg.profile_steps)
    step = 0
    passes_per_step, reduces_per_step = [], []  # gradient all-reduce passes / bucket all-reduces per step
    counted = (0, 0)  # the counters' values at the last step
    train_loss = float("nan")
    images_per_s = data_wait = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        model.train()
        timer.reset()
        loss_sum = seen = 0.0
        profile.epoch_start()
        for i, (images, labels) in enumerate(timer.iterate(train_loader)):
            if i % accum_steps == 0:
                profile.begin()  # a window's first micro-batch: the profiled "step" spans the window
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            window_start = i - i % accum_steps
            window_end = min(window_start + accum_steps, micro_batches)  # an epoch's last window may be short
            window_samples = min(window_end * cfg.batch_size, samples_per_rank) - window_start * cfg.batch_size
            sync = i == window_end - 1  # the window's last micro-batch all-reduces
            # Forward AND backward inside no_sync: DDP reads the flag in forward() to prepare the
            # backward's all-reduce, so a forward outside no_sync still communicates.
            with model.no_sync() if cfg.use_no_sync and not sync else nullcontext():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=cfg.precision != "fp32"):
                    loss = F.cross_entropy(model(images), labels)
                # .grad sums over the window; weighting each micro-batch's mean loss by its share of the
                # window's samples makes that sum the window's mean gradient: loss / accum_steps when the
                # window is full, and still exact in an epoch's shorter last window.
                # fp16: every micro-batch is scaled by the same factor (update() only runs after a step).
                scaler.scale(loss * len(labels) / window_samples).backward()
            loss_sum += loss.item() * len(labels)
            seen += len(labels)
            if not sync:
                continue  # no step: keep accumulating
            profile.backward_done()
            for group in optimizer.param_groups:
                group["lr"] = peak_lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else peak_lr
            scaler.step(optimizer)  # fp16: unscales the window's summed gradient, skips the step on overflow
            scaler.update()
            optimizer.zero_grad(set_to_none=True)  # only after a step: until then .grad accumulates
            profile.end()
            step += 1
            passes_per_step.append(counter["passes"] - counted[0])
            reduces_per_step.append(counter["all_reduces"] - counted[1])
            counted = (counter["passes"], counter["all_reduces"])
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                total_loss, total_seen = all_reduce_sums([loss_sum, seen], device)
                images_per_s, data_wait = timer.global_rates()
                print0(f"epoch {epoch + 1} step {step} loss {total_loss / total_seen:.4f} "
                       f"lr {optimizer.param_groups[0]['lr']:.4g} all-reduce passes/step {passes_per_step[-1]} "
                       f"(buckets {reduces_per_step[-1]}) "
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
                  device=str(device), local_batch_size=cfg.batch_size, accum_steps=accum_steps,
                  global_batch_size=effective_batch, lr=peak_lr, base_lr=cfg.lr, scale_lr=cfg.scale_lr,
                  warmup_steps=cfg.warmup_steps, use_no_sync=cfg.use_no_sync, epochs=epoch + 1, steps=step,
                  all_reduce_passes=counter["passes"], all_reduces=counter["all_reduces"],
                  all_reduce_hook=(counter["compress"] or allreduce_hook).__name__,  # what the counting hook called
                  all_reduce_passes_per_step=passes_per_step, all_reduces_per_step=reduces_per_step,
                  final_train_loss=train_loss, eval_loss=eval_loss, eval_accuracy=eval_acc,
                  eval_samples=eval_count, images_per_second=images_per_s, data_wait_fraction=data_wait,
                  replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1,
                  wall_time_s=time.perf_counter() - start_time, profile=profile_summary,
                  perf=perf_settings(model, scaler, cfg))
    print0(f"eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}; "
           f"{counter['passes']} gradient all-reduce passes ({counter['all_reduces']} bucket all-reduces) "
           f"for {step} optimizer steps")


if __name__ == "__main__":
    run(main)
