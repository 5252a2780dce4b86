"""Which rank says bad input (errors.py) and when the others exit: by the launcher's rule."""

import os
import sys
import time
from contextlib import contextmanager

from common.errors import BAD_INPUT_EXIT_CODE, ConfigError, DataError, UsageError, exit_with_error
from common.launcher import Ranks, launched_by

# silent ranks exit later: a launcher stops all ranks once one exits, the reporting one too
SILENT_RANK_DELAY_S = 2.0


@contextmanager
def exit_on_bad_input():
    """Turn a UsageError into an `error:` line and exit code 2. A config error is the same on
    every rank, so global rank 0 says it; a data error (a folder missing on one node) is said by
    each node's local rank 0; a launcher error is this rank's own view of its launch, so every
    rank that finds one says it (a rank that found nothing to say would exit silently)."""
    try:
        yield
    except UsageError as exc:
        try:
            ranks = launched_by(os.environ)
        except UsageError:
            ranks = Ranks("unknown", None, None, None, None)
        reporter = {ConfigError: ranks.rank, DataError: ranks.local_rank}.get(type(exc), 0)
        if reporter in (None, 0):
            exit_with_error(exc)
        time.sleep(SILENT_RANK_DELAY_S)
        sys.exit(BAD_INPUT_EXIT_CODE)
