"""01 - the same training, launched from Python with torch.multiprocessing.spawn.

For readers who start workers themselves (a notebook, a Python driver) instead of with
torchrun. The parent sets MASTER_ADDR/MASTER_PORT, then spawns one process per rank;
each process passes its rank and the world size explicitly to the process group.

    python 01_basic_ddp/train_spawn.py --nprocs 2
"""

import dataclasses
import os
import socket
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch.multiprocessing as mp

from common.config import TrainConfig, field, load_config
from common.dist import cleanup_distributed, setup_distributed
from common.entry import run
from train import train  # the training loop is train.py's, unchanged


@dataclasses.dataclass
class SpawnConfig(TrainConfig):
    nprocs: int = field(2, "processes to spawn (one per GPU on a GPU machine)", min=1)


def worker(rank: int, world_size: int, cfg: SpawnConfig) -> None:
    """Runs in each spawned process; mp.spawn passes the rank as the first argument."""
    ctx = setup_distributed(cfg.backend, cfg.timeout_s, cfg.device, rank=rank, world_size=world_size)
    try:
        train(cfg, ctx)
    finally:
        cleanup_distributed()


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    cfg = load_config(SpawnConfig)
    # One machine: rendezvous on loopback, on a port nobody else is using.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
    try:
        # Each child reports its own errors (common.entry.run); the parent only passes on the exit code.
        mp.spawn(run_worker, args=(cfg.nprocs, cfg), nprocs=cfg.nprocs, join=True)
    except mp.ProcessExitedException as exc:
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)


def run_worker(rank: int, world_size: int, cfg: SpawnConfig) -> None:
    run(partial(worker, rank, world_size, cfg))


if __name__ == "__main__":
    run(main)
