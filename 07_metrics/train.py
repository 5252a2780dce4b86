"""07 - 01 plus metrics across ranks: logged once, decided on together.

Each rank sums its loss, correct predictions and samples since the last log line; at a log step
every rank all-reduces those sums, so the logged loss is the exact mean over all ranks' samples,
and rank 0 alone prints it and writes it to TensorBoard (one run directory per job). Decisions
come from the same all-reduced numbers, so every rank takes them alike: early stopping when the
eval loss stops improving (--patience), and a stop at the first non-finite gradient, which
after backward is the same all-reduced gradient on every rank: that step is skipped everywhere,
the last finite weights are saved and every rank exits 1.
`diff 01_basic_ddp/train.py 07_metrics/train.py` shows exactly that.

    torchrun --standalone --nproc_per_node=2 07_metrics/train.py --patience 1
    tensorboard --logdir runs/latest/tensorboard
"""

import dataclasses
import math
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
from torch.utils.tensorboard import SummaryWriter

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, run_record, write_summary


@dataclasses.dataclass
class MetricsConfig(TrainConfig):
    patience: int = field(
        0, "stop when the eval loss has not improved for this many epochs (0: never)", min=0
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


def tensorboard_writer(cfg, launch):
    """Rank 0's TensorBoard writer, None on the other ranks: a writer on every rank makes one run
    per rank. One directory per job: the scheduler's job id (a requeued job goes on in it), else
    the start time."""
    writer = None
    if launch.rank == 0:
        run_name = launch.job_id or time.strftime("%Y%m%d-%H%M%S")
        writer = SummaryWriter(Path(cfg.output_dir) / "tensorboard" / run_name)
    return writer


class Metrics:
    """What the run logs, the same on every rank. Each rank sums its own batches into two
    accumulators, the samples since the last log line and the epoch's; every rank all-reduces them
    at the same steps (collectives), so a logged loss is the exact mean over all ranks' samples,
    not rank 0's batch and not a mean of means. Rank 0 alone prints and writes to TensorBoard."""

    def __init__(self, cfg, launch, device):
        self.rank = launch.rank
        self.writer = tensorboard_writer(cfg, launch)
        # This rank's sums since the last log step: loss, correct, samples.
        self.window = torch.zeros(3, dtype=torch.float64, device=device)
        # This rank's loss sum and sample count of the epoch.
        self.loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)

    def add(self, loss, logits, labels):
        """This rank's batch, into both sums."""
        self.loss_and_count[0] += loss.detach() * len(labels)
        self.loss_and_count[1] += len(labels)
        self.window[0] += loss.detach() * len(labels)
        self.window[1] += (logits.argmax(1) == labels).sum()
        self.window[2] += len(labels)

    def log_step(self, epoch, step):
        """Collective, at a log step: the window's sums over all ranks, then a new window."""
        dist.all_reduce(self.window)
        loss_sum, correct, count = self.window.tolist()
        self.window.zero_()
        if self.rank == 0:
            print(
                f"epoch {epoch + 1} step {step} loss {loss_sum / count:.4f} accuracy "
                f"{correct / count:.4f} (all ranks' {int(count)} samples since the last line)",
                flush=True,
            )
            self.writer.add_scalar("train/loss", loss_sum / count, step)
            self.writer.add_scalar("train/accuracy", correct / count, step)

    def train_loss(self):
        """Collective, at the epoch's end: the epoch's train loss over all ranks; the next epoch's
        sums start from zero."""
        dist.all_reduce(self.loss_and_count)
        train_loss = (self.loss_and_count[0] / self.loss_and_count[1]).item()
        self.loss_and_count.zero_()
        return train_loss

    def log_epoch(self, epoch, step, train_loss, eval_loss, eval_acc, eval_count):
        """Rank 0's line and eval curves at the epoch's end (every number already all-reduced)."""
        if self.rank == 0:
            print(
                f"epoch {epoch + 1} done: train loss {train_loss:.4f}, "
                f"eval loss {eval_loss:.4f}, "
                f"eval accuracy {eval_acc:.4f} ({eval_count} images)",
                flush=True,
            )
            self.writer.add_scalar("eval/loss", eval_loss, step)
            self.writer.add_scalar("eval/accuracy", eval_acc, step)

    def close(self):
        """Rank 0's: the event file complete on disk."""
        self.writer.close()


class Stopping:
    """When to stop before the last epoch, decided from numbers every rank holds alike, so that
    every rank stops after the same step: a non-finite gradient (all-reduced, so the same on
    every rank) and early stopping on the all-reduced eval loss. 01's --max-steps stays in the
    loop. A decision one rank took from its own numbers would leave the others waiting in their
    next collective."""

    def __init__(self, patience):
        self.patience = patience
        # why the run stops early, and the error a non-finite gradient is ("" for none)
        self.reason = ""
        self.failure = ""
        self.best_eval_loss = float("inf")
        self.epochs_without_improvement = 0

    def non_finite_gradient(self, loss, step, world_size):
        """Collective: every rank holds the same non-finite gradient and calls it, to learn whose
        loss it was. Each rank skips the step alike (as GradScaler does) and no replica takes it."""
        losses = [None] * world_size
        dist.all_gather_object(losses, loss.item())
        ranks = [r for r, value in enumerate(losses) if not math.isfinite(value)]
        self.failure = (
            f"a non-finite gradient at step {step + 1} (non-finite loss on ranks {ranks})"
        )
        self.reason = f"{self.failure}; that step was skipped on every rank"

    def after_epoch(self, eval_loss):
        """Early stopping on the all-reduced eval loss: the same number on every rank, so every
        rank stops after the same epoch. Returns why to stop now ("" to go on)."""
        if eval_loss < self.best_eval_loss:
            self.best_eval_loss = eval_loss
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        if self.patience and self.epochs_without_improvement >= self.patience and not self.reason:
            self.reason = f"no better eval loss for {self.patience} epochs"
        return self.reason

    def report(self, step):
        """Rank 0's one error line after a non-finite gradient; train() then returns 1."""
        if self.failure:
            # the weights saved are the last finite ones
            print(
                f"error: {self.failure}; stopped with the weights of step {step}", file=sys.stderr
            )

    def summary(self):
        """summary.json's fields beside 01's: why the run stopped early ("" if it did not)."""
        return dict(stopped_early=self.reason, best_eval_loss=self.best_eval_loss)


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
    # From here on each rank its own augmentation and loader worker seeds.
    torch.manual_seed(cfg.seed + launch.rank)
    metrics = Metrics(cfg, launch, device)  # what is logged: the same on every rank
    stopping = Stopping(cfg.patience)  # when to stop: the same on every rank

    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        global_batch = cfg.local_batch_size * launch.world_size
        print(
            f"launcher {launch.launcher}, {backend} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} = {global_batch}",
            flush=True,
        )
    step, images_seen = 0, 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces (averages) the gradients here: every rank steps alike.
            loss.backward()
            # All-reduced now, one rank's inf or NaN is on every rank: each skips this step alike.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not torch.stack([g.isfinite().all() for g in grads]).all():
                stopping.non_finite_gradient(loss, step, launch.world_size)  # a collective
                break
            optimizer.step()
            step += 1
            images_seen += len(labels)
            metrics.add(loss, logits, labels)
            if step % cfg.log_every == 0:
                metrics.log_step(epoch, step)  # a collective: every rank, at the same steps
            if step == cfg.max_steps:
                break
        train_loss = metrics.train_loss()  # a collective: the epoch's exact mean
        eval_loss, eval_acc, eval_count = evaluate(model.module, test_loader, device)
        metrics.log_epoch(epoch, step, train_loss, eval_loss, eval_acc, eval_count)
        stop = stopping.after_epoch(eval_loss)
        if stop and launch.rank == 0:
            print(f"stopping early after epoch {epoch + 1}: {stop}", flush=True)
        if stop or step == cfg.max_steps:
            break

    # Plain file I/O on one rank; model.module drops DDP's "module." prefix.
    if launch.rank == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), Path(cfg.output_dir) / "model.pt")
        metrics.close()
        stopping.report(step)

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
            epochs=epoch + 1,
            steps=step,
            final_train_loss=train_loss,
            eval_loss=eval_loss,
            eval_accuracy=eval_acc,
            eval_samples=eval_count,
            replica_checksums=checksums,
        )
        write_summary(cfg.output_dir, **summary, **stopping.summary())
    # --- end of the end-of-run record ---

    # Release the DDP model first: it holds the process group, which would otherwise outlive
    # destroy_process_group() and keep gloo's threads running into interpreter shutdown.
    del model
    dist.destroy_process_group()
    return 1 if stopping.failure else 0  # 1 after a non-finite gradient: the run failed


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(MetricsConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    # non-zero on every rank after a non-finite gradient, so the launcher reports the job failed
    sys.exit(train(cfg, launch))


if __name__ == "__main__":
    main()
