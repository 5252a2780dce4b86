"""The READMEs agree with the code and with each other where they quote it.

- Every traceback frame a README quotes (`File ".../x.py", line N, in f` and the source line under
  it)
  points at that line of the file, inside that function: a sample output goes stale when the script
  moves, and this test then fails.
- The tolerance the READMEs give for "N ranks equal one process on the global batch" is the one
  tests/test_basic_ddp.py checks.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

from tests.helpers import REPO, markdown_blocks, pinned_torch_only, tracked_files
from tests.readme_samples import (
    FRAME,
    PY_SPY_WAITS,
    RENUMBER,
    enclosing_function,
    py_spy_frames,
    renumber_frames,
)
from tests.test_basic_ddp import assert_same_params

DOCS = tracked_files("*.md")
SITE_PACKAGES = Path(torch.__file__).resolve().parents[1]


def frame_problems(text: str) -> list[str]:
    """What is wrong with each quoted frame in `text` (a
    file of this repository, or of site-packages)."""
    problems = []
    for frame in FRAME.finditer(text):
        path, line = frame["path"], int(frame["line"])
        file = next(
            (root / path for root in (REPO, SITE_PACKAGES) if (root / path).is_file()), None
        )
        if file is None:
            problems.append(f"{path}: no such file")
            continue
        source = file.read_text()
        actual = (
            source.splitlines()[line - 1].strip()
            if line <= len(source.splitlines())
            else "<past the end>"
        )
        if actual != frame["source"].strip():
            problems.append(
                f"{path}, line {line}: quoted {frame['source'].strip()!r}, the file has {actual!r}"
            )
        if enclosing_function(source, line) != frame["function"]:
            problems.append(f"{path}, line {line}: not in {frame['function']}()")
    return problems


def test_quoted_traceback_frames_point_at_the_quoted_lines():
    quotes = {doc: doc.read_text() for doc in DOCS if FRAME.search(doc.read_text())}
    assert REPO / "debugging" / "README.md" in quotes  # the timeout sample quotes 01's train.py
    problems = [
        f"{doc.relative_to(REPO)}: {p}"
        for doc, text in quotes.items()
        for p in frame_problems(text)
    ]
    assert problems == [], f"{problems}\nRenumber them: {RENUMBER}"
    # The check itself: a frame one line off, or in another function, is reported.
    lesson = (REPO / "01_basic_ddp" / "train.py").read_text().splitlines()
    number = next(
        i for i, text in enumerate(lesson, 1) if text.strip().startswith("loss.backward()")
    )
    off_by_one = (
        f'File ".../01_basic_ddp/train.py", line {number + 1}, in train\n    '
        f"{lesson[number - 1].strip()}"
    )
    wrong_function = (
        f'File ".../01_basic_ddp/train.py", line {number}, in main\n    '
        f"{lesson[number - 1].strip()}"
    )
    assert len(frame_problems(off_by_one)) == 1 and len(frame_problems(wrong_function)) == 1


def py_spy_problems(block: str) -> list[str]:
    """A frame whose line is not inside the function py-spy
    names (`Class.method`, `f.<locals>.g`: the last part)."""
    problems = []
    for function, file, line in py_spy_frames(block):
        if file is None or enclosing_function(file.read_text(), line) != function.split(".")[-1]:
            problems.append(f"{function} ({file}:{line})")
    return problems


@pinned_torch_only("points at lines of torch's source")
def test_quoted_py_spy_dump_points_at_the_waiting_lines():
    guide = (REPO / "debugging" / "README.md").read_text()
    block = next(
        "\n".join(b.lines)
        for b in markdown_blocks(guide)
        if not b.info and b.lines and re.match(r"Process \d+:", b.lines[0])
    )
    waits = [
        file.read_text().splitlines()[number - 1].strip()
        for _, file, number in py_spy_frames(block)
        if file.name in ("train.py", "sitecustomize.py")
    ]
    # Rank 0 waits in backward's all-reduce; rank 1 in the test injection's hang, called from
    # optimizer.step(); both under main()'s call of train() (readme_samples.PY_SPY_WAITS).
    problems = py_spy_problems(block)
    assert problems == [] and [w.split("  #")[0] for w in waits] == PY_SPY_WAITS, (
        f"{problems}, {waits}\nRenumber them: {RENUMBER}"
    )
    # The check itself: a frame one line off is reported.
    assert (
        py_spy_problems("Process 1: python -u 01_basic_ddp/train.py\n    main (train.py:1)\n") != []
    )


def test_the_global_batch_tolerance_in_the_readmes_is_the_tested_one():
    rtol = inspect.signature(assert_same_params).parameters["rtol"].default
    quoted = f"{rtol:.0e}".replace("e-0", "e-")  # 1e-05 -> 1e-5, as the READMEs write it
    assert quoted == "1e-5"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (
        f"the tests check this to a relative tolerance of {quoted} for a model without BatchNorm"
        in readme
    )
    basic = " ".join((REPO / "01_basic_ddp" / "README.md").read_text().split())
    assert f"as 1 process with batch 32 on the same samples (relative tolerance {quoted})" in basic
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    claim = re.search(
        r"DDP with the same global batch should match one process to (\D*\d+e-\d+)", guide
    )
    assert claim and claim[1] == f"a relative {quoted}", claim and claim[0]


def test_frames_of_installed_packages_are_not_the_repositorys(monkeypatch):
    """A virtual environment inside the clone, or beside it under a longer name (`repo` and
    `repo-venv`), holds no repository file whose quoted frames the writer would renumber."""
    from tests import readme_samples

    inside = REPO / ".venv" / "lib" / "python3.11" / "site-packages"
    monkeypatch.setattr(readme_samples, "site_packages", lambda: inside)
    assert readme_samples.in_repository(REPO / "01_basic_ddp" / "train.py")
    assert not readme_samples.in_repository(inside / "torch" / "nn" / "modules" / "module.py")
    beside = Path(f"{REPO}-venv") / "lib" / "python3.11" / "site-packages" / "torch" / "x.py"
    assert str(beside).startswith(str(REPO))  # the prefix a string comparison took for inside
    assert not readme_samples.in_repository(beside)
    assert not readme_samples.in_repository(None)


def test_renumbering_puts_moved_frames_back_on_their_lines():
    """The writer the failures above name: a traceback frame and a py-spy frame, each one line
    off, come back to the lines they quote; the guide as it is stays as it is."""
    guide = (REPO / "debugging" / "README.md").read_text()
    assert renumber_frames(guide) == guide
    lesson = (REPO / "01_basic_ddp" / "train.py").read_text().splitlines()
    number = next(
        i for i, text in enumerate(lesson, 1) if text.strip().startswith("loss.backward()")
    )
    moved = guide.replace(f'train.py", line {number}, in', f'train.py", line {number + 1}, in')
    moved = moved.replace(f"    train (train.py:{number})", f"    train (train.py:{number - 1})")
    assert moved != guide and renumber_frames(moved) == guide
