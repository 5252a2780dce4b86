"""03_grad_accum: accumulation under DDP equals one large batch, and no_sync saves all-reduces.

Every run is a real torchrun (gloo, CPU). The reference for "one large batch" is
01_basic_ddp/train.py in ONE process with batch 2 x b x k: same seed, same sampler order.
The all-reduces are counted from outside the lesson: tests/ddp_probe.py runs the lesson's main()
with a counting DDP communication hook.
"""

from __future__ import annotations

import inspect
import json
import math
import re

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from common.data import digits

from tests.helpers import (
    PYTHON,
    REPO,
    load_model,
    markdown_blocks,
    read_summary,
    readme_sample,
    relative_difference,
    run,
    torchrun,
)

SCRIPT = "03_grad_accum/train.py"
BASIC = "01_basic_ddp/train.py"
PROBE = "tests/ddp_probe.py"
K = 3  # micro-batches per optimizer step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 optimizer steps each: 2 ranks x batch 4 x 3 micro-batches with and without no_sync
    (under the probe, which counts the all-reduces), 1 process x batch 24 (01), and 2
    ranks x batch 4 without accumulation (the lesson as is, a negative control)."""
    root = tmp_path_factory.mktemp("accum")
    steps = ("--max-steps", "3", "--epochs", "1")
    out = {name: root / name for name in ("no_sync", "sync_every", "reference", "no_accum")}
    counts = {}
    for name, flags in (("no_sync", ()), ("sync_every", ("--no-use-no-sync",))):
        result_file = root / f"{name}.json"
        torchrun(
            PROBE,
            str(result_file),
            SCRIPT,
            *steps,
            "--batch-size",
            "4",
            "--accum-steps",
            str(K),
            *flags,
            "--output-dir",
            str(out[name]),
        )
        counts[name] = json.loads(result_file.read_text())
    torchrun(
        BASIC,
        *steps,
        "--batch-size",
        str(2 * 4 * K),
        "--output-dir",
        str(out["reference"]),
        nproc=1,
    )
    # step lines too, for the README sample's shapes
    lesson = torchrun(
        SCRIPT,
        *steps,
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--output-dir",
        str(out["no_accum"]),
    )
    (root / "no_accum.stdout").write_text(lesson.stdout)
    return out, counts


@pytest.mark.min_torch
def test_accumulation_equals_one_process_with_the_large_batch(runs):
    out, _ = runs
    reference = load_model(out["reference"])
    for name in ("no_sync", "sync_every"):
        summary = read_summary(out[name])
        assert (summary["steps"], summary["accum_steps"], summary["global_batch_size"]) == (
            3,
            K,
            24,
        )
        assert summary["replicas_identical"]
        assert relative_difference(load_model(out[name]), reference) < 1e-5, name
    assert (
        read_summary(out["no_sync"])["use_no_sync"]
        and not read_summary(out["sync_every"])["use_no_sync"]
    )
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


SHORT_WINDOW = ("--batch-size", "400", "--accum-steps", "3", "--epochs", "1")
LOSS_WEIGHT = "(loss * len(labels) / window_samples).backward()"  # the script's line


@pytest.fixture(scope="module")
def one_step_on_everything(tmp_path_factory):
    """01 in one process taking one step on all 1438 training samples."""
    reference = tmp_path_factory.mktemp("one_step")
    torchrun(
        BASIC, "--batch-size", "2400", "--epochs", "1", "--output-dir", str(reference), nproc=1
    )
    assert read_summary(reference)["steps"] == 1
    return load_model(reference)


def test_short_last_window_of_an_epoch_is_the_exact_mean(tmp_path, one_step_on_everything):
    """719 samples per rank in micro-batches of 400: 400 + 319 make one
    window of 2 (not 3) micro-batches, and weighting each by its share
    of the window's samples gives one process's step on all 1438."""
    result = torchrun(SCRIPT, *SHORT_WINDOW, "--output-dir", str(tmp_path))
    assert re.search(r"\b2 micro-batches\b", result.stdout), result.stdout  # the banner's count
    assert read_summary(tmp_path)["steps"] == 1
    assert relative_difference(load_model(tmp_path), one_step_on_everything) < 1e-5


# 3, though the window holds 2
@pytest.mark.parametrize(
    "division",
    [
        "(loss / cfg.accum_steps).backward()",
        # 2: 319 counts as 400
        "(loss / (window_end - window_start)).backward()",
    ],
)
def test_dividing_by_accum_steps_or_by_the_micro_batch_count_misses_the_exact_mean(
    tmp_path, division, one_step_on_everything
):
    """Negative control for the test above: the script with either usual
    division instead of its weighting ends more than 5e-4 away from one
    process's step (5e-3 and 1.4e-3 measured; the weighting: 5e-8)."""
    source = (REPO / SCRIPT).read_text()
    assert source.count(LOSS_WEIGHT) == 1
    variant = tmp_path / "train.py"
    # `common` is found through PYTHONPATH
    variant.write_text(source.replace(LOSS_WEIGHT, division))
    torchrun(variant, *SHORT_WINDOW, "--output-dir", str(tmp_path / "out"))
    assert read_summary(tmp_path / "out")["steps"] == 1
    assert relative_difference(load_model(tmp_path / "out"), one_step_on_everything) > 5e-4


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
    result = torchrun("tests/grad_accum_worker.py", timeout=90)
    # no_sync must cover the forward: DDP prepares the backward's all-reduce there.
    assert "forward+backward inside no_sync: 0 all-reduces" in result.stdout
    assert "forward outside, backward inside no_sync: 1 all-reduces" in result.stdout
    # Syncing on the first micro-batch leaves the later ones un-averaged: replicas diverge.
    assert "sync on the last micro-batch: gradients identical on all ranks: True" in result.stdout
    assert "sync on the first micro-batch: gradients identical on all ranks: False" in result.stdout
    # DDP already averages over ranks; dividing again halves the step on 2 ranks.
    assert "extra division by world size: gradient x 0.500" in result.stdout
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


def test_accum_steps_1_is_01s_loop(runs, tmp_path):
    """The README: accum_steps defaults to 1, 01's loop.
    03 with the default ends bitwise where 01 ends."""
    out, _ = runs
    assert read_summary(out["no_accum"])["accum_steps"] == 1
    torchrun(
        BASIC,
        "--max-steps",
        "3",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--output-dir",
        str(tmp_path),
    )
    basic, accum_1 = load_model(tmp_path), load_model(out["no_accum"])
    assert basic.keys() == accum_1.keys() and all(torch.equal(basic[k], accum_1[k]) for k in basic)


# --- what the README quotes and counts, held to the
# script -------------------------------------------

README = REPO / "03_grad_accum" / "README.md"


def test_the_readmes_code_is_the_scripts():
    """Each line of the README's loop excerpt (without its comment) is a line of the script."""
    script = {line.split("  #")[0].strip() for line in (REPO / SCRIPT).read_text().splitlines()}
    (block,) = [b.lines for b in markdown_blocks(README.read_text()) if b.info == "python"]
    code = [line.split("  #")[0].strip() for line in block if line.strip()]
    assert len(code) == 7 and [line for line in code if line not in script] == []
    # "a config subclass with two keys"
    source = (REPO / SCRIPT).read_text()
    accum_config = source.split("class AccumConfig(TrainConfig):", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^    (\w+): ", accum_config, re.M) == ["accum_steps", "use_no_sync"]


def test_the_sample_outputs_counts():
    """90 micro-batches of 8 per rank per epoch (719 samples per rank) make 23 optimizer steps of
    accum 4: 22 full windows and a last one of 2; the sample's step lines follow from that."""
    data = digits()
    loader = DataLoader(
        data.train, batch_size=8, sampler=DistributedSampler(data.train, num_replicas=2, rank=0)
    )
    per_epoch = len(loader)
    steps = math.ceil(per_epoch / 4)
    text = " ".join(README.read_text().split())
    assert (per_epoch, steps) == (90, 23)
    assert (
        f"{per_epoch} micro-batches per epoch make {steps} optimizer steps: {per_epoch // 4} "
        "windows of 4 and a "
        f"last window of {per_epoch % 4}."
    ) in text
    sample = "\n".join(readme_sample(README, "## Output"))
    # the banner's numbers (its words: test_readme_sample_lines_are_what_the_script_prints)
    assert re.search(r"\b8 x 2 x accum 4 = 64, 90 micro-batches\b", sample)
    logged = [(int(e), int(s)) for e, s in re.findall(r"epoch (\d) step (\d+) loss", sample)]
    # the epoch each step falls in
    assert logged and all((s - 1) // steps + 1 == e for e, s in logged)


def test_readme_sample_lines_are_what_the_script_prints(runs):
    """Every line of the README's sample output, numbers masked, is a line the lesson prints
    (its run above: 2 ranks, 3 steps, a progress line per step). A reworded print line fails
    here, and the message says how to regenerate the sample."""
    from tests.readme_samples import drift_message, shape_drift

    out, _ = runs
    stdout = (out["no_accum"].parent / "no_accum.stdout").read_text()
    problems = shape_drift("03", stdout, str(out["no_accum"]))
    assert not problems, drift_message("03", problems)


def test_the_script_uses_lr_as_given():
    """No scaling, no warm-up in the script; the README's LinearLR call is torch's
    signature, and torch wants the scheduler's step() after optimizer.step()
    (it warns otherwise; torch 2.14.1, torch/optim/lr_scheduler.py)."""
    source = (REPO / SCRIPT).read_text()
    assert "lr=cfg.lr," in source and "lr_scheduler" not in source and "param_groups" not in source
    parameters = inspect.signature(torch.optim.lr_scheduler.LinearLR).parameters
    assert {"start_factor", "total_iters"} <= parameters.keys()
    assert "Detected call of `lr_scheduler.step()` before `optimizer.step()`" in inspect.getsource(
        torch.optim.lr_scheduler
    )
    assert "LinearLR(optimizer, start_factor=0.1, total_iters=warmup_steps)" in README.read_text()
    # the README's worked example of the linear scaling rule
    assert 0.1 * 256 / 32 == pytest.approx(0.8)
