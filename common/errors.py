"""Bad input the user can fix is not a crash: each kind of it is one exception class here, and
it ends the run with one `error:` line and exit code 2, as with argparse. Which rank says it:
`exit_on_bad_input()` in bad_input.py."""

import sys
from typing import NoReturn

BAD_INPUT_EXIT_CODE = 2


class UsageError(Exception):
    """Invalid input the user can fix; the message says what and how."""


class ConfigError(UsageError):
    """A config key, type or value is wrong: the same on every rank."""


class LauncherError(UsageError):
    """The launcher environment is missing or inconsistent."""


class DataError(UsageError):
    """A data set is missing or unusable (possibly on one node only)."""


def exit_with_error(exc: UsageError) -> NoReturn:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT_EXIT_CODE)
