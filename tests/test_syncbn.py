"""04_syncbn: synchronized BatchNorm on 2 ranks equals BatchNorm in one process on the full batch.

Real torchrun, gloo, CPU: the script selects CpuSyncBatchNorm (nn.SyncBatchNorm is GPU-only).
What the model holds when DDP wraps it is seen from outside the lesson (tests/ddp_probe.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import read_summary, torchrun

SCRIPT = "04_syncbn/train.py"
WORKER = "tests/syncbn_worker.py"
PROBE = "tests/ddp_probe.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def math() -> dict:
    result = torchrun(WORKER, timeout=150)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def relative_difference(a: dict, b: dict) -> float:
    """Largest ||a - b|| / ||b|| over parameters and running statistics (num_batches_tracked compared exactly)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        if k.endswith("num_batches_tracked"):
            assert torch.equal(a[k], b[k]), k
            continue
        worst = max(worst, ((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item())
    return worst


def test_sync_batchnorm_on_two_ranks_equals_batchnorm_on_the_full_batch(math):
    sync = math["worst"]["sync"]
    assert sync["output"] < TOLERANCE
    assert sync["grad"] < TOLERANCE
    assert sync["running_stats"] < TOLERANCE
    assert sync["params"] < TOLERANCE


def test_plain_batchnorm_on_two_ranks_differs(math):
    plain = math["worst"]["plain"]
    assert plain["output"] > 1e-3
    assert plain["grad"] > 1e-3
    assert plain["running_stats"] > 1e-3


def test_one_all_reduce_per_layer_in_training_and_none_in_eval_mode(math):
    assert math["sync_layers"] == 2
    assert math["train_forward_all_reduces"] == 2  # per layer: sum, sum of squares and count in one tensor
    assert math["train_backward_all_reduces"] == 2  # the differentiable all-reduce's backward
    assert math["eval_forward_all_reduces"] == 0  # running statistics: nothing to communicate


def test_conversion_happens_before_the_ddp_wrap(tmp_path):
    """The probe records the BatchNorm classes of each model the lesson hands to DDP."""
    result_file = tmp_path / "probe.json"
    torchrun(PROBE, str(result_file), SCRIPT, "--batch-norm", "compare", "--max-steps", "1",
             "--output-dir", str(tmp_path / "out"), timeout=150)
    probe = json.loads(result_file.read_text())
    # compare mode: the plain run wraps BatchNorm2d, the sync run wraps the converted layers only.
    assert probe["wrapped"] == [["BatchNorm2d"], ["CpuSyncBatchNorm"]]
    assert probe["passes_per_step"] == [1, 1]  # one gradient all-reduce pass per step, as in 01


def test_script_sync_run_equals_one_process_and_plain_run_does_not(tmp_path):
    """The training script: 2 ranks x 4 samples with synced BN == 1 process x 8 samples with plain BN."""
    two, one = tmp_path / "two_ranks", tmp_path / "one_process"
    result = torchrun(SCRIPT, "--batch-norm", "compare", "--batch-size", "4", "--max-steps", "3",
                      "--output-dir", str(two), timeout=180)
    assert "sync: 2 x CpuSyncBatchNorm, statistics over 8 samples per channel" in result.stdout
    assert "plain: 2 x BatchNorm2d, statistics over 4 samples per channel" in result.stdout
    torchrun(SCRIPT, "--batch-norm", "plain", "--batch-size", "8", "--max-steps", "3",
             "--output-dir", str(one), nproc=1, timeout=120)
    summary = read_summary(two)
    runs = summary["runs"]
    assert summary["norm_layer"] == "CpuSyncBatchNorm" and summary["replicas_identical"]  # top level: the sync run
    assert runs["sync"]["norm_layer"] == "CpuSyncBatchNorm" and runs["sync"]["normalized_over"] == 8
    assert runs["plain"]["norm_layer"] == "BatchNorm2d" and runs["plain"]["normalized_over"] == 4
    assert runs["sync"]["steps"] == runs["plain"]["steps"] == 3
    reference = torch.load(one / "model_plain.pt", weights_only=True)
    assert relative_difference(torch.load(two / "model_sync.pt", weights_only=True), reference) < TOLERANCE
    assert relative_difference(torch.load(two / "model_plain.pt", weights_only=True), reference) > 1e-3
