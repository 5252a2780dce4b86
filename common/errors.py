"""Bad input the user can fix is not a crash: each kind of it is one exception class here.
`exit_on_bad_input()` (launcher.py, which knows the rank) turns one into an `error:` line from the
rank that should say it, and exit code 2, as with argparse."""


class UsageError(Exception):
    """Invalid input the user can fix; the message says what and how."""


class ConfigError(UsageError):
    """A config key, type or value is wrong: the same on every rank."""


class LauncherError(UsageError):
    """The launcher environment is missing or inconsistent."""


class DataError(UsageError):
    """A data set is missing or unusable (possibly on one node only)."""
