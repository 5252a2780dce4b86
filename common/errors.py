"""Bad input the user can fix is not a crash: an `error:` line from a rank that found it, and exit
code 2, as with argparse."""

import os
import sys
import time
from contextlib import contextmanager

BAD_INPUT_EXIT_CODE = 2
# silent ranks exit later: a launcher stops all ranks once one exits, the reporting one too
SILENT_RANK_DELAY_S = 2.0


class UsageError(Exception):
    """Invalid input the user can fix; the message says what and how."""


class ConfigError(UsageError):
    """A config key, type or value is wrong: the same on every rank."""


class LauncherError(UsageError):
    """The launcher environment is missing or inconsistent."""


class DataError(UsageError):
    """A data set is missing or unusable (possibly on one node only)."""


@contextmanager
def exit_on_bad_input():
    """Turn a UsageError into an `error:` line and exit code 2. A config error is the same on
    every rank, so global rank 0 says it; a data error (a folder missing on one node) is said by
    each node's local rank 0; a launcher error is this rank's own view of its launch, so every
    rank that finds one says it (a rank that found nothing to say would exit silently)."""
    try:
        yield
    except UsageError as exc:
        rank, local_rank = _this_rank()
        reporter = {ConfigError: rank, DataError: local_rank}.get(type(exc), 0)
        if reporter in (None, 0):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(SILENT_RANK_DELAY_S)
        sys.exit(BAD_INPUT_EXIT_CODE)


def _this_rank() -> tuple[int | None, int | None]:
    """(rank, local rank) by the launcher's own rule; (None, None) where it cannot tell."""
    from common.launcher import launched_by  # here: that module imports this one

    try:
        ranks = launched_by(os.environ)
    except UsageError:
        return None, None
    return ranks.rank, ranks.local_rank
