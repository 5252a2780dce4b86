"""03_grad_accum: accumulation under DDP equals one large batch, and no_sync saves all-reduces.

Every run is a real torchrun (gloo, CPU). The reference for "one large batch" is
01_basic_ddp/train.py in ONE process with batch 2 x b x k: same seed, same sampler order.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import read_summary, torchrun

SCRIPT = "03_grad_accum/train.py"
BASIC = "01_basic_ddp/train.py"


def relative_difference(a: dict, b: dict) -> float:
    """Largest ||a - b|| / ||b|| over the tensors of two state dicts (same keys required)."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in a)


def load(output_dir) -> dict:
    return torch.load(output_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 ranks x batch 4 x 3 micro-batches (with and without no_sync) and 1 process x batch 24, 3 steps."""
    root = tmp_path_factory.mktemp("accum")
    common = ("--max-steps", "3", "--epochs", "1", "--bucket-cap-mb", "0.1")  # small buckets: several per pass
    out = {name: root / name for name in ("no_sync", "sync_every", "reference")}
    torchrun(SCRIPT, *common, "--batch-size", "4", "--accum-steps", "3", "--output-dir", str(out["no_sync"]))
    # The same accumulation given as a global batch: 24 = 4 x 2 x 3.
    sync_every = torchrun(SCRIPT, *common, "--batch-size", "4", "--global-batch-size", "24", "--no-use-no-sync",
                          "--output-dir", str(out["sync_every"]))
    torchrun(BASIC, *common, "--batch-size", "24", "--output-dir", str(out["reference"]), nproc=1)
    return out, sync_every.stdout


def test_accumulation_equals_one_process_with_the_large_batch(runs):
    out, _ = runs
    reference = load(out["reference"])
    for name in ("no_sync", "sync_every"):
        summary = read_summary(out[name])
        assert summary["steps"] == 3 and summary["global_batch_size"] == 24 and summary["replicas_identical"]
        assert relative_difference(load(out[name]), reference) < 1e-5, name


def test_global_batch_size_derives_accumulation_steps(runs):
    out, stdout = runs
    assert read_summary(out["sync_every"])["accum_steps"] == 3
    assert "local 4 x world 2 x accum 3 = effective 24" in stdout


def test_no_sync_all_reduces_once_per_optimizer_step(runs):
    out, _ = runs
    with_no_sync, without = read_summary(out["no_sync"]), read_summary(out["sync_every"])
    k = 3
    # One backward pass per optimizer step communicates with no_sync; all k of them without it.
    assert with_no_sync["all_reduce_passes_per_step"] == [1, 1, 1]
    assert without["all_reduce_passes_per_step"] == [k, k, k]
    # Each pass all-reduces every bucket. (Step 1 differs: DDP rebuilds its buckets after the first pass.)
    buckets = with_no_sync["all_reduces_per_step"][-1]
    assert buckets >= 2  # --bucket-cap-mb 0.1 splits the gradients, so buckets are really counted
    assert with_no_sync["all_reduces_per_step"][1:] == [buckets, buckets]
    assert without["all_reduces_per_step"][1:] == [k * buckets, k * buckets]
    assert without["all_reduces"] > with_no_sync["all_reduces"]


def test_short_last_window_of_an_epoch_is_the_exact_mean(tmp_path):
    """719 samples per rank in micro-batches of 400: 400 + 319 make one window of 2 (not 3) micro-batches.

    Dividing by accum_steps (3) or by the micro-batch count (2, ignoring the short 319) would not match
    one process taking one step on all 1438 samples.
    """
    accum, reference = tmp_path / "accum", tmp_path / "reference"
    result = torchrun(SCRIPT, "--batch-size", "400", "--accum-steps", "3", "--epochs", "1",
                      "--output-dir", str(accum))
    assert "2 micro-batches = 1 steps/epoch" in result.stdout
    torchrun(BASIC, "--batch-size", "2400", "--epochs", "1", "--output-dir", str(reference), nproc=1)
    assert read_summary(accum)["steps"] == read_summary(reference)["steps"] == 1
    assert relative_difference(load(accum), load(reference)) < 1e-5


def test_global_batch_that_does_not_divide_is_rejected(tmp_path):
    result = torchrun(SCRIPT, "--batch-size", "8", "--global-batch-size", "100", "--output-dir", str(tmp_path),
                      check=False, timeout=90)
    assert result.returncode != 0
    assert ("error: global_batch_size 100 is not divisible by batch_size 8 x world size 2 = 16: "
            "use a multiple of 16") in result.stderr
    assert result.stderr.count("error: global_batch_size") == 1  # one line, from one rank
    assert "] failed:" not in result.stderr  # no rank traceback: a usage error, not a crash
    assert not (tmp_path / "summary.json").exists()


def test_linear_lr_scaling_and_warmup_are_printed_and_applied(tmp_path):
    result = torchrun(SCRIPT, "--batch-size", "4", "--accum-steps", "2", "--scale-lr", "--base-batch-size", "4",
                      "--warmup-steps", "2", "--max-steps", "3", "--log-every", "1", "--output-dir", str(tmp_path),
                      nproc=1)
    # lr 0.1 x (4 x 1 x 2 = 8) / 4 = 0.2, reached after 2 warmup steps (0.1, 0.2, 0.2).
    assert "0.1 x 8 / 4 = 0.2 (linear scaling), linear warmup over 2 steps from 0.1" in result.stdout
    lrs = [line.split(" lr ")[1].split()[0] for line in result.stdout.splitlines() if " lr " in line]
    assert lrs == ["0.1", "0.2", "0.2"]
    assert read_summary(tmp_path)["lr"] == pytest.approx(0.2)


def test_the_common_mistakes(tmp_path):
    """The README's mistakes, shown with DDP itself (tests/grad_accum_worker.py)."""
    result = torchrun("tests/grad_accum_worker.py", timeout=90)
    # no_sync must cover the forward: DDP prepares the backward's all-reduce there.
    assert "forward+backward inside no_sync: 0 all-reduces" in result.stdout
    assert "forward outside, backward inside no_sync: 1 all-reduces" in result.stdout
    # Syncing on the first micro-batch leaves the later ones un-averaged: replicas diverge.
    assert "sync on the last micro-batch: gradients identical on all ranks: True" in result.stdout
    assert "sync on the first micro-batch: gradients identical on all ranks: False" in result.stdout
    # DDP already averages over ranks; dividing again halves the step on 2 ranks.
    assert "extra division by world size: gradient x 0.500" in result.stdout
