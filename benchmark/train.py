r"""The script with every performance knob: 01_basic_ddp/train.py plus mixed
precision, channels_last, model.compile(), activation checkpointing, DDP's
bucket and communication-hook settings, a --no-ddp baseline, device and backend
choice, input-pipeline settings, a step profile, peak memory and TensorBoard.

The lessons stay short; this is the script benchmark/benchmark.py runs. `diff
01_basic_ddp/train.py benchmark/train.py` shows every knob line. summary.json gets 01's fields
plus `perf` (what each knob set, read back from the objects, and every rank's peak memory) and
`profile` (images/s, data wait, and with --profile-steps the median split of a step).

    torchrun --standalone --nproc_per_node=2 \
        benchmark/train.py --precision bf16 --comm-hook bf16_compress
    # the baseline
    torchrun --standalone --nproc_per_node=2 benchmark/train.py --no-ddp --profile-steps 20
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
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary

# benchmark/perf.py
from perf import (
    ACTIVATION_CHECKPOINTING,
    AMP_DTYPES,
    COMM_HOOKS,
    SYNC_BUFFERS_ARGUMENT,
    NoDDP,
    StepTimer,
    buffer_checksum,
    check_knobs,
    checkpoint_blocks,
    device_type,
    loader_kwargs,
    peak_memory,
    perf_settings,
)


@dataclasses.dataclass
class PerfConfig(TrainConfig):
    """01's settings plus the performance knobs; the defaults are 01's behaviour."""

    device: str = field(
        "auto", "device type (auto: cuda where there is a GPU)", choices=("auto", "cpu", "cuda")
    )
    backend: str = field(
        "auto",
        "process-group backend (auto: nccl on cuda where torch has it, else gloo)",
        choices=("auto", "gloo", "nccl"),
    )
    precision: str = field(
        "fp32",
        "autocast: fp32 (off), bf16, or fp16 (with a GradScaler)",
        choices=("fp32", "bf16", "fp16"),
    )
    channels_last: bool = field(False, "channels_last memory format for model and inputs")
    compile: bool = field(False, "model.compile() (before the DDP wrap)")
    activation_checkpointing: str = field(
        "none",
        "recompute each block's activations in backward instead of "
        "keeping them: torch.utils.checkpoint with use_reentrant=False "
        "(non_reentrant) or True (reentrant)",
        choices=tuple(ACTIVATION_CHECKPOINTING),
    )
    ddp: bool = field(
        True, "wrap in DDP; --no-ddp: the same loop without gradient communication (a baseline)"
    )
    bucket_cap_mb: float = field(25.0, "DDP gradient bucket size in MiB", min=0.0)
    gradient_as_bucket_view: bool = field(
        False, "DDP: gradients are views into the buckets (saves their memory and the copy out)"
    )
    broadcast_buffers: bool = field(
        True,
        "DDP: broadcast rank 0's buffers (BatchNorm statistics) at every forward; "
        "--no-broadcast-buffers: each rank keeps its own, averaged before evaluation",
    )
    batched_grad_copy: bool = field(
        False, "DDP (torch 2.13+): one batched copy of the gradients into each bucket"
    )
    static_graph: bool = field(
        False, "DDP: the graph is the same every step (enables optimizations)"
    )
    find_unused_parameters: bool = field(
        False, "DDP: allow parameters that get no gradient (costs a graph walk)"
    )
    comm_hook: str = field(
        "none",
        "DDP communication hook compressing gradients",
        choices=("none", "bf16_compress", "fp16_compress"),
    )
    cudnn_benchmark: bool = field(
        True, "cuDNN times its convolution algorithms per input shape and keeps the fastest (GPU)"
    )
    pin_memory: bool = field(True, "pinned host memory for faster copies to the GPU (GPU only)")
    persistent_workers: bool = field(
        True, "keep DataLoader workers alive between epochs (num_workers > 0)"
    )
    prefetch_factor: int = field(
        2, "batches each DataLoader worker loads ahead (num_workers > 0)", min=1
    )
    fake_images: int = field(
        0,
        "--dataset fake: this many training images (0: 2,048, 8 steps at batch 256), so that "
        "the measured steps see the loader's steady state, not each epoch's start",
        min=0,
    )
    profile_steps: int = field(
        0,
        "time this many steps (after profile_warmup) and write the median split of a "
        "step into summary.json; 0: off",
        min=0,
    )
    profile_warmup: int = field(
        5, "steps left out before profiling (start-up, first-step allocations)", min=0
    )

    # load_config calls it: bad combinations are one error line, before any process group
    def validate(self):
        check_knobs(self)


@torch.no_grad()
def evaluate(model, forward, loader, device, memory_format=torch.preserve_format):
    """Exact distributed evaluation: this rank's sums, all-reduced. `model` is the plain module
    (ddp_model.module): ranks may hold different numbers of test batches; `forward` runs it."""
    model.eval()
    # loss sum, correct, count
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, memory_format=memory_format), labels.to(device)
        logits = forward(images)
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
    start_time = time.perf_counter()
    # One GPU per process (--device auto: where there is one):
    # the local rank's, or 0 where each rank sees only its own.
    device = torch.device("cuda", launch.gpu) if device_type(cfg) == "cuda" else torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else choose_backend(device)
    if device.type == "cuda":
        # before the process group, so its collectives use this device
        torch.cuda.set_device(device)
    # fixed input shapes: cuDNN picks the fastest convolution algorithm once per shape (GPU only)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    # Same initial weights on every rank (and DDP broadcasts rank 0's at the wrap).
    torch.manual_seed(cfg.seed)

    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if launch.rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, launch.world_size)
    if cfg.fake_images:  # random images from the same seeds; only the epoch's length changes
        data.train.size = cfg.fake_images
    # Each rank a disjoint 1/world_size of the training set, shuffled alike (seed + epoch).
    train_sampler = DistributedSampler(
        data.train,
        num_replicas=launch.world_size,
        rank=launch.rank,
        shuffle=True,
        seed=cfg.seed,
    )
    # num_workers, pin_memory (GPU only), persistent_workers
    # and prefetch_factor (with workers) from the config.
    train_loader = DataLoader(
        data.train,
        batch_size=cfg.local_batch_size,
        sampler=train_sampler,
        **loader_kwargs(cfg, device),
    )
    # A strided slice per rank: every test sample once (DistributedSampler pads with repeats).
    test_shard = Subset(data.test, range(launch.rank, len(data.test), launch.world_size))
    test_loader = DataLoader(
        test_shard, batch_size=cfg.local_batch_size, **loader_kwargs(cfg, device)
    )

    # To this rank's device, then wrap: DDP's hooks all-reduce the gradients in backward().
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    model = model.to(device)
    # NHWC, the fast layout for convolutions on tensor cores; the inputs follow in the loop.
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model = model.to(memory_format=memory_format)
    # Activation checkpointing: each block keeps only its
    # input and runs again in backward (less memory, more
    # compute). Before the wrap. reentrant fails with
    # find_unused_parameters unless static_graph is set
    # (benchmark/README.md, "Activation checkpointing with DDP"); non_reentrant does not.
    checkpoint_blocks(model, cfg.activation_checkpointing)
    if cfg.compile:  # in place, before the wrap: DDP's hooks stay outside the compiled graphs
        # (no wrapper: state_dict keys stay the module's own; DDPOptimizer still splits at buckets)
        model.compile()
    comm_hook = COMM_HOOKS[cfg.comm_hook] if cfg.ddp else None
    if cfg.ddp:
        ddp_knobs = {}
        if not cfg.broadcast_buffers:  # forward_sync_buffers from torch 2.13 on
            ddp_knobs[SYNC_BUFFERS_ARGUMENT] = False
        if cfg.batched_grad_copy:
            ddp_knobs["batched_grad_copy"] = True
        model = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            # gradients are all-reduced in buckets of this size
            bucket_cap_mb=cfg.bucket_cap_mb,
            # .grad points into the bucket
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,  # same graph every step: DDP can plan ahead
            # only if some parameters get no grad
            find_unused_parameters=cfg.find_unused_parameters,
            **ddp_knobs,
        )
        if comm_hook is not None:  # default_hooks.bf16_compress_hook / fp16_compress_hook
            model.register_comm_hook(state=None, hook=comm_hook)
    else:  # the baseline: the same loop without gradient communication (replicas drift apart)
        model = NoDDP(model)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    # From here on each rank its own augmentation and loader worker seeds.
    torch.manual_seed(cfg.seed + launch.rank)
    # Mixed precision: autocast runs the forward pass in bf16/fp16; fp16 also needs a GradScaler,
    # which scales the loss so small gradients do not underflow (a no-op when disabled).
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    # Images/s and data wait; with --profile-steps also where
    # each step's time goes (hooks, no calls in the step).
    timer = StepTimer(model.module, optimizer, device, cfg.profile_warmup, cfg.profile_steps)
    writer = None
    if launch.rank == 0:  # TensorBoard on rank 0 only
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(Path(cfg.output_dir) / "tensorboard"))

    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        global_batch = cfg.local_batch_size * launch.world_size
        print(
            f"launcher {launch.launcher}, {backend} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} = {global_batch}; "
            f"{type(model).__name__}, precision {cfg.precision}, comm hook {cfg.comm_hook}, "
            f"compile {cfg.compile}, channels_last {cfg.channels_last}, "
            f"activation checkpointing {cfg.activation_checkpointing}",
            flush=True,
        )
    step, images_seen = 0, 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        model.train()
        # This rank's loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        for images, labels in timer.iterate(train_loader):
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(
                device.type, dtype=AMP_DTYPES[cfg.precision], enabled=cfg.precision != "fp32"
            ):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            # set_to_none (the default), also under --gradient-as-bucket-view: backward's fresh
            # .grad is copied into the bucket once; a zeroed one would cost a zero, an add and a
            # divide per gradient (benchmark/README.md, "What DDP adds to a step").
            optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces (averages) the gradients here: every rank steps alike.
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # fp16: unscales, and skips the step if a gradient overflowed
            scaler.update()
            step += 1
            images_seen += len(labels)
            loss_and_count[0] += loss.detach() * len(labels)
            loss_and_count[1] += len(labels)
            if step % cfg.log_every == 0:
                # collective: every rank logs at the same steps
                images_per_s, data_wait = timer.rates()
                if launch.rank == 0:
                    print(
                        f"epoch {epoch + 1} step {step} loss {loss.item():.4f} (rank 0's "
                        "batch) images/s "
                        f"{images_per_s:.0f} data-wait {100 * data_wait:.1f}%",
                        flush=True,
                    )
                    writer.add_scalar("train/loss", loss.item(), step)
                    writer.add_scalar("perf/images_per_s", images_per_s, step)
                    writer.add_scalar("perf/data_wait_fraction", data_wait, step)
            if step == cfg.max_steps:
                break
        # Sums and counts over all ranks, the exact mean (not a mean of means); every rank calls it.
        dist.all_reduce(loss_and_count)
        train_loss = (loss_and_count[0] / loss_and_count[1]).item()
        images_per_s, data_wait = timer.rates()  # this epoch's training loop
        if not cfg.broadcast_buffers and launch.world_size > 1:
            # Each rank's BatchNorm statistics saw only its own batches: evaluate and save their
            # average, the same on every rank. A collective: every rank calls it.
            for buffer in model.module.buffers():
                if buffer.is_floating_point():
                    dist.all_reduce(buffer)
                    buffer /= launch.world_size
        # --compile: the module's own forward, eager; compiling it again for eval mode
        # would take as long as the training graphs did
        forward = model.module.forward if cfg.compile else model.module
        eval_loss, eval_acc, eval_count = evaluate(
            model.module, forward, test_loader, device, memory_format
        )
        if launch.rank == 0:
            print(
                f"epoch {epoch + 1} done: train loss {train_loss:.4f}, eval loss {eval_loss:.4f}, "
                f"eval accuracy {eval_acc:.4f} ({eval_count} images), images/s {images_per_s:.0f}, "
                f"data-wait {100 * data_wait:.1f}%",
                flush=True,
            )
            for name, value in (
                ("train/epoch_loss", train_loss),
                ("eval/loss", eval_loss),
                ("eval/accuracy", eval_acc),
            ):
                writer.add_scalar(name, value, epoch + 1)
        if step == cfg.max_steps:
            break

    # Plain file I/O on one rank; model.module drops DDP's "module." prefix.
    if launch.rank == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), Path(cfg.output_dir) / "model.pt")
        writer.close()
    # collective
    profile = dict(timer.profile(), images_per_second=images_per_s, data_wait_fraction=data_wait)
    # collective: GPU max_memory_allocated, CPU peak resident set, every rank
    memory = peak_memory(device)
    if launch.rank == 0:
        print(
            f"peak memory per rank ({memory['peak_memory']}): "
            + ", ".join(f"{b / 2**20:.0f}" for b in memory["peak_memory_bytes_per_rank"])
            + " MiB",
            flush=True,
        )

    # --- end-of-run record: summary.json; a copy may delete this block whole ---
    elapsed = time.perf_counter() - start_time
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    # ... and of its buffers, which DDP's forward broadcast leaves each rank's own (a collective)
    buffer_checksums = [None] * launch.world_size
    dist.all_gather_object(buffer_checksums, buffer_checksum(model.module))
    summary = dict(
        world_size=launch.world_size,
        launcher=launch.launcher,
        backend=backend,
        global_batch_size=cfg.local_batch_size * launch.world_size,
        # every rank saw as many
        images_per_second=images_seen * launch.world_size / elapsed,
        device=str(device),
        local_batch_size=cfg.local_batch_size,
        lr=cfg.lr,
        epochs=epoch + 1,
        steps=step,
        train_samples=len(data.train),
        final_train_loss=train_loss,
        eval_loss=eval_loss,
        eval_accuracy=eval_acc,
        eval_samples=eval_count,
        wall_time_s=elapsed,
        profile=profile,
        perf=dict(
            perf_settings(model, scaler, train_loader, comm_hook, cfg.compile, logits, images),
            **memory,
            buffers_identical=len(set(buffer_checksums)) == 1,
        ),
        replica_checksums=checksums,
    )
    if launch.rank == 0:
        write_summary(cfg.output_dir, **summary)
    # --- end of the end-of-run record ---

    # Release the DDP model first: it holds the process group, which would otherwise outlive
    # destroy_process_group() and keep gloo's threads running into interpreter shutdown.
    del model
    dist.destroy_process_group()


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(PerfConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher(uses_gpu=device_type(cfg) == "cuda")
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
