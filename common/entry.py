"""How a script ends when something is wrong.

    if __name__ == "__main__":
        run(main)

- Bad input (a UsageError: config, data, launcher environment) prints ONE line,
  `error: ...`, from one rank, and exits with code 2. Every rank meets the same bad
  input at the same point, so the others exit quietly instead of repeating it.
- Any other exception prints its traceback once, labelled with rank and host, and
  exits with code 1.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Callable

import torch.distributed as dist

from common.errors import UsageError

USAGE_EXIT_CODE = 2

# Every launcher's rank variable: used when the error came before the rank was known.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def guess_rank() -> int:
    """This process's rank, even if the process group never started (best effort)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _is_reporting_rank(rank: int) -> bool:
    """Rank 0 reports, or the lowest rank this launcher has if rank 0 is missing (e.g. RANK=3 WORLD_SIZE=2)."""
    if rank == 0:
        return True
    world = os.environ.get("WORLD_SIZE", "")
    return world.isdigit() and rank >= int(world) and os.environ.get("LOCAL_RANK", "0") == "0"


def run(main: Callable[[], object]) -> None:
    try:
        main()
    except UsageError as exc:
        if _is_reporting_rank(guess_rank()):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        rank = guess_rank()
        print(f"[rank {rank} on {socket.gethostname()}] failed:\n{traceback.format_exc()}",
              file=sys.stderr, end="", flush=True)
        sys.exit(1)
