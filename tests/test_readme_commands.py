"""Every command in a README's ```bash blocks is marked in the README itself: an HTML comment
above the block, `<!-- commands: ... -->`, holds a YAML list with one entry a command, in order:

- `run` (options: `short`, `exit`, `expect`, `files`, `summary`, `torch`, `warm`): run here as
  written, through `bash -c`, from the root of a fresh copy of the tracked tree (so runs/ and data/
  land there); `short: true` appends the shortening flags below (tests/README.md names them);
  `warm: true` starts a `torchrun --standalone` command's ranks warm instead (warm_command).
- `proven-by: tests/test_x.py`: a test of that file runs the command, its exact text in its source.
- `not-run: gpu|download|scheduler|test-suite`: the README says why next to it.

A new block without a marker, or a marker that does not match its block, fails here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher_tools import need_root, need_tools, unavailable
from tests.markdown import readme_commands
from tests.paths import PYTHON, REPO, tracked_files
from tests.processes import (
    short_run,
    clean_env,
    dump_stacks,
    fail_timed_out,
    kill_group,
    run,
    start,
    warm_command,
)
from tests.results import read_summary
from tests.sample_runs import RUNS
from tests.torch_versions import skip_below_torch

SHORT = " ".join(short_run(max_steps=2, local_batch_size=None))  # `short: true` appends them
# Open MPI refuses to start as root without these; 06_multinode/README.md names them.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _kind(command) -> str:
    [kind] = command.how  # one key an entry
    return kind


# --- the markers
# ---------------------------------------------------------------------------------------


# --- running them
# -----------------------------------------------------------------------------------


def _groups() -> dict[str, list]:
    """The commands to run, a group a block: one group runs in order in one copy of the tree. A
    command shown in two READMEs, marked alike, runs once."""
    groups: dict[str, list] = {}
    seen = set()
    for command in readme_commands():
        key = (command.text, repr(command.how))
        if _kind(command) == "run" and key not in seen:
            seen.add(key)
            groups.setdefault(f"{command.readme}:{command.block}", []).append(command)
    return {" && ".join(c.text for c in group): group for group in groups.values()}


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


ADDRESS_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _run_once(script: str, env: dict, cwd: Path, timeout: float, copies: int):
    if copies == 1:
        return run(["bash", "-c", script], timeout, env=env, cwd=cwd)
    # two terminals (06's two "nodes" on one machine): both copies at once; both must succeed
    procs = [
        start(["bash", "-c", script], env=env, cwd=cwd, stderr=subprocess.STDOUT)
        for _ in range(copies)
    ]
    outputs, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        # every copy's stacks before any is killed: one copy's end changes what the other does
        stacks = "\n".join(dump_stacks(proc) for proc in procs if proc.poll() is None)
        for proc in procs:
            kill_group(proc)
        fail_timed_out(timeout, script, "\n".join(outputs), "", stacks)
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(script, code, "\n".join(outputs), "")


def _run_command(command, cwd: Path):
    how = command.how["run"] or {}
    script = f"{command.source} {SHORT}" if how.get("short") else command.source
    exit_code = how.get("exit", 0)
    env = _env(OPEN_MPI_AS_ROOT if command.text.startswith("mpiexec") else {})
    copies = 2 if "--nnodes=2" in command.text else 1
    if how.get("warm"):  # a free loopback port of its own: nothing to retry
        extra = SHORT.split() if how.get("short") else []
        result = warm_command(command.text, *extra, env=env, cwd=cwd, timeout=240)
        output = result.output
    for attempt in range(0 if how.get("warm") else 3):
        result = _run_once(script, env, cwd, timeout=240, copies=copies)
        output = (result.stdout or "") + (result.stderr or "")
        # a fixed port (06's 29400, torchrun's default 29500) taken by another test: retry only that
        if not (result.returncode and ADDRESS_IN_USE.search(output)) or exit_code:
            break
        time.sleep(5 * (attempt + 1))
    # a container without the privilege
    if command.text.startswith("unshare") and re.search(r"^(unshare|mount): ", output, re.M):
        unavailable(f"not permitted here: {output.strip().splitlines()[0]}")
    assert result.returncode == exit_code, f"exit {result.returncode}: {script}\n{output[-4000:]}"
    for pattern in how.get("expect", ()):
        assert re.search(pattern, output), (
            f"{pattern!r} not in the output of: {script}\n{output[-4000:]}"
        )
    for name in how.get("files", ()):
        assert (cwd / name).exists(), f"{script} wrote no {name}"
    if how.get("summary"):
        summary = read_summary(cwd / "runs" / "latest")
        for key, value in how["summary"].items():
            ok = (
                re.fullmatch(value, summary[key])
                if isinstance(value, str)
                else summary[key] == value
            )
            assert ok, f"{script}: summary.json has {key}={summary[key]!r}, not {value!r}"
    return output


def _program(command) -> str:
    """The program a command starts, after its VAR=value words."""
    return next(word for word in shlex.split(command.text) if "=" not in word)


def _tier(group: list) -> tuple:
    """A block whose claim is a launcher's (mpiexec, two nodes, restarts) is in the launcher tier
    (pytest.ini)."""
    launchers = any(
        _program(c) == "mpiexec" or re.search(r"--nnodes|--max-restarts", c.text) for c in group
    )
    return (pytest.mark.launchers,) if launchers else ()


@pytest.mark.parametrize("group", [pytest.param(g, marks=_tier(c)) for g, c in GROUPS.items()])
def test_readme_command_runs_as_written(group, tracked_tree, tmp_path):
    commands = GROUPS[group]
    for command in commands:
        if _program(command) not in ("python", "torchrun"):
            need_tools(_program(command))  # mpiexec, unshare, ruff, diff
        if _program(command) == "unshare":
            need_root(command.text)
        if (command.how["run"] or {}).get("torch"):
            skip_below_torch(*command.how["run"]["torch"])
    tree = tmp_path / "repo"
    shutil.copytree(tracked_tree, tree)
    for command in commands:
        _run_command(command, tree)


# Collects each command's tests in one interpreter, the test modules imported once (pytest.main
# called again in one process re-reads no changed file: nothing changes between these calls).
COLLECT = """
import json, sys, pytest
for args in json.loads(sys.argv[1]):
    print("=== collect", *args, flush=True)
    code = pytest.main([*args, "--collect-only", "-q", "-n", "0"])
    print(f"=== exit {int(code)}", flush=True)
"""


def test_test_suite_commands_collect():
    """The pytest commands are run by CI (the whole suite: .ci/lint.py, ci-runs-the-readme);
    one that names a file or a marker must at least collect tests without an error."""
    texts = {c.text for c in readme_commands() if c.how.get("not-run") == "test-suite"}
    selections = [shlex.split(t.split("python -m pytest", 1)[-1]) for t in sorted(texts)]
    selections = [args for args in selections if args]
    assert selections, texts
    result = run([PYTHON, "-c", COLLECT, json.dumps(selections)], timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    parts = re.split(r"^=== collect .*$", result.stdout, flags=re.M)[1:]
    assert len(parts) == len(selections), result.output[-4000:]
    for args, part in zip(selections, parts):
        assert part.rstrip().endswith("=== exit 0"), (args, part[-4000:])
        # "N tests collected", or with -q -q one "file: N" line per file
        assert re.search(
            r"(?<![\d/])[1-9]\d*(/\d+)? tests? collected|^tests/\S+\.py: [1-9]\d*$", part, re.M
        ), (args, part[-2000:])


# The tiers the default run leaves out (pytest.ini), as a test's decorator
OTHER_TIERS = {
    f"pytest.mark.{tier}" for tier in ("launchers", "scheduler", "torch_text", "readme_text")
}


def test_commands_proven_elsewhere_are_run_as_written_by_that_test():
    """A test (or fixture) of the `proven-by` file runs the command through command_argv (or,
    ranks started warm, warm_command), the README's exact text a string constant in it or in its
    module. Each script keeps at least one of its README commands under the real launcher in the
    default tier: run here, or through command_argv in its test (tests/README.md, "How ranks
    start"); a test in another tier does not count."""
    real, scripts = set(), {}
    launcher_tier = {c.text for group in GROUPS.values() if _tier(group) for c in group}
    for command in readme_commands():
        # a torchrun command, or one that starts it (unshare ... sh -c '... torchrun ...')
        started = re.search(r"\btorchrun --standalone --nproc_per_node=\d+ (\S+\.py)", command.text)
        if started and _kind(command) != "not-run":
            scripts.setdefault(started[1], set()).add(command.text)
        warm = _kind(command) == "run" and (command.how["run"] or {}).get("warm")
        if _kind(command) == "run" and not warm and command.text not in launcher_tier:
            real.add(command.text)
        if _kind(command) != "proven-by":
            continue
        path = command.how["proven-by"]
        tree = ast.parse((REPO / path).read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        module_tier = any(
            isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "pytestmark"
            and ast.unparse(node.value) in OTHER_TIERS
            for node in tree.body
        )
        # the tests (or fixtures) of the file that run the command, as written
        provers = [
            (test, ran)
            for test in tree.body
            if isinstance(test, ast.FunctionDef)
            for ran in [_runs(test, constants)]
            if command.text in ran[0]
        ]
        assert provers, (
            f"no test in {path} runs {command.text!r} (command_argv, warm_command, sample_run)"
        )
        for test, (_, under_torchrun) in provers:
            if not module_tier and not any(
                ast.unparse(d) in OTHER_TIERS for d in test.decorator_list
            ):
                real |= under_torchrun
    only_warm = sorted(script for script, texts in scripts.items() if not texts & real)
    assert only_warm == [], f"no README command of these runs under the real torchrun: {only_warm}"


def _runs(test: ast.FunctionDef, constants: dict) -> tuple[set, set]:
    """The commands a test runs (command_argv, warm_command, a shared sample_run), and those of
    them it starts under the real torchrun (command_argv, a sample run not started warm)."""
    calls = {
        getattr(node.func, "id", None) for node in ast.walk(test) if isinstance(node, ast.Call)
    }
    strings = {
        constants.get(node.id) if isinstance(node, ast.Name) else node.value
        for node in ast.walk(test)
        if isinstance(node, (ast.Name, ast.Constant))
    }
    # a run shared with a README sample (tests/sample_runs.py) names its command
    shared = [
        RUNS[call.args[0].value]
        for call in ast.walk(test)
        if isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == "sample_run"
        and isinstance(call.args[0], ast.Constant)
    ]
    runs = strings if calls & {"command_argv", "warm_command"} else set()
    runs |= {getattr(ran, "readme_command", None) for ran in shared}
    real = {
        constants.get(arg.id) if isinstance(arg, ast.Name) else getattr(arg, "value", None)
        for call in ast.walk(test)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "command_argv"
        for arg in call.args[:1]
    }
    real |= {
        getattr(ran, "readme_command", None) for ran in shared if not getattr(ran, "warm", False)
    }
    return runs, real
