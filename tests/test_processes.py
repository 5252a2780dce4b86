"""The suite's own guard against hangs (tests/processes.py): a launcher that runs past its timeout
fails its test with the Python and native stacks of every process it started, and leaves none
of them behind, torchrun's workers in their own sessions included. Shown on a real torchrun
whose two workers sleep, so that the test has a known line to find in the stacks. And the runs that
README samples share with behaviour tests (tests/sample_runs.py) run once per session."""

import re
import time

import pytest

from tests.paths import PYTHON
from tests.processes import run, torchrun_nodes, warm_ranks

HANGS = "import time\nprint('started', flush=True)\ntime.sleep(3600)  # the line a hang waits on\n"


@pytest.mark.parametrize(
    "runner",
    # waits out its timeout under a real torchrun: launchers tier; the warm guard stays by default
    [
        pytest.param("torchrun", marks=pytest.mark.launchers),
        pytest.param("torchrun nodes", marks=pytest.mark.launchers),
        "warm ranks",
    ],
)
def test_a_timeout_records_every_processs_stacks_and_leaves_none(tmp_path, runner):
    """processes.run on a real torchrun and its two workers, processes.torchrun_nodes on two
    torchrun "nodes" with a worker each, and processes.warm_ranks on ranks forked from the
    worker's forkserver (not this process's children): past the timeout, every process is dumped
    with the Python line it waits on, then killed; none is left."""
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(pytest.fail.Exception) as failure:
        if runner == "torchrun":
            run(
                [
                    PYTHON,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node=2",
                    script,
                ],
                20,
            )
        elif runner == "torchrun nodes":
            torchrun_nodes(tmp_path, script, [], nodes=2, timeout=30)
        else:
            warm_ranks(script, timeout=20)
    message = str(failure.value)
    assert re.match(r"timed out after (20|30)s", message), message[-3000:]
    # torchrun or the warm job, and both ranks, each with the Python line it waits on
    assert message.count("--- pid ") >= 3, message[-3000:]
    assert message.count("(hangs.py:3)") == 2, message[-3000:]
    if runner.startswith("torchrun"):  # native frames too
        assert "libc.so" in message or "libpython" in message, message[-3000:]
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
