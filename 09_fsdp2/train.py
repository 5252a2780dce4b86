"""09 - 01 with FSDP2 (fully_shard) in place of DDP.

DDP keeps a whole replica of the model, its gradients and its optimizer state on every rank.
fully_shard splits each parameter across the ranks instead: a rank holds 1/world_size of the
parameters, gradients and optimizer state. Each block's forward and backward first all-gather its
parameters, and backward reduce-scatters (averages) the gradients, so every rank steps its own
shard. `diff 01_basic_ddp/train.py 09_fsdp2/train.py` shows exactly what changes.

    torchrun --standalone --nproc_per_node=2 09_fsdp2/train.py
    torchrun --standalone --nproc_per_node=3 09_fsdp2/train.py --epochs 14 --resume
"""

import dataclasses
import json
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
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.errors import ConfigError
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import run_record, write_json_atomic, write_summary


@dataclasses.dataclass
class FsdpConfig(TrainConfig):
    precision: str = field(
        "fp32",
        "bf16: parameters all-gathered and computed in bfloat16, gradients reduced in float32",
        choices=("fp32", "bf16"),
    )
    resume: bool = field(
        False, "continue from the checkpoint in output_dir, saved at any world size"
    )

    def validate(self):  # called by load_config: one error line, exit code 2, before any group
        if self.resume:
            folder, progress = latest_checkpoint(self.output_dir)
            if progress["epochs"] >= self.epochs or 0 < self.max_steps <= progress["steps"]:
                raise ConfigError(
                    f"--resume: {folder} is at epoch {progress['epochs']}, step "
                    f"{progress['steps']}; pass a larger --epochs (and --max-steps, if set)"
                )


def latest_checkpoint(output_dir):
    """The newest complete checkpoint folder in output_dir/checkpoints, and its progress.json
    (epochs and steps done), which rank 0 writes once every rank has written its shards."""
    done = sorted(Path(output_dir).glob("checkpoints/epoch-*/progress.json"))
    if not done:
        raise ConfigError(f"--resume: no checkpoint in {output_dir}: run once without --resume")
    return done[-1].parent, json.loads(done[-1].read_text())


def shard(model, mp_policy, backend):
    """FSDP2: each block of the model its own unit, then the root. A unit's parameters are
    all-gathered just before its forward (and backward) and freed after it, so a rank holds the
    whole of one block at a time; the root takes the parameters no block holds."""
    blocks = [block for block in model.children() if any(True for _ in block.parameters())]
    for unit in [*blocks, model]:
        fully_shard(unit, mp_policy=mp_policy)
        if backend == "gloo":
            # Gradients summed, then divided by the world size: FSDP2 asks for an average, which
            # gloo's reduce-scatter summed until a fix of December 2025 (pytorch/pytorch#162338):
            # torch 2.8 steps world_size times too far.
            unit.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def evaluate(model, loader, batches, empty_batch, device):
    """Exact distributed evaluation: this rank's sums, all-reduced. Every rank runs `batches`
    forwards, since each forward all-gathers the parameters (a collective): a rank out of test
    batches runs the rest on an empty one."""
    model.eval()
    # loss sum, correct, count
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    test_batches = iter(loader)
    for _ in range(batches):
        images, labels = next(test_batches, empty_batch)
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
    # Rank 0's slice is the longest: every rank runs as many test forwards as it has batches.
    test_batches = math.ceil(
        len(range(0, len(data.test), launch.world_size)) / cfg.local_batch_size
    )
    image, label = data.test[0]
    empty_batch = (image[None][:0], torch.tensor([label])[:0])
    test_loader = DataLoader(
        test_shard,
        batch_size=cfg.local_batch_size,
        num_workers=cfg.num_workers,
        multiprocessing_context=worker_start_method(cfg.num_workers),
    )

    # To this rank's device, then shard: each parameter becomes a DTensor holding this rank's
    # 1/world_size of it. bf16: computed in bfloat16, kept and reduced in float32.
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    model = model.to(device)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    shard(model, MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32), backend)
    # After the shard: the optimizer steps this rank's shards, and its state is sharded too.
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    start_epoch, step = 0, 0
    if cfg.resume:
        folder, progress = latest_checkpoint(cfg.output_dir)
        # Load in place: the fresh state dicts say which shards this rank needs; DCP reads them
        # from a checkpoint saved at any world size. A collective, on every rank.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = dict(model=model_state, optimizer=optimizer_state)
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        start_epoch, step = progress["epochs"], progress["steps"]
    # From here on each rank its own augmentation and loader worker seeds.
    torch.manual_seed(cfg.seed + launch.rank)

    if launch.rank == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        global_batch = cfg.local_batch_size * launch.world_size
        print(
            f"launcher {launch.launcher}, {backend} on {device} "
            f"(CUDA_VISIBLE_DEVICES={visible}), world size {launch.world_size}, "
            f"batch {cfg.local_batch_size} x {launch.world_size} = {global_batch}, "
            f"{cfg.precision}, from epoch {start_epoch + 1}",
            flush=True,
        )
    images_seen = 0
    for epoch in range(start_epoch, cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        train_sampler.set_epoch(epoch)
        model.train()
        # This rank's loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            # FSDP reduce-scatters (averages) the gradients here: each rank its shard of them.
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
        eval_loss, eval_acc, eval_count = evaluate(
            model, test_loader, test_batches, empty_batch, device
        )
        if launch.rank == 0:
            print(
                f"epoch {epoch + 1} done: train loss {train_loss:.4f}, "
                f"eval loss {eval_loss:.4f}, "
                f"eval accuracy {eval_acc:.4f} ({eval_count} images)",
                flush=True,
            )
        if step == cfg.max_steps:
            break

    folder = Path(cfg.output_dir) / "checkpoints" / f"epoch-{epoch + 1:04d}"
    if launch.rank == 0:
        # Marks a folder saved before as incomplete while it is overwritten: before the gather
        # below, which no rank leaves before rank 0 has entered it.
        (folder / "progress.json").unlink(missing_ok=True)
    # The whole model for one process: every rank sends its shards (a collective), rank 0 alone
    # receives them, into CPU memory, under the plain model's keys.
    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if launch.rank == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        torch.save(full_state, Path(cfg.output_dir) / "model.pt")
    # The checkpoint to resume from: each rank writes its own shards (a collective); then rank 0
    # the progress, last, so a folder with progress.json is complete.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(dict(model=model_state, optimizer=optimizer_state), checkpoint_id=folder)
    if launch.rank == 0:
        write_json_atomic(folder / "progress.json", dict(epochs=epoch + 1, steps=step))

    # --- end-of-run record: summary.json; a copy may delete this block whole ---
    # No replicas to compare: each rank holds its own shard of every parameter.
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
            precision=cfg.precision,
        )
        write_summary(cfg.output_dir, **summary)
    # --- end of the end-of-run record ---

    # Release the model first: it holds the process group, which would otherwise outlive
    # destroy_process_group() and keep gloo's threads running into interpreter shutdown.
    del model
    dist.destroy_process_group()


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(FsdpConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
