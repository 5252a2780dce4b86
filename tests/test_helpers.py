"""The suite's own guard against hangs (tests/helpers.py): a launcher that runs past its timeout
fails its test with the Python and native stacks of every process it started, and leaves none
of them behind, torchrun's workers in their own sessions included. Shown on a real torchrun
whose two workers sleep, so that the test has a known line to find in the stacks. And the runs that
README samples share with behaviour tests (tests/sample_runs.py) run once per session."""

import os
import re
import signal
import time

import pytest

from tests.helpers import (
    Result,
    PYTHON,
    REPO,
    _marked_pids,
    code_lines_without_messages,
    kill_group,
    run,
    start,
    warm_ranks,
    without_comments,
)

HANGS = "import time\nprint('started', flush=True)\ntime.sleep(3600)  # the line a hang waits on\n"


def torchrun_that_hangs(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]


@pytest.mark.launchers  # waits out its timeout under a real torchrun; the warm guard below stays
def test_a_timeout_records_every_processs_stacks_and_kills_the_whole_tree(tmp_path):
    cmd = torchrun_that_hangs(tmp_path)
    with pytest.raises(pytest.fail.Exception) as failure:
        run(cmd, timeout=25)
    message = str(failure.value)
    assert message.startswith("timed out after 25s")
    # torchrun and both workers, each with the Python line it waits on
    assert message.count("--- pid ") >= 3, message[-3000:]
    assert message.count("<module> (hangs.py:3)") == 2, message[-3000:]
    # native frames too
    assert "libc.so" in message or "libpython" in message, message[-3000:]


def test_warm_ranks_past_the_timeout_record_both_ranks_stacks_and_leave_none(tmp_path):
    """The same guard for ranks forked from the worker's forkserver (helpers.warm_ranks): the job
    and both ranks are dumped, then killed; none is left (they are not this process's children)."""
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(pytest.fail.Exception) as failure:
        warm_ranks(script, timeout=20)
    message = str(failure.value)
    assert message.startswith("timed out after 20s") and message.count("started") == 2, message
    assert message.count("--- pid ") >= 3, message[-3000:]
    assert message.count("(hangs.py:3)") == 2, message[-3000:]
    dumped = [int(pid) for pid in re.findall(r"^--- pid (\d+)", message, re.M)]
    deadline = time.monotonic() + 30
    while [pid for pid in dumped if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in dumped if _alive(pid)] == []


def _alive(pid: int) -> bool:
    """Running, or stopped: not gone and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_group_reaches_workers_in_their_own_sessions(tmp_path):
    """torchrun starts each worker with setsid: killing torchrun's process group alone leaves
    them running (the control), kill_group() ends them too."""
    proc = start(torchrun_that_hangs(tmp_path), cwd=REPO)
    deadline = time.monotonic() + 60
    while len(_marked_pids(proc.tree_marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    workers = _marked_pids(proc.tree_marker) - {proc.pid}
    assert len(workers) >= 2
    assert all(os.getsid(pid) != os.getsid(proc.pid) for pid in workers if pid != proc.pid)
    try:
        # the control: the process group alone
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(1)
        survivors = _marked_pids(proc.tree_marker)
        assert survivors, "torchrun's workers no longer outlive its process group"
    finally:
        kill_group(proc)
    deadline = time.monotonic() + 30
    while _marked_pids(proc.tree_marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _marked_pids(proc.tree_marker) == set()
    proc.communicate(timeout=30)


def test_torch_text_tests_skip_on_another_torch_only(monkeypatch):
    """conftest's rule: on a torch other than the pinned one, every `torch_text` test gets a skip
    naming both versions; on the pinned torch, none does (the control); other tests never."""
    import pytest

    from tests import conftest

    class Item:
        def __init__(self, marked):
            self.marked, self.added = marked, []

        def get_closest_marker(self, name):
            return self.marked if name == "torch_text" else None

        def add_marker(self, marker):
            self.added.append(marker)

    for running, skipped in ((conftest.PINNED_TORCH, False), ("2.8.0", True)):
        monkeypatch.setattr(conftest, "RUNNING_TORCH", running)
        text, other = Item(pytest.mark.torch_text), Item(None)
        conftest.pytest_collection_modifyitems(None, [text, other])
        assert other.added == [] and bool(text.added) == skipped
        if skipped:
            reason = text.added[0].kwargs["reason"]
            assert conftest.PINNED_TORCH in reason and "2.8.0" in reason


def test_the_code_view_of_a_script_leaves_out_comments_and_what_prints_say():
    """What lesson comparisons see (tests/test_lessons.py, tests/test_multinode.py)."""
    source = (
        'x = 1  # one\n# alone\ns = "# kept"\nprint(\n    f"{x} said",\n    flush=True,\n)\ny = 2\n'
    )
    assert (
        without_comments(source)
        == 'x = 1\ns = "# kept"\nprint(\n    f"{x} said",\n    flush=True,\n)\ny = 2\n'
    )
    assert code_lines_without_messages(without_comments(source)) == [
        "x = 1",
        's = "# kept"',
        "print(...)",
        "y = 2",
    ]


def test_a_shared_sample_run_runs_once_and_a_held_one_is_taken_last(tmp_path, monkeypatch):
    """tests/sample_runs.py: a second asker reads the first one's run (output, exit codes, files)
    instead of running it again; shared_runs() takes first the runs no other process holds, and
    waits for a held one only when nothing else is left."""
    import fcntl
    import threading

    from tests import sample_runs

    calls = []

    def fake(out):
        calls.append(out.parent.name)
        (out / "made").write_text("file")
        return [Result("fake", 3, "printed\n", "said\n")]

    for name in ("held", "free"):
        monkeypatch.setitem(sample_runs.RUNS, name, fake)
    first = sample_runs.shared_run("free", tmp_path)
    assert sample_runs.shared_run("free", tmp_path) == first and calls == ["free"]
    assert (first.stdout, first.stderr, first.returncodes) == ("printed\n", "said\n", (3,))
    assert (first.output_dir / "made").read_text() == "file"

    order = []
    with open(tmp_path / "held.lock", "w") as lock:  # as another worker running "held" would
        fcntl.flock(lock, fcntl.LOCK_EX)
        taker = threading.Thread(
            target=lambda: order.extend(
                n for n, _ in sample_runs.shared_runs(["held", "free"], tmp_path)
            )
        )
        taker.start()
        deadline = time.monotonic() + 10
        while order != ["free"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert order == ["free"] and taker.is_alive()  # waits for the held one
    taker.join(10)
    assert order == ["free", "held"] and calls == ["free", "held"]
