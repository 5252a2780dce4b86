"""02 - partition viewer: which sample indices DistributedSampler gives each rank.

Every rank builds its own DistributedSampler from (data set size, world size, rank, seed,
epoch) alone, with no communication; rank 0 gathers the results and prints them. Shows:
  - padding (drop_last=False): ceil(N/W) indices per rank, the first few repeated at the end;
  - dropping (drop_last=True): floor(N/W) per rank, the tail of the (shuffled) order unused;
  - shuffle: the same permutation on every rank for the same seed and epoch, a new one after
    set_epoch; each rank takes every W-th index of it, so shards stay disjoint.

Run (CPU, 3 processes, a data set of 10 samples):
    torchrun --standalone --nproc_per_node=3 02_sampler_patterns/partition_viewer.py --num-samples 10
Without processes, for any world size (each "rank" is built in this one process):
    python 02_sampler_patterns/partition_viewer.py --num-samples 10 --simulate-world-size 8
"""

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch.distributed as dist
from torch.utils.data import DistributedSampler

from common.config import field, load_config
from common.dist import cleanup_distributed, setup_distributed
from common.entry import run
from common.report import print0, write_json_atomic


@dataclasses.dataclass
class ViewerConfig:
    """Show how DistributedSampler partitions a data set."""

    num_samples: int = field(10, "data set size N", min=1)
    epochs: int = field(2, "epochs to show (set_epoch(0), set_epoch(1), ...)", min=1)
    seed: int = field(0, "sampler seed (must be the same on every rank)", min=0)
    simulate_world_size: int = field(0, "0: use the real process group; W > 0: build W ranks' samplers here", min=0)
    backend: str = field("auto", "process-group backend", choices=("auto", "gloo", "nccl", "xccl"))
    timeout_s: float = field(60.0, "seconds a collective may wait for the other ranks", min=1.0)
    output_dir: str = field("runs/partition_viewer", "where partition.json goes")


def rank_indices(n, world_size, rank, shuffle, drop_last, seed, epoch):
    """Exactly what one rank's DataLoader would read in this epoch."""
    dataset = range(n)  # any object with len() will do: the sampler only yields indices
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)  # without this call, every epoch repeats epoch 0's order
    return list(sampler)


def main(argv=None):
    cfg = load_config(ViewerConfig, argv)
    if cfg.simulate_world_size:
        show(cfg, cfg.simulate_world_size, ranks=range(cfg.simulate_world_size), gather=None)
        return
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, device="cpu")
    try:
        show(cfg, ctx.world_size, ranks=[ctx.rank], gather=dist.all_gather_object)
    finally:
        cleanup_distributed()


def show(cfg, world_size, ranks, gather):
    n, w = cfg.num_samples, world_size
    print0(f"N = {n} samples, W = {w} ranks: padding gives ceil(N/W) = {math.ceil(n / w)} per rank "
           f"({math.ceil(n / w) * w - n} repeated), drop_last gives floor(N/W) = {n // w} per rank ({n % w} unused)")
    results = []
    for shuffle in (False, True):
        for drop_last in (False, True):
            for epoch in range(cfg.epochs if shuffle else 1):  # without shuffle every epoch is the same
                mine = {r: rank_indices(n, w, r, shuffle, drop_last, cfg.seed, epoch) for r in ranks}
                # The full shuffled order, as this rank derives it from (seed, epoch) alone.
                order = {r: rank_indices(n, 1, 0, shuffle, False, cfg.seed, epoch) for r in ranks}
                if gather:  # real ranks: collect every rank's view on all ranks
                    everyone = [None] * w
                    gather(everyone, (mine, order))
                    mine = {r: v for m, _ in everyone for r, v in m.items()}
                    order = {r: v for _, o in everyone for r, v in o.items()}
                results.append(dict(shuffle=shuffle, drop_last=drop_last, epoch=epoch,
                                    indices=[mine[r] for r in range(w)], order=[order[r] for r in range(w)]))
                print0(f"\nshuffle={shuffle} drop_last={drop_last} seed={cfg.seed} epoch={epoch}"
                       + (f"   order {order[0]}" if shuffle else ""))
                for r in range(w):
                    # Position k of rank r is order[r + k*W]; past the end of the order it wraps around (padding).
                    repeated = [i for k, i in enumerate(mine[r]) if r + k * w >= n]
                    print0(f"  rank {r}: {mine[r]}" + (f"   <- repeats {repeated}" if repeated else ""))
                unused = sorted(set(range(n)) - {i for r in range(w) for i in mine[r]})
                if unused:
                    print0(f"  never read this epoch: {unused}")
    if not gather or dist.get_rank() == 0:
        path = Path(cfg.output_dir) / "partition.json"
        write_json_atomic(path, dict(num_samples=n, world_size=w, seed=cfg.seed, results=results))
        print0(f"\nwritten to {path}")


if __name__ == "__main__":
    run(main)
