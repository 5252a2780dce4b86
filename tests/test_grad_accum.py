"""03_grad_accum: accumulation under DDP equals one large batch, and no_sync saves all-reduces.

The runs are 2 ranks (gloo, CPU) forked from one warm process (tests/warm_ranks.py): the claim is
what DDP computes, not how ranks start. The one run whose output the README's sample shows is a
real torchrun, as the README's command. The reference for "one large batch" is
01_basic_ddp/train.py in ONE process with batch 2 x b x k: same seed, same sampler order. The
all-reduces are counted from outside the lesson: tests/ddp_probe.py runs the lesson's main() with a
counting DDP communication hook.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.paths import PYTHON, REPO, load_script
from tests.processes import command_argv, run, warm_ranks, short_run
from tests.results import load_model, read_summary, relative_difference

SCRIPT = "03_grad_accum/train.py"
BASIC = "01_basic_ddp/train.py"
PROBE = "tests/ddp_probe.py"
K = 3  # micro-batches per optimizer step
STEPS = short_run(local_batch_size=None)
ACCUM = ("--local-batch-size", "4", "--accum-steps", str(K))  # 2 ranks x 4 x K: batch 24


def variant(tmp_path, old: str, new: str):
    """A copy of the script with its one line `old` replaced: a negative control (`common` is
    found through PYTHONPATH)."""
    source = (REPO / SCRIPT).read_text()
    assert source.count(old) == 1
    path = tmp_path / "train.py"
    path.write_text(source.replace(old, new))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_run):
    """3 optimizer steps each: 2 ranks x batch 4 x 3 micro-batches with and without no_sync
    (under the probe, which counts the all-reduces), 1 process x batch 24 (01), and 2
    ranks x batch 4 without accumulation (the lesson as is, a negative control)."""
    root = tmp_path_factory.mktemp("accum")
    out = {name: root / name for name in ("no_sync", "sync_every", "reference")}
    counts = {}
    for name, flags in (("no_sync", ()), ("sync_every", ("--no-use-no-sync",))):
        result_file = root / f"{name}.json"
        warm_ranks(PROBE, result_file, SCRIPT, *STEPS, *ACCUM, *flags, "--output-dir", out[name])
        counts[name] = json.loads(result_file.read_text())
    one_process = ("--local-batch-size", str(2 * 4 * K), "--output-dir", out["reference"])
    warm_ranks(BASIC, *STEPS, *one_process, nproc=1)
    # the lesson as is, under torchrun, a progress line per step: the run its README's sample
    # shows (tests/sample_runs.py)
    out["no_accum"] = sample_run("03").ok().output_dir
    return out, counts


@pytest.mark.min_torch
def test_accumulation_equals_one_process_with_the_large_batch(runs):
    out, _ = runs
    reference = load_model(out["reference"])
    for name in ("no_sync", "sync_every"):
        # (global_batch_size counts accum_steps: the scaled-rate test below; which run used
        # no_sync: the all-reduce counts of the next test)
        summary = read_summary(out[name])
        assert (summary["steps"], summary["accum_steps"]) == (3, K)
        assert summary["replicas_identical"]
        assert relative_difference(load_model(out[name]), reference) < 1e-5, name
    # Negative control: the same micro-batches without
    # accumulation (a step after each) end elsewhere.
    assert read_summary(out["no_accum"])["steps"] == 3
    assert relative_difference(load_model(out["no_accum"]), reference) > 1e-3


def test_no_sync_all_reduces_once_per_optimizer_step(runs):
    _, counts = runs
    with_no_sync, without = counts["no_sync"], counts["sync_every"]
    # One backward pass per optimizer step communicates with no_sync; all K of them without it.
    assert with_no_sync["passes_per_step"] == [1, 1, 1]
    assert without["passes_per_step"] == [K, K, K]
    # Each pass all-reduces every bucket. (Step 1 can differ:
    # DDP rebuilds its buckets after the first pass.)
    buckets = with_no_sync["buckets_per_step"][-1]
    assert buckets >= 1 and with_no_sync["buckets_per_step"][1:] == [buckets, buckets]
    assert without["buckets_per_step"][1:] == [K * buckets, K * buckets]
    assert with_no_sync["wrapped"] == without["wrapped"] == [[]]  # one DDP model (no BatchNorm)


MAX_NORM = "0.1"  # well below the gradient's norm at every one of the 3 steps: clipping is active
CLIPPED = (*STEPS, "--max-grad-norm", MAX_NORM)
CLIPPED_FP16 = (*CLIPPED, *ACCUM, "--precision", "fp16")
INJECT = REPO / "tests" / "inject"


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory):
    """3 optimizer steps of clipped training: fp32 on 2 ranks x batch 4 x 3 micro-batches and in
    1 process x batch 24; fp16 (GradScaler) on 2 ranks, and the same with an inf injected into
    rank 1's 4th forward (window 2's first micro-batch, inside no_sync) from outside the lesson
    (tests/inject/sitecustomize.py)."""
    root = tmp_path_factory.mktemp("clip")
    out = {name: root / name for name in ("fp32", "one_process", "fp16", "fp16_overflow")}
    warm_ranks(SCRIPT, *CLIPPED, *ACCUM, "--output-dir", out["fp32"])
    one_process = ("--local-batch-size", str(2 * 4 * K), "--output-dir", out["one_process"])
    warm_ranks(SCRIPT, *CLIPPED, *one_process, nproc=1)
    warm_ranks(SCRIPT, *CLIPPED_FP16, "--output-dir", out["fp16"])
    env = dict(
        PYTHONPATH=f"{REPO}:{INJECT}",
        DDP_TEST_NONFINITE_AT_FORWARD="4",
        DDP_TEST_NONFINITE_RANK="1",
    )
    overflow = warm_ranks(SCRIPT, *CLIPPED_FP16, "--output-dir", out["fp16_overflow"], env=env)
    assert "injecting inf into forward 4 on rank 1" in overflow.stderr, overflow.output[-3000:]
    return out


@pytest.mark.min_torch
def test_clipping_after_the_all_reduce_equals_one_process_with_the_large_batch(runs, clip_runs):
    """Clipped on the window's all-reduced gradient (after the scaler's unscale_), 2 ranks x 4 x
    3 micro-batches equal 1 process x 24; fp16 with its GradScaler lands within fp16's tolerance."""
    accumulated, one_process = load_model(clip_runs["fp32"]), load_model(clip_runs["one_process"])
    assert read_summary(clip_runs["fp32"])["replicas_identical"]
    assert relative_difference(accumulated, one_process) < 1e-5
    # Control: clipping is active, the unclipped run (same micro-batches) ends elsewhere.
    assert relative_difference(load_model(runs[0]["no_sync"]), one_process) > 1e-3
    fp16 = read_summary(clip_runs["fp16"])
    assert (fp16["precision"], fp16["max_grad_norm"], fp16["grad_scale"]) == ("fp16", 0.1, 2.0**16)
    assert fp16["replicas_identical"]
    assert relative_difference(load_model(clip_runs["fp16"]), one_process) < 1e-2


UNSCALE = "            scaler.unscale_(optimizer)\n"  # the script's line (Accumulation.step)


def test_clipping_without_unscale_clips_the_scaled_gradient(tmp_path, clip_runs):
    """Negative control for the fp16 half of the test above: the script without its
    scaler.unscale_ clips the gradient still multiplied by the scale (2**16), so its steps are
    about 2**16 times too short, and the run lands far from one process's."""
    warm_ranks(variant(tmp_path, UNSCALE, ""), *CLIPPED_FP16, "--output-dir", tmp_path / "out")
    assert read_summary(tmp_path / "out")["grad_scale"] == 2.0**16  # no step was skipped
    one_process = load_model(clip_runs["one_process"])
    assert relative_difference(load_model(tmp_path / "out"), one_process) > 1e-2


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(clip_runs):
    """inf in rank 1's gradient alone: the all-reduce hands it to every rank, every rank's scaler
    skips that step and halves its scale, and the replicas stay identical and finite."""
    summary = read_summary(clip_runs["fp16_overflow"])
    assert summary["steps"] == 3  # a skipped step still counts as a step of the loop
    assert summary["grad_scale"] == 2.0**15  # halved once, from 2**16
    assert summary["replicas_identical"]
    weights = load_model(clip_runs["fp16_overflow"])
    assert all(torch.isfinite(w).all() for w in weights.values())
    # Control: without the overflow (its scale stays 2**16: the test of clipping above) all
    # three steps update the weights.
    assert relative_difference(weights, load_model(clip_runs["fp16"])) > 1e-3


SHORT_WINDOW = ("--local-batch-size", "400", "--accum-steps", "3", "--epochs", "1")
LOSS_WEIGHT = "scaler.scale(loss * len(labels) / window_samples).backward()"  # the script's line


@pytest.fixture(scope="module")
def one_step_on_everything(tmp_path_factory):
    """01 in one process taking one step on all 1438 training samples."""
    reference = tmp_path_factory.mktemp("one_step")
    warm_ranks(
        BASIC, "--local-batch-size", "2400", "--epochs", "1", "--output-dir", reference, nproc=1
    )
    assert read_summary(reference)["steps"] == 1
    return load_model(reference)


@pytest.mark.parametrize(
    "loss_line",
    [
        LOSS_WEIGHT,
        "scaler.scale(loss / cfg.accum_steps).backward()",  # 3, though the window holds 2
        "scaler.scale(loss / (window_end - window_start)).backward()",  # 2: 319 counts as 400
    ],
)
def test_short_last_window_of_an_epoch_is_the_exact_mean(
    tmp_path, loss_line, one_step_on_everything
):
    """719 samples per rank in micro-batches of 400: 400 + 319 make one window of 2 (not 3)
    micro-batches, and the script, weighting each by its share of the window's samples, gives one
    process's step on all 1438. The negative controls: a copy with either usual division instead
    ends more than 5e-4 away (5e-3 and 1.4e-3 measured; the weighting: 5e-8)."""
    script = SCRIPT if loss_line == LOSS_WEIGHT else variant(tmp_path, LOSS_WEIGHT, loss_line)
    result = warm_ranks(script, *SHORT_WINDOW, "--output-dir", tmp_path / "out")
    assert re.search(r"\b2 micro-batches\b", result.stdout), result.stdout  # the banner's count
    assert read_summary(tmp_path / "out")["steps"] == 1
    difference = relative_difference(load_model(tmp_path / "out"), one_step_on_everything)
    assert difference < 1e-5 if loss_line == LOSS_WEIGHT else difference > 5e-4, difference


def test_accum_steps_below_one_is_rejected_in_one_line(tmp_path):
    result = run(
        [PYTHON, REPO / SCRIPT, "--accum-steps", "0", "--output-dir", tmp_path], timeout=60
    )
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: config key 'accum_steps' must be >= 1, got 0"
    ]
    assert "Traceback" not in result.output


def test_the_common_mistakes():
    """The README's mistakes, shown with DDP itself (tests/grad_accum_worker.py)."""
    result = warm_ranks("tests/grad_accum_worker.py", timeout=90)
    # no_sync must cover the forward: DDP prepares the backward's all-reduce there.
    assert "forward+backward inside no_sync: 0 all-reduces" in result.stdout
    assert "forward outside, backward inside no_sync: 1 all-reduces" in result.stdout
    # Syncing on the first micro-batch leaves the later ones un-averaged: replicas diverge.
    assert "sync on the last micro-batch: gradients identical on all ranks: True" in result.stdout
    assert "sync on the first micro-batch: gradients identical on all ranks: False" in result.stdout
    # zero_grad only after a step: zeroing in between throws the earlier micro-batches away.
    assert (
        "zero_grad between micro-batches: equals the last micro-batch's alone: True, "
        "equals the accumulated window: False"
    ) in result.stdout
    # Equivalent to the large batch only without BatchNorm:
    # each micro-batch is normalized on its own.
    differences = dict(
        re.findall(
            r"accumulation vs the large batch, (BatchNorm|no BatchNorm): relative difference "
            r"(\S+)",
            result.stdout,
        )
    )
    assert float(differences["no BatchNorm"]) < 1e-5 and float(differences["BatchNorm"]) > 1e-2, (
        differences
    )
    # Clip on the sync step only: clipping each micro-batch (before the all-reduce) clips every
    # rank's partial sum, and the step is not the large batch's clipped one.
    assert "clip on the sync step only: equals the large batch's clipped gradient: True" in (
        result.stdout
    )
    assert "clip after every micro-batch: equals the large batch's clipped gradient: False" in (
        result.stdout
    )


def test_accum_steps_1_is_01s_loop(runs, tmp_path):
    """The README: accum_steps defaults to 1, 01's loop.
    03 with the default ends bitwise where 01 ends."""
    out, _ = runs
    assert read_summary(out["no_accum"])["accum_steps"] == 1
    warm_ranks(BASIC, *STEPS, "--local-batch-size", "4", "--output-dir", tmp_path)
    basic, accum_1 = load_model(tmp_path), load_model(out["no_accum"])
    assert basic.keys() == accum_1.keys() and all(torch.equal(basic[k], accum_1[k]) for k in basic)


def test_the_scaled_rate_counts_the_effective_batch_and_warm_up_counts_optimizer_steps(tmp_path):
    """--lr-base-batch 8 on 2 ranks x batch 8 x accum 2: the effective batch is 32, so the rate is
    4x --lr. --warmup-steps 4 with 2 optimizer steps (4 micro-batches) done: LinearLR from 1/4 of
    the rate stands at 1/4 + 3/4 x 2/4 = 0.625 of it. A warm-up stepped per micro-batch would be
    over (1.0), one that ignored accumulation would scale by 2."""
    flags = ["--local-batch-size", "8", "--accum-steps", "2", "--lr", "0.1", "--lr-base-batch", "8"]
    flags += ["--warmup-steps", "4", "--max-steps", "2", "--epochs", "1"]
    warm_ranks(SCRIPT, *flags, "--output-dir", str(tmp_path))
    summary = read_summary(tmp_path)
    assert summary["global_batch_size"] == 32
    assert summary["lr"] == pytest.approx(0.1 * 32 / 8)
    assert summary["final_lr"] == pytest.approx(summary["lr"] * 0.625)


LR_SCALING = "python 03_grad_accum/lr_scaling.py"


def test_linear_scaling_wins_back_half_of_what_four_ranks_lose_in_a_short_run(tmp_path):
    """The README's table: its command (python 03_grad_accum/lr_scaling.py), at 1 and 4 ranks,
    each run as the driver plans it, ranks started warm. In 3 epochs, 4 ranks at --lr as given
    (4x the batch, a quarter of the steps) end well below 1 rank; the linearly scaled rate wins
    back part of the loss (more than 20%: 58% in the README's run, 29% on another CPU of the same
    kind: 36 steps at rate 0.4 are sensitive to rounding); a 5-step warm-up adds at most 0.02. The
    same scaled rate at one rank's batch diverges: the rate belongs to the batch."""
    lr_scaling = load_script("03_grad_accum/lr_scaling.py", "lr_scaling")
    argv = command_argv(LR_SCALING)[2:]
    args, extra = lr_scaling.parse(argv + ["--world-sizes", "1,4"])  # 2 ranks left out: time
    args.output_dir = str(tmp_path)
    accuracy = {}
    for world_size, setting, train_args in lr_scaling.plan(args, extra):
        if (world_size, setting) == (1, "linear + warm-up"):
            continue  # the one row no claim reads
        warm_ranks(lr_scaling.SCRIPT, *train_args, nproc=world_size, timeout=240)
        out = train_args[train_args.index("--output-dir") + 1]
        accuracy[world_size, setting] = read_summary(out)["eval_accuracy"]
    one_rank, as_given, linear = (
        accuracy[1, "as given"],
        accuracy[4, "as given"],
        accuracy[4, "linear"],
    )
    assert one_rank - as_given > 0.1, accuracy
    assert linear - as_given > 0.2 * (one_rank - as_given), accuracy
    assert accuracy[4, "linear + warm-up"] <= linear + 0.02, accuracy  # "did not help much"
    warm_ranks(
        SCRIPT, "--epochs", "3", "--lr", "0.4", "--output-dir", str(tmp_path / "0.4"), nproc=1
    )
    assert read_summary(tmp_path / "0.4")["eval_accuracy"] < 0.3


@pytest.mark.launchers
def test_lr_scaling_starts_its_runs_with_torchrun_and_prints_the_table(tmp_path):
    """The driver itself, as a user runs it: real torchrun per run (one rank, 2 steps each), then
    one table row per run with the rate each run used. The figures are the test above's."""
    cmd = [PYTHON, "03_grad_accum/lr_scaling.py", "--world-sizes", "1"]
    cmd += ["--output-dir", str(tmp_path), "--", "--max-steps", "2", "--epochs", "1"]
    result = run(cmd, timeout=240, check=True)
    table = result.stdout.splitlines()[-3:]
    assert table[0].split() == "world size global batch setting lr steps eval accuracy".split()
    assert [line.split()[2:5] for line in table[1:]] == [
        ["as", "given", "0.1"],
        ["linear", "+", "warm-up"],
    ]
    assert all(line.split()[-2] == "2" for line in table[1:])  # the flags after -- reached each run
    assert len(list(tmp_path.glob("*/summary.json"))) == 2
