"""08_several_models: distillation from a frozen, unwrapped teacher (train.py) and a GAN with two
DDP wraps (gan.py), each a real torchrun of 2 ranks on CPU; what happens without `.detach()` in
the GAN's D step; freezing a wrapped model, in part or whole, in one process (README, rules)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ddp_probe import counting_allreduce_hook, counts
from tests.paths import PYTHON, REPO
from tests.processes import command_argv, run, torchrun, warm_command
from tests.quoted import TEACHER_ERRORS
from tests.results import load_model, read_summary, root_cause

SCRIPT = "08_several_models/train.py"
TEACHER = "torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py --output-dir runs/teacher"
DISTILL = (
    "torchrun --standalone --nproc_per_node=2 08_several_models/train.py "
    "--teacher runs/teacher/model.pt"
)
GAN = "torchrun --standalone --nproc_per_node=2 08_several_models/gan.py"
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


# --- train.py: distillation from a frozen teacher
# -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distillation(tmp_path_factory):
    """The README's two commands as written, two epochs each, output folders moved: a teacher
    trained by 01, a student distilled from it; and the student with --distill-weight 0."""
    out = tmp_path_factory.mktemp("distillation")
    short = ["--epochs", "2"]
    # The teacher (01) and the control start their ranks warm: what they compute is the claim.
    warm_command(TEACHER, *short, "--output-dir", str(out / "teacher"), check=True)
    teacher = ["--teacher", str(out / "teacher" / "model.pt")]
    run(
        command_argv(DISTILL) + teacher + short + ["--output-dir", str(out / "student")],
        timeout=120,
        check=True,
    )
    plain = [*teacher, *short, "--distill-weight", "0", "--output-dir", str(out / "plain")]
    warm_command(DISTILL, *plain, check=True)
    return out


def _checksum_of_file(path) -> str:
    from common.models import build_model
    from common.report import parameter_checksum

    model = build_model("small_cnn", 10, 1, 8)
    model.load_state_dict(torch.load(path, weights_only=True))
    return parameter_checksum(model)


@pytest.mark.min_torch
def test_distillation_keeps_replicas_identical_and_the_teacher_unchanged(distillation):
    summary = read_summary(distillation / "student")
    assert (summary["world_size"], summary["launcher"], summary["steps"]) == (2, "torchrun", 46)
    assert summary["replicas_identical"] and len(summary["replica_checksums"]) == 2
    teacher_file = distillation / "teacher" / "model.pt"
    assert summary["teacher"] == str(teacher_file)
    # The teacher's parameters at the end are the file's; the student's are its own.
    assert summary["teacher_checksum"] == _checksum_of_file(teacher_file)
    assert summary["teacher_checksum"] != summary["replica_checksums"][0]
    assert summary["replica_checksums"][0] == _checksum_of_file(
        distillation / "student" / "model.pt"
    )
    assert summary["eval_accuracy"] > 0.5


def test_distill_weight_0_trains_as_01_and_the_distillation_term_changes_the_result(distillation):
    """With alpha = 0 the student is the teacher's own 01 run, bit for bit (same seed, data and
    flags); the default alpha ends elsewhere: the KL term is what differs."""
    teacher, plain, student = (
        load_model(distillation / name) for name in ("teacher", "plain", "student")
    )
    assert all(torch.equal(plain[k], teacher[k]) for k in teacher)
    assert not any(torch.equal(student[k], teacher[k]) for k in teacher)


def test_a_missing_teacher_is_one_error_line_and_exit_code_2(tmp_path):
    """The README's two error lines: under torchrun one rank says the file is missing and exits
    with 2 (torchrun's Root Cause), no traceback; without --teacher, one process, exit code 2."""
    required, missing = TEACHER_ERRORS
    # relative to a folder without runs/ (the repository may have one)
    result = run(
        [*TORCHRUN, REPO / SCRIPT, "--teacher", "runs/teacher/model.pt", "--output-dir", "out"],
        timeout=60,
        cwd=tmp_path,
    )
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [missing], result.output[-3000:]
    assert re.search(r"exitcode\s+: 2 ", root_cause(result.output)), result.output[-3000:]
    assert not re.search(r"^\[rank\d\]: Traceback", result.output, re.M)
    assert not (tmp_path / "out").exists()
    alone = run([PYTHON, REPO / SCRIPT], timeout=60, cwd=tmp_path)
    assert alone.returncode == 2 and alone.stdout == "", alone.output[-3000:]
    assert alone.stderr.splitlines() == [required]


# --- gan.py: two wraps, two optimizers
# -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    """The README's GAN command as written, 20 steps, output folder moved."""
    out = tmp_path_factory.mktemp("gan")
    result = run(
        command_argv(GAN) + ["--max-steps", "20", "--output-dir", str(out)],
        timeout=120,
        check=True,
    )
    return result, out


def test_gan_keeps_both_models_identical_on_every_rank(gan):
    _, out = gan
    summary = read_summary(out)
    assert (summary["world_size"], summary["steps"]) == (2, 20)
    for name in ("generator", "discriminator"):
        checksums = summary[f"{name}_checksums"]
        assert len(checksums) == 2 and len(set(checksums)) == 1, summary
        assert summary[f"{name}s_identical"]
    assert summary["generator_checksums"] != summary["discriminator_checksums"]
    assert math.isfinite(summary["final_d_loss"]) and math.isfinite(summary["final_g_loss"])


def test_gan_with_retain_graph_instead_of_detach_lets_the_generators_drift_apart(tmp_path, gan):
    """A copy of gan.py whose D step keeps G's graph (retain_graph=True) runs without an error,
    and G's replicas differ after two steps: the G step's gradients were not all-reduced. D's stay
    identical. The fixture's run with .detach() is the control."""
    source = (REPO / "08_several_models" / "gan.py").read_text()
    assert source.count("            d_loss.backward()\n") == 1
    copy = tmp_path / "gan_retain_graph.py"
    copy.write_text(
        source.replace(
            "            d_loss.backward()\n", "            d_loss.backward(retain_graph=True)\n"
        )
    )
    torchrun(copy, "--no-detach", "--max-steps", "2", "--output-dir", str(tmp_path / "out"))
    summary = read_summary(tmp_path / "out")
    assert summary["generators_identical"] is False and summary["discriminators_identical"]
    assert read_summary(gan[1])["generators_identical"]


# --- freezing a wrapped model (one process: DDP's bookkeeping is the same)
# -----------------------------------------------------------------------------------------------


def _step(model, optimizer, x):
    loss = model(x).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def test_wrapping_again_after_freezing_mid_training_trains_on(one_rank_group):
    """README rule 5 and debugging/README.md: a part frozen after a step of training, then wrapped
    again, trains on, and the frozen part stays as it was. (Without the new wrap the forward after
    the next backward fails: the "first layer" control of the test below, and the guide's
    freeze_after_wrap demo in tests/test_torch_text.py.)"""
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optimizer, x)
    model.module[0].requires_grad_(False)
    model = DDP(model.module)
    frozen = model.module[0].weight.detach().clone()
    trained = model.module[2].weight.detach().clone()
    for _ in range(4):
        _step(model, optimizer, x)
    assert torch.equal(model.module[0].weight, frozen)
    assert not torch.equal(model.module[2].weight, trained)
    del model


def test_freezing_all_of_a_wrapped_model_for_a_step_starts_no_all_reduce(one_rank_group):
    """README rule 5: D frozen whole during the G step (requires_grad_(False), then back) gets no
    gradient and its DDP all-reduces nothing, and the next D step runs; D frozen in part instead
    fails at its next forward (the control); D not frozen all-reduces in the G step too."""
    for frozen_part in ("nothing", "all", "first layer"):
        torch.manual_seed(0)
        generator = DDP(nn.Linear(4, 8))
        discriminator = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
        discriminator.register_comm_hook(None, counting_allreduce_hook)  # counts D's buckets
        start = counts["buckets"]
        to_freeze = {
            "nothing": nn.Sequential(),
            "all": discriminator.module,
            "first layer": discriminator.module[0],
        }[frozen_part]
        seen = []
        try:
            for _ in range(3):
                fake = generator(torch.randn(16, 4))
                real = torch.randn(16, 8) + 1
                d_loss = F.softplus(-discriminator(real)).mean()
                d_loss = d_loss + F.softplus(discriminator(fake.detach())).mean()
                d_loss.backward()
                seen.append(counts["buckets"] - start)
                to_freeze.requires_grad_(False)
                g_loss = F.softplus(-discriminator(fake)).mean()
                g_loss.backward()
                seen.append(counts["buckets"] - start)
                to_freeze.requires_grad_(True)
        except RuntimeError as error:
            assert frozen_part == "first layer" and "Expected to have finished reduction" in str(
                error
            )
            assert seen == [1, 1]  # the first D step's all-reduce; none in the G step
            continue
        finally:
            del generator, discriminator
        if frozen_part == "all":
            assert seen == [1, 1, 2, 2, 3, 3]  # one per D step, none in a G step
        else:  # D trainable in the G step: its DDP all-reduces D's gradients there too (README, 2.)
            assert seen == [1, 2, 3, 4, 5, 6]


def test_without_detach_g_is_all_reduced_in_the_d_step_and_not_in_the_g_step(one_rank_group):
    """README, "Without .detach()": after G's one forward, DDP all-reduces G's gradients in the
    first backward that reaches G. With .detach() that is the G step's; without it (and with
    retain_graph=True, so that the G step's backward can run at all) the D step's, and the G step's
    backward through the same forward is not all-reduced."""
    for detach in (True, False):
        torch.manual_seed(0)
        generator = DDP(nn.Linear(4, 8))
        discriminator = DDP(nn.Linear(8, 1))
        generator.register_comm_hook(None, counting_allreduce_hook)  # counts G's buckets
        start = counts["buckets"]
        fake = generator(torch.randn(16, 4))
        d_loss = F.softplus(-discriminator(torch.randn(16, 8))).mean()
        d_loss = d_loss + F.softplus(discriminator(fake.detach() if detach else fake)).mean()
        d_loss.backward(retain_graph=not detach)
        after_d_step = counts["buckets"] - start
        F.softplus(-discriminator(fake)).mean().backward()
        after_g_step = counts["buckets"] - start
        assert (after_d_step, after_g_step) == ((0, 1) if detach else (1, 1)), detach
        assert generator.module.weight.grad is not None
        del generator, discriminator
