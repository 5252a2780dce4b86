"""02 - exact distributed evaluation on a test set whose size W does not divide.

Each rank sums loss and correct answers over its own disjoint slice of the test set and
counts its samples; one all-reduce of (sums, count) gives exactly the single-process metric.
Next to it, the usual wrong versions and their error against a single-process reference:
  - DistributedSampler (padding): repeats samples to even out the ranks, counts them twice;
  - DistributedSampler(drop_last=True): leaves samples out;
  - the mean of per-rank means: ranks hold different numbers of samples, so it is biased;
  - rank 0's number alone: measured on 1/W of the test set.

Run (CPU, 3 processes, embedded digits: 359 test images, 359 = 3 x 119 + 2):
    torchrun --standalone --nproc_per_node=3 02_sampler_patterns/distributed_eval.py
"""

import dataclasses
import sys
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


@dataclasses.dataclass
class EvalConfig(TrainConfig):
    max_steps: int = field(
        40, "training steps before evaluating (0: evaluate the initial model)", min=0
    )
    output_dir: str = field("runs/distributed_eval", "where summary.json and model.pt go")


@torch.no_grad()
def local_sums(model, dataset, device, sampler=None, batch_size=64):
    """(loss sum, correct, count) over what this rank's loader yields: sums, never means."""
    model.eval()
    loss_sum = correct = count = 0
    for images, labels in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        logits = model(images.to(device))
        labels = labels.to(device)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        count += len(labels)
    return loss_sum, correct, count


def sum_over_ranks(values, device):
    """Collective: element-wise sums over all ranks (float64, so counts stay exact)."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return totals.tolist()


def train_and_evaluate(cfg, launch):
    # as in 01
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    # nccl where this torch has it (Linux GPUs); gloo on CPUs and on Windows and macOS
    backend = choose_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    w, rank = launch.world_size, launch.rank
    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, w)
    test = data.test
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # as in 01: each rank its own augmentation from here on
    torch.manual_seed(cfg.seed + launch.rank)
    train_briefly(cfg, launch, device, model, data.train)
    # evaluate without the DDP wrapper: ranks may hold different numbers of batches
    net = model.module

    results = {}
    # RIGHT: a strided slice per rank covers every
    # sample exactly once (sizes differ by at most one);
    # all-reduce the sums and the count, divide once.
    mine = Subset(test, range(rank, len(test), w))
    local = local_sums(net, mine, device)  # this rank's (loss sum, correct, count)
    results["exact"] = sum_over_ranks(local, device)

    # WRONG 1: DistributedSampler pads to ceil(N/W) per rank, so a few samples are counted twice.
    padded = DistributedSampler(test, num_replicas=w, rank=rank, shuffle=False)
    results["sampler_padded"] = sum_over_ranks(local_sums(net, test, device, padded), device)
    # WRONG 2: drop_last=True keeps floor(N/W) per rank, so the last N mod W samples are never seen.
    dropped = DistributedSampler(test, num_replicas=w, rank=rank, shuffle=False, drop_last=True)
    results["sampler_drop_last"] = sum_over_ranks(local_sums(net, test, device, dropped), device)
    # WRONG 3: average of per-rank averages (each rank's mean weighs the same, whatever its count).
    l, c, n = local
    mean_loss, mean_acc = sum_over_ranks([l / n, c / n], device)
    results["mean_of_rank_means"] = (mean_loss / w * len(test), mean_acc / w * len(test), len(test))
    # WRONG 4: rank 0 reports its own shard only (rank
    # 0's numbers, shared with everyone for printing).
    results["rank0_only"] = sum_over_ranks([l, c, n] if rank == 0 else [0, 0, 0], device)

    # Reference: one process over the whole test set (rank 0 alone; no collectives in here).
    summary = {
        name: dict(loss_sum=l, correct=c, count=n, accuracy=c / n, loss=l / n)
        for name, (l, c, n) in results.items()
    }
    if rank == 0:
        l, c, n = local_sums(net, test, device)
        summary["reference"] = dict(loss_sum=l, correct=c, count=n, accuracy=c / n, loss=l / n)
        print(
            f"test set: {len(test)} samples, world size {w}; reference (one process): "
            f"accuracy {c / n:.6f}, loss {l / n:.6f}",
            flush=True,
        )
        print(
            f"{'method':>20} {'samples':>8} {'accuracy':>9} {'loss':>9} {'accuracy error':>15}",
            flush=True,
        )
        for name, m in summary.items():
            print(
                f"{name:>20} {int(m['count']):>8} {m['accuracy']:>9.6f} {m['loss']:>9.6f} "
                f"{m['accuracy'] - c / n:>+15.6f}",
                flush=True,
            )
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), Path(cfg.output_dir) / "model.pt")
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * w
    dist.all_gather_object(checksums, parameter_checksum(model))
    if rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=w,
            test_size=len(test),
            replica_checksums=checksums,
            **summary,
        )
    # Release the DDP model (it holds the process group) before destroying the group.
    del model, net
    dist.destroy_process_group()


def train_briefly(cfg, launch, device, model, train_set):
    """A few ordinary DDP steps, so the metric is not chance level."""
    sampler = DistributedSampler(
        train_set, num_replicas=launch.world_size, rank=launch.rank, shuffle=True, seed=cfg.seed
    )
    loader = DataLoader(train_set, batch_size=cfg.local_batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    model.train()
    step, epoch = 0, 0
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == cfg.max_steps:
                break
        epoch += 1


@record
def main():
    cfg = load_config(EvalConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    train_and_evaluate(cfg, launch)


if __name__ == "__main__":
    main()
