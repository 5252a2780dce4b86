"""01 - the same training, launched from Python with torch.multiprocessing.spawn.

For readers who start workers themselves (a notebook, a Python driver) instead of with torchrun.
The parent picks a free loopback port, then spawns one process per rank; each process passes
its rank and the world size explicitly.

    python 01_basic_ddp/train_spawn.py --nprocs 2
"""

import dataclasses
import os
import socket
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch.multiprocessing as mp

from common.config import TrainConfig, field, load_config
from common.data import check_data
from common.launcher import detect_launcher
from train import train  # the training is train.py's, unchanged


@dataclasses.dataclass
class SpawnConfig(TrainConfig):
    nprocs: int = field(2, "processes to spawn (one per GPU on a GPU machine)", min=1)


def worker(rank: int, world_size: int, cfg: SpawnConfig) -> None:
    """Runs in each spawned process; mp.spawn passes the rank as the first argument. It must be
    importable by the children (a module-level function, not one defined in a notebook cell)."""
    train(cfg, detect_launcher(rank=rank, world_size=world_size))


def main():
    cfg = load_config(SpawnConfig)  # bad input: one "error:" line, exit code 2
    check_data(cfg, cfg.nprocs)
    # One machine: rendezvous on loopback, on a port nobody else is using.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    try:
        mp.spawn(worker, args=(cfg.nprocs, cfg), nprocs=cfg.nprocs, join=True)
    except mp.ProcessRaisedException as exc:  # a worker's traceback; the others were stopped
        sys.exit(f"a worker failed:\n{exc}")
    # a worker exited with a code (2: bad input) or a signal
    except mp.ProcessExitedException as exc:
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)


if __name__ == "__main__":
    main()
