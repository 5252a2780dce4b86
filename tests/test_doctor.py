"""debugging/doctor.py on scripts with one planted mistake each (tests/planted_ports.py and
tests/doctor_corpus/, the mistake's line marked `# planted: KIND`), on correct ports, on the
lessons and on the demos.

lint reads code: cheap, no torch. run starts torchrun twice per script (about 10 s each): only
the cases the README shows run by default: no sampler, no set_epoch, a rank-0-only break, the
correct port with and without dropout. The hang and each demo a run can see are in the
launchers tier. Not covered: the demos whose bug this torch or torchrun no longer has
(debugging/two_forwards.py --buffers inplace: torch 2.6-2.11; debugging/local_rank_args.py: the
old torch.distributed.launch), and those of cost rather than correctness (compile_ddp.py's
graphs, loader_memory.py's memory).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.paths import PYTHON, REPO
from tests.planted_ports import CORRECT_PORT, NAMES, write
from tests.processes import clean_env, command_argv, run

DOCTOR = str(REPO / "debugging" / "doctor.py")
FINDING = re.compile(r"^problem: (?P<path>\S+):(?P<line>\d+): .* \[(?P<kind>[a-z0-9-]+)\]$")


def doctor(*args, timeout=240, cwd=None):
    return run([PYTHON, DOCTOR, *map(str, args)], timeout=timeout, env=clean_env(), cwd=cwd or REPO)


def findings(output: str) -> set[tuple[str, int, str]]:
    return {
        (Path(m["path"]).name, int(m["line"]), m["kind"])
        for m in map(FINDING.match, output.splitlines())
        if m
    }


def planted(path: Path) -> set[tuple[str, int, str]]:
    return {
        (path.name, number, kind)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for kind in re.findall(r"# planted: ([a-z0-9-]+)", line)
    }


def line_of(path: Path, text: str) -> int:
    lines = path.read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


# --- lint ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_lint_finds_each_planted_mistake_at_its_line_and_nothing_else(name, tmp_path):
    script = write(name, tmp_path)
    result = doctor("lint", script)
    expected = planted(script)
    assert findings(result.stdout) == expected, result.output
    last = result.stdout.strip().splitlines()[-1]
    if expected:
        assert result.returncode == 1 and last == f"lint: {len(expected)} problems found".replace(
            "1 problems", "1 problem"
        )
    else:
        assert result.returncode == 0 and last.startswith("lint: the port looks right")


LESSON_FOLDERS = sorted(REPO.glob("0[0-9]_*")) + [REPO / "benchmark", REPO / "porting"]
# Not ports: the one-process baseline, and the lesson that shows the no-sampler mistake.
NOT_PORTS = {"train_single.py", "no_sampler_pitfall.py", "train_plain.py"}


@pytest.mark.parametrize("folder", LESSON_FOLDERS, ids=lambda p: p.name)
def test_lint_finds_nothing_in_the_lessons(folder):
    scripts = [p for p in sorted(folder.glob("*.py")) if p.name not in NOT_PORTS]
    assert scripts
    result = doctor("lint", *scripts)
    assert result.returncode == 0, result.output


def test_lint_names_the_mistakes_the_lessons_show_on_purpose():
    single = REPO / "01_basic_ddp" / "train_single.py"
    result = doctor("lint", single)
    assert result.returncode == 1
    assert {kind for _, _, kind in findings(result.stdout)} == {
        "no-process-group",
        "unsharded-sampler",
        "every-rank-writes",
    }
    pitfall = REPO / "02_sampler_patterns" / "no_sampler_pitfall.py"
    result = doctor("lint", pitfall)
    assert findings(result.stdout) == {
        ("no_sampler_pitfall.py", line_of(pitfall, "plain_loader = DataLoader"), "no-sampler")
    }


def test_lint_flags_the_demos_collectives_on_one_rank():
    demo = REPO / "debugging" / "demo_bugs.py"
    result = doctor("lint", demo)
    assert result.returncode == 1
    assert findings(result.stdout) == {
        ("demo_bugs.py", line_of(demo, "dist.all_reduce(loss_sum)"), "collective-in-rank-branch"),
        (
            "demo_bugs.py",
            line_of(demo, "BUG: a collective inside") + 1,
            "collective-in-rank-branch",
        ),
    }


def test_lint_flags_the_ema_demos_copy_of_the_wrapper_evaluated_on_rank_0():
    demo = REPO / "debugging" / "ema_ddp.py"
    result = doctor("lint", demo)
    assert findings(result.stdout) == {
        (
            "ema_ddp.py",
            line_of(demo, "eval_loss = F.cross_entropy(ema(x)"),
            "ddp-forward-in-rank-branch",
        )
    }


def test_lint_refuses_what_is_not_python(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n")
    result = doctor("lint", broken, tmp_path / "missing.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {broken}:1: not Python: invalid syntax"
    ] or result.stderr.startswith("error: "), result.output
    assert len(result.stderr.strip().splitlines()) == 1


# --- run ----------------------------------------------------------------------------------------

PORT = CORRECT_PORT
SHORT = ("--steps", "8", "--deadline", "60")  # 6 steps an epoch: 8 reach the second


def test_run_passes_a_correct_port_and_explains_its_dropout_losses(tmp_path):
    with_dropout = doctor(
        "run", *SHORT, "--", PORT, "--batch-size", "8", "--dropout", "0.5", cwd=tmp_path
    )
    assert with_dropout.returncode == 0, with_dropout.output
    out = with_dropout.stdout
    assert "ok: the replicas are identical after each of 8 steps" in out
    assert "ok: the ranks drew disjoint samples" in out
    assert "ok: each epoch draws a new order" in out
    assert re.search(r"note: the ranks' mean loss differs .* by up to [\d.]+%.*dropout", out), out
    assert out.strip().splitlines()[-1] == "run: the port looks right"
    # the control: without dropout the same port's losses agree to rounding
    plain = doctor("run", *SHORT, "--", PORT, "--batch-size", "8", cwd=tmp_path)
    assert plain.returncode == 0, plain.output
    match = re.search(r"ok: the ranks' mean loss follows .* difference ([\d.e+-]+)", plain.stdout)
    assert match and float(match[1]) < 1e-5, plain.output
    assert "dropout" not in plain.stdout


def test_run_finds_ranks_reading_the_same_samples(tmp_path):
    result = doctor(
        "run", *SHORT, "--", write("no_sampler", tmp_path), "--batch-size", "8", cwd=tmp_path
    )
    assert result.returncode == 1, result.output
    assert re.search(r"problem: in epoch 1 \d+ samples went to more than one rank", result.stdout)
    assert result.stdout.strip().splitlines()[-1] == "run: 1 problem found"


def test_run_finds_an_epoch_that_repeats_the_first(tmp_path):
    result = doctor(
        "run", *SHORT, "--", write("no_set_epoch", tmp_path), "--batch-size", "8", cwd=tmp_path
    )
    assert result.returncode == 1, result.output
    assert "problem: epoch 2 draws the same order as epoch 1" in result.stdout
    assert "ok: the ranks drew disjoint samples" in result.stdout


def test_run_names_the_rank_0_break_within_the_deadline(tmp_path):
    script = write("rank0_break", tmp_path)
    started = time.monotonic()
    result = doctor(
        "run",
        "--steps",
        "8",
        "--deadline",
        "60",
        "--",
        script,
        "--batch-size",
        "8",
        "--dry-run",
        cwd=tmp_path,
    )
    assert time.monotonic() - started < 90
    assert result.returncode == 1, result.output
    out = result.stdout
    assert re.search(
        r"problem: the ranks stopped agreeing on collectives after step \d+, .*rank 0 called "
        r"none: it ran to its end; rank 1 called backward\(\)",
        out,
    ), out
    (line,) = [n for _, n, _ in planted(script)]
    assert ("rank0_break.py", line, "rank-control-flow") in findings(out)


@pytest.mark.launchers  # a hang under torchrun, stopped at the deadline
def test_run_reports_a_hang_with_each_ranks_place(tmp_path):
    demo = REPO / "debugging" / "demo_bugs.py"
    started = time.monotonic()
    result = doctor(
        "run",
        "--steps",
        "6",
        "--deadline",
        "40",  # on a loaded CI machine, 15 s once ended with the ranks still in DDP(...)
        "--batch-flag",
        "none",
        "--",
        demo,
        "--bug",
        "rank0_barrier",
        "--timeout-s",
        "300",
        cwd=tmp_path,
    )
    assert time.monotonic() - started < 120  # the demo's own timeout is 300 s
    assert result.returncode == 1, result.output
    out = result.stdout
    assert "problem: the ranks did not finish 6 steps within 40 s (a hang)" in out
    barrier = line_of(demo, "BUG: a collective inside") + 1
    assert (
        f"rank 0 is at {demo.relative_to(REPO)}:{barrier} (waiting in barrier)"
        in out.replace(str(demo), str(demo.relative_to(REPO)))
        or f"demo_bugs.py:{barrier} (waiting in barrier)" in out
    ), out
    assert re.search(r"rank 1 is at \S*demo_bugs\.py:\d+ \(waiting in backward\)", out), out


@pytest.mark.launchers  # failures under torchrun
@pytest.mark.parametrize(
    "bug, message",
    [
        ("unused_parameter", "RuntimeError: Expected to have finished reduction"),
        ("freeze_after_wrap", "RuntimeError: Expected to have finished reduction"),
        ("wrapper_attribute", "AttributeError: 'DistributedDataParallel' object has no attribute"),
        ("module_prefix", "RuntimeError: Error(s) in loading state_dict"),
        ("wrap_frozen", "RuntimeError: DistributedDataParallel is not needed"),
        ("different_models", "RuntimeError: DDP expects same model across all ranks"),
    ],
)
def test_run_names_each_demo_bug_a_run_shows(tmp_path, bug, message):
    result = doctor(
        "run",
        "--steps",
        "6",
        "--deadline",
        "60",
        "--batch-flag",
        "none",
        "--",
        REPO / "debugging" / "demo_bugs.py",
        "--bug",
        bug,
        "--timeout-s",
        "30",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.output
    assert re.search(
        rf"rank \d failed at \S*demo_bugs\.py:\d+: {re.escape(message)}", result.stdout
    )


def test_run_refuses_bad_usage_and_a_script_that_does_not_start(tmp_path):
    no_batch = doctor("run", "--", PORT, cwd=tmp_path)
    assert no_batch.returncode == 2
    assert no_batch.stderr.strip().splitlines() == [
        "error: --batch-size is not among the script's arguments: give the batch per rank "
        "(--batch-size B), or name the script's batch option with --batch-flag"
    ]
    refused = doctor(
        "run", *SHORT, "--", PORT, "--batch-size", "8", "--no-such-option", cwd=tmp_path
    )
    assert refused.returncode == 2, refused.output
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: the script does not start (its output is above)"
    )
    assert "unrecognized arguments: --no-such-option" in refused.stdout
    missing = doctor("run", "--", tmp_path / "none.py", "--batch-size", "8", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")


# --- the worked port (porting/README.md) --------------------------------------------------------

PORT_RUN = (
    "python debugging/doctor.py run -- porting/train_ddp.py --data-dir data/digits --batch-size 64"
)


def test_lint_before_and_after_the_worked_port(sample_run):
    """The README's two lint commands: the plain script's four traps, the port clean (the lines
    themselves: tests/test_readme_text.py)."""
    before = sample_run("porting-lint-plain")
    assert before.returncodes == (1,)
    assert {kind for _, _, kind in findings(before.stdout)} == {
        "no-process-group",
        "worker-pickles-local-function",
        "no-sampler",
        "every-rank-writes",
    }
    after = sample_run("porting-lint-port")
    assert after.returncodes == (0,) and not findings(after.stdout)


def test_run_passes_the_worked_port(tmp_path):
    """The README's run of the port: identical replicas, disjoint samples, a new order in the
    second epoch, and the loss difference put down to dropout; the port looks right."""
    for folder in ("debugging", "porting"):
        (tmp_path / folder).symlink_to(REPO / folder)
    made = run(
        [PYTHON, REPO / "porting" / "make_digits_folder.py", "data/digits"], 120, cwd=tmp_path
    )
    assert made.returncode == 0, made.output
    result = run(command_argv(PORT_RUN), 240, env=clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.output
    out = result.stdout
    assert "ok: the replicas are identical after each of 20 steps" in out
    assert "ok: the ranks drew disjoint samples" in out
    assert "ok: each epoch draws a new order" in out
    assert re.search(r"note: the ranks' mean loss differs .* by up to \d+(\.\d+)?%.*dropout", out)
    assert out.strip().splitlines()[-1] == "run: the port looks right"


# --- the guide's commands (debugging/README.md) -------------------------------------------------

GUIDE_LINT = "python debugging/doctor.py lint my_train.py my_utils.py"
GUIDE_RUN = "python debugging/doctor.py run --nproc 2 --steps 20 -- my_train.py --batch-size 32"
UTILS = """import torch
import torch.distributed as dist


def save(model, path):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
"""


def test_the_guides_doctor_commands(tmp_path):
    """The guide's two commands on a correct script and a module of its own: both clean (the
    script ends after 6 steps, before the 20 asked for)."""
    (tmp_path / "debugging").symlink_to(REPO / "debugging")
    (tmp_path / "my_train.py").write_text(PORT.read_text())
    (tmp_path / "my_utils.py").write_text(UTILS)
    linted = run(command_argv(GUIDE_LINT), 60, env=clean_env(), cwd=tmp_path)
    assert linted.returncode == 0, linted.output
    assert linted.stdout.strip() == "lint: the port looks right (2 files read)"
    ran = run(command_argv(GUIDE_RUN), 240, env=clean_env(), cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    assert "ok: the replicas are identical after each of 6 steps" in ran.stdout
    assert ran.stdout.strip().splitlines()[-1] == "run: the port looks right"
