"""debugging/: each bug demo fails fast with the message torch and gloo print for it, as
debugging/README.md quotes it, and each fix runs clean; and no rank-0-only block in the examples
calls a collective (a static check that also finds the demo's deliberate bugs).
"""

from __future__ import annotations

import ast
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, clean_env, kill_group, read_summary, root_cause, torchrun

DEMO = "debugging/demo_bugs.py"


def test_demo_runs_clean_without_a_bug(tmp_path):
    result = torchrun(DEMO, "--output-dir", str(tmp_path), timeout=120)
    assert "step 4 mean loss" in result.stdout and "done: no bug" in result.stdout
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["replicas_identical"]


def test_demo_mismatched_collective_gloo_aborts_on_the_size_mismatch(tmp_path):
    """Without debugging aids: rank 1's all-reduce of 2 doubles meets rank 0's of 1 float, and gloo
    aborts the receiving process (SIGABRT) with its own message."""
    result = torchrun(DEMO, "--bug", "mismatched_collective", "--output-dir", str(tmp_path), check=False,
                      timeout=120)
    out = result.output
    assert result.returncode != 0
    assert "Received data size doesn't match expected size. Is there a distributed collective mismatch" in out, \
        out[-3000:]
    # The receiving process aborts (SIGABRT). torchrun's summary usually says so, but an abort can leave
    # that rank's error file half written, and torchrun then fails reading it: check the abort itself.
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in out, out[-3000:]


def test_demo_mismatched_collective_named_by_debug_detail(tmp_path):
    # TORCH_SHOW_CPP_STACKTRACES adds the C++ stack to the error c10d raises (addr2line off: symbolizing is slow).
    env = clean_env(TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_SHOW_CPP_STACKTRACES="1", TORCH_DISABLE_ADDR2LINE="1")
    result = torchrun(DEMO, "--bug", "mismatched_collective", "--output-dir", str(tmp_path), env=env,
                      check=False, timeout=120)
    out = result.output
    assert result.returncode != 0
    # The skipped all-reduce (shape [1], on rank 0 only) meets rank 1's next one (shape [2]) at the
    # same sequence number; the check runs on both ranks, either may report first.
    pattern = (r"Detected mismatch between collectives on ranks\. Rank (\d) is running collective: "
               r"CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=ALLREDUCE, TensorShape=\[(\d)\].*?"
               r"but Rank (\d) is running collective: CollectiveFingerPrint\(SequenceNumber=\2, "
               r"OpType=ALLREDUCE, TensorShape=\[(\d)\]")
    m = re.search(pattern, out)
    assert m, out[-3000:]
    assert {int(m.group(1)): m.group(3), int(m.group(4)): m.group(5)} == {0: "1", 1: "2"}
    assert re.search(r"^\[rank\d\]: RuntimeError: Detected mismatch between collectives", out, re.M)
    # @record put the exception into torchrun's summary.
    assert "Detected mismatch between collectives on ranks" in root_cause(out)
    assert re.search(r"^\[rank\d\]: Exception raised from \w+ at \S+/c10d/ProcessGroupWrapper\.cpp:\d+ \(most recent "
                     r"call first\):$", out, re.M), out[-3000:]


def test_demo_unused_parameter_error_and_both_fixes(tmp_path):
    result = torchrun(DEMO, "--bug", "unused_parameter", "--output-dir", str(tmp_path / "bug"), check=False,
                      timeout=120)
    out = result.output
    assert result.returncode != 0
    assert "step 1 mean loss" in out and "step 2 mean loss" not in out  # DDP notices at the next forward
    assert re.search(r"^\[rank\d\]: RuntimeError: Expected to have finished reduction in the prior iteration "
                     r"before starting a new one", out, re.M), out[-3000:]
    # DDP names the aux head's weight and bias (parameters 4 and 5), on each rank that reports.
    assert re.search(r"^\[rank\d\]: Parameter indices which did not receive grad for rank \d: 4 5$", out, re.M)
    root = root_cause(out)
    assert "Expected to have finished reduction" in root and re.search(r"did not receive grad for rank \d: 4 5", root)
    # Negative control for the variables other runs set: without TORCH_SHOW_CPP_STACKTRACES this c10d error
    # has no C++ stack, and without TORCH_CPP_LOG_LEVEL=INFO c10d logs no store connections.
    assert "Exception raised from" not in out and "[c10d] The client socket has connected to" not in out
    for fix in ("find_unused", "use_all"):
        fixed = torchrun(DEMO, "--bug", "unused_parameter", "--fix", fix, "--output-dir", str(tmp_path / fix),
                         timeout=120)
        assert "step 4 mean loss" in fixed.stdout and "done: no bug" in fixed.stdout
        assert read_summary(tmp_path / fix)["replicas_identical"]


def _run_timed(cmd: list, marker: str, timeout: float, env: dict[str, str]) -> tuple[int, str, float]:
    """Run `cmd` (own process group, stdout and stderr merged); return its exit code, its output and
    the seconds from the first line containing `marker` to its exit."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines, seen = [], []

    def read():
        for line in proc.stdout:
            if marker in line and not seen:
                seen.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{''.join(lines)[-4000:]}", pytrace=False)
    ended = time.monotonic()
    reader.join(timeout=10)
    out = "".join(lines)
    assert seen, f"{marker!r} never printed:\n{out[-3000:]}"
    return proc.returncode, out, ended - seen[0]


def test_demo_rank0_only_barrier_ends_at_the_timeout_with_both_waits_shown(tmp_path):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / DEMO,
           "--bug", "rank0_barrier", "--timeout-s", "5", "--output-dir", tmp_path]
    env = clean_env(TORCH_CPP_LOG_LEVEL="INFO", TORCH_SHOW_CPP_STACKTRACES="1")
    code, out, after_bug = _run_timed(cmd, "rank 0 writes a checkpoint", timeout=120, env=env)
    assert code != 0
    # TORCH_CPP_LOG_LEVEL=INFO: c10d logs its store connections. TORCH_SHOW_CPP_STACKTRACES adds no C++ stack
    # to gloo's own timeout (it does to the errors c10d raises: the DETAIL test above).
    assert "[c10d] The client socket has connected to" in out, out[-3000:]
    assert "Exception raised from" not in out, out[-3000:]
    # gloo raised on both ranks after 5 s (not its default 30 min); torchrun stopped the job.
    assert 5 <= after_bug < 30, f"{after_bug:.1f} s from the bug to the end of the job"
    # Whichever rank times out first raises gloo's timeout; the other raises the same or, when the first
    # one's exit closed the connection before its own timeout fired, "Connection closed by peer".
    timed_out = [rank for rank in (0, 1)
                 if re.search(rf"^\[rank{rank}\]: RuntimeError: .*Timed out waiting 5000ms", out, re.M)]
    assert timed_out, out[-3000:]
    for rank in {0, 1} - set(timed_out):
        assert re.search(rf"^\[rank{rank}\]: RuntimeError: .*Connection closed by peer", out, re.M), out[-3000:]
    # Each rank's traceback shows the line it waited in: two DIFFERENT collectives.
    rank0 = "\n".join(line for line in out.splitlines() if line.startswith("[rank0]:"))
    rank1 = "\n".join(line for line in out.splitlines() if line.startswith("[rank1]:"))
    assert "dist.barrier()  # BUG" in rank0 and "loss.backward()" not in rank0, rank0
    assert "loss.backward()" in rank1 and "dist.barrier()" not in rank1, rank1
    root = root_cause(out)
    assert "Timed out waiting 5000ms" in root or "Connection closed by peer" in root, root


# --- static check: rank-0-only blocks call no collective ----------------------------------------

_DIST_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "new_group",
}


def _documented_collectives(paths: list[Path]) -> set[str]:
    """Functions whose docstring says they are collectives ("Collective: ...")."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (ast.get_docstring(node) or "").startswith("Collective"):
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
    """`file:line: calls` for collectives inside rank-dependent `if` blocks that the other branch
    does not match call for call (an if/else that calls the same collectives on both sides is fine).
    Collectives: torch.distributed's, and the functions of common/ and of the file itself whose
    docstring starts with "Collective"."""
    collectives = _documented_collectives(sorted((REPO / "common").glob("*.py")) + [path])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and _rank_test(node.test):
            body = _collective_calls(node.body, collectives)
            other = _collective_calls(node.orelse, collectives)
            if body != other:
                name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                found.append(f"{name}:{node.lineno}: {body or other}")
    return found


def test_no_rank0_only_block_calls_a_collective():
    files = sorted(REPO.glob("0*/*.py")) + sorted((REPO / "common").glob("*.py"))
    assert files
    problems = [p for f in files for p in rank_only_collectives(f)]
    assert problems == [], "collectives inside rank-only blocks:\n" + "\n".join(problems)


def test_static_check_finds_the_deliberate_bugs_of_the_demo(tmp_path):
    # The same check flags the deliberate bugs, so it would flag one in an example too.
    problems = rank_only_collectives(REPO / DEMO)
    assert any("['barrier']" in p for p in problems), problems  # --bug rank0_barrier
    assert any("['all_reduce']" in p for p in problems), problems  # --bug mismatched_collective
    # A script's own collective helper (docstring "Collective: ...") counts too.
    script = tmp_path / "probe.py"
    script.write_text('def helper():\n    """Collective: sums."""\n\n\nif rank == 0:\n    helper()\n')
    assert rank_only_collectives(script) == [f"{script}:5: ['helper']"]


def evaluation_problems(source: str) -> list[str]:
    """What keeps `evaluate` from being safe on uneven shards: it must get the plain module (DDP's forward
    may run collectives) and all-reduce once, after its loop, not per batch."""
    tree = ast.parse(source)
    problems = []
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "evaluate"]
    if not calls or any(not ast.unparse(c.args[0]).endswith(".module") for c in calls):
        problems.append("evaluate is not called with model.module")
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "evaluate")
    in_loops = [c for loop in ast.walk(function) if isinstance(loop, ast.For) for c in ast.walk(loop)
                if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("all_reduce")]
    every = [c for c in ast.walk(function) if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("all_reduce")]
    if len(every) != 1 or in_loops:
        problems.append(f"evaluate all-reduces {len(every)} time(s) in its body, {len(in_loops)} inside a loop")
    return problems


def test_basic_ddp_evaluates_the_plain_module_and_all_reduces_once():
    """debugging/README.md, "Hang at the end of an epoch": evaluate model.module and all-reduce sums and
    counts once at the end, as 01_basic_ddp does."""
    source = (REPO / "01_basic_ddp" / "train.py").read_text()
    assert evaluation_problems(source) == []
    # The check itself: evaluating through the wrapper, or all-reducing per batch, is reported.
    assert evaluation_problems(source.replace("evaluate(model.module,", "evaluate(model,")) != []
    per_batch = source.replace("    dist.all_reduce(totals)  # sum over ranks",
                               "    for _ in range(1):\n        dist.all_reduce(totals)")
    assert per_batch != source and evaluation_problems(per_batch) != []
