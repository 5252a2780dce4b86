"""Failures are loud and fast, with torch's own mechanisms: a failing rank ends the job within
seconds under torchrun and mpiexec, and torchrun's summary names its exception (@record); a hang
ends at --timeout-s; bad input is one line and exit code 2 from one rank, before any process group.

Failures are injected from outside the examples: tests/inject/sitecustomize.py, which Python
imports at start-up because the tests put tests/inject on the PYTHONPATH (real runs never do).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.paths import PYTHON, REPO
from tests.processes import (
    clean_env,
    command_argv,
    free_port,
    run,
    torchrun,
    warm_ranks,
    warm_up,
    short_run,
)
from tests.quoted import RENDEZVOUS_TIMED_OUT
from tests.results import root_cause
from tests.torch_versions import needs_torch

SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("0*/train.py"))
# The failure path is torch's and the launcher's, the same in every lesson (each has @record on
# main: tests/test_lessons.py): it runs against 01, and 05's preempt.py, which has signal handlers
# of its own.
FAILURE_SCRIPTS = ["01_basic_ddp/train.py", "05_checkpointing/preempt.py"]
FAST = short_run(max_steps=6, log_every=100)


def _injected_at(output: str) -> float:
    """The time the injection fired (it prints t=<unix time>)."""
    m = re.search(r"test injection, t=([\d.]+)", output)
    assert m, f"the injected failure was not reported:\n{output[-3000:]}"
    return float(m.group(1))


# The README's command (debugging/README.md), run as written with --output-dir: rank 1 stops
# calling collectives at step 2 (tests/inject), and every rank waits at most 5 s.
HANG = (
    "PYTHONPATH=.:tests/inject DDP_TEST_FAIL_AT_STEP=2 DDP_TEST_FAIL_RANK=1 "
    "DDP_TEST_FAIL_MODE=hang torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py "
    "--timeout-s 5"
)


def raised_exit(rank: int) -> str:
    """torchrun's summary lines for a rank that raised: exit code 1, or now and then -6.

    Seen once in a fresh clone's run of this file, and in 2 of 273 runs of the raise (with and
    without @record) next to a busy process: the traceback, then "terminate called without an
    active exception". The rank's process group is still alive while its interpreter shuts down
    (the exception's traceback holds the DDP model), so a gloo thread can end it as in
    debugging/README.md's "terminate called without an active exception", here on the failure
    path; with @record the error file still holds the exception. assert_exit_explained() requires
    C++'s terminate message with a -6, so that any other cause still fails the test."""
    return rf"rank\s+: {rank} \(local_rank: {rank}\)\n\s+exitcode\s+: (1|-6) \(pid: (\d+)\)"


def assert_exit_explained(entry: re.Match, output: str) -> None:
    if entry[1] == "-6":
        assert "terminate called" in output, output[-8000:]


def _fail_vars(mode: str) -> dict[str, str]:
    """tests/inject's variables: rank 1 fails after its 3rd optimizer step, as `mode` says."""
    return dict(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
        DDP_TEST_FAIL_AT_STEP="3",
        DDP_TEST_FAIL_RANK="1",
        DDP_TEST_FAIL_MODE=mode,
    )


# debugging/README.md's test injection, as written (its marker: proven-by the test below)
INJECTED_FAILURE = (
    "PYTHONPATH=.:tests/inject DDP_TEST_FAIL_AT_STEP=3 DDP_TEST_FAIL_RANK=1 torchrun --standalone "
    "--nproc_per_node=2 01_basic_ddp/train.py"
)


@pytest.mark.launchers
@pytest.mark.parametrize("script", FAILURE_SCRIPTS)
def test_rank_raising_mid_training_ends_job_fast_and_torchrun_names_it(script, tmp_path):
    flags = [*FAST, "--output-dir", str(tmp_path)]
    if script == "01_basic_ddp/train.py":  # the guide's command
        result = run(command_argv(INJECTED_FAILURE) + flags, timeout=180)
    else:
        result = torchrun(
            script, *flags, env=clean_env(**_fail_vars("raise")), check=False, timeout=180
        )
    ended = time.time()
    out = result.output
    assert result.returncode == 1  # torchrun's own exit code
    assert ended - _injected_at(out) < 30, "the job did not end within 30 s of the failure"
    # The failing rank's traceback, printed once by the
    # rank itself ([rankN]: on each line, from torch).
    assert out.count("[rank1]: RuntimeError: injected failure at step 3 on rank 1") == 1, out[
        -3000:
    ]
    # The other rank lost its peer (gloo's "Connection
    # closed/reset by peer") or torchrun stopped it first.
    assert re.search(
        r"^\[rank0\]: RuntimeError: .*Connection (closed|reset) by peer", out, re.M
    ) or re.search(
        r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: -15 \(pid: \d+\)\s+\(SIGTERM\)", out
    ), out[-3000:]
    # @record wrote rank 1's exception into torchrun's
    # error file: its summary names it as the root cause.
    root = root_cause(out)
    rank_1 = raised_exit(1)
    if not re.search(rank_1, root):
        # A tie (debugging/README.md, ChildFailedError): rank 0 failed in the same second and
        # torchrun collected both at once; rank 1's entry, with its exception, is under Failures.
        summary = out.split("ChildFailedError:")[-1]
        assert len(set(re.findall(r"time\s+: (\S+)", summary))) == 1, summary
        root = summary
    entry = re.search(rank_1, root)
    assert entry, root
    assert_exit_explained(entry, out)
    assert "RuntimeError: injected failure at step 3 on rank 1" in root, root
    # torchrun's own traceback (unprefixed, ending in
    # ChildFailedError) is torch's code only, not the script's.
    own = out.split("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")[0]
    own = own[own.rindex("\nTraceback (most recent call last):") :]
    frames = re.findall(r'File "([^"]+)"', own)
    assert frames and all(f == "<frozen runpy>" or "/torch/distributed/" in f for f in frames), own
    assert "train.py" not in own, own


@pytest.mark.launchers
@needs_torch("2.12", "torchrun names the signal on its exitcode line from torch 2.12")
@pytest.mark.parametrize("script", FAILURE_SCRIPTS)
def test_rank_killed_with_sigkill_ends_job_without_restarts(script, tmp_path):
    result = torchrun(
        script,
        *FAST,
        "--output-dir",
        str(tmp_path),
        env=clean_env(**_fail_vars("kill")),
        check=False,
        timeout=180,
        launcher_args=("--max-restarts=0",),
    )
    ended = time.time()
    out = result.output
    assert result.returncode == 1
    assert ended - _injected_at(out) < 30, "the job did not end within 30 s of the kill"
    # The literal lines debugging/README.md keys on: a
    # killed rank writes no error file, so no traceback.
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in out
    summary = out.split("ChildFailedError")[-1]
    m = re.search(
        r"exitcode  : -9 \(pid: (\d+)\)  \(SIGKILL\)\n  error_file: <N/A>\n"
        r"  traceback : Signal 9 \(SIGKILL\) received by PID (\d+)",
        summary,
    )
    assert m and m[1] == m[2], out[-3000:]
    # Root Cause is the earliest whole-second time; the
    # killed rank's is when torchrun collected it, so the
    # survivor's consequence (its peer's connection gone)
    # can take that place (debugging/README.md says so).
    root = root_cause(out)
    assert re.search(r"exitcode\s+: -9 .*\(SIGKILL\)", root) or re.search(
        r"Connection (reset|closed) by peer", root
    ), root
    # a restarted worker would inject again
    assert out.count("injecting SIGKILL at") == 1, out[-3000:]


@pytest.mark.launchers
def test_hung_rank_ends_the_job_at_the_timeout(tmp_path):
    """Rank 1 stops calling collectives; rank 0 waits in DDP's all-reduce until --timeout-s, then
    gloo raises and torchrun stops the job. The root cause names the timeout and where it waited."""
    result = run(command_argv(HANG) + ["--output-dir", str(tmp_path)], timeout=180)
    ended = time.time()
    out = result.output
    assert result.returncode == 1
    assert "injecting a hang" in out, out[-3000:]
    assert 5 <= ended - _injected_at(out) < 30
    # gloo's message, as debugging/README.md quotes it (the
    # source file and line are gloo's of torch 2.14.1).
    assert re.search(
        r"^\[rank0\]: RuntimeError: \[\S+/gloo/transport/tcp/unbound_buffer\.cc:78\] Timed "
        r"out waiting "
        r"5000ms for recv operation to complete$",
        out,
        re.M,
    ), out[-3000:]
    root = root_cause(out)
    entry = re.search(raised_exit(0), root)
    assert entry, root
    assert_exit_explained(entry, out)
    assert "Timed out waiting 5000ms" in root, root
    assert "loss.backward()" in root, root  # the call in the script where rank 0 waited


@pytest.mark.launchers
def test_rank_missing_at_start_waits_at_the_rendezvous_silently(tmp_path):
    """Hang at start: rank 0 of a promised world of 2, alone. It prints nothing of its own and waits
    for the missing rank in the rendezvous until --timeout-s, then says how many joined."""
    env = clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    start = time.perf_counter()
    result = run(
        [PYTHON, REPO / SCRIPTS[0], "--timeout-s", "1", "--output-dir", tmp_path],
        timeout=120,
        env=env,
    )
    assert result.returncode == 1 and time.perf_counter() - start >= 1
    assert result.stdout == ""  # no banner: the rendezvous comes first
    assert re.search(
        r"^torch\.distributed\.DistStoreError: Timed out after \d+ seconds "
        + re.escape(RENDEZVOUS_TIMED_OUT)
        + "$",
        result.stderr,
        re.M,
    ), result.stderr[-3000:]


@pytest.mark.launchers
@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_rank_raising_under_mpiexec_ends_the_job(tmp_path, flavour):
    from tests.launcher_tools import need_tools, openmpi_env

    tool = {"openmpi": "mpiexec.openmpi", "mpich": "mpiexec.mpich"}[flavour]
    need_tools(tool)
    inject = dict(_fail_vars("raise"), MASTER_PORT=str(free_port()))
    if flavour == "openmpi":
        env = openmpi_env(**inject)
        cmd = [
            tool,
            "-n",
            "2",
            *[a for name in inject for a in ("-x", name)],
            "-x",
            "OMP_NUM_THREADS",
        ]
    else:
        env, cmd = clean_env(**inject), [tool, "-n", "2"]
    result = run(
        [*cmd, PYTHON, REPO / SCRIPTS[0], *FAST, "--output-dir", tmp_path], timeout=150, env=env
    )
    ended = time.time()
    assert result.returncode != 0
    assert ended - _injected_at(result.output) < 30
    # The [rankN]: prefix is torch's (init_process_group
    # installs an exception hook), so it is there under any
    # launcher; torchrun's closing summary is not.
    assert "[rank1]: RuntimeError: injected failure at step 3 on rank 1" in result.output, (
        result.output[-3000:]
    )
    assert "Root Cause" not in result.output and "ChildFailedError" not in result.output
    import inspect

    import torch.distributed as dist

    assert 'excepthook_prefix = f"[rank{get_rank()}]"' in inspect.getsource(dist.init_process_group)


# Bad input: (id, extra args, extra environment, words the
# one line must contain: the key or file, and the fix).
# {tmp} is replaced by the test's temporary folder.
BAD_INPUT = [
    ("negative_batch", ["--local-batch-size", "-4"], {}, ["local_batch_size", ">= 1", "-4"]),
    # renamed: refused, naming the new flag (common/config.py, RENAMED)
    ("old_batch_flag", ["--batch-size", "32"], {}, ["--batch-size is now --local-batch-size"]),
    (
        "unknown_yaml_key",
        ["--config", "{tmp}/bad.yaml"],
        {},
        ["unknown config key 'batch_sise'", "valid keys: ", "batch_size"],
    ),
    ("wrong_type", ["--lr", "fast"], {}, ["'lr'", "float", "fast"]),
    (
        "world_larger_than_data",
        [],
        {"RANK": "0", "WORLD_SIZE": "5000"},
        ["world size 5000", "training set", "use fewer processes"],
    ),
    (
        "missing_data_dir",
        ["--dataset", "cifar10", "--data-dir", "{tmp}/no_such_dir"],
        {},
        [
            "no_such_dir",
            "does not exist",
            "python -m common.prepare --dataset cifar10",
            "--download",
        ],
    ),
    (
        "rank_not_below_world",
        [],
        {"RANK": "3", "WORLD_SIZE": "2"},
        ["rank 3", "world size 2", "must be 0..1"],
    ),
]
# The cases that depend on a script's own config class and data set run against every lesson; the
# others are common/ code that runs before anything script-specific: 01 stands for all.
SCRIPT_SPECIFIC_CASES = ("unknown_yaml_key", "world_larger_than_data", "missing_data_dir")
# A lesson's own required flags, given so that each case's error is the one said (08's teacher is
# checked as the config is read, before the data): {tmp}/teacher.pt is an empty file.
REQUIRED_ARGS = {"08_several_models/train.py": ["--teacher", "{tmp}/teacher.pt"]}
BAD_INPUT_RUNS = [
    pytest.param(script, case, id=f"{case[0]}-{script}")
    for script in SCRIPTS
    for case in BAD_INPUT
    if script == SCRIPTS[0] or case[0] in SCRIPT_SPECIFIC_CASES
]


@pytest.fixture(scope="module")
def python_start_s() -> float:
    """Seconds this machine needs to start Python and import what the scripts import."""
    start = time.perf_counter()
    run([PYTHON, "-c", "import torch, torchvision, yaml"], timeout=120, check=True)
    return time.perf_counter() - start


@pytest.mark.parametrize("script,case", BAD_INPUT_RUNS)
def test_bad_input_is_one_line_and_exit_code_2(script, case, tmp_path, python_start_s):
    """01's cases under a real interpreter (the exit path); the other lessons' cases, each its own
    config class and data set, in a process forked warm as `python script` (tests/README.md)."""
    _, args, env, words = case
    (tmp_path / "bad.yaml").write_text("batch_sise: 8\n")
    (tmp_path / "teacher.pt").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in REQUIRED_ARGS.get(script, []) + args]
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("kept")  # nothing written before is lost
    start = time.perf_counter()
    if script == SCRIPTS[0]:
        argv = [PYTHON, REPO / script, *args, "--output-dir", str(out)]
        result = run(argv, timeout=120, env=clean_env(**env))
        elapsed = time.perf_counter() - start - python_start_s
    else:
        argv = [*args, "--output-dir", str(out)]
        warm_up()
        start = time.perf_counter()
        result = warm_ranks(script, *argv, nproc=0, env=clean_env(**env), check=False)
        elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.output[-3000:]
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word.replace("{tmp}", str(tmp_path)) in lines[0]
    assert [p.name for p in out.iterdir()] == ["earlier.txt"] and (
        out / "earlier.txt"
    ).read_text() == "kept"
    assert elapsed < 10  # before any process group: no waiting for other ranks


@pytest.mark.launchers
@pytest.mark.parametrize("script", FAILURE_SCRIPTS)
def test_bad_input_under_torchrun_is_said_exactly_once(script, tmp_path):
    result = torchrun(
        script, "--local-batch-size", "-4", "--output-dir", str(tmp_path), check=False, timeout=120
    )
    out = result.output
    assert result.returncode != 0
    # once, by rank 0; the other rank exits quietly
    assert out.count("local_batch_size") == 1, out[-3000:]
    assert re.search(r"^error: config key 'local_batch_size' must be >= 1, got -4$", out, re.M)
    assert re.search(r"exitcode\s+: 2", out)
    # no traceback from the ranks (torchrun's own is all)
    assert not re.search(r"^\[rank\d\]: Traceback", out, re.M)


def test_node_specific_bad_input_is_said_by_each_nodes_first_rank(tmp_path):
    """A data folder missing on a node is said by that node's local rank 0, not only by global rank
    0 (which may be on a node where the folder exists); a config error only by global rank 0."""
    missing = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "none")]
    said = {}
    for rank, local_rank in ((0, 0), (2, 0), (3, 1)):
        env = clean_env(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE="4",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",  # two hosts, no job: rank 0's host must be given
        )
        data = warm_ranks(SCRIPTS[0], *missing, nproc=0, env=env, check=False)
        config = warm_ranks(SCRIPTS[0], "--lr", "fast", nproc=0, env=env, check=False)
        assert data.returncode == config.returncode == 2
        said[rank] = ("does not exist" in data.stderr, "'lr'" in config.stderr)
    assert said == {0: (True, True), 2: (True, False), 3: (False, False)}


def test_without_record_the_summary_has_no_traceback(tmp_path):
    """Negative control for @record: the same failure in a copy of 01 without the decorator leaves
    torchrun's summary with `error_file: <N/A>` and no exception."""
    source = (REPO / SCRIPTS[0]).read_text()
    assert source.count("@record") == 1
    copy = tmp_path / "train_without_record.py"
    copy.write_text(
        source.replace("@record", "", 1).replace(
            "Path(__file__).resolve().parents[1]", repr(str(REPO))
        )
    )
    result = torchrun(
        copy,
        *FAST,
        "--output-dir",
        str(tmp_path / "out"),
        env=clean_env(**_fail_vars("raise")),
        check=False,
        timeout=180,
    )
    assert result.returncode == 1
    # torchrun's closing summary: every failed rank's entry. Rank 1's may be listed under
    # "Failures" rather than "Root Cause": without error files torchrun stamps each failure with
    # the second it saw it, and a tie goes to the one it saw first, or to the lower rank where one
    # poll saw both (rank 0, which lost its peer, aborting at once: seen in CI).
    summary = result.output.split("ChildFailedError:")[-1]
    assert "Root Cause" in summary and "injected failure" not in summary, summary
    assert "error_file: <N/A>" in summary and "error_file: /" not in summary, summary
    # torchrun's stand-in for the missing traceback (debugging/README.md quotes it); for a rank
    # that aborted while shutting down (raised_exit()), the signal's.
    entry = re.search(raised_exit(1) + r".*\n\s+error_file: <N/A>\n\s+traceback : (.*)", summary)
    assert entry, summary
    assert_exit_explained(entry, result.output)
    assert entry[3] == (
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        if entry[1] == "1"
        else f"Signal 6 (SIGABRT) received by PID {entry[2]}"
    ), summary
