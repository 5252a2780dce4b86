"""05 - checkpoints: complete, atomic, and resumed exactly, mid-epoch and on another world size.

01_basic_ddp/train.py plus a checkpoint of the training state (model, optimizer), where the run
is (step, epoch, samples read) and every rank's RNG states; rank 0 writes it atomically
(checkpoint.py) and a new start resumes from the newest one that loads. preempt.py runs this
train() and adds stopping on a signal or a deadline. `diff 01_basic_ddp/train.py train.py` shows
this lesson.
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
from torch.utils.data import DataLoader, Subset

# 05_checkpointing/checkpoint.py: atomic files, `latest`, RNG states, the resumable sampler
import checkpoint as ckpt
from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.errors import ConfigError
from common.bad_input import exit_on_bad_input
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, run_record, write_summary


@dataclasses.dataclass
class CheckpointConfig(TrainConfig):
    checkpoint_dir: str = field("", "checkpoint folder (empty: <output_dir>/checkpoints)")
    save_every_steps: int = field(
        0, "also save every N optimizer steps (0: only at the end of each epoch)", min=0
    )
    keep_last: int = field(
        3, "checkpoints to keep (older ones are deleted after a successful save)", min=1
    )

    @property
    def checkpoints(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.output_dir) / "checkpoints")


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


@dataclasses.dataclass
class Progress:
    """Where the run is: the optimizer steps taken, the epoch to go on in, and how many samples of
    that epoch's order all ranks have read together. A checkpoint holds it as its keys step, epoch
    and consumed; resume() gives it back."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0

    def done(self, cfg):
        """A finished run, started again: nothing to do."""
        return self.epoch >= cfg.epochs or 0 < cfg.max_steps <= self.step

    @classmethod
    def after(cls, step, epoch, batch, train_loader, world_size):
        """Where to go on after `batch` of `epoch`: the next epoch after its last batch, else this
        one, after the samples all ranks have read."""
        if batch == len(train_loader):
            return cls(step, epoch + 1, 0)
        read = batch * train_loader.batch_size * world_size
        return cls(step, epoch, train_loader.sampler.consumed + read)


def resumable_loaders(cfg, launch, data, device, worker_init_fn=None):
    """01's sampler and loaders, with what an exact resume needs: ResumableSampler (checkpoint.py)
    can skip the samples of an epoch's order read before the checkpoint, and the loaders draw their
    seeds from a generator of their own. Each loader worker runs worker_init_fn as it starts
    (preempt.py's ignores its signals). Returns the sampler, the generator and the loaders."""
    # Each rank a disjoint 1/world_size of the training set, shuffled alike (seed + epoch).
    train_sampler = ckpt.ResumableSampler(
        data.train,
        num_replicas=launch.world_size,
        rank=launch.rank,
        shuffle=True,
        seed=cfg.seed,
    )
    # A DataLoader draws a seed at every iter() from `generator`, or else from the global RNG,
    # which the checkpoint restores: its own generator keeps the loaders from shifting that stream.
    generator = torch.Generator()
    train_loader = DataLoader(
        data.train,
        batch_size=cfg.local_batch_size,
        sampler=train_sampler,
        num_workers=cfg.num_workers,
        # not fork(), which can copy a lock that gloo's or NCCL's threads hold (common/data.py)
        multiprocessing_context=worker_start_method(cfg.num_workers),
        pin_memory=device.type == "cuda",
        generator=generator,
        worker_init_fn=worker_init_fn,
    )
    # A strided slice per rank: every test sample once (DistributedSampler pads with repeats).
    test_shard = Subset(data.test, range(launch.rank, len(data.test), launch.world_size))
    test_loader = DataLoader(
        test_shard,
        batch_size=cfg.local_batch_size,
        num_workers=cfg.num_workers,
        multiprocessing_context=worker_start_method(cfg.num_workers),
        generator=generator,
        worker_init_fn=worker_init_fn,
    )
    return train_sampler, generator, train_loader, test_loader


def save_checkpoint(cfg, launch, device, training, progress, loss_and_count, model_args):
    """Collective: rank 0 writes `training` (the replicas are identical), `progress`, `model_args`
    and every rank's RNG states and loss sums; the barrier keeps all ranks from going on before the
    file is whole."""
    ranks = [None] * launch.world_size if launch.rank == 0 else None
    rank_state = {**ckpt.rng_state(device), "loss_and_count": loss_and_count.cpu()}
    dist.gather_object(rank_state, ranks, dst=0)
    if launch.rank == 0:
        state = {name: part.state_dict() for name, part in training.items()}
        state.update(dataclasses.asdict(progress), model_args=model_args, ranks=ranks)
        state.update(world_size=launch.world_size, batch_size=cfg.local_batch_size)
        path = ckpt.save(state, cfg.checkpoints, progress.step, cfg.keep_last)
        print(f"saved {path}", flush=True)
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def resume(cfg, launch, device, training):
    """Collective: rank 0 picks the newest checkpoint that loads; every rank loads it (weights_only)
    and restores `training` and its own RNG states. Returns where to go on (a new run: at the
    start), and this rank's share of the saved epoch's loss sums."""
    found, state = None, None
    if launch.rank == 0:
        found, state = ckpt.find_resumable(cfg.checkpoints, map_location=device)
    choice = [found]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return Progress(), None
    if launch.rank != 0:
        state = ckpt.load(choice[0], map_location=device)
    with exit_on_bad_input():  # the same on every rank: rank 0 says it, all exit with code 2
        if state["batch_size"] != cfg.local_batch_size:
            raise ConfigError(
                f"{choice[0]} was written with batch size {state['batch_size']} per rank; a "
                f"resume needs the same (now {cfg.local_batch_size}), or another --checkpoint-dir"
            )
    for name, part in training.items():
        part.load_state_dict(state[name])
    # this rank's own RNG states; a rank the saved run did not have keeps its seed + rank
    if launch.rank < len(state["ranks"]):
        ckpt.set_rng_state(state["ranks"][launch.rank], device)
    # The epoch's loss sums so far: with W ranks now, rank r adds those of saved ranks r, r + W, ...
    loss_and_count = sum(
        s["loss_and_count"] for s in state["ranks"][launch.rank :: launch.world_size]
    )
    progress = Progress(state["step"], state["epoch"], state["consumed"])
    if launch.rank == 0:
        print(
            f"resumed from {choice[0]}: step {state['step']}, epoch {state['epoch'] + 1}, "
            f"world size {state['world_size']} -> {launch.world_size}",
            flush=True,
        )
        if progress.done(cfg):
            print(f"nothing to do: step {progress.step} is the end of this run", flush=True)
    return progress, loss_and_count


def train(cfg, launch, preemption=None) -> str:
    """The run. `preemption` is preempt.py's (None here): asked at every step boundary whether to
    stop, it makes all ranks save that step and return early. Returns why the run stopped early
    ("SIGTERM", "time limit"), or "" when it ended or had nothing left to do."""
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
    train_sampler, generator, train_loader, test_loader = resumable_loaders(
        cfg, launch, data, device, preemption.worker_init_fn if preemption else None
    )

    # To this rank's device, then wrap: DDP's hooks all-reduce the gradients in backward().
    # saved, so that export_model.py can rebuild the network
    model_args = [cfg.model, data.num_classes, data.in_channels, data.image_size]
    model = build_model(*model_args)
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
    # The training state, saved and restored whole (model.module: no "module." prefix).
    training = {"model": model.module, "optimizer": optimizer}
    progress, resumed_sums = resume(cfg, launch, device, training)
    if progress.done(cfg):  # a finished run, started again
        del model
        dist.destroy_process_group()
        return ""

    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        global_batch = cfg.local_batch_size * launch.world_size
        print(
            f"launcher {launch.launcher}, {backend} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} = {global_batch}",
            flush=True,
        )
    step, images_seen, stop = progress.step, 0, ""
    for epoch in range(progress.epoch, cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        # Mid-epoch resume: the same order, without the samples trained on before the checkpoint.
        train_sampler.consumed = progress.consumed if epoch == progress.epoch else 0
        generator.manual_seed(cfg.seed + launch.rank + epoch * launch.world_size)  # worker seeds
        model.train()
        # This rank's loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        if train_sampler.consumed:  # and those of the batches before the resume
            loss_and_count += resumed_sums
        for batch, (images, labels) in enumerate(train_loader, 1):
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
            # preempt.py's step boundary: a collective, so every rank learns whether to stop.
            stop = preemption.requested(device) if preemption else ""
            # Save at the same step on every rank (a collective): periodically, at each epoch's end.
            periodic = cfg.save_every_steps and step % cfg.save_every_steps == 0
            if stop or periodic or batch == len(train_loader) or step == cfg.max_steps:
                at = Progress.after(step, epoch, batch, train_loader, launch.world_size)
                save_checkpoint(cfg, launch, device, training, at, loss_and_count, model_args)
            if stop:
                preemption.saved(cfg, launch, device, step, stop)  # a collective: its note
                break
            if step == cfg.max_steps:
                break
        if stop:  # saved to be resumed: no evaluation, final model or end-of-run record
            del model
            dist.destroy_process_group()
            return stop
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
            epochs=epoch + 1,
            steps=step,
            resumed_from_step=progress.step,
            final_train_loss=train_loss,
            eval_loss=eval_loss,
            eval_accuracy=eval_acc,
            eval_samples=eval_count,
            replica_checksums=checksums,
        )
        write_summary(cfg.output_dir, **summary)
    # --- end of the end-of-run record ---

    # Release the DDP model first: it holds the process group, which would otherwise outlive
    # destroy_process_group() and keep gloo's threads running into interpreter shutdown.
    del model
    dist.destroy_process_group()
    return ""


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(CheckpointConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
