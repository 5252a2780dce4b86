"""The torch versions a test runs on: the pinned one (requirements.txt), the one running (a
site's, the minimum), and the C++ headers its wheel ships."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
from pathlib import Path

import pytest
from packaging.version import Version

from tests.paths import REPO

# torch's C++ headers, shipped in its wheel (found without importing torch)
C10D_HEADERS = (
    Path(importlib.util.find_spec("torch").origin).parent / "include/torch/csrc/distributed/c10d"
)


PINNED_TORCH = next(
    line.split("==")[1]
    for line in (REPO / "requirements.txt").read_text().splitlines()
    if line.startswith("torch==")
)


RUNNING_TORCH = Version(metadata.version("torch")).public


def needs_torch(version: str, why: str) -> pytest.MarkDecorator:
    """Skip on a torch older than `version`, saying why and naming both versions."""
    return pytest.mark.skipif(
        Version(RUNNING_TORCH) < Version(version),
        reason=f"needs torch {version}: {why}; this is torch {RUNNING_TORCH}",
    )


def skip_below_torch(version: str, why: str) -> None:
    """needs_torch inside a test (for one parameter of several)."""
    if Version(RUNNING_TORCH) < Version(version):
        pytest.skip(f"needs torch {version}: {why}; this is torch {RUNNING_TORCH}")


def pinned_torch_only(why: str) -> pytest.MarkDecorator:
    """Skip on any torch but the pinned one: a check of that release's own behaviour or output."""
    return pytest.mark.skipif(
        RUNNING_TORCH != PINNED_TORCH,
        reason=f"{why}, as torch {PINNED_TORCH} (requirements.txt) does; this is torch "
        f"{RUNNING_TORCH}",
    )
