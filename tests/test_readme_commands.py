"""Every command in a README's ```bash blocks is classified here by its exact text, and every one
that runs on a CPU offline is run as written: through `bash -c`, from the root of a fresh copy
of the tracked tree (so runs/ and data/ land there), training runs shortened with the suffixes
below (the top-level README names them). The others say next to them why they are not run here:
a GPU, a download, a scheduler, or the test suite itself (whose commands are only collected).

A new command in a README fails test_every_readme_command_is_classified
until it is added to COMMANDS; an entry no README has any more fails it too.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import (
    LESSON_DIRS,
    PYTHON,
    REPO,
    clean_env,
    kill_group,
    read_summary,
    readme_commands,
    run,
    skip_below_torch,
    tracked_files,
)
from tests.launcher_tools import need_root, need_tools, unavailable

# --- the table
# ---------------------------------------------------------------------------------------

SHORT = "--epochs 1 --max-steps 2"  # training commands
# 06_multinode/comm_check.py (256 MiB messages by default)
COMM_SHORT = "--max-bytes 65536 --iters 3"
# one knob; tests/test_perf.py
SWEEP_SHORT = "--warmup 1 --steps 2 --sweep-knobs bf16_compress --output-dir"
# what the tests of 02 and of debugging add to the README command they run
OUTPUT_DIR = "--output-dir"
SAMPLER_TESTS = "tests/test_sampler_patterns.py"
FORUM_TESTS = "tests/test_forum_errors.py"

# Open MPI refuses to start as root without these; 06_multinode/README.md names them.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclass(frozen=True)
class Run:
    """Run the command as written (+ suffix, inserted before `insert_before` if that is in it)."""

    suffix: str = ""
    expect: tuple[str, ...] = ()  # regular expressions the output must contain
    files: tuple[str, ...] = ()  # files (relative to the tree) the command must leave
    exit_code: int = 0
    group: str = ""  # commands of one group run in table order in one tree copy
    env: dict = field(default_factory=dict)
    tools: tuple[str, ...] = ()  # skip without them (fail under REQUIRE_REAL_LAUNCHERS=1)
    root: bool = False
    two_nodes: bool = False  # run two copies at once (06's two "nodes" on one machine)
    insert_before: str = ""
    # fields runs/latest/summary.json must hold after the command (a str value is a regex)
    summary: dict = field(default_factory=dict)
    # (the oldest torch that gives what `expect` asks for, why): skipped on an older one
    needs_torch: tuple[str, str] = ()


@dataclass(frozen=True)
class NotRun:
    reason: str  # gpu, download, scheduler, test-suite


@dataclass(frozen=True)
class RunElsewhere:
    test: str  # tests/test_x.py::name, which runs the command it reads from the README
    suffix: str = ""  # the flags it adds, each a string constant in that test


# The words a README must show next to a command that
# is not run (comment or paragraph before the block).
REASON_WORDS = {
    "gpu": r"\bGPU",
    "download": r"download|pip install",
    "scheduler": r"cluster|Slurm|PBS|allocation",
    "test-suite": r"\btests?\b",
}

COMMANDS: dict[str, Run | NotRun | RunElsewhere] = {
    # README.md
    "pip install -r requirements.txt && torchrun --standalone --nproc_per_node=2 "
    "01_basic_ddp/train.py": NotRun("download"),
    "pip install -r requirements.txt -r requirements-test.txt && python -m pytest": NotRun(
        "test-suite"
    ),
    "pip install -r requirements-site.txt -r requirements-test.txt && "
    "python -m pytest -m min_torch": NotRun("test-suite"),
    "ruff format --check . && ruff check .": Run(expect=(r"files? already formatted",)),
    "module load conda && conda activate": NotRun("scheduler"),
    "pip install -r requirements-site.txt": NotRun("download"),
    "python -m common.prepare --dataset cifar10 --data-dir data": NotRun("download"),
    "torchrun --standalone --nproc_per_node=2 benchmark/train.py --precision bf16 "
    "--comm-hook bf16_compress": Run(SHORT, summary={"world_size": 2}),
    # 01_basic_ddp
    "diff 01_basic_ddp/train_single.py 01_basic_ddp/train.py": Run(
        exit_code=1, expect=(r"> .*init_process_group", r"> .*DistributedSampler", r"> .*DDP\(")
    ),
    "torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py": RunElsewhere(
        "tests/test_basic_ddp.py::quick_start", "--output-dir"
    ),
    "python 01_basic_ddp/train.py": Run(
        SHORT, summary={"launcher": "single", "world_size": 1}, files=("runs/latest/model.pt",)
    ),
    "python 01_basic_ddp/train_single.py": RunElsewhere(
        "tests/test_basic_ddp.py::"
        "test_single_process_baseline_is_the_same_training_as_one_ddp_process",
        "--max-steps 30 --output-dir",
    ),
    "python 01_basic_ddp/train_spawn.py --nprocs 2": RunElsewhere(
        "tests/test_basic_ddp.py::test_mp_spawn_variant_matches_torchrun",
        "--batch-size 16 --output-dir",
    ),
    "mpiexec -n 2 python 01_basic_ddp/train.py": Run(
        SHORT,
        summary={"launcher": "openmpi|mpich|intel-mpi", "world_size": 2},
        env=OPEN_MPI_AS_ROOT,
        tools=("mpiexec",),
    ),
    "srun --ntasks=2 python 01_basic_ddp/train.py": NotRun("scheduler"),
    "torchrun --standalone --nproc_per_node=4 01_basic_ddp/train.py --config "
    "01_basic_ddp/cifar10.yaml": NotRun("download"),
    # 02_sampler_patterns
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/partition_viewer.py "
    "--num-samples 10": RunElsewhere(
        f"{SAMPLER_TESTS}::viewer", OUTPUT_DIR
    ),  # the module's fixture
    "python 02_sampler_patterns/partition_viewer.py --num-samples 10 --simulate-world-size 8": Run(
        expect=(r"N = 10 samples, W = 8 ranks",)
    ),
    "torchrun --standalone --nproc_per_node=2 "
    "02_sampler_patterns/no_sampler_pitfall.py": RunElsewhere(
        f"{SAMPLER_TESTS}::test_plain_dataloader_duplicates_and_distributed_sampler_does_not",
        OUTPUT_DIR,
    ),
    "torchrun --standalone --nproc_per_node=3 "
    "02_sampler_patterns/distributed_eval.py": RunElsewhere(
        f"{SAMPLER_TESTS}::test_distributed_eval_equals_one_process", OUTPUT_DIR
    ),
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/gather_predictions.py": (
        RunElsewhere(
            f"{SAMPLER_TESTS}::test_gathered_predictions_equal_one_process_row_for_row",
            f"--weights {OUTPUT_DIR}",
        )
    ),
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/gather_predictions.py "
    "--padded": RunElsewhere(
        f"{SAMPLER_TESTS}::test_gathering_over_a_padded_distributed_sampler_repeats_samples",
        f"--weights {OUTPUT_DIR}",
    ),
    "torchrun --standalone --nproc_per_node=2 "
    "02_sampler_patterns/weighted_sampler.py": RunElsewhere(
        f"{SAMPLER_TESTS}::test_weighted_sampler_is_disjoint_and_balanced", OUTPUT_DIR
    ),
    "python 02_sampler_patterns/prepare_shards.py --num-shards 12 --out-dir "
    "data/digits_shards": Run(files=("data/digits_shards/manifest.json",), group="02-shards"),
    "torchrun --standalone --nproc_per_node=2 02_sampler_patterns/sharded_loading.py "
    "--shards-dir data/digits_shards": Run(
        SHORT, group="02-shards", files=("runs/sharded_loading/summary.json",)
    ),
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/uneven_inputs.py "
    "--fix join": RunElsewhere(
        f"{SAMPLER_TESTS}::test_join_finishes_uneven_inputs_with_identical_gradients", OUTPUT_DIR
    ),
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/uneven_inputs.py --fix "
    "drop_last": RunElsewhere(
        f"{SAMPLER_TESTS}::test_drop_last_runs_the_smallest_rank_count", OUTPUT_DIR
    ),
    "torchrun --standalone --nproc_per_node=2 02_sampler_patterns/uneven_inputs.py --fix "
    "none --timeout-s 5": RunElsewhere(
        f"{SAMPLER_TESTS}::"
        "test_without_a_fix_uneven_inputs_time_out_naming_the_rank_that_never_arrived",
        OUTPUT_DIR,
    ),
    "python -m pytest tests/test_sampler_patterns.py -q": NotRun("test-suite"),
    "python -m pytest -m torch_text": NotRun("test-suite"),
    'python -m pytest -m "scheduler or torch_text"': NotRun("test-suite"),
    # 05_checkpointing: stopped and started again it resumes (there: stopped by --max-steps 57,
    # with the flags of its README sample, then run again)
    "torchrun --standalone --nproc_per_node=2 05_checkpointing/train.py --save-every-steps 20": (
        RunElsewhere("tests/test_checkpointing.py::stopped_and_resumed")
    ),
    "python 05_checkpointing/export_model.py runs/latest/checkpoints model.pt": RunElsewhere(
        "tests/test_checkpointing.py::test_exported_state_dict_loads_into_a_plain_model"
    ),
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 "
    "--max-restarts=2 "
    "05_checkpointing/train.py": Run(SHORT, files=("runs/latest/checkpoints",)),
    "sbatch jobs/slurm_srun.sbatch": NotRun("scheduler"),
    "qsub jobs/pbs_mpiexec.pbs": NotRun("scheduler"),
    "SITE=perlmutter sbatch jobs/slurm_srun.sbatch": NotRun("scheduler"),  # jobs/sites
    "qsub -v SITE=derecho jobs/pbs_mpiexec.pbs": NotRun("scheduler"),
    "torchrun --standalone --nproc_per_node=2 05_checkpointing/dcp_example.py "
    "--mode save": RunElsewhere(
        "tests/test_checkpointing.py::test_dcp_save_on_two_ranks_loads_on_one", "--output-dir"
    ),
    "torchrun --standalone --nproc_per_node=1 05_checkpointing/dcp_example.py "
    "--mode load": RunElsewhere(
        "tests/test_checkpointing.py::test_dcp_save_on_two_ranks_loads_on_one", "--output-dir"
    ),
    "python -m torch.distributed.checkpoint.format_utils dcp_to_torch runs/dcp/checkpoint "
    "model.pt": RunElsewhere(
        "tests/test_checkpointing.py::test_dcp_save_on_two_ranks_loads_on_one"
    ),
    # 06_multinode
    "torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d "
    "--rdzv_endpoint=127.0.0.1:29400 --rdzv_id=demo "
    "06_multinode/train.py --max-steps 20 --epochs 1": Run(
        two_nodes=True, summary={"world_size": 2}
    ),
    "mpiexec -n 2 python 06_multinode/train.py": Run(
        SHORT,
        summary={"launcher": "openmpi|mpich|intel-mpi", "world_size": 2},
        env=OPEN_MPI_AS_ROOT,
        tools=("mpiexec",),
    ),
    "torchrun --standalone --nproc_per_node=2 06_multinode/comm_check.py": RunElsewhere(
        "tests/test_multinode.py::test_comm_check_prints_busbw_per_size",
        f"{COMM_SHORT} --output-dir",
    ),
    "srun --ntasks-per-node=4 python 06_multinode/comm_check.py --pairs": NotRun("scheduler"),
    # benchmark
    "torchrun --standalone --nproc_per_node=2 benchmark/train.py --no-ddp --profile-steps 20": Run(
        SHORT, files=("runs/latest/summary.json",)
    ),
    "torchrun --standalone --nproc_per_node=2 benchmark/train.py --model resnet18 --dataset "
    "fake --image-size 32 "
    "--activation-checkpointing non_reentrant": Run(SHORT, files=("runs/latest/summary.json",)),
    # the sweep command's test runs the table's 4 runs too (it is this command plus --sweep)
    "python benchmark/benchmark.py --world-sizes 1,2": RunElsewhere(
        "tests/test_perf.py::test_benchmark_table_and_sweep", SWEEP_SHORT
    ),
    "python benchmark/benchmark.py --world-sizes 1,2,4,8 --model resnet18 --dataset cifar10 "
    "--batch-size 128": NotRun("download"),
    "python benchmark/benchmark.py --world-sizes 1,2 --sweep -- --precision bf16": RunElsewhere(
        "tests/test_perf.py::test_benchmark_table_and_sweep", SWEEP_SHORT
    ),
    "python 03_grad_accum/lr_scaling.py": RunElsewhere(
        "tests/test_grad_accum.py::test_linear_scaling_wins_back_half_of_what_four_ranks_lose_in_a_"
        "short_run",
        "--world-sizes 1,4",
    ),
    "mkdir -p external && curl -fsSL -o external/imagenet_main.py https://raw.githubusercontent"
    ".com/pytorch/examples/77f55b912142e11fcfdf5b530231fb9c52f181e8/imagenet/main.py": NotRun(
        "download"
    ),
    # a CPU dry run with a stand-in main.py: tests/test_perf.py::test_gpu_check_*
    "python benchmark/gpu_check.py --imagenet-main external/imagenet_main.py": NotRun("gpu"),
    # debugging: the injected failures fail on purpose
    "PYTHONPATH=.:tests/inject DDP_TEST_FAIL_AT_STEP=3 DDP_TEST_FAIL_RANK=1 torchrun --standalone "
    "--nproc_per_node=2 01_basic_ddp/train.py": Run(exit_code=1, expect=(r"injected failure at",)),
    "PYTHONPATH=.:tests/inject DDP_TEST_FAIL_AT_STEP=2 DDP_TEST_FAIL_RANK=1 "
    "DDP_TEST_FAIL_MODE=hang torchrun "
    "--standalone --nproc_per_node=2 01_basic_ddp/train.py --timeout-s 5": RunElsewhere(
        "tests/test_failures.py::test_hung_rank_ends_the_job_at_the_timeout", OUTPUT_DIR
    ),
    "export TORCH_FR_DUMP_TEMP_FILE=$PWD/runs/fr/trace_": NotRun("gpu"),
    "torchfrtrace runs/fr -p trace_": NotRun("gpu"),
    "torchfrtrace runs/fr -p trace_ -j": NotRun("gpu"),
    'py-spy dump --subprocesses --pid $(pgrep -f "torch.distributed.run|torchrun" | '
    "head -1)": NotRun("download"),
    "for pid in $(pgrep -f 01_basic_ddp/train.py); do py-spy dump --pid $pid; done": NotRun(
        "download"
    ),
    "torchrun --standalone --nproc_per_node=2 debugging/rank_signal.py --how abort": RunElsewhere(
        "tests/test_forum_errors.py::test_rank_aborted_is_exitcode_minus_6_sigabrt"
    ),
    "unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && torchrun --standalone "
    "--nproc_per_node=2 "
    "debugging/rank_signal.py --how shm --shm-mb 4'": Run(
        exit_code=1,
        root=True,
        tools=("unshare", "mount"),
        expect=(r"exitcode  : -7 .*\(SIGBUS\)",),
        needs_torch=("2.12", "torchrun names the signal on its exitcode line"),
    ),
    # (all three on a free port from PET_MASTER_PORT, which both launchers read)
    "python -m torch.distributed.launch --nproc-per-node=2 debugging/local_rank_args.py "
    "--plain": RunElsewhere(
        f"{FORUM_TESTS}::test_torch_distributed_launch_passes_local_rank_argument"
    ),
    "python -m torch.distributed.launch --nproc-per-node=2 "
    "debugging/local_rank_args.py": RunElsewhere(
        f"{FORUM_TESTS}::test_torch_distributed_launch_passes_local_rank_argument"
    ),
    "torchrun --nproc-per-node=2 debugging/local_rank_args.py": RunElsewhere(
        f"{FORUM_TESTS}::test_torch_distributed_launch_passes_local_rank_argument"
    ),
    # run here too: its test in test_forum_errors.py starts
    # it with torch.distributed.launch (the examples
    # take its --local-rank)
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py": Run(
        needs_torch=("2.12", "DDP syncs buffers without bumping their version")
    ),
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers "
    "inplace": RunElsewhere(
        f"{FORUM_TESTS}::test_two_forwards_with_buffers_synced_in_place_fail", OUTPUT_DIR
    ),
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers inplace "
    "--forward concat": RunElsewhere(
        f"{FORUM_TESTS}::test_two_forwards_fixes_run_with_identical_replicas", OUTPUT_DIR
    ),
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers "
    "local": RunElsewhere(
        f"{FORUM_TESTS}::test_two_forwards_fixes_run_with_identical_replicas", OUTPUT_DIR
    ),
    # debugging: the wrapper in place of the model
    **{
        command: RunElsewhere(
            "tests/test_debugging.py::test_wrapper_in_place_of_the_model_errors_and_fixes",
            "--output-dir",
        )
        for command in (
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix",
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix "
            "--fix module",
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix "
            "--fix strip_prefix",
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug "
            "wrapper_attribute",
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug "
            "wrapper_attribute --fix module",
        )
    },
    # debugging: different models on different ranks
    **{
        command: RunElsewhere(
            "tests/test_debugging.py::test_different_models_error_and_fix", "--output-dir"
        )
        for command in [
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug "
            f"different_models{flags}"
            for flags in ("", " --fix data_set_size")
        ]
    },
    # debugging: frozen models and layers
    **{
        command: RunElsewhere(
            "tests/test_debugging.py::test_frozen_models_and_layers_errors_and_fixes",
            "--output-dir",
        )
        for command in (
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrap_frozen",
            "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrap_frozen "
            "--fix no_wrap",
            *(
                "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug "
                f"freeze_after_wrap{flags}"
                for flags in (
                    "",
                    " --steps 1",
                    " --fix freeze_first",
                    " --fix rewrap",
                    " --fix find_unused",
                )
            ),
        )
    },
    # 07_metrics
    "torchrun --standalone --nproc_per_node=2 07_metrics/train.py --patience 1": RunElsewhere(
        "tests/test_metrics.py::patience_run", "--log-every 1 --output-dir"
    ),
    # 08_several_models
    "torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py "
    "--output-dir runs/teacher": RunElsewhere(
        "tests/test_several_models.py::distillation", "--output-dir"
    ),
    "torchrun --standalone --nproc_per_node=2 08_several_models/train.py "
    "--teacher runs/teacher/model.pt": RunElsewhere(
        "tests/test_several_models.py::distillation", "--output-dir"
    ),
    "torchrun --standalone --nproc_per_node=2 08_several_models/gan.py": RunElsewhere(
        "tests/test_several_models.py::gan", "--output-dir"
    ),
    "torchrun --standalone --nproc_per_node=2 08_several_models/gan.py --no-detach": RunElsewhere(
        "tests/test_several_models.py::test_gan_without_detach_fails_in_the_g_step",
        "--output-dir",
    ),
}


def _lesson_main_commands() -> dict[str, Run]:
    """A lesson's own torchrun command (a script of its folder, in its README, no flags) needs no
    entry above: it runs shortened and must exit 0. So adding a lesson needs no edit here."""
    defaults = {}
    for command in readme_commands():
        folder = command.readme.split("/")[0]
        pattern = rf"torchrun --standalone --nproc_per_node=\d+ {re.escape(folder)}/\w+\.py"
        if folder in LESSON_DIRS and re.fullmatch(pattern, command.text):
            defaults[command.text] = Run(SHORT)
    return defaults


COMMANDS = {**_lesson_main_commands(), **COMMANDS}


# --- the table against the READMEs
# -------------------------------------------------------------------


def test_every_readme_command_is_classified_and_every_entry_is_in_a_readme():
    found = {c.text for c in readme_commands()}
    assert len(found) > 40, found  # the parser still finds the blocks
    unclassified = sorted(found - COMMANDS.keys())
    stale = sorted(COMMANDS.keys() - found)
    assert not unclassified, "README commands missing from COMMANDS:\n" + "\n".join(unclassified)
    assert not stale, "COMMANDS entries in no README:\n" + "\n".join(stale)


def test_commands_not_run_say_why_next_to_them():
    silent = []
    for command in readme_commands():
        how = COMMANDS.get(command.text)
        if isinstance(how, NotRun):
            assert how.reason in REASON_WORDS, how
            if not re.search(
                REASON_WORDS[how.reason], f"{command.comment}\n{command.before}", re.I
            ):
                silent.append(
                    f"{command.readme}: `{command.text}` ({how.reason}: {REASON_WORDS[how.reason]})"
                )
    assert not silent, (
        "not run, but neither the comment nor the paragraph before the block says why:\n"
        + ("\n".join(silent))
    )


def test_readme_names_the_shortening_flags_the_table_uses():
    """tests/README.md's section on README commands names exactly the flags the table appends."""
    text = (REPO / "tests" / "README.md").read_text()
    section = text.split("## README samples and commands", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(--[^`]*)`", section))
    used = {
        how.suffix
        for how in COMMANDS.values()
        if isinstance(how, (Run, RunElsewhere)) and how.suffix
    }
    for suffix in used:  # each suffix is made of flags the sentence names
        rest = suffix
        for flags in sorted(named, key=len, reverse=True):
            rest = rest.replace(flags, "")
        assert not rest.strip(), f"the README does not name {rest.strip()!r} (of {suffix!r})"
    for flags in named:  # and it names no flag the table does not use
        assert any(flags in suffix for suffix in used), flags


def test_the_parser_reads_continuations_comments_and_open_quotes():
    commands = {c.text: c for c in readme_commands()}
    demo = commands[
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 "
        "--max-restarts=2 05_checkpointing/train.py"
    ]
    assert demo.comment.startswith("survives a crashed worker") and "\\\n" in demo.source
    shm = next(c for c in commands.values() if c.text.startswith("unshare -m"))
    assert shm.source.endswith("--shm-mb 4'") and "\n" in shm.source
    spy = next(c for c in commands.values() if c.text.startswith("py-spy dump --subprocesses"))
    assert spy.text.endswith("| head -1)") and spy.comment == "all ranks under this torchrun"


# --- running them
# -----------------------------------------------------------------------------------


def _groups() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for text, how in COMMANDS.items():
        if isinstance(how, Run):
            groups.setdefault(how.group or text, []).append(text)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="module")
def tracked_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tracked") / "repo"
    for path in tracked_files():
        copy = tree / path.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
    return tree


def _env(extra: dict) -> dict[str, str]:
    """A user's shell: no PYTHONPATH, this interpreter's `python` and `torchrun` first on PATH."""
    env = clean_env(**extra)
    del env["PYTHONPATH"]
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env['PATH']}"
    return env


def _script(source: str, how: Run) -> str:
    if not how.suffix:
        return source
    if how.insert_before:
        head, sep, tail = source.partition(how.insert_before)
        assert sep, (source, how.insert_before)
        return f"{head} {how.suffix}{sep}{tail}"
    return f"{source} {how.suffix}"


ADDRESS_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _run_once(script: str, how: Run, cwd: Path, timeout: float):
    if not how.two_nodes:
        return run(["bash", "-c", script], timeout, env=_env(how.env), cwd=cwd)
    # two terminals: both copies at once; both must succeed
    procs = [
        subprocess.Popen(
            ["bash", "-c", script],
            cwd=cwd,
            env=_env(how.env),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    outputs, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_group(proc)
        pytest.fail(f"timed out after {timeout}s: {script}", pytrace=False)
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(script, code, "\n".join(outputs), "")


def _run_command(text: str, cwd: Path, sources: dict[str, str]):
    how = COMMANDS[text]
    script = _script(sources[text], how)
    for attempt in range(3):
        result = _run_once(script, how, cwd, timeout=240)
        output = (result.stdout or "") + (result.stderr or "")
        # a fixed port (06's 29400, torchrun's default 29500) taken by another test: retry only that
        if not (result.returncode and ADDRESS_IN_USE.search(output)) or how.exit_code:
            break
        time.sleep(5 * (attempt + 1))
    # a container without the privilege
    if how.root and re.search(r"^(unshare|mount): ", output, re.M):
        unavailable(f"not permitted here: {output.strip().splitlines()[0]}")
    assert result.returncode == how.exit_code, (
        f"exit {result.returncode}: {script}\n{output[-4000:]}"
    )
    for pattern in how.expect:
        assert re.search(pattern, output), (
            f"{pattern!r} not in the output of: {script}\n{output[-4000:]}"
        )
    for name in how.files:
        assert (cwd / name).exists(), f"{script} wrote no {name}"
    if how.summary:
        summary = read_summary(cwd / "runs" / "latest")
        for key, value in how.summary.items():
            ok = (
                re.fullmatch(value, summary[key])
                if isinstance(value, str)
                else summary[key] == value
            )
            assert ok, f"{script}: summary.json has {key}={summary[key]!r}, not {value!r}"
    return output


@pytest.mark.parametrize("group", list(GROUPS))
def test_readme_command_runs_as_written(group, tracked_tree, tmp_path):
    sources = {c.text: c.source for c in readme_commands()}
    texts = GROUPS[group]
    for text in texts:
        how = COMMANDS[text]
        if how.tools:
            need_tools(*how.tools)
        if how.root:
            need_root(text)
        if how.needs_torch:
            skip_below_torch(*how.needs_torch)
    tree = tmp_path / "repo"
    shutil.copytree(tracked_tree, tree)
    for text in texts:
        _run_command(text, tree, sources)


def test_test_suite_commands_collect():
    """The pytest commands are run by CI (the whole suite: test_ci_runs_the_readmes_test_command);
    one that names a file or a marker must at least collect tests without an error."""
    for text, how in COMMANDS.items():
        pytest_args = shlex.split(text.split("python -m pytest", 1)[-1])
        if isinstance(how, NotRun) and how.reason == "test-suite" and pytest_args:
            result = run(
                [PYTHON, "-m", "pytest", *pytest_args, "--collect-only", "-q", "-n", "0"],
                timeout=240,
            )
            assert result.returncode == 0, result.output[-4000:]
            # "N tests collected", or with -q -q one "file: N" line per file
            assert re.search(
                r"(?<![\d/])[1-9]\d*(/\d+)? tests? collected|^tests/\S+\.py: [1-9]\d*$",
                result.output,
                re.M,
            ), result.output[-2000:]


def test_ci_runs_the_readmes_test_command():
    """.ci/run runs the README's own test command, the tiers that leaves out, then the style
    check, as written."""
    readme = {c.text for c in readme_commands() if c.readme == "README.md"}
    ci_commands = [
        " ".join(line.split())
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci_commands[-3:] == [
        "pip install -r requirements.txt -r requirements-test.txt && python -m pytest",
        'python -m pytest -m "scheduler or torch_text"',
        "ruff format --check . && ruff check .",
    ]
    assert {ci_commands[-3], ci_commands[-1]} <= readme
    # tests/README.md names the tiers the default run leaves out, as CI runs them
    assert ci_commands[-2] in {c.text for c in readme_commands() if c.readme == "tests/README.md"}
    # The quick start shows the same test command.
    assert (REPO / "README.md").read_text().count(ci_commands[-3]) >= 2


def test_commands_run_elsewhere_are_read_from_the_readme_by_that_test():
    """A RunElsewhere test exists and runs the command
    through readme_command (so it runs it as written)."""
    for text, how in COMMANDS.items():
        if not isinstance(how, RunElsewhere):
            continue
        path, name = how.test.split("::")
        tree = ast.parse((REPO / path).read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        test = next(
            (node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name),
            None,
        )
        assert test is not None, f"{how.test} does not exist"
        commands = [
            constants.get(arg.id) if isinstance(arg, ast.Name) else getattr(arg, "value", None)
            for call in ast.walk(test)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "readme_command"
            for arg in call.args[1:2]
        ]
        assert text in commands, f"{how.test} does not run readme_command(..., {text!r})"
        strings = {node.value for node in ast.walk(test) if isinstance(node, ast.Constant)}
        assert set(how.suffix.split()) <= strings, f"{how.test} does not add {how.suffix!r}"
