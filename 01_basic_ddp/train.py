"""01 - the minimal complete DDP training script.

Every rank holds a full replica of the model and reads its own shard of each epoch
(DistributedSampler); DDP averages gradients during backward(), so all replicas step alike and
stay identical. `diff train_single.py train.py` shows exactly what DDP adds to a one-process
script. Run it with `torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py` (or mpiexec,
srun; nccl on GPUs).
"""

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

from common.config import TrainConfig, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, run_record, write_summary


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


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(TrainConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
