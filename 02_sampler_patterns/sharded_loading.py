r"""02 - sharded loading: each rank opens and reads only its own shard files.

For data too large for every rank to hold or even to index (DistributedSampler needs a map-style
data set with len() and random access to every sample). A prepare step (prepare_shards.py)
writes the data as shard files plus a manifest. Each epoch, every rank shuffles the shard list
with the same seed + epoch and takes every W-th shard; an IterableDataset streams its shards one
at a time. From the manifest alone, every rank computes every rank's number of batches and all
run the smallest, so no rank waits in a collective for a batch that another rank never has.

Run (CPU, 2 processes, embedded digits data):
    python 02_sampler_patterns/prepare_shards.py --num-shards 12 --out-dir data/digits_shards
    torchrun --standalone --nproc_per_node=2 \
        02_sampler_patterns/sharded_loading.py --shards-dir data/digits_shards
"""

import dataclasses
import json
import math
import sys
from datetime import timedelta
from itertools import islice
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.config import TrainConfig, field, load_config
from common.data import worker_start_method
from common.errors import ConfigError, DataError
from common.bad_input import exit_on_bad_input
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class ShardConfig(TrainConfig):
    shards_dir: str = field("data/digits_shards", "folder written by prepare_shards.py")
    epochs: int = field(2, "passes over the data", min=1)
    output_dir: str = field(
        "runs/sharded_loading", "where summary.json and the shard access logs go"
    )


class ShardStream(IterableDataset):
    """Streams (image, label, original index) from the
    given shard files, one shard in memory at a time."""

    def __init__(self, folder, seed, access_log):
        self.folder, self.seed, self.access_log = Path(folder), seed, access_log
        self.files, self.epoch = [], 0

    def set_epoch(self, epoch, files):
        self.epoch, self.files = epoch, files

    def __iter__(self):
        files = self.files
        worker = get_worker_info()
        # DataLoader workers must split the rank's shards again, or each repeats them all
        if worker is not None:
            files = files[worker.id :: worker.num_workers]
        for name in files:
            with open(self.access_log, "a") as log:  # a record of every file this rank opens
                log.write(f"{self.epoch} {name}\n")
            shard = torch.load(self.folder / name, weights_only=True)
            order = torch.randperm(
                len(shard["labels"]),
                generator=torch.Generator().manual_seed(self.seed + self.epoch),
            )
            for i in order.tolist():
                yield shard["images"][i], shard["labels"][i], shard["indices"][i]


def read_manifest(folder):
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise DataError(
            f"no shards in {folder} (missing manifest.json): write them first with "
            f"`python 02_sampler_patterns/prepare_shards.py --out-dir {folder}`"
        )
    return json.loads(path.read_text())


def shards_for(rank, world_size, files, seed, epoch):
    """This rank's shard files for this epoch: the same shuffle everywhere, every W-th file."""
    order = torch.randperm(
        len(files), generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()
    return [files[i] for i in order[rank::world_size]]


def train(cfg, launch, manifest):
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
    files = [s["file"] for s in manifest["shards"]]
    sizes = {s["file"]: s["samples"] for s in manifest["shards"]}
    access_log = Path(cfg.output_dir) / "access" / f"rank{rank}.log"
    access_log.parent.mkdir(parents=True, exist_ok=True)
    access_log.write_text("")
    stream = ShardStream(cfg.shards_dir, cfg.seed, access_log)
    loader = DataLoader(
        stream,
        batch_size=cfg.local_batch_size,
        num_workers=cfg.num_workers,
        # not fork(), which can copy a lock that gloo's or NCCL's threads hold (common/data.py)
        multiprocessing_context=worker_start_method(cfg.num_workers),
    )
    workers = max(1, cfg.num_workers)

    def batches(mine):  # each DataLoader worker batches its own slice of the shards
        return sum(
            math.ceil(sum(sizes[f] for f in mine[k::workers]) / cfg.local_batch_size)
            for k in range(workers)
        )

    torch.manual_seed(cfg.seed)
    model = build_model(
        cfg.model, manifest["num_classes"], manifest["in_channels"], manifest["image_size"]
    ).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if rank == 0:
        print(f"{manifest['total']} samples in {len(files)} shards, {w} ranks", flush=True)
    epochs = []
    for epoch in range(cfg.epochs):
        mine = shards_for(rank, w, files, cfg.seed, epoch)
        stream.set_epoch(epoch, mine)
        # Equal step counts without communication: every rank can compute every rank's batches.
        steps = min(batches(shards_for(r, w, files, cfg.seed, epoch)) for r in range(w))
        seen, done = [], 0
        for images, labels, index in islice(loader, steps):  # stop after `steps` batches
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += index.tolist()
            done += 1
        counts = torch.tensor([len(seen), sum(sizes[f] for f in mine)], device=device)
        dist.all_reduce(counts)  # samples read and samples assigned, summed over the ranks
        read, assigned = counts.tolist()
        gathered = [None] * w
        dist.all_gather_object(gathered, dict(shards=mine, steps=done, indices=seen))
        epochs.append(gathered)
        if rank == 0:
            print(
                f"epoch {epoch + 1}: {steps} steps on every rank, {read} of {assigned} "
                "samples read "
                f"({assigned - read} left over); shards per rank: "
                f"{[g['shards'] for g in gathered]}",
                flush=True,
            )
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * w
    dist.all_gather_object(checksums, parameter_checksum(model))
    if rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=w,
            total=manifest["total"],
            shards=len(files),
            epochs=epochs,
            replica_checksums=checksums,
        )
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record
def main():
    cfg = load_config(ShardConfig)
    launch = detect_launcher()
    with exit_on_bad_input():  # before the process group: a missing folder fails fast everywhere
        manifest = read_manifest(cfg.shards_dir)
        if len(manifest["shards"]) < launch.world_size:
            raise ConfigError(
                f"shards_dir: {len(manifest['shards'])} shards cannot feed "
                f"{launch.world_size} ranks; "
                f"run prepare_shards.py with --num-shards at least {launch.world_size} "
                f"(better: a multiple of {launch.world_size})"
            )
    train(cfg, launch, manifest)


if __name__ == "__main__":
    main()
