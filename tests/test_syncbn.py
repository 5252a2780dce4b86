"""04_syncbn: synchronized BatchNorm on 2 ranks equals BatchNorm in one process on the full batch.

2 ranks forked from one warm process (tests/warm_ranks.py), gloo, CPU: the script selects
CpuSyncBatchNorm (nn.SyncBatchNorm takes no CPU tensors). What the model holds when DDP wraps it
is seen from outside the lesson (tests/ddp_probe.py). The run whose output the README's sample shows
is a real torchrun, as the README's command.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.paths import load_script
from tests.processes import warm_ranks
from tests.results import read_summary, relative_difference

cpu_sync_batchnorm = load_script("04_syncbn/cpu_sync_batchnorm.py", "cpu_sync_batchnorm_under_test")
CpuSyncBatchNorm, convert_to_cpu_sync_batchnorm = (
    cpu_sync_batchnorm.CpuSyncBatchNorm,
    cpu_sync_batchnorm.convert_to_cpu_sync_batchnorm,
)

SCRIPT = "04_syncbn/train.py"
WORKER = "tests/syncbn_worker.py"
PROBE = "tests/ddp_probe.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def math() -> dict:
    result = warm_ranks(WORKER, timeout=150)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_sync_batchnorm_on_two_ranks_equals_batchnorm_on_the_full_batch(math):
    """Output, gradients, running statistics and parameters, the worst over 3 steps. The control:
    plain BatchNorm on 2 ranks differs in output, gradients and running statistics."""
    sync, plain = math["worst"]["sync"], math["worst"]["plain"]
    assert sync.keys() == {"output", "grad", "running_stats", "params"}
    assert max(sync.values()) < TOLERANCE, sync
    assert min(plain["output"], plain["grad"], plain["running_stats"]) > 1e-3, plain


def test_running_statistics_are_the_same_on_every_rank_only_when_synchronized(math):
    """The README: eval mode communicates nothing because the
    running statistics are identical on every rank."""
    assert math["identical_running_stats"] == {"sync": True, "plain": False}


def test_one_all_reduce_per_layer_in_training_and_none_in_eval_mode(math):
    assert math["sync_layers"] == 2
    # per layer: sum, sum of squares and count in one tensor
    assert math["train_forward_all_reduces"] == 2
    assert math["train_backward_all_reduces"] == 2  # the differentiable all-reduce's backward
    assert math["eval_forward_all_reduces"] == 0  # running statistics: nothing to communicate


def test_conversion_happens_before_the_ddp_wrap(tmp_path):
    """The probe records the BatchNorm classes of each model the lesson hands to DDP."""
    result_file = tmp_path / "probe.json"
    warm_ranks(
        PROBE,
        str(result_file),
        SCRIPT,
        "--batch-norm",
        "compare",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        timeout=150,
    )
    probe = json.loads(result_file.read_text())
    # compare mode: the plain run wraps BatchNorm2d, the sync run wraps the converted layers only.
    assert probe["wrapped"] == [["BatchNorm2d"], ["CpuSyncBatchNorm"]]
    assert probe["passes_per_step"] == [1, 1]  # one gradient all-reduce pass per step, as in 01


@pytest.mark.min_torch
def test_script_sync_run_equals_one_process_and_plain_run_does_not(tmp_path, sample_run):
    """The training script: 2 ranks x 4 samples with synced
    BN == 1 process x 8 samples with plain BN."""
    # under torchrun, both runs (plain and synchronized), 3 steps: the run the README's sample
    # shows (tests/sample_runs.py)
    result = sample_run("04").ok()
    two, one = result.output_dir, tmp_path / "one_process"
    warm_ranks(
        SCRIPT,
        "--batch-norm",
        "plain",
        "--local-batch-size",
        "8",
        "--max-steps",
        "3",
        "--output-dir",
        str(one),
        nproc=1,
        timeout=120,
    )
    summary = read_summary(two)
    runs = summary["runs"]
    # top level: the sync run
    assert summary["norm_layer"] == "CpuSyncBatchNorm" and summary["replicas_identical"]
    assert runs["sync"]["norm_layer"] == "CpuSyncBatchNorm" and runs["sync"]["normalized_over"] == 8
    assert runs["plain"]["norm_layer"] == "BatchNorm2d" and runs["plain"]["normalized_over"] == 4
    assert runs["sync"]["steps"] == runs["plain"]["steps"] == 3
    reference = torch.load(one / "model_plain.pt", weights_only=True)
    sync, plain = (torch.load(two / f"model_{n}.pt", weights_only=True) for n in ("sync", "plain"))
    # num_batches_tracked too: 3 in both, a relative difference of 0
    assert relative_difference(sync, reference) < TOLERANCE
    assert relative_difference(plain, reference) > 1e-3
    # The README: per run, losses and accuracy; the model files hold the running statistics too.
    for run in runs.values():
        assert {"final_train_loss", "eval_loss", "eval_accuracy"} <= run.keys()
    assert any(k.endswith("running_mean") for k in reference) and any(
        k.endswith("running_var") for k in reference
    )
    # the closing comparison: a line per run, plain first (whatever its words)
    closing = re.findall(r"^ *(BatchNorm2d|CpuSyncBatchNorm) ", result.stdout, re.M)
    assert closing[-2:] == ["BatchNorm2d", "CpuSyncBatchNorm"], result.stdout


# --- the module itself, in this process (what the README says of it: tests/test_readme_text.py)
# ------------------------------------------------------------


def test_cpu_sync_batchnorm_is_a_batchnorm2d_and_plain_batchnorm_without_a_process_group():
    """Same parameters, buffers and state_dict keys as BatchNorm2d; with no
    process group (or in eval mode) it is BatchNorm2d, bitwise. It converts
    only BatchNorm2d; nn.SyncBatchNorm's conversion also takes 1d and 3d."""
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 2)
        plain.running_mean.uniform_(-1, 1)
    model = nn.Sequential(nn.BatchNorm1d(3), copy.deepcopy(plain), nn.BatchNorm3d(3))
    converted = convert_to_cpu_sync_batchnorm(copy.deepcopy(model))
    assert [type(m) for m in converted] == [nn.BatchNorm1d, CpuSyncBatchNorm, nn.BatchNorm3d]
    assert (
        isinstance(converted[1], nn.BatchNorm2d)
        and converted.state_dict().keys() == model.state_dict().keys()
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(converted.state_dict().values(), model.state_dict().values())
    )
    x = torch.randn(4, 3, 5, 5)
    assert not dist.is_initialized()
    for mode in ("train", "eval"):
        getattr(plain, mode)(), getattr(converted[1], mode)()
        assert torch.equal(converted[1](x), plain(x)), mode
    assert torch.equal(converted[1].running_mean, plain.running_mean)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    assert [type(m) for m in synced] == [nn.SyncBatchNorm] * 3
    # convert_sync_batchnorm keeps the parameters and running statistics.
    assert all(
        torch.equal(a, b) for a, b in zip(synced.state_dict().values(), model.state_dict().values())
    )


@pytest.mark.parametrize("name", ["LayerNorm", "GroupNorm", "RMSNorm"])
def test_per_sample_norms_have_no_batch_statistics(name):
    """Each sample is normalized on its own: its output does not depend on the rest of
    the batch, in training mode too. BatchNorm in training mode is the control."""
    if not hasattr(nn, name):
        pytest.skip(f"torch {torch.__version__} has no nn.{name} (added in torch 2.4)")
    norm = nn.GroupNorm(1, 3) if name == "GroupNorm" else getattr(nn, name)([3, 4, 4])
    x = torch.randn(8, 3, 4, 4)
    assert torch.allclose(norm.train()(x)[:2], norm(x[:2]), atol=1e-6)
    batch_norm = nn.BatchNorm2d(3).train()
    assert not torch.allclose(batch_norm(x)[:2], batch_norm(x[:2]), atol=1e-3)
