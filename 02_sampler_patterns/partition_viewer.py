r"""02 - partition viewer: which sample indices DistributedSampler gives each rank.

Every rank builds its own DistributedSampler from (data set size, world size, rank, seed,
epoch) alone, with no communication; rank 0 gathers the results and prints them. Shows:
  - padding (drop_last=False): ceil(N/W) indices per rank, the first few repeated at the end;
  - dropping (drop_last=True): floor(N/W) per rank, the tail of the (shuffled) order unused;
  - shuffle: the same permutation on every rank for the same seed and epoch, a new one after
    set_epoch; each rank takes every W-th index of it, so shards stay disjoint.

Run (CPU, 3 processes, a data set of 10 samples):
    torchrun --standalone --nproc_per_node=3 \
        02_sampler_patterns/partition_viewer.py --num-samples 10
Without processes, for any world size (each "rank" is built in this one process):
    python 02_sampler_patterns/partition_viewer.py --num-samples 10 --simulate-world-size 8
"""

import dataclasses
import math
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DistributedSampler

from common.config import field, load_config
from common.launcher import detect_launcher
from common.report import write_json_atomic


@dataclasses.dataclass
class ViewerConfig:
    """Show how DistributedSampler partitions a data set."""

    num_samples: int = field(10, "data set size N", min=1)
    epochs: int = field(2, "epochs to show (set_epoch(0), set_epoch(1), ...)", min=1)
    seed: int = field(0, "sampler seed (must be the same on every rank)", min=0)
    simulate_world_size: int = field(
        0, "0: use the real process group; W > 0: build W ranks' samplers here", min=0
    )
    timeout_s: float = field(60.0, "seconds a collective may wait for the other ranks", min=1.0)
    output_dir: str = field("runs/partition_viewer", "where partition.json goes")


def rank_indices(n, world_size, rank, shuffle, drop_last, seed, epoch):
    """Exactly what one rank's DataLoader would read in this epoch."""
    dataset = range(n)  # any object with len() will do: the sampler only yields indices
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    sampler.set_epoch(epoch)  # without this call, every epoch repeats epoch 0's order
    return list(sampler)


def partitions(cfg, world_size, ranks, gather=False):
    """Every case's indices per rank and the full order, as the ranks in `ranks` compute them on
    their own; with gather=True (a collective) each real rank's view is collected on all ranks."""
    n, w, results = cfg.num_samples, world_size, []
    for shuffle in (False, True):
        for drop_last in (False, True):
            # without shuffle every epoch is the same
            for epoch in range(cfg.epochs if shuffle else 1):
                mine = {
                    r: rank_indices(n, w, r, shuffle, drop_last, cfg.seed, epoch) for r in ranks
                }
                # The full shuffled order, as this rank derives it from (seed, epoch) alone.
                order = {r: rank_indices(n, 1, 0, shuffle, False, cfg.seed, epoch) for r in ranks}
                if gather:  # real ranks: collect every rank's view on all ranks
                    everyone = [None] * w
                    dist.all_gather_object(everyone, (mine, order))
                    mine = {r: v for m, _ in everyone for r, v in m.items()}
                    order = {r: v for _, o in everyone for r, v in o.items()}
                results.append(
                    dict(
                        shuffle=shuffle,
                        drop_last=drop_last,
                        epoch=epoch,
                        indices=[mine[r] for r in range(w)],
                        order=[order[r] for r in range(w)],
                    )
                )
    return results


def report(cfg, world_size, results):
    """Print every case and write partition.json (one process: rank 0, or the simulation)."""
    n, w = cfg.num_samples, world_size
    print(
        f"N = {n} samples, W = {w} ranks: padding gives ceil(N/W) = {math.ceil(n / w)} per rank "
        f"({math.ceil(n / w) * w - n} repeated), drop_last gives floor(N/W) = {n // w} per "
        f"rank ({n % w} unused)"
    )
    for case in results:
        mine, order = case["indices"], case["order"]
        print(
            f"\nshuffle={case['shuffle']} drop_last={case['drop_last']} seed={cfg.seed} "
            f"epoch={case['epoch']}" + (f"   order {order[0]}" if case["shuffle"] else "")
        )
        for r in range(w):
            # Position k of rank r is order[r + k*W]; past
            # the end of the order it wraps around (padding).
            repeated = [i for k, i in enumerate(mine[r]) if r + k * w >= n]
            print(f"  rank {r}: {mine[r]}" + (f"   <- repeats {repeated}" if repeated else ""))
        unused = sorted(set(range(n)) - {i for r in range(w) for i in mine[r]})
        if unused:
            print(f"  never read this epoch: {unused}")
    path = Path(cfg.output_dir) / "partition.json"
    write_json_atomic(path, dict(num_samples=n, world_size=w, seed=cfg.seed, results=results))
    print(f"\nwritten to {path}", flush=True)


@record
def main(argv=None):
    cfg = load_config(ViewerConfig, argv)
    if cfg.simulate_world_size:  # no processes: build every rank's sampler here
        report(
            cfg,
            cfg.simulate_world_size,
            partitions(cfg, cfg.simulate_world_size, range(cfg.simulate_world_size)),
        )
        return
    # a CPU run: on a GPU node it may have more ranks than GPUs
    launch = detect_launcher(uses_gpu=False)
    # No tensors move here (all_gather_object pickles on the CPU), so gloo suits any machine.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    results = partitions(cfg, launch.world_size, [launch.rank], gather=True)
    if launch.rank == 0:
        report(cfg, launch.world_size, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
