"""The one exception type for bad input: a config key, a data folder, a launcher environment.

A UsageError is reported as a single line on stderr, by one rank, with exit code 2
(see common.entry.run). Anything else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """Invalid input the user can fix; the message says what and how."""


class ConfigError(UsageError):
    """A config key, type or value is wrong."""


class LauncherError(UsageError):
    """The launcher environment is missing or inconsistent."""


class DataError(UsageError):
    """A data set is missing or unusable."""
