"""05 - complete, atomic, exactly resumable checkpoints, and surviving a killed worker.

01_basic_ddp/train.py plus everything a long job needs to be killed and resumed as if
nothing happened: rank 0 saves model, optimizer, LR scheduler, GradScaler, the position
in the epoch and every rank's RNG states; writes are atomic with a `latest` pointer; start-up
resumes from the newest checkpoint that loads; SIGTERM/SIGUSR1 make all ranks save at the
next step boundary and exit with code 75 (requeue me).

Run (CPU, 2 processes), stop it with Ctrl-C or `kill -TERM`, run it again: it resumes.
    torchrun --standalone --nproc_per_node=2 05_checkpointing/train.py --save-every-steps 20
Survive a worker crash: torchrun restarts the group, which resumes from the latest checkpoint.
    torchrun --standalone --nproc_per_node=2 --max-restarts=2 05_checkpointing/train.py
Export the weights for inference (a plain state_dict, no DDP needed to load it):
    python 05_checkpointing/export_model.py runs/latest/checkpoints model.pt
"""

import dataclasses
import hashlib
import itertools
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

import checkpoint as ckpt  # 05_checkpointing/checkpoint.py: atomic files, `latest`, RNG <-> tensors
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
class CheckpointConfig(TrainConfig):
    checkpoint_dir: str = field("", "checkpoint folder (empty: <output_dir>/checkpoints)")
    save_every_steps: int = field(0, "also save every N optimizer steps (0: only at the end of each epoch)", min=0)
    keep_last: int = field(3, "checkpoints to keep (older ones are deleted after a successful save)", min=1)
    resume: bool = field(True, "resume from the newest valid checkpoint in checkpoint_dir, if any")
    input_noise: float = field(0.0, "std of Gaussian noise added to training images (an augmentation "
                                    "drawn from each rank's own RNG)", min=0.0)
    record_batches: bool = field(False, "append a fingerprint of every training batch to "
                                        "<output_dir>/batches.rank<R>.txt (to compare sample order)")


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way: the same shuffle (seed + epoch),
    with the first `skip` samples of this rank's share left out. Reset `skip` to 0 afterwards."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return max(0, self.num_samples - self.skip)


class Preemption:
    """SIGTERM / SIGUSR1 only set a flag; the ranks act on it together at a step boundary.

    A rank must not save or exit on its own inside a handler: the others would hang in the
    next all-reduce. `requested()` is a collective: MAX over ranks, so if any rank got the
    signal, all of them stop at the same step.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.signum = 0
        for s in signals:
            signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        self.signum = signum

    def requested(self, device) -> int:
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


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


def save_checkpoint(ctx, cfg, folder, model, optimizer, scheduler, scaler, model_args,
                    epoch, step_in_epoch, step, loss_sum, seen):
    """Collective: every rank sends its RNG states and loss sums to rank 0; rank 0 writes one
    file; a barrier keeps every rank from going on (or reading it) before it is complete."""
    rank_state = {**ckpt.rng_state(ctx.device), "loss_sum": loss_sum, "seen": seen}
    gathered = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(rank_state, gathered, dst=0)
    path = None
    if ctx.is_main:
        state = {
            "model": unwrap(model).state_dict(),  # the plain model: no "module."/"_orig_mod." prefix
            "optimizer": optimizer.state_dict(),  # momentum buffers, param groups
            "scheduler": scheduler.state_dict(),  # where in the LR schedule we are
            "scaler": scaler.state_dict(),  # fp16 loss scale ({} when not in use)
            "epoch": epoch, "step_in_epoch": step_in_epoch, "step": step,  # sampler position
            "world_size": ctx.world_size, "batch_size": cfg.batch_size, "seed": cfg.seed,
            "ranks": gathered,  # per-rank RNG states and loss sums, restored rank by rank
            "model_args": model_args,  # how export_model.py rebuilds the network
        }
        path = ckpt.save(state, folder, step, cfg.keep_last)
    dist.barrier()  # nobody reads, resumes or exits before rank 0 has finished writing
    return path


def main(argv=None):
    cfg = load_config(CheckpointConfig, argv)  # bad keys/types fail here, before any process group
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device)
    try:
        train(cfg, ctx)
    finally:
        cleanup_distributed()


def train(cfg, ctx):
    start_time = time.perf_counter()
    device = ctx.device
    preemption = Preemption()  # install the handlers first: a signal from now on is not lost
    check_perf_config(cfg, device)  # e.g. bf16 on a GPU without it, --no-ddp with a comm hook: every rank fails alike
    torch.manual_seed(cfg.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    output_dir = Path(cfg.output_dir)
    ckpt_dir = Path(cfg.checkpoint_dir or output_dir / "checkpoints")

    # Data: the sampler gives each rank a disjoint 1/world_size of the (shuffled) training set.
    data = load_datasets(cfg.dataset, cfg.data_dir, cfg.image_size, cfg.download, ctx.rank)
    train_sampler = ResumableSampler(data.train, num_replicas=ctx.world_size, rank=ctx.rank,
                                     shuffle=True, seed=cfg.seed)
    # num_workers, pin_memory (GPU only), persistent_workers, prefetch_factor (with workers) from the config.
    loader_options = loader_kwargs(cfg, device)
    # The loader gets its own generator, reseeded each epoch: starting an epoch then draws nothing
    # from the global RNG (which the checkpoint restores), and worker seeds depend on the epoch only.
    loader_generator = torch.Generator()
    # shuffle=False here: shuffling is the sampler's job (it must be the same on every rank).
    train_loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=train_sampler,
                              generator=loader_generator, **loader_options)
    # Evaluation: a strided slice per rank covers every test sample exactly once. (DistributedSampler
    # would pad the last ranks with repeated samples and count them twice.)
    test_shard = Subset(data.test, range(ctx.rank, len(data.test), ctx.world_size))
    test_loader = DataLoader(test_shard, batch_size=cfg.batch_size, **loader_options)

    # Model: move to this rank's device first, then wrap. DDP broadcasts rank 0's weights
    # and registers the hooks that all-reduce gradients during backward.
    model_args = dict(name=cfg.model, num_classes=data.num_classes, in_channels=data.in_channels,
                      image_size=data.image_size)
    model = build_model(**model_args).to(device)
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
    # The LR schedule advances every step, so it is part of the state a resume must restore.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * steps_per_epoch)
    # From here on each rank draws its own random numbers (augmentation differs between ranks).
    torch.manual_seed(cfg.seed * 1000 + ctx.rank)
    random.seed(cfg.seed * 1000 + ctx.rank)
    np.random.seed(cfg.seed * 1000 + ctx.rank)

    # Resume: rank 0 picks the newest checkpoint that loads, every rank loads that same file
    # onto its own device (map_location) with weights_only=True.
    start_epoch = start_in_epoch = step = 0
    loss_sum = seen = 0.0
    choice, state = [None], None
    if ctx.is_main:
        for leftover in ckpt.remove_partial_files(ckpt_dir):
            print(f"removed {leftover.name}: a checkpoint write that never completed", flush=True)
        (ckpt_dir / "REQUEUE").unlink(missing_ok=True)
        if cfg.resume:
            found, state = ckpt.find_resumable(ckpt_dir, log=lambda line: print(line, flush=True),
                                               map_location=device)
            choice = [str(found) if found else None]
        elif ckpt.list_checkpoints(ckpt_dir):
            choice = ["exists"]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] == "exists":
        raise ConfigError(f"--no-resume but {ckpt_dir} holds checkpoints of an earlier run: "
                          "remove them or pass another --checkpoint-dir")
    if choice[0]:
        if not ctx.is_main:  # rank 0 loaded it while picking it
            state = ckpt.load(choice[0], map_location=device)
        if state["world_size"] != ctx.world_size or state["batch_size"] != cfg.batch_size:
            raise ConfigError(f"{choice[0]} was written with world size {state['world_size']} and batch size "
                              f"{state['batch_size']}; an exact resume needs the same (now {ctx.world_size}, "
                              f"{cfg.batch_size}), or start fresh with --no-resume and another --checkpoint-dir")
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        start_epoch, start_in_epoch, step = state["epoch"], state["step_in_epoch"], state["step"]
        mine = state["ranks"][ctx.rank]  # this rank's own RNG states and partial loss sums
        ckpt.set_rng_state(mine, device)
        loss_sum, seen = mine["loss_sum"], mine["seen"]
        print0(f"resumed from {choice[0]}: epoch {start_epoch + 1}, step {step} "
               f"({start_in_epoch} of {steps_per_epoch} in the epoch)")
        del state
    resumed_from = step

    banner(ctx, cfg, **{"data sizes": f"train {len(data.train)} ({len(train_sampler)} per rank, "
                                       f"{steps_per_epoch} steps/epoch), test {len(data.test)}",
                        "checkpoints": f"{ckpt_dir} (every {cfg.save_every_steps or steps_per_epoch} steps, "
                                       f"keep {cfg.keep_last})"})
    tensorboard = TensorBoard(output_dir / "tensorboard")
    record = None
    if cfg.record_batches:  # appended to, so a resumed run continues the same file
        output_dir.mkdir(parents=True, exist_ok=True)
        record = open(output_dir / f"batches.rank{ctx.rank}.txt", "a")
    timer = StepTimer(device)
    profile = StepProfiler(unwrap(model), device, cfg.profile_warmup, cfg.profile_steps)
    train_loss = eval_loss = eval_acc = float("nan")
    eval_count = 0
    images_per_s = data_wait = 0.0
    epoch = start_epoch

    def save(epoch, in_epoch):  # collective; `step`, `loss_sum` and `seen` are read when it is called
        path = save_checkpoint(ctx, cfg, ckpt_dir, model, optimizer, scheduler, scaler, model_args,
                               epoch, in_epoch, step, loss_sum, seen)
        print0(f"saved {path}")

    for epoch in range(start_epoch, cfg.epochs):
        if cfg.max_steps and step >= cfg.max_steps:  # a resumed run that had already finished
            break
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on every rank
        resuming = epoch == start_epoch and start_in_epoch > 0
        in_epoch = start_in_epoch if resuming else 0
        train_sampler.skip = in_epoch * cfg.batch_size  # continue mid-epoch with the same order
        loader_generator.manual_seed(cfg.seed + epoch)
        if not resuming:
            loss_sum = seen = 0.0
        model.train()
        timer.reset()
        profile.epoch_start()
        for images, labels in timer.iterate(train_loader):
            profile.begin()
            if record:
                digest = hashlib.sha1(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()[:16]
                record.write(f"{epoch} {step + 1} {digest}\n")
                record.flush()
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if cfg.input_noise:
                images = images + cfg.input_noise * torch.randn_like(images)
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
            scheduler.step()
            step += 1
            in_epoch += 1
            loss_sum += loss.item() * len(labels)
            seen += len(labels)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                total_loss, total_seen = all_reduce_sums([loss_sum, seen], device)
                images_per_s, data_wait = timer.global_rates()
                print0(f"epoch {epoch + 1} step {step} loss {total_loss / total_seen:.4f} "
                       f"lr {scheduler.get_last_lr()[0]:.4f} images/s {images_per_s:.0f} "
                       f"data-wait {100 * data_wait:.1f}%")
                tensorboard.scalars(step, **{"train/loss": total_loss / total_seen, "perf/images_per_s": images_per_s})
            # Step boundary: every rank learns whether any rank was told to stop.
            signum = preemption.requested(device)
            periodic = cfg.save_every_steps and step % cfg.save_every_steps == 0
            if signum or ((periodic or step == cfg.max_steps) and in_epoch < steps_per_epoch):
                save(epoch, in_epoch)  # mid-epoch: the position (epoch, in_epoch) is in the file
            if signum:
                if ctx.is_main:
                    (ckpt_dir / "REQUEUE").write_text(f"{signal.Signals(signum).name} at step {step}\n")
                print0(f"{signal.Signals(signum).name}: checkpoint at step {step} saved; "
                       f"exiting with code {ckpt.REQUEUE_EXIT_CODE} (requeue)")
                sys.exit(ckpt.REQUEUE_EXIT_CODE)
            if step == cfg.max_steps:
                break
        total_loss, total_seen = all_reduce_sums([loss_sum, seen], device)
        train_loss = total_loss / total_seen
        images_per_s, data_wait = timer.global_rates()
        eval_loss, eval_acc, eval_count = evaluate(unwrap(model), test_loader, device, cfg.channels_last)
        print0(f"epoch {epoch + 1} done: train loss {train_loss:.4f}, eval loss {eval_loss:.4f}, "
               f"eval accuracy {eval_acc:.4f} ({eval_count} images), images/s {images_per_s:.0f}, "
               f"data-wait {100 * data_wait:.1f}%")
        tensorboard.scalars(epoch + 1, **{"eval/loss": eval_loss, "eval/accuracy": eval_acc})
        if in_epoch == steps_per_epoch:  # the epoch is complete: the next run starts the next one
            save(epoch + 1, 0)

    # Every rank computes a checksum of its replica (a collective); rank 0 writes the files.
    checksums = replica_checksums(model)
    profile_summary = profile.summary()  # collective when profiling
    if ctx.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(unwrap(model).state_dict(), output_dir / "model.pt")  # no "module."/"_orig_mod." prefix
    if record:
        record.close()
    tensorboard.close()
    write_summary(output_dir, world_size=ctx.world_size, launcher=ctx.info.launcher, backend=ctx.backend,
                  device=str(device), local_batch_size=cfg.batch_size,
                  global_batch_size=cfg.batch_size * ctx.world_size, lr=cfg.lr, epochs=epoch + 1, steps=step,
                  resumed_from_step=resumed_from,
                  final_train_loss=train_loss, eval_loss=eval_loss, eval_accuracy=eval_acc,
                  eval_samples=eval_count, images_per_second=images_per_s, data_wait_fraction=data_wait,
                  replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1,
                  wall_time_s=time.perf_counter() - start_time, profile=profile_summary,
                  perf=perf_settings(model, scaler, cfg))
    print0(f"eval accuracy {eval_acc:.4f}; replicas identical: {len(set(checksums)) == 1}")


if __name__ == "__main__":
    run(main)
