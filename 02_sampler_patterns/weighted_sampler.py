"""02 - class-balanced (weighted) sampling across ranks.

WeightedRandomSampler knows nothing about ranks: under DDP every rank would draw from the
whole data set. DistributedClassBalancedSampler below does both jobs: like DistributedSampler
it gives each rank a disjoint share of the data set for the epoch (same shuffle on every rank
from seed + epoch), then each rank draws from its own share with weight 1 / (count of the
sample's class there), so every rank sees the classes about equally often and no index is read by
two ranks in one epoch. The data set is the digits made imbalanced (class c keeps a fraction
imbalance^(-c/9) of its samples: by default the 9s keep 1/10 of theirs, the 0s all).

Run (CPU, 2 processes, embedded digits data):
    torchrun --standalone --nproc_per_node=2 02_sampler_patterns/weighted_sampler.py
"""

import dataclasses
import math
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
from torch.utils.data import DataLoader, Sampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets
from common.errors import ConfigError
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class WeightedConfig(TrainConfig):
    epochs: int = field(
        2, "passes (each rank draws ceil(len(data set) / W) samples per pass)", min=1
    )
    imbalance: float = field(10.0, "class c keeps imbalance^(-c/(K-1)) of its samples", min=1.0)
    output_dir: str = field("runs/weighted_sampler", "where summary.json goes")

    def validate(self):  # called by load_config: before any process group
        if self.dataset == "fake":
            raise ConfigError(
                "dataset: fake does not list its labels; use digits, cifar10, mnist, "
                "fashion_mnist or imagefolder"
            )


class DistributedClassBalancedSampler(Sampler):
    """Disjoint per-rank shares (like DistributedSampler),
    class-balanced draws within each share."""

    def __init__(self, labels, num_replicas, rank, num_samples=None, seed=0):
        self.labels, self.num_replicas, self.rank, self.seed = labels, num_replicas, rank, seed
        self.num_samples = num_samples or math.ceil(len(labels) / num_replicas)  # draws per rank
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        # 1. The same shuffle on every rank (seed + epoch), grouped by class (a stable sort keeps
        #    the shuffle within each class), dealt round-robin: every rank gets a disjoint share
        #    holding ~1/W of every class, even of a rare one.
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.labels), generator=g)
        order = order[torch.argsort(self.labels[order], stable=True)]
        share = order[self.rank :: self.num_replicas]
        # 2. Draw from this rank's share only, each sample
        # weighted by 1 / (its class's count there).
        counts = torch.bincount(self.labels[share])
        weights = 1.0 / counts[self.labels[share]].double()
        # different draws on each rank
        g.manual_seed(self.seed + self.epoch + 7919 * (self.rank + 1))
        picks = torch.multinomial(weights, self.num_samples, replacement=True, generator=g)
        return iter(share[picks].tolist())


def labels_of(dataset):
    """Every label of a data set without loading its images (torchvision sets: .targets)."""
    if hasattr(dataset, "tensors"):  # TensorDataset (the embedded digits)
        return dataset.tensors[1]
    return torch.as_tensor(dataset.targets)


def imbalanced(dataset, labels, num_classes, imbalance):
    """Keep the first imbalance^(-c/(K-1)) of each class
    c: class 0 whole, the last class 1/imbalance."""
    keep = []
    for c in range(num_classes):
        members = (labels == c).nonzero().flatten()
        keep.append(members[: max(1, round(len(members) * imbalance ** (-c / (num_classes - 1))))])
    keep = torch.cat(keep)
    return Subset(dataset, keep.tolist()), labels[keep]


def train(cfg, launch):
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
    k = data.num_classes
    dataset, labels = imbalanced(data.train, labels_of(data.train), k, cfg.imbalance)
    before = torch.bincount(labels, minlength=k)
    if launch.rank == 0:
        print(
            f"imbalanced training set: {len(dataset)} samples; class counts {before.tolist()} "
            f"(frequency {min(before) / len(labels):.3f} .. {max(before) / len(labels):.3f})",
            flush=True,
        )

    sampler = DistributedClassBalancedSampler(labels, launch.world_size, launch.rank, seed=cfg.seed)
    # no shuffle: the sampler does it
    loader = DataLoader(dataset, batch_size=cfg.local_batch_size, sampler=sampler)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, k, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # as in 01: each rank its own augmentation from here on
    torch.manual_seed(cfg.seed + launch.rank)

    epochs = []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # a new share and new draws each epoch, agreed by every rank
        histogram = torch.zeros(k, dtype=torch.long)
        for images, y in loader:
            histogram += torch.bincount(y, minlength=k)  # what this rank really trained on
            loss = F.cross_entropy(model(images.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        gathered = [None] * launch.world_size
        dist.all_gather_object(gathered, (list(sampler), histogram.tolist()))
        per_rank = [h for _, h in gathered]
        total = torch.tensor(per_rank).sum(0)
        overlap = sum(
            len(set(a) & set(b)) for i, (a, _) in enumerate(gathered) for b, _ in gathered[i + 1 :]
        )
        epochs.append(
            dict(
                indices=[ix for ix, _ in gathered],
                histograms=per_rank,
                total=total.tolist(),
                indices_in_several_ranks=overlap,
            )
        )
        if launch.rank == 0:
            print(
                f"epoch {epoch + 1}: drawn per class {total.tolist()} (frequency "
                f"{min(total) / sum(total):.3f} .. "
                f"{max(total) / sum(total):.3f}); per rank {per_rank}; indices read by two "
                f"ranks: {overlap}",
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
            labels=labels.tolist(),
            class_counts_before=before.tolist(),
            epochs=epochs,
            replica_checksums=checksums,
        )
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record
def main():
    cfg = load_config(WeightedConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
