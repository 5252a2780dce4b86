"""What the READMEs say DDP and nn.SyncBatchNorm do, held to the installed torch (2.14.1).

On 2 ranks forked from one warm process (tests/ddp_facts_worker.py, tests/warm_ranks.py): DDP's wrap
gives every rank rank 0's parameters and buffers; DDP broadcasts rank 0's buffers again at the start
of forward; nn.SyncBatchNorm refuses CPU tensors; DDP(static_graph=True) with no_sync() accumulation
fails (PyTorch issue 143580: when a release fixes it, that test fails and the README's warning can
go). What nn.SyncBatchNorm communicates cannot run without a GPU: it is read from torch's source.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import skip_below_torch, warm_ranks

WORKER = "tests/ddp_facts_worker.py"
SYNCBN_FUNCTION = Path(torch.__file__).parent / "nn" / "modules" / "_functions.py"


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


def test_collectives_in_a_different_order_silently_mix_tensors_of_the_same_shape(facts):
    """debugging/README.md, "Hang mid-epoch": with gloo, if the shapes happen to match, ranks
    that call collectives in a different order get no error, only the wrong sums."""
    # the control: loss 1 + 2, count 10 + 20
    assert [f["order"]["same_order"] for f in facts] == [[3.0, 30.0]] * 2
    # Rank 0's loss sum met rank 1's count, and the other way round.
    assert [f["order"]["swapped_on_rank_1"] for f in facts] == [[21.0, 12.0], [12.0, 21.0]]


@pytest.mark.torch_text
def test_nn_syncbatchnorm_refuses_cpu_tensors(facts):
    assert (
        facts[0]["syncbn_cpu"]
        == facts[1]["syncbn_cpu"]
        == ("ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone")
    )


def test_a_skipped_all_reduce_of_equal_shapes_silently_sums_the_wrong_tensors(facts):
    """debugging/README.md: the mismatched-collective demo aborts because the shapes differ; with
    equal shapes gloo sums rank 0's loss (1) with rank 1's count (20) and raises nothing."""
    assert facts[0]["equal_shapes_mismatch"] == {"loss": 1.0 + 20.0, "count": 10.0 + 0.0}
    assert facts[1]["equal_shapes_mismatch"] == {"count": 20.0 + 1.0, "extra": 0.0 + 10.0}


@pytest.mark.torch_text
def test_static_graph_with_no_sync_accumulation_fails(facts):
    """03's README: PyTorch issue 143580, still open in torch 2.14.1. The first backward
    inside no_sync() of a DDP(static_graph=True) model trips an internal assert. If
    this test fails, torch has changed: check the issue, then the README's warning."""
    for rank in facts:
        assert rank["static_graph_no_sync"].startswith(
            "RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED"
        )


def syncbn_method(name: str) -> ast.FunctionDef:
    """A method of the autograd Function behind nn.SyncBatchNorm, from torch's source file."""
    tree = ast.parse(SYNCBN_FUNCTION.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SyncBatchNorm")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def collectives(function: ast.FunctionDef) -> set[str]:
    """The torch.distributed functions a method calls (as
    `dist.x(...)` or `torch.distributed.x(...)`)."""
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.add(node.func.attr)
    return found


def concatenated(function: ast.FunctionDef) -> list[list[str]]:
    """The names in each `torch.cat([a, b, ...])` of a method: what goes into one message."""
    return [
        [ast.unparse(e) for e in node.args[0].elts]
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.cat"
        and node.args
        and isinstance(node.args[0], ast.List)
    ]


@pytest.mark.torch_text
def test_nn_syncbatchnorm_all_gathers_mean_invstd_count_and_all_reduces_gradient_sums():
    """04's README: nn.SyncBatchNorm's forward all-gathers each rank's per-channel mean,
    inverse standard deviation and count (all_gather on gloo, all_gather_single
    otherwise) and all-reduces nothing; its backward all-reduces the two per-channel
    gradient sums. (CpuSyncBatchNorm all-reduces sums instead.)"""
    forward, backward = syncbn_method("forward"), syncbn_method("backward")
    assert collectives(forward) == {"all_gather", "all_gather_single"}
    assert ["mean", "invstd", "count"] in concatenated(forward)
    assert "batch_norm_gather_stats_with_counts" in ast.unparse(forward)
    assert collectives(backward) == {"all_reduce"}
    assert ["sum_dy", "sum_dy_xmu"] in concatenated(backward)
    # Which all-gather: all_gather where the group's
    # backend is gloo, all_gather_single on any other.
    (branch,) = [
        n for n in ast.walk(forward) if isinstance(n, ast.If) and "'gloo'" in ast.unparse(n.test)
    ]
    assert "!=" in ast.unparse(branch.test)
    assert collectives(ast.Module(body=branch.body)) == {"all_gather_single"}
    assert collectives(ast.Module(body=branch.orelse)) == {"all_gather"}


@pytest.mark.torch_text
def test_the_differentiable_all_reduce_is_deprecated_with_the_warning_04_silences():
    """04_syncbn/cpu_sync_batchnorm.py: torch 2.14 marks torch.distributed.nn.functional.all_reduce
    deprecated (in favour of a private module); the lesson filters exactly that warning."""
    import inspect
    import re
    import warnings

    import torch.distributed.nn.functional as dist_nn

    assert "_deprecated(" in inspect.getsource(dist_nn.all_reduce)
    lesson = (
        Path(__file__).resolve().parents[1] / "04_syncbn" / "cpu_sync_batchnorm.py"
    ).read_text()
    (pattern,) = re.findall(r'message=r"([^"]+)"', lesson)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # no process group: the warning comes first, then the error
            dist_nn.all_reduce(torch.ones(1))
        except (RuntimeError, ValueError):
            pass
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert (
        messages and re.match(pattern, messages[0]) and "_functional_collectives" in messages[0]
    ), messages
