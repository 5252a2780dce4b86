"""Failures are loud and fast: a failing rank ends the job within seconds with its error shown
once; bad input is one line and exit code 2; the bug demos fail fast with the diagnostic that
debugging/README.md promises; no rank-0-only block calls a collective.

Failures are injected with the test hook of common/entry.py (DDP_EXAMPLES_FAIL_AT_STEP,
DDP_EXAMPLES_FAIL_RANK, DDP_EXAMPLES_FAIL_MODE), so every example is covered unchanged.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, clean_env, run, torchrun

SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("0*/train.py"))
# The failure handling lives in common/ (entry.run, dist.setup_distributed), shared by every script:
# each behaviour runs against every script where the script's own code is involved (its config, its
# data, its training loop), and against 01 and 05 (which has signal handlers of its own) elsewhere.
SHARED_PATH_SCRIPTS = [s for s in SCRIPTS if s.startswith(("01_", "05_"))]
DEMO = "debugging/demo_bugs.py"
FAST = ("--max-steps", "6", "--epochs", "1", "--batch-size", "16", "--log-every", "100")


def _injected_at(output: str) -> float:
    """The time the hook injected the failure (it prints t=<unix time>)."""
    m = re.search(r"DDP_EXAMPLES_FAIL_AT_STEP test hook, t=([\d.]+)", output)
    assert m, f"the injected failure was not reported:\n{output[-3000:]}"
    return float(m.group(1))


def _fail_env(mode: str, step: int = 3, rank: int = 1) -> dict[str, str]:
    return clean_env(DDP_EXAMPLES_FAIL_AT_STEP=str(step), DDP_EXAMPLES_FAIL_RANK=str(rank),
                     DDP_EXAMPLES_FAIL_MODE=mode)


@pytest.mark.parametrize("script", SCRIPTS)
def test_rank_raising_mid_training_ends_job_fast_with_error_once(script, tmp_path):
    result = torchrun(script, *FAST, "--output-dir", str(tmp_path), env=_fail_env("raise"),
                      check=False, timeout=180)
    ended = time.time()
    out = result.output
    assert result.returncode != 0
    assert ended - _injected_at(out) < 30, "the job did not end within 30 s of the failure"
    # The failing rank's traceback, once, labelled with its rank; nobody else prints one.
    assert len(re.findall(r"^\[rank 1 on \S+\] failed:$", out, re.M)) == 1, out[-3000:]
    assert out.count("RuntimeError: injected failure at step 3 on rank 1") == 1, out[-3000:]
    assert not re.search(r"^\[rank 0 on \S+\] failed:$", out, re.M), out[-3000:]
    # Rank 0 either was stopped by torchrun or says in one line that it lost its peer.
    rank0_lines = [ln for ln in out.splitlines() if ln.startswith("[rank 0 on")]
    assert len(rank0_lines) <= 1 and all("lost contact" in ln for ln in rank0_lines), rank0_lines
    # torchrun's summary names rank 1 as the root cause, not the rank it stopped.
    root = out.split("Root Cause")[-1]
    assert re.search(r"rank\s+: 1 ", root) and "RuntimeError on rank 1" in root, root


@pytest.mark.parametrize("script", SHARED_PATH_SCRIPTS)
def test_rank_killed_with_sigkill_ends_job_without_restarts(script, tmp_path):
    result = torchrun(script, *FAST, "--output-dir", str(tmp_path), env=_fail_env("kill"),
                      check=False, timeout=180, launcher_args=("--max-restarts=0",))
    ended = time.time()
    out = result.output
    assert result.returncode != 0
    assert ended - _injected_at(out) < 30, "the job did not end within 30 s of the kill"
    assert "SIGKILL" in out.split("Root Cause")[-1]  # torchrun reports the killed rank
    assert out.count("injecting SIGKILL at") == 1, out[-3000:]  # a restarted worker would inject again
    assert not re.search(r"^\[rank \d on \S+\] failed:$", out, re.M), out[-3000:]


def test_hung_rank_gives_timeout_report_naming_collective_and_missing_rank(tmp_path):
    result = torchrun(SCRIPTS[0], *FAST, "--timeout-s", "5", "--output-dir", str(tmp_path),
                      env=_fail_env("hang", step=2), check=False, timeout=180)
    ended = time.time()
    out = result.output
    assert result.returncode != 0
    assert ended - _injected_at(out) < 30
    report = re.search(r"^\[rank 0 on \S+\] a collective timed out after 5 s.*?(?=\n\S|\Z)", out, re.M | re.S)
    assert report, out[-3000:]
    text = report.group(0)
    assert "rank 0 in backward() (DDP's gradient all-reduce) called at train.py:" in text
    assert "never arrived: rank(s) 1" in text
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text and "py-spy dump" in text


# Bad input: (id, extra args, extra environment, words the one line must contain).
# {tmp} is replaced by the test's temporary folder.
BAD_INPUT = [
    ("negative_batch", ["--batch-size", "-4"], {}, ["batch_size", ">= 1", "-4"]),
    ("unknown_yaml_key", ["--config", "{tmp}/bad.yaml"], {}, ["unknown config key 'batch_sise'"]),
    ("wrong_type", ["--lr", "fast"], {}, ["'lr'", "float", "fast"]),
    ("world_larger_than_data", [], {"RANK": "0", "WORLD_SIZE": "5000"}, ["world size 5000", "training set"]),
    ("missing_data_dir", ["--dataset", "cifar10", "--data-dir", "{tmp}/no_such_dir"], {},
     ["no_such_dir", "does not exist"]),
    ("backend_for_device", ["--device", "cpu", "--backend", "nccl"], {}, ["nccl", "cpu"]),
    ("rank_not_below_world", [], {"RANK": "3", "WORLD_SIZE": "2"}, ["rank 3", "world size 2"]),
    ("local_rank_without_gpu", ["--device", "cuda"], {"LOCAL_RANK": "{gpus}", "RANK": "{gpus}",
                                                       "WORLD_SIZE": "{gpus+1}", "LOCAL_WORLD_SIZE": "{gpus+1}"},
     ["local rank {gpus}", "cuda"]),
]


@pytest.fixture(scope="module")
def python_start_s() -> float:
    """Seconds this machine needs to start Python and import what the scripts import."""
    start = time.perf_counter()
    run([PYTHON, "-c", "import torch, torchvision, sklearn, yaml"], timeout=120, check=True)
    return time.perf_counter() - start


def _fill(text: str, tmp_path: Path) -> str:
    import torch

    gpus = torch.cuda.device_count()
    return (text.replace("{tmp}", str(tmp_path)).replace("{gpus+1}", str(gpus + 1))
            .replace("{gpus}", str(gpus)))


# The cases that depend on a script's own config class and data set; type and value checks, launcher
# and backend checks are common/ code that runs before anything script-specific.
SCRIPT_SPECIFIC_CASES = ("unknown_yaml_key", "world_larger_than_data", "missing_data_dir")
BAD_INPUT_RUNS = [pytest.param(script, case, id=f"{case[0]}-{script}") for script in SCRIPTS for case in BAD_INPUT
                  if script in SHARED_PATH_SCRIPTS or case[0] in SCRIPT_SPECIFIC_CASES]


@pytest.mark.parametrize("script,case", BAD_INPUT_RUNS)
def test_bad_input_is_one_line_and_exit_code_2(script, case, tmp_path, python_start_s):
    _, args, env, words = case
    (tmp_path / "bad.yaml").write_text("batch_sise: 8\n")
    args = [_fill(a, tmp_path) for a in args]
    env = clean_env(**{k: _fill(v, tmp_path) for k, v in env.items()})
    start = time.perf_counter()
    result = run([PYTHON, REPO / script, *args, "--output-dir", str(tmp_path / "out")], timeout=120, env=env)
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.output[-3000:]
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert _fill(word, tmp_path) in lines[0]
    # Within 10 s of what starting Python and importing torch takes on this (shared) machine.
    assert elapsed - python_start_s < 10


@pytest.mark.parametrize("script", SHARED_PATH_SCRIPTS)
def test_bad_input_under_torchrun_is_said_exactly_once(script, tmp_path):
    result = torchrun(script, "--batch-size", "-4", "--output-dir", str(tmp_path), check=False, timeout=120)
    out = result.output
    assert result.returncode != 0
    assert out.count("batch_size") == 1, out[-3000:]  # once, by one rank; not repeated by torchrun
    assert re.search(r"^error: config key 'batch_size' must be >= 1, got -4$", out, re.M)
    assert re.search(r"exitcode\s+: 2", out)
    # torchrun's summary points at that line instead of at its generic "enable traceback" hint.
    assert "see the line starting with 'error:' above" in out


# --- the bug demos: each fails fast and prints what debugging/README.md says it prints ------------

def test_demo_runs_clean_without_a_bug():
    result = torchrun(DEMO, timeout=120)
    assert "done: no bug" in result.stdout


def test_demo_mismatched_collective_named_by_debug_detail():
    env = clean_env(TORCH_DISTRIBUTED_DEBUG="DETAIL")
    result = torchrun(DEMO, "--bug", "mismatched_collective", env=env, check=False, timeout=120)
    out = result.output
    assert result.returncode != 0
    assert out.count("Traceback (most recent call last)") == 2, out[-3000:]  # rank 0's and torchrun's own
    # Whichever rank fails first prints it: the skipped all-reduce (shape [1], on rank 0 only)
    # meets rank 1's next one (shape [2]) at the same sequence number.
    m = re.search(r"Detected mismatch between collectives on ranks\. Rank (\d) is running collective: "
                  r"CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=ALLREDUCE, TensorShape=\[(\d)\].*?"
                  r"but Rank (\d) is running collective: CollectiveFingerPrint\(SequenceNumber=\2, "
                  r"OpType=ALLREDUCE, TensorShape=\[(\d)\]", out)
    assert m, out[-3000:]
    shapes = {int(m.group(1)): m.group(3), int(m.group(4)): m.group(5)}
    assert shapes == {0: "1", 1: "2"}
    assert len(re.findall(r"^\[rank \d on \S+\] failed too: RuntimeError: Detected mismatch", out, re.M)) == 1


def test_demo_unused_parameter_error_and_both_fixes():
    result = torchrun(DEMO, "--bug", "unused_parameter", check=False, timeout=120)
    out = result.output
    assert result.returncode != 0
    # One traceback, from the rank that failed first; the other says one line (or is stopped).
    assert len(re.findall(r"^\[rank \d on \S+\] failed:$", out, re.M)) == 1, out[-3000:]
    assert len(re.findall(r"Parameter indices which did not receive grad for rank \d: 4 5", out)) == 1  # aux_head
    assert out.count("Expected to have finished reduction in the prior iteration") in (1, 2)
    for fix in ("find_unused", "use_all"):
        fixed = torchrun(DEMO, "--bug", "unused_parameter", "--fix", fix, timeout=120)
        assert "step 4 mean loss" in fixed.stdout and "done: no bug" in fixed.stdout


def test_demo_rank0_only_barrier_times_out_with_both_collectives_named():
    result = torchrun(DEMO, "--bug", "rank0_barrier", "--timeout-s", "5", check=False, timeout=120)
    out = result.output
    assert result.returncode != 0
    assert re.search(r"^\[rank 0 on \S+\] a collective timed out after 5 s", out, re.M), out[-3000:]
    assert re.search(r"waiting: rank 0 in dist\.barrier called at demo_bugs\.py:\d+; "
                     r"rank 1 in backward\(\) \(DDP's gradient all-reduce\) called at demo_bugs\.py:\d+", out)
    assert "the ranks wait in DIFFERENT collectives" in out
    assert re.search(r"^\[rank 1 on \S+\] timed out too", out, re.M)


# --- static check: rank-0-only blocks call no collective ----------------------------------------

_DIST_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "new_group",
}


def _common_collectives() -> set[str]:
    """Functions and methods in common/ whose docstring says they are collectives."""
    names = set()
    for path in (REPO / "common").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if doc.startswith("Collective"):
                    names.add(node.name)
    return names


def _rank_test(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return "is_main" in text or bool(re.search(r"rank\b\)?\s*(==|!=|>|<|>=|<=)\s*\d|\d\s*(==|!=)\s*\S*rank", text))


def _collective_calls(nodes: list[ast.stmt], collectives: set[str]) -> list[str]:
    calls = []
    for stmt in nodes:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
                if (name in _DIST_COLLECTIVES and owner in ("dist", "torch.distributed")) or name in collectives:
                    calls.append(name)
    return calls


def rank_only_collectives(path: Path) -> list[str]:
    """`file:line: call` for collectives inside rank-dependent `if` blocks that the other branch
    does not match call for call (an if/else that calls the same collectives on both sides is fine)."""
    collectives = _common_collectives()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and _rank_test(node.test):
            body = _collective_calls(node.body, collectives)
            other = _collective_calls(node.orelse, collectives)
            if body != other:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {body or other}")
    return found


def test_no_rank0_only_block_calls_a_collective():
    files = sorted(REPO.glob("0*/*.py")) + sorted((REPO / "common").glob("*.py"))
    assert files
    problems = [p for f in files for p in rank_only_collectives(f)]
    assert problems == [], "collectives inside rank-only blocks:\n" + "\n".join(problems)


def test_static_check_finds_the_deliberate_bugs_of_the_demo():
    # The same check flags the deliberate bug, so it would flag one in an example too.
    problems = rank_only_collectives(REPO / DEMO)
    assert any("['barrier']" in p for p in problems), problems  # --bug rank0_barrier
    assert any("['all_reduce']" in p for p in problems), problems  # --bug mismatched_collective
