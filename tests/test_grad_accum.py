"""03_grad_accum: accumulation under DDP equals one large batch, and no_sync saves all-reduces.

Every run is a real torchrun (gloo, CPU). The reference for "one large batch" is
01_basic_ddp/train.py in ONE process with batch 2 x b x k: same seed, same sampler order.
The all-reduces are counted from outside the lesson: tests/ddp_probe.py runs the lesson's main()
with a counting DDP communication hook.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import PYTHON, REPO, load_model, read_summary, relative_difference, run, torchrun

SCRIPT = "03_grad_accum/train.py"
BASIC = "01_basic_ddp/train.py"
PROBE = "tests/ddp_probe.py"
K = 3  # micro-batches per optimizer step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 optimizer steps each: 2 ranks x batch 4 x 3 micro-batches with and without no_sync (under the
    probe, which counts the all-reduces), 1 process x batch 24 (01), and 2 ranks x batch 4 without
    accumulation (the lesson as is, a negative control)."""
    root = tmp_path_factory.mktemp("accum")
    steps = ("--max-steps", "3", "--epochs", "1")
    out = {name: root / name for name in ("no_sync", "sync_every", "reference", "no_accum")}
    counts = {}
    for name, flags in (("no_sync", ()), ("sync_every", ("--no-use-no-sync",))):
        result_file = root / f"{name}.json"
        torchrun(PROBE, str(result_file), SCRIPT, *steps, "--batch-size", "4", "--accum-steps", str(K), *flags,
                 "--output-dir", str(out[name]))
        counts[name] = json.loads(result_file.read_text())
    torchrun(BASIC, *steps, "--batch-size", str(2 * 4 * K), "--output-dir", str(out["reference"]), nproc=1)
    torchrun(SCRIPT, *steps, "--batch-size", "4", "--output-dir", str(out["no_accum"]))
    return out, counts


def test_accumulation_equals_one_process_with_the_large_batch(runs):
    out, _ = runs
    reference = load_model(out["reference"])
    for name in ("no_sync", "sync_every"):
        summary = read_summary(out[name])
        assert (summary["steps"], summary["accum_steps"], summary["global_batch_size"]) == (3, K, 24)
        assert summary["replicas_identical"]
        assert relative_difference(load_model(out[name]), reference) < 1e-5, name
    assert read_summary(out["no_sync"])["use_no_sync"] and not read_summary(out["sync_every"])["use_no_sync"]
    # Negative control: the same micro-batches without accumulation (a step after each) end elsewhere.
    assert read_summary(out["no_accum"])["steps"] == 3
    assert relative_difference(load_model(out["no_accum"]), reference) > 1e-3


def test_no_sync_all_reduces_once_per_optimizer_step(runs):
    _, counts = runs
    with_no_sync, without = counts["no_sync"], counts["sync_every"]
    # One backward pass per optimizer step communicates with no_sync; all K of them without it.
    assert with_no_sync["passes_per_step"] == [1, 1, 1]
    assert without["passes_per_step"] == [K, K, K]
    # Each pass all-reduces every bucket. (Step 1 can differ: DDP rebuilds its buckets after the first pass.)
    buckets = with_no_sync["buckets_per_step"][-1]
    assert buckets >= 1 and with_no_sync["buckets_per_step"][1:] == [buckets, buckets]
    assert without["buckets_per_step"][1:] == [K * buckets, K * buckets]
    assert with_no_sync["wrapped"] == without["wrapped"] == [[]]  # one DDP model (no BatchNorm)


SHORT_WINDOW = ("--batch-size", "400", "--accum-steps", "3", "--epochs", "1")
LOSS_WEIGHT = "(loss * len(labels) / window_samples).backward()"  # the script's line


@pytest.fixture(scope="module")
def one_step_on_everything(tmp_path_factory):
    """01 in one process taking one step on all 1438 training samples."""
    reference = tmp_path_factory.mktemp("one_step")
    torchrun(BASIC, "--batch-size", "2400", "--epochs", "1", "--output-dir", str(reference), nproc=1)
    assert read_summary(reference)["steps"] == 1
    return load_model(reference)


def test_short_last_window_of_an_epoch_is_the_exact_mean(tmp_path, one_step_on_everything):
    """719 samples per rank in micro-batches of 400: 400 + 319 make one window of 2 (not 3) micro-batches,
    and weighting each by its share of the window's samples gives one process's step on all 1438."""
    result = torchrun(SCRIPT, *SHORT_WINDOW, "--output-dir", str(tmp_path))
    assert "2 micro-batches per rank per epoch" in result.stdout
    assert read_summary(tmp_path)["steps"] == 1
    assert relative_difference(load_model(tmp_path), one_step_on_everything) < 1e-5


@pytest.mark.parametrize("division", ["(loss / cfg.accum_steps).backward()",  # 3, though the window holds 2
                                      "(loss / (window_end - window_start)).backward()"])  # 2: 319 counts as 400
def test_dividing_by_accum_steps_or_by_the_micro_batch_count_misses_the_exact_mean(tmp_path, division,
                                                                                 one_step_on_everything):
    """Negative control for the test above: the script with either usual division instead of its weighting
    ends more than 5e-4 away from one process's step (5e-3 and 1.4e-3 measured; the weighting: 5e-8)."""
    source = (REPO / SCRIPT).read_text()
    assert source.count(LOSS_WEIGHT) == 1
    variant = tmp_path / "train.py"
    variant.write_text(source.replace(LOSS_WEIGHT, division))  # `common` is found through PYTHONPATH
    torchrun(variant, *SHORT_WINDOW, "--output-dir", str(tmp_path / "out"))
    assert read_summary(tmp_path / "out")["steps"] == 1
    assert relative_difference(load_model(tmp_path / "out"), one_step_on_everything) > 5e-4


def test_accum_steps_below_one_is_rejected_in_one_line(tmp_path):
    result = run([PYTHON, REPO / SCRIPT, "--accum-steps", "0", "--output-dir", tmp_path], timeout=60)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: config key 'accum_steps' must be >= 1, got 0"]
    assert "Traceback" not in result.output


def test_the_common_mistakes():
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
