"""02 - uneven inputs: ranks with different numbers of batches.

DDP all-reduces gradients in every backward(). If one rank runs out of batches while another
still trains, the latter waits in that all-reduce for a partner that never comes: on GPUs
(NCCL) the job hangs until the watchdog ends it, about a minute after the process-group timeout
(see the README). Here each rank reads its own slice of
the digits, rank r with r * --uneven fewer samples (like per-rank files of different sizes).
    --fix join       DDP's Join context manager: a rank that runs out "joins" and shadows the
                     others' all-reduces with zeros until all are done; then DDP copies the
                     last rank's weights to everyone.
    --fix drop_last  every rank runs the smallest rank's number of batches (one all-reduce MIN
                     before the loop), the same idea as DistributedSampler(drop_last=True).
    --fix none       the hang, on purpose: after --timeout-s gloo gives up; its monitored_barrier
                     names the rank that never arrived (see the README for what it prints).

Run (CPU, 3 processes, embedded digits data):
    torchrun --standalone --nproc_per_node=3 02_sampler_patterns/uneven_inputs.py --fix join
"""

import dataclasses
import hashlib
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
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class UnevenConfig(TrainConfig):
    fix: str = field(
        "join",
        "how to handle uneven inputs (none: hang until --timeout-s)",
        choices=("join", "drop_last", "none"),
    )
    uneven: int = field(64, "rank r reads r * uneven samples fewer than its strided share", min=0)
    epochs: int = field(2, "passes over each rank's slice", min=1)
    # Plain SGD: with Join, ranks that ran out skip optimizer.step(), so their momentum misses those
    # steps, and in the next epoch their weights drift from the others' (DDP re-syncs only the
    # weights, at the end of the Join block; see the README).
    momentum: float = field(0.0, "SGD momentum (see the note on Join in the README)", min=0.0)
    output_dir: str = field("runs/uneven_inputs", "where summary.json goes")


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().numpy().tobytes() if t is not None else b"-")
    return h.hexdigest()[:16]


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
    w, rank = launch.world_size, launch.rank
    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, w)
    sizes = [len(range(r, len(data.train), w)) - r * cfg.uneven for r in range(w)]
    batches = [math.ceil(n / cfg.local_batch_size) for n in sizes]
    mine = Subset(data.train, list(range(rank, len(data.train), w))[: sizes[rank]])
    loader = DataLoader(mine, batch_size=cfg.local_batch_size, shuffle=False)
    if rank == 0:
        print(f"samples per rank {sizes}, batches per rank {batches}, fix: {cfg.fix}", flush=True)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    # as in 01: each rank its own augmentation from here on
    torch.manual_seed(cfg.seed + launch.rank)
    digests = []  # (epoch, step, gradient digest, weights digest) for every step this rank ran
    for epoch in range(cfg.epochs):
        steps = len(loader)
        if cfg.fix == "drop_last":  # agree on the smallest number of batches, drop the rest
            count = torch.tensor([steps], device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            steps = int(count)
        # Join is a no-op unless enabled; enabled, it lets
        # the ranks that finish early shadow the rest.
        with Join([model], enable=cfg.fix == "join"):
            for step, (images, labels) in enumerate(islice(loader, steps)):
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # the all-reduce that every rank must join, step by step
                grads = digest(p.grad for p in model.parameters())
                optimizer.step()
                digests.append((epoch, step, grads, digest(model.parameters())))
        # Every rank waits here for the others. With --fix none a rank that ran out of batches waits
        # while another waits in its gradient all-reduce,
        # until --timeout-s. gloo's monitored_barrier
        # then names the rank that never arrived; NCCL has none
        # (a plain barrier waits until its watchdog's timeout).
        if backend == "gloo":
            dist.monitored_barrier()
        else:
            dist.barrier(device_ids=[device.index])
        if rank == 0:
            print(
                f"epoch {epoch + 1}: ranks ran "
                f"{batches if cfg.fix != 'drop_last' else [steps] * w} steps",
                flush=True,
            )

    # Every rank's step digests and parameter checksum: collectives, so every rank calls them.
    everyone = [None] * w
    dist.all_gather_object(everyone, digests)
    checksums = [None] * w
    dist.all_gather_object(checksums, parameter_checksum(model))
    if rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=w,
            fix=cfg.fix,
            samples_per_rank=sizes,
            batches_per_rank=batches,
            steps_per_rank=[len(d) for d in everyone],
            digests=everyone,
            replica_checksums=checksums,
        )
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record
def main():
    cfg = load_config(UnevenConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    train(cfg, launch)


if __name__ == "__main__":
    main()
