"""03 - 01 plus gradient accumulation under DDP, with no_sync().

One optimizer step sees `accum_steps` micro-batches per rank: effective batch = local batch x
world size x accum_steps. The micro-batches' gradients add up in .grad; inside model.no_sync()
DDP skips the all-reduce, so only a window's last micro-batch communicates: once per optimizer
step instead of once per micro-batch. The window's step is where mixed precision and gradient
clipping meet accumulation: clip only there, on the all-reduced gradient, after the GradScaler
has unscaled it. `diff 01_basic_ddp/train.py 03_grad_accum/train.py` shows exactly what
accumulation adds.

    torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --local-batch-size 8 \
        --accum-steps 4
    torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --local-batch-size 8 \
        --accum-steps 4 --precision fp16 --max-grad-norm 1.0
"""

import dataclasses
import os
import sys
import time
from contextlib import nullcontext
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
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, run_record, write_summary


@dataclasses.dataclass
class AccumConfig(TrainConfig):
    accum_steps: int = field(
        1, "micro-batches per rank per optimizer step (gradient accumulation)", min=1
    )
    use_no_sync: bool = field(
        True, "skip the gradient all-reduce on all but the last micro-batch (DDP no_sync)"
    )
    precision: str = field(
        "fp32",
        "autocast: fp32 (off), bf16, or fp16 (with a GradScaler)",
        choices=("fp32", "bf16", "fp16"),
    )
    max_grad_norm: float = field(
        0.0, "clip the gradient's total norm at each optimizer step (0: no clipping)", min=0.0
    )
    lr_base_batch: int = field(
        0, "scale --lr by effective batch / this batch, the one --lr was tuned for (0: off)", min=0
    )
    warmup_steps: int = field(
        0, "raise the learning rate linearly over this many optimizer steps (0: none)", min=0
    )


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


class Accumulation:
    """`accum_steps` micro-batches per rank make one optimizer step: effective batch = local batch
    x world size x accum_steps, and the learning rate for it. backward() runs each micro-batch
    inside no_sync() but the window's last; step() is the window's optimizer step, where mixed
    precision, gradient clipping and warm-up meet accumulation."""

    def __init__(self, cfg, world_size, optimizer, train_loader, device):
        self.cfg = cfg
        self.optimizer = optimizer
        self.device = device
        # micro-batches per rank per epoch, and the samples they hold
        self.micro_batches = len(train_loader)
        self.samples = len(train_loader.sampler)
        # samples per optimizer step
        self.effective_batch = cfg.local_batch_size * world_size * cfg.accum_steps
        # Linear scaling rule (SGD): a larger batch, a proportionally larger learning rate.
        self.lr = cfg.lr * self.effective_batch / cfg.lr_base_batch if cfg.lr_base_batch else cfg.lr
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        # Warm-up: from lr / warmup_steps up to lr, one scheduler step per optimizer step.
        self.warmup = None
        if cfg.warmup_steps:
            self.warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=1 / cfg.warmup_steps, total_iters=cfg.warmup_steps
            )
        # fp16 only: scales the loss so small gradients do not underflow (a no-op otherwise)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)

    def backward(self, model, i, images, labels):
        """Forward and backward of micro-batch i of the epoch. Returns its loss, and whether it
        is its window's last: the one whose backward all-reduced, after which step() steps."""
        cfg = self.cfg
        amp_dtype = self.amp_dtype
        window_start = i - i % cfg.accum_steps
        # an epoch's last window may be short
        window_end = min(window_start + cfg.accum_steps, self.micro_batches)
        window_samples = (
            min(window_end * cfg.local_batch_size, self.samples)
            - window_start * cfg.local_batch_size
        )
        sync = i == window_end - 1  # the window's last micro-batch all-reduces
        # Forward AND backward inside no_sync: DDP reads the flag in forward() to prepare the
        # backward's all-reduce, so a forward outside no_sync still communicates.
        with model.no_sync() if cfg.use_no_sync and not sync else nullcontext():
            with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            # .grad sums over the window. Weighting each micro-batch's mean loss by its share of
            # the window's samples makes the sum the window's mean gradient: loss / accum_steps
            # for a full window, and still exact in an epoch's shorter last window. (Not / world
            # size: DDP already averages.)
            self.scaler.scale(loss * len(labels) / window_samples).backward()
        return loss, sync

    def step(self, model):
        """The window's optimizer step. The sync backward before it averaged the window's
        gradient over the ranks."""
        cfg = self.cfg
        scaler = self.scaler
        optimizer = self.optimizer
        if cfg.max_grad_norm:
            # Clip here, after the all-reduce, never inside no_sync: each rank would clip its own
            # partial sum. The norm is the same on every rank, so all clip alike. Unscale first,
            # or the norm is the scaled gradient's.
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        # fp16: skips the step if a gradient is inf or nan; after the all-reduce that is every
        # rank's gradient, so every rank skips alike.
        scaler.step(optimizer)
        scaler.update()
        if self.warmup is not None:  # counts optimizer steps, not micro-batches
            self.warmup.step()
        optimizer.zero_grad(set_to_none=True)  # only after a step: until then .grad accumulates

    def describe(self):
        """For the start line: the window, the precision, the clipping and the rate."""
        cfg = self.cfg
        return (
            f"accum {cfg.accum_steps} = {self.effective_batch}, "
            f"{self.micro_batches} micro-batches per rank per epoch, no_sync {cfg.use_no_sync}, "
            f"precision {cfg.precision}, max grad norm {cfg.max_grad_norm}, "
            f"lr {self.lr:g}, warm-up {cfg.warmup_steps} steps"
        )

    def summary(self):
        """summary.json's fields of the accumulation, beside 01's."""
        cfg = self.cfg
        return dict(
            accum_steps=cfg.accum_steps,
            use_no_sync=cfg.use_no_sync,
            precision=cfg.precision,
            max_grad_norm=cfg.max_grad_norm,
            # fp16: 65536 halved at each skipped step (1.0 without a scaler)
            grad_scale=self.scaler.get_scale(),
            warmup_steps=cfg.warmup_steps,
            final_lr=self.optimizer.param_groups[0]["lr"],
        )


def train(cfg, launch):
    start_time = time.perf_counter()
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
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    model = model.to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    accumulation = Accumulation(cfg, launch.world_size, optimizer, train_loader, device)
    # From here on each rank its own augmentation and loader worker seeds.
    torch.manual_seed(cfg.seed + launch.rank)

    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        print(
            f"launcher {launch.launcher}, {backend} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} x {accumulation.describe()}",
            flush=True,
        )
    step, images_seen = 0, 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        model.train()
        # This rank's loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        for i, (images, labels) in enumerate(train_loader):
            images, labels = images.to(device), labels.to(device)
            loss, sync = accumulation.backward(model, i, images, labels)  # no_sync but the last
            images_seen += len(labels)
            loss_and_count[0] += loss.detach() * len(labels)
            loss_and_count[1] += len(labels)
            if not sync:
                continue  # no step yet: keep accumulating
            accumulation.step(model)
            step += 1
            if launch.rank == 0 and step % cfg.log_every == 0:
                print(
                    f"epoch {epoch + 1} step {step} loss {loss.item():.4f} (rank 0's last "
                    "micro-batch)",
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
        torch.save(model.module.state_dict(), Path(cfg.output_dir) / "model.pt")

    # --- end-of-run record: summary.json; a copy may delete this block whole ---
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        summary = run_record(
            cfg,
            launch,
            backend=backend,
            device=device,
            start_time=start_time,
            images_seen=images_seen,
            global_batch_size=accumulation.effective_batch,
            lr=accumulation.lr,
            epochs=epoch + 1,
            steps=step,
            final_train_loss=train_loss,
            eval_loss=eval_loss,
            eval_accuracy=eval_acc,
            eval_samples=eval_count,
            replica_checksums=checksums,
        )
        write_summary(cfg.output_dir, **summary, **accumulation.summary())
    # --- end of the end-of-run record ---

    # Release the DDP model first: it holds the process group, which would otherwise outlive
    # destroy_process_group() and keep gloo's threads running into interpreter shutdown.
    del model
    dist.destroy_process_group()


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(AccumConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
