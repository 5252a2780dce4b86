"""A lesson ends the ordinary way, so what a copier adds to it still runs at exit: an `atexit`
handler (a tracker's finisher, a profiler's export) and a buffered file (a metrics log) both
complete. The control is the same copy ending in os._exit(0), the workaround the scripts used to
end with: neither completes. The real 01 under the real torchrun; only the copier's lines are
added (tests/stress_exit.py runs the lessons many times over to count aborts at exit)."""

from pathlib import Path

import pytest

from tests.paths import REPO
from tests.processes import clean_env, torchrun

# What a user adds near the top of a copied 01: a metrics file they write through a buffer, and
# a handler that runs when the interpreter exits. Neither is flushed or run by the lesson itself.
COPIER_LINES = """
import atexit

_RANK = os.environ["RANK"]
METRICS = open(Path(os.environ["EXIT_PROBE_DIR"]) / f"metrics.{_RANK}", "w", buffering=1 << 16)
METRICS.write("metrics of rank " + _RANK + "\\n")
atexit.register(
    lambda: (Path(os.environ["EXIT_PROBE_DIR"]) / f"atexit.{_RANK}").write_text("ran\\n")
)
"""
ANCHOR = "from common.report import parameter_checksum, run_record, write_summary\n"


def copied_lesson(tmp_path: Path, ending: str = "") -> Path:
    """A copy of 01 with the copier's lines (and `ending` after train() in main), next to a link
    to the repository's common/."""
    root = tmp_path / "copy"
    (root / "01_basic_ddp").mkdir(parents=True)
    (root / "common").symlink_to(REPO / "common")
    source = (REPO / "01_basic_ddp" / "train.py").read_text()
    assert source.count(ANCHOR) == 1 and source.count("    train(cfg, launch)\n") == 1
    source = source.replace(ANCHOR, ANCHOR + COPIER_LINES)
    source = source.replace("    train(cfg, launch)\n", "    train(cfg, launch)\n" + ending)
    script = root / "01_basic_ddp" / "train.py"
    script.write_text(source)
    return script


def run_copy(script: Path, probe: Path):
    """The copy under the real torchrun, 2 ranks, 3 steps; it must exit 0."""
    probe.mkdir()
    args = ("--epochs", "1", "--max-steps", "3", "--output-dir", str(probe / "run"))
    return torchrun(script, *args, timeout=180, env=clean_env(EXIT_PROBE_DIR=str(probe)))


def written(probe: Path) -> dict[str, str]:
    return {
        path.name: path.read_text()
        for pattern in ("metrics.*", "atexit.*")
        for path in sorted(probe.glob(pattern))
    }


@pytest.mark.launchers
def test_a_copied_lesson_runs_atexit_handlers_and_flushes_buffered_files(tmp_path):
    probe = tmp_path / "probe"
    result = run_copy(copied_lesson(tmp_path), probe)
    assert "terminate called" not in result.output
    assert written(probe) == {
        "metrics.0": "metrics of rank 0\n",
        "metrics.1": "metrics of rank 1\n",
        "atexit.0": "ran\n",
        "atexit.1": "ran\n",
    }


@pytest.mark.launchers
def test_control_os_exit_loses_both(tmp_path):
    """Negative control: the old ending skips both, and still exits 0, so nothing warns."""
    probe = tmp_path / "probe"
    run_copy(copied_lesson(tmp_path, ending="    os._exit(0)\n"), probe)
    assert written(probe) == {"metrics.0": "", "metrics.1": ""}
