"""Bad input the user can fix is not a crash: one `error:`
line from one rank and exit code 2, as with argparse."""

import os
import sys
import time
from contextlib import contextmanager

BAD_INPUT_EXIT_CODE = 2
# silent ranks exit later: a launcher stops all ranks once one exits, the reporting one too
SILENT_RANK_DELAY_S = 2.0
RANK_VARIABLES = (
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PALS_RANKID",
    "PMIX_RANK",
    "SLURM_PROCID",
)
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PALS_LOCAL_RANKID",
    # each launcher's: torchrun, Open MPI,
    # MPICH/Intel MPI, HPE PALS, PMIx, Slurm
    "SLURM_LOCALID",
)


class UsageError(Exception):
    """Invalid input the user can fix; the message says what and how."""


class ConfigError(UsageError):
    """A config key, type or value is wrong: the same on every rank."""


class LauncherError(UsageError):
    """The launcher environment is missing or inconsistent."""


class DataError(UsageError):
    """A data set is missing or unusable (possibly on one node only)."""


def _first(names: tuple[str, ...]) -> int | None:
    return next(
        (int(os.environ[name]) for name in names if os.environ.get(name, "").isdigit()), None
    )


@contextmanager
def exit_on_bad_input():
    """Turn a UsageError into one `error:` line and exit code 2. A config error
    is the same on every rank, so global rank 0 says it; anything else (say, a
    data folder missing on one node) is said by each node's local rank 0."""
    try:
        yield
    except UsageError as exc:
        rank, local_rank = _first(RANK_VARIABLES), _first(LOCAL_RANK_VARIABLES)
        reporter = rank if isinstance(exc, ConfigError) else local_rank
        if reporter in (None, 0):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif rank is not None:
            time.sleep(SILENT_RANK_DELAY_S)
        sys.exit(BAD_INPUT_EXIT_CODE)
