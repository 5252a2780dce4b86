"""09_fsdp2: FSDP2 trains as 01's DDP does, saves a plain model.pt, resumes on another world size,
and each rank holds a world size's share of the parameters, gradients and optimizer state."""

import re
import shutil

import pytest
import torch

from common.models import SmallCNN
from tests.paths import REPO
from tests.processes import command_argv, run, warm_command, warm_ranks, short_run
from tests.results import assert_same_params, load_model, read_summary, relative_difference
from tests.torch_versions import PINNED_TORCH, RUNNING_TORCH

SCRIPT = "09_fsdp2/train.py"
# 09's README, "Run it": continue the run on 3 ranks
RESUME = "torchrun --standalone --nproc_per_node=3 09_fsdp2/train.py --epochs 14 --resume"
# 09's README, "Stay on DDP, or switch": the measurement at 1, 2 and 4 ranks
MEMORY_1 = "torchrun --standalone --nproc_per_node=1 09_fsdp2/memory.py"
MEMORY_2 = "torchrun --standalone --nproc_per_node=2 09_fsdp2/memory.py"
MEMORY_4 = "torchrun --standalone --nproc_per_node=4 09_fsdp2/memory.py"
# 8 steps of 3 ranks x 16, a loss line each: 01's comparison run (tests/test_basic_ddp.py)
SHORT = short_run(max_steps=8, epochs=None, lr=0.05, log_every=1)


def step_losses(output: str) -> list[str]:
    return re.findall(r"step \d+ loss (\d+\.\d+)", output)


@pytest.fixture(scope="module")
def quick_start(sample_run):
    """The README's command as written, under the real torchrun (tests/sample_runs.py)."""
    ran = sample_run("09").ok()
    return ran, ran.output_dir


@pytest.mark.min_torch
def test_quick_start_trains_and_saves_a_model_a_plain_module_loads(quick_start):
    _, out = quick_start
    summary = read_summary(out)
    assert summary["eval_accuracy"] >= 0.95 and summary["eval_samples"] == 359
    assert (summary["world_size"], summary["launcher"], summary["epochs"]) == (2, "torchrun", 12)
    # model.pt: the whole model under the plain module's keys, loaded with weights_only=True
    model = SmallCNN(1, 10)
    model.load_state_dict(load_model(out))
    # the sharded checkpoint: a file a rank, and progress.json, written last, says where it ended
    folder = out / "checkpoints" / "epoch-0012"
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    progress = (folder / "progress.json").read_text()
    assert '"epochs": 12' in progress and f'"steps": {summary["steps"]}' in progress


@pytest.mark.min_torch
def test_on_2_ranks_fsdp2_ends_where_ddp_does(quick_start, sample_run):
    """01's and 09's quick starts, 276 steps each: a sum of two gradients and a division by 2 round
    alike in either order, so the weights are bitwise equal."""
    ddp = load_model(sample_run("01").ok().output_dir)
    fsdp = load_model(quick_start[1])
    assert ddp.keys() == fsdp.keys() and all(torch.equal(ddp[k], fsdp[k]) for k in ddp)


# how far one step of 2 ranks moves the weights when gloo is left to average: twice as far as DDP
# where gloo's reduce-scatter sums instead (torch 2.8.0), as far where it averages
LEFT_TO_GLOO = {"2.8.0": 2.0, PINNED_TORCH: 1.0}


@pytest.mark.min_torch
def test_on_gloo_the_gradients_are_summed_then_divided(tmp_path):
    """09's README, "Equal to DDP": 09 tells FSDP2 to sum on gloo and divide after. The control, a
    copy of 09 that leaves the average to gloo, steps twice as far as 01 on torch 2.8.0 and as far
    on the pinned torch (pytorch/pytorch#162338)."""
    copy = tmp_path / "09_fsdp2" / "train.py"
    copy.parent.mkdir()
    text = (REPO / SCRIPT).read_text()
    assert text.count('        if backend == "gloo":\n') == 1
    copy.write_text(text.replace('        if backend == "gloo":\n', "        if False:\n"))
    torch.manual_seed(0)  # 01's and 09's initial weights
    initial = SmallCNN(1, 10).state_dict()
    moved = {}
    for name, script in (("ddp", "01_basic_ddp/train.py"), ("fsdp", SCRIPT), ("gloo", copy)):
        warm_ranks(script, "--max-steps", "1", "--output-dir", tmp_path / name)
        weights = load_model(tmp_path / name)
        moved[name] = torch.cat([(weights[k] - initial[k]).flatten() for k in initial])
    assert torch.equal(moved["fsdp"], moved["ddp"])
    if RUNNING_TORCH in LEFT_TO_GLOO:
        ratio = (moved["gloo"].norm() / moved["ddp"].norm()).item()
        assert ratio == pytest.approx(LEFT_TO_GLOO[RUNNING_TORCH], rel=1e-3), RUNNING_TORCH


def test_on_3_ranks_fsdp2_follows_ddp_within_rounding(tmp_path):
    """8 steps on 3 ranks: the same loss at every step and weights within assert_same_params's
    relative 1e-5, though not bitwise (09's README, "Equal to DDP"). The control: bf16 compute, a
    real change of the numbers, is caught by the same comparison."""
    runs = {}
    for name, script, extra in (
        ("ddp", "01_basic_ddp/train.py", ()),
        ("fsdp", SCRIPT, ()),
        ("bf16", SCRIPT, ("--precision", "bf16")),
    ):
        out = tmp_path / name
        result = warm_ranks(script, *SHORT, *extra, "--output-dir", out, nproc=3)
        runs[name] = (step_losses(result.stdout), load_model(out))
    (ddp_losses, ddp), (fsdp_losses, fsdp), (bf16_losses, bf16) = runs.values()
    assert len(ddp_losses) == 8 and fsdp_losses == ddp_losses
    assert_same_params(fsdp, ddp)
    assert not all(torch.equal(fsdp[k], ddp[k]) for k in ddp)
    assert relative_difference(bf16, ddp) > 1e-3 and bf16_losses != ddp_losses


@pytest.mark.min_torch
def test_a_resume_on_another_world_size_goes_on_where_the_run_stopped(tmp_path):
    """1 epoch on 2 ranks x 24, resumed by the README's command on 3 ranks x 16 (the same global
    batch) for 10 steps of epoch 2, equals 2 ranks that never stopped: the model, the momentum
    and the step count came back, resharded. The control: the same 40 steps on 3 ranks from the
    start (a different last batch of epoch 1) end elsewhere."""
    resumed, never_stopped, fresh = tmp_path / "resumed", tmp_path / "never", tmp_path / "fresh"
    warm_ranks(SCRIPT, "--epochs", "1", "--local-batch-size", "24", "--output-dir", resumed)
    shutil.copytree(resumed, tmp_path / "after_epoch_1")
    result = warm_command(
        RESUME, "--local-batch-size", "16", "--max-steps", "40", "--output-dir", resumed
    )
    assert result.returncode == 0, result.output
    assert "world size 3, batch 16 x 3 = 48, fp32, from epoch 2" in result.stdout
    assert read_summary(resumed)["steps"] == 40
    flags = ("--epochs", "2", "--max-steps", "40")
    warm_ranks(SCRIPT, *flags, "--local-batch-size", "24", "--output-dir", never_stopped)
    warm_ranks(SCRIPT, *flags, "--local-batch-size", "16", "--output-dir", fresh, nproc=3)
    assert_same_params(load_model(resumed), load_model(never_stopped))
    assert relative_difference(load_model(fresh), load_model(never_stopped)) > 1e-3
    # The checkpoint it resumed from is still there, beside the new one.
    assert (resumed / "checkpoints" / "epoch-0001" / "progress.json").exists()
    assert (resumed / "checkpoints" / "epoch-0002" / "progress.json").exists()


def test_every_rank_runs_as_many_test_forwards(tmp_path):
    """09's README, "What changes": each forward all-gathers, so every rank runs as many. At 3 ranks
    x 119, rank 0's test slice (120 images) is 2 batches and rank 2's (119) is 1: 09 evaluates all
    359 images. The control, a copy that runs only its own batches, leaves rank 0 in a forward that
    no other rank joins, until the timeout."""
    flags = ("--max-steps", "1", "--local-batch-size", "119", "--timeout-s", "5")
    warm_ranks(SCRIPT, *flags, "--output-dir", tmp_path / "09", nproc=3)
    assert read_summary(tmp_path / "09")["eval_samples"] == 359
    copy = tmp_path / "09_fsdp2" / "train.py"
    copy.parent.mkdir()
    own_batches = (
        "    for _ in range(batches):\n        images, labels = next(test_batches, empty_batch)\n"
    )
    text = (REPO / SCRIPT).read_text()
    assert text.count(own_batches) == 1
    copy.write_text(text.replace(own_batches, "    for images, labels in test_batches:\n"))
    result = warm_ranks(copy, *flags, "--output-dir", tmp_path / "copy", nproc=3, check=False)
    assert result.returncode != 0 and "Timed out waiting 5000ms" in result.output
    assert not (tmp_path / "copy" / "summary.json").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--resume",), "error: --resume: no checkpoint in "),
        (("--resume", "--epochs", "1"), "is at epoch 1, step 23; pass a larger --epochs"),
    ],
    ids=["no_checkpoint", "already_done"],
)
def test_a_resume_that_cannot_go_on_is_one_line_and_exit_2(tmp_path, flags, message):
    """Before any process group: one process, no rank variables (a group would need them)."""
    out = tmp_path / "run"
    if "--epochs" in flags:
        warm_ranks(SCRIPT, "--epochs", "1", "--output-dir", out)
    result = warm_ranks(SCRIPT, *flags, "--output-dir", out, nproc=0, check=False)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("error:") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_each_rank_holds_a_world_sizes_share_under_fsdp2():
    """The README's three commands (1 rank under the real torchrun, 2 and 4 started warm): under
    DDP every rank holds the whole 170.5 MiB at every world size; under FSDP2 the rank holding most
    holds 1/N of it (plus the padding of shards that do not divide evenly), in each of its
    parts; Adam's state is twice the parameters."""
    outputs = [run(command_argv(MEMORY_1), 120, check=True).stdout]
    outputs += [warm_command(c, timeout=180, check=True).stdout for c in (MEMORY_2, MEMORY_4)]
    rows = {}
    for line in "\n".join(outputs).splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0].isdigit():
            world, wrap, *mib, _share = cells
            rows[int(world), wrap] = [float(v) for v in mib]
    assert set(rows) == {(n, w) for n in (1, 2, 4) for w in ("DDP", "FSDP2")}
    ddp = rows[1, "DDP"]
    assert ddp[3] == pytest.approx(170.5, abs=0.1) and ddp[2] == pytest.approx(2 * ddp[0], abs=0.1)
    for n in (1, 2, 4):
        assert rows[n, "DDP"] == ddp
        for part, whole in zip(rows[n, "FSDP2"], ddp):
            # printed to 0.1 MiB
            assert whole / n - 0.1 <= part <= whole / n * 1.01 + 0.1, (n, rows[n, "FSDP2"])


def test_the_doctor_reads_a_sharded_port(tmp_path):
    """debugging/doctor.py run on 09: no replicas to compare, the shards summed, no problem."""
    command = (
        "python debugging/doctor.py run --steps 8 --batch-flag=--local-batch-size -- "
        "09_fsdp2/train.py --local-batch-size 16"
    )
    result = run(command_argv(command) + ["--output-dir", str(tmp_path)], 300)
    assert result.returncode == 0, result.output
    assert "ok: a sharded model (FSDP2): each rank holds its own shard" in result.stdout
    assert "ok: the ranks' mean loss follows one process's" in result.stdout
    assert result.stdout.strip().endswith("run: the port looks right"), result.stdout
