"""02 - the no-sampler pitfall: a plain DataLoader is NOT sharded under DDP.

DDP synchronizes gradients; it never touches your DataLoader. Without a DistributedSampler
every rank reads the whole data set (with the same seed even in the same order), so W ranks
do W times the work of one process, each step on the same batch. This script trains one
epoch both ways and counts, per rank, which samples were read.

Run (CPU, 2 processes, embedded digits data):
    torchrun --standalone --nproc_per_node=2 02_sampler_patterns/no_sampler_pitfall.py
"""

import dataclasses
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class PitfallConfig(TrainConfig):
    local_batch_size: int = field(64, "samples per rank per step", min=1)
    output_dir: str = field("runs/no_sampler_pitfall", "where summary.json goes")


class WithIndex(Dataset):
    """Returns (image, label, index), so we can count which samples each rank really read."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return (*self.dataset[i], i)


def compare(cfg, launch):
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
    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if launch.rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, launch.world_size)
    dataset = WithIndex(data.train)

    # WRONG: what many single-GPU scripts (and some tutorials) do. Nothing here knows about ranks.
    plain_loader = DataLoader(dataset, batch_size=cfg.local_batch_size, shuffle=True)
    # RIGHT: the sampler hands each rank a disjoint 1/W of the data; shuffling moves into it.
    sampler = DistributedSampler(
        dataset, num_replicas=launch.world_size, rank=launch.rank, shuffle=True, seed=cfg.seed
    )
    sampler.set_epoch(0)
    sharded_loader = DataLoader(dataset, batch_size=cfg.local_batch_size, sampler=sampler)

    results = {}
    for name, loader in (("no_sampler", plain_loader), ("distributed_sampler", sharded_loader)):
        # [indices read by rank 0, 1, ...]
        per_rank, model = train_one_epoch(cfg, launch, device, data, loader)
        reads = Counter(i for seen in per_rank for i in seen)
        results[name] = r = dict(
            samples_per_rank=[len(seen) for seen in per_rank],
            steps_per_rank=[-(-len(seen) // cfg.local_batch_size) for seen in per_rank],
            total_reads=sum(reads.values()),
            distinct_samples=len(reads),
            samples_read_by_several_ranks=sum(1 for c in reads.values() if c > 1),
            same_order_on_all_ranks=all(seen == per_rank[0] for seen in per_rank),
        )
        if launch.rank == 0:
            print(
                f"{name:>20}: samples per rank {r['samples_per_rank']}, steps per rank "
                f"{r['steps_per_rank']}, "
                f"{r['total_reads']} reads of {r['distinct_samples']} distinct samples (data "
                f"set {len(dataset)}), "
                f"{r['samples_read_by_several_ranks']} read by more than one rank, "
                f"{100 * (1 - r['distinct_samples'] / r['total_reads']):.0f}% of the compute "
                "repeated",
                flush=True,
            )
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            dataset_size=len(dataset),
            replica_checksums=checksums,
            **results,
        )
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


def train_one_epoch(cfg, launch, device, data, loader):
    """Collective: one epoch of ordinary DDP training; returns the
    indices every rank read (on all ranks) and the model."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    seen = []
    for images, labels, index in loader:
        loss = F.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += index.tolist()
    everyone = [None] * launch.world_size
    dist.all_gather_object(everyone, seen)
    return everyone, model


@record
def main():
    cfg = load_config(PitfallConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    compare(cfg, launch)


if __name__ == "__main__":
    main()
