"""Where things are: the repository, its code folders, this interpreter, the files git tracks, and
a script of it loaded as a module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# The lessons are found, not listed: every numbered folder with a README.
LESSON_DIRS = tuple(sorted(p.parent.name for p in REPO.glob("[0-9][0-9]_*/README.md")))


# Every folder of code a user runs or copies.
CODE_DIRS = ("common", *LESSON_DIRS, "benchmark", "debugging")


PYTHON = sys.executable


def load_script(path: str | Path, name: str):
    """Import a script that is not in a package (the numbered folders start with a digit)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tracked_files(*patterns: str) -> list[Path]:
    """The repository's own files (`git ls-files`) matching `patterns`, sorted: never those of a
    virtual environment, data or runs that live in the clone."""
    names = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return sorted(REPO / name for name in names if (REPO / name).is_file())
