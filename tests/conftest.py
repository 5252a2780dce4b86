"""Fixtures shared by several test files, and the skip of torch-text checks on another torch."""

import os

import pytest
import torch.distributed as dist

# Before any process group, as detect_launcher() does in every script (common/launcher.py says
# why): tests that train in this process hand train() a LaunchInfo without calling it.
import torch.distributed.nn  # noqa: F401

from tests.sample_runs import Ran, shared_run
from tests.torch_versions import PINNED_TORCH, RUNNING_TORCH


def pytest_configure(config):
    """A test file named on the command line runs all its tests, whatever their tier:
    `python -m pytest tests/test_readme_text.py` needs no `-m ""`. pytest.ini's `-m` leaves the
    tiers out of a run of the whole suite only; a `-m` of one's own still applies."""
    named = [arg for arg in config.args if arg.split("::")[0].endswith(".py")]
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    if named and not any(arg.startswith("-m") for arg in given):
        config.option.markexpr = ""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test that starts the two-node Slurm cluster (the `cluster` fixture, directly or through
    another fixture) is in the `scheduler` tier.

    The `torch_text` tests hold the READMEs to the pinned torch's own messages, docstrings,
    source and libraries; on any other torch (a site's, the minimum) they are skipped, naming both
    versions, instead of failing on wording that torch is free to change."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.scheduler)
    if RUNNING_TORCH == PINNED_TORCH:
        return
    skip = pytest.mark.skip(
        reason=f"checks torch {PINNED_TORCH}'s own text (requirements.txt); "
        f"this is torch {RUNNING_TORCH}"
    )
    for item in items:
        if item.get_closest_marker("torch_text"):
            item.add_marker(skip)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (this process), for code that calls collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory):
    """sample_run(name): the run README sample `name` shows, run once per test session and read by
    every test that asks (tests/sample_runs.py). Its folder is the session's: pytest-xdist's
    workers each have a folder under the controller's, which is pytest's own per-run temporary
    folder (it keeps the last three)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sample-runs"
    folder.mkdir(exist_ok=True)

    def ran(name: str) -> Ran:
        return shared_run(name, folder)

    ran.folder = folder
    return ran
