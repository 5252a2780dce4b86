"""Real launchers for tests: skip when a tool is missing,
unless REQUIRE_REAL_LAUNCHERS=1 (CI), then fail."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers import clean_env

REQUIRED = os.environ.get("REQUIRE_REAL_LAUNCHERS") == "1"


def unavailable(reason: str) -> None:
    """Skip (locally) or fail (CI sets REQUIRE_REAL_LAUNCHERS=1) because `reason`."""
    if REQUIRED:
        pytest.fail(f"REQUIRE_REAL_LAUNCHERS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def need_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        unavailable(f"not installed: {', '.join(missing)}")


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        unavailable(f"{what} needs root")


def openmpi_env(**extra: str) -> dict[str, str]:
    """Open MPI as root, kept on loopback."""
    return clean_env(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_oob_tcp_if_include="lo",
        OMPI_MCA_btl_tcp_if_include="lo",
        **extra,
    )
