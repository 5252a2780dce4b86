"""What the READMEs say DDP does, held to the installed torch (2.14.1).

On 2 ranks forked from one warm process (tests/ddp_facts_worker.py, tests/warm_ranks.py): DDP's
wrap gives every rank rank 0's parameters and buffers; DDP broadcasts rank 0's buffers again at the
start of forward; DDP(static_graph=True) with no_sync() accumulation fails (PyTorch issue 143580:
when a release fixes it, that test fails and the README's warning can go). nn.SyncBatchNorm's
refusal of CPU tensors, and what it communicates (which cannot run without a GPU):
tests/test_torch_text.py.
"""

from __future__ import annotations

import json

import pytest

from tests.processes import warm_ranks
from tests.torch_versions import skip_below_torch

WORKER = "tests/ddp_facts_worker.py"


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    """Each rank's RESULT line, in rank order."""
    skip_below_torch("2.13", "the worker wraps with DDP's forward_sync_buffers")
    result = warm_ranks(WORKER, timeout=150)
    lines = sorted(
        line.split(" ", 2)[1:] for line in result.stdout.splitlines() if line.startswith("RESULT ")
    )
    assert [rank for rank, _ in lines] == ["0", "1"], result.output[-3000:]
    return [json.loads(text) for _, text in lines]


def test_the_wrap_gives_every_rank_rank_0s_parameters_and_buffers(facts):
    """README.md, "What DDP does"; 01's table: DDP(...)
    broadcasts rank 0's parameters and buffers."""
    wrap = facts[0]["wrap"]
    assert wrap["params_before"][0] != wrap["params_before"][1]  # built with different weights
    assert wrap["buffers_before"][0] != wrap["buffers_before"][1]
    # rank 0's, bitwise, on both ranks
    assert wrap["params_after"] == [wrap["params_before"][0]] * 2
    assert wrap["buffers_after"] == [wrap["buffers_before"][0]] * 2
    # Control: DDP(init_sync=False) skips that broadcast, and the ranks keep their own weights.
    assert wrap["params_without_init_sync"] == wrap["params_before"]


def test_buffers_are_broadcast_from_rank_0_at_the_start_of_forward(facts):
    """README.md, "What DDP does", and debugging/README.md's two forwards: rank 0's buffers at the
    start of forward, unless the previous forward ran without grad or under no_sync() (DDP's
    require_forward_param_sync, torch/nn/parallel/distributed.py)."""
    forward = facts[0]["forward"]
    default, control = forward["default"], forward["forward_sync_buffers_false"]
    assert default["before_forward"][0] != default["before_forward"][1]
    assert default["after_forward"] == [default["before_forward"][0]] * 2
    # forward_sync_buffers=False: no broadcast
    assert control["after_forward"] == control["before_forward"]
    # After a forward without grad or under no_sync() the
    # next forward broadcasts nothing: the ranks keep
    # the different buffers they were given.
    for after in ("after_a_forward_after_no_grad", "after_a_forward_after_no_sync"):
        assert default[after][0] != default[after][1], after


def test_a_skipped_all_reduce_of_equal_shapes_silently_sums_the_wrong_tensors(facts):
    """debugging/README.md, "Hang mid-epoch": a collective skipped on some ranks, if the shapes
    happen to match, silently mixes the wrong tensors. The mismatched-collective demo aborts because
    the shapes differ; with equal shapes gloo sums rank 0's loss (1) with rank 1's count (20) and
    raises nothing (the right sums: loss 1 + 2, count 10 + 20)."""
    assert facts[0]["equal_shapes_mismatch"] == {"loss": 1.0 + 20.0, "count": 10.0 + 0.0}
    assert facts[1]["equal_shapes_mismatch"] == {"count": 20.0 + 1.0, "extra": 0.0 + 10.0}


def test_static_graph_with_no_sync_accumulation_fails(facts):
    """03's README: PyTorch issue 143580, still open in torch 2.14.1. The first backward
    inside no_sync() of a DDP(static_graph=True) model trips an internal assert. If
    this test fails, torch has changed: check the issue, then the README's warning."""
    for rank in facts:
        assert rank["static_graph_no_sync"].startswith(
            "RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED"
        )
