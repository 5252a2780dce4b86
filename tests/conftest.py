"""Fixtures shared by several test files."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (this process), for code that calls collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
