"""The READMEs agree with the code and with each other where they quote it.

- Every traceback frame and py-spy frame a README quotes (`File ".../x.py", line N, in f` and the
  source line under it; `f (x.py:N)`) points at a line of that file inside that function: a quoted
  output goes stale when the script's lines move, and this test then fails, naming the line the
  quoted text is at now (edit the number by hand).
- The tolerance the READMEs give for "N ranks equal one process on the global batch" is the one
  tests/test_basic_ddp.py checks.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from urllib.parse import unquote

import torch

from tests.helpers import REPO, pinned_torch_only, tracked_files
from tests.markdown import markdown_blocks, markdown_headings, markdown_links
from tests.test_basic_ddp import assert_same_params

SITE_PACKAGES = Path(torch.__file__).resolve().parents[1]
# `File ".../x.py", line N, in f` and the source line under it
FRAME = re.compile(
    r'File "(?:\.\.\./)?(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>[\w<>]+)\n'
    r"(?:\[rank\d+\]:)?[ \t]*(?P<source>[^\n]+)"
)
# `    function (file.py:N)` in a py-spy dump
PY_SPY_FRAME = re.compile(
    r"^    (?P<function>[\w.<>]+) \((?P<path>[\w/.]+\.py):(?P<line>\d+)\)$", re.M
)
# What the ranks of debugging/README.md's py-spy dump wait on, in the repository's files, in order:
# rank 0 in backward's all-reduce; rank 1 in the test injection's hang, called from
# optimizer.step(); both under main()'s call of train().
PY_SPY_WAITS = [
    "loss.backward()",
    "train(cfg, launch)",
    "time.sleep(3600)",
    "optimizer.step()",
    "train(cfg, launch)",
]


def enclosing_function(source: str, line: int) -> str:
    """The innermost def containing `line`, or <module>."""
    name, start = "<module>", 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= node.end_lineno:
            if node.lineno >= start:
                name, start = node.name, node.lineno
    return name


def code(line: str) -> str:
    return line.split("  #")[0].strip()


def frame_problems(path: str, number: int, function: str, quoted: str | None, beside=()):
    """What is wrong with a quoted frame: `path` (in the repository, site-packages or `beside`)
    has no line `number` inside `function` (py-spy's `Class.method`: the last part) reading
    `quoted` (None: any line)."""
    file = next((d / path for d in (REPO, SITE_PACKAGES, *beside) if (d / path).is_file()), None)
    if file is None:
        return [f"{path}: no such file"]
    source = file.read_text()
    lines = source.splitlines()
    problems = []
    actual = code(lines[number - 1]) if number <= len(lines) else "<past the end>"
    if quoted is not None and actual != code(quoted):
        now = [n for n, line in enumerate(lines, 1) if code(line) == code(quoted)]
        problems.append(
            f"{path}, line {number}: quoted {code(quoted)!r}, the file has {actual!r}; "
            f"the quoted text is at line(s) {now} now: edit the number"
        )
    if enclosing_function(source, number) != function.split(".")[-1]:
        problems.append(f"{path}, line {number}: not in {function}()")
    return problems


def traceback_problems(text: str) -> list[str]:
    return [
        problem
        for frame in FRAME.finditer(text)
        for problem in frame_problems(
            frame["path"], int(frame["line"]), frame["function"], frame["source"]
        )
    ]


def test_quoted_traceback_frames_point_at_the_quoted_lines():
    quotes = {doc: doc.read_text() for doc in tracked_files("*.md")}
    quotes = {doc: text for doc, text in quotes.items() if FRAME.search(text)}
    assert REPO / "debugging" / "README.md" in quotes  # the timeout sample quotes 01's train.py
    problems = [
        f"{doc.relative_to(REPO)}: {p}"
        for doc, text in quotes.items()
        for p in traceback_problems(text)
    ]
    assert problems == [], problems
    # The check itself: a frame one line off, or in another function, is reported, and the
    # message says where the quoted line is.
    lesson = (REPO / "01_basic_ddp" / "train.py").read_text().splitlines()
    number = next(
        i for i, text in enumerate(lesson, 1) if text.strip().startswith("loss.backward()")
    )
    quoted = lesson[number - 1].strip()
    [off_by_one] = traceback_problems(
        f'File ".../01_basic_ddp/train.py", line {number + 1}, in train\n    {quoted}'
    )
    assert f"at line(s) [{number}] now" in off_by_one
    wrong_function = f'File ".../01_basic_ddp/train.py", line {number}, in main\n    {quoted}'
    assert len(traceback_problems(wrong_function)) == 1


def py_spy_problems(block: str) -> list[str]:
    """The frames of a quoted py-spy dump off their functions, or, in the repository's files, off
    the PY_SPY_WAITS lines; a bare file name is looked for beside the script the dump's
    `Process N: python -u <script>` line names, then in tests/inject."""
    script = re.search(r"^Process \d+: \S+ -u (\S+\.py)", block, re.M)
    beside = ([(REPO / script[1]).parent] if script else []) + [REPO / "tests" / "inject"]
    waits = iter(PY_SPY_WAITS)
    return [
        problem
        for frame in PY_SPY_FRAME.finditer(block)
        for problem in frame_problems(
            frame["path"],
            int(frame["line"]),
            frame["function"],
            next(waits) if "/" not in frame["path"] else None,
            beside,
        )
    ]


@pinned_torch_only("points at lines of torch's source")
def test_quoted_py_spy_dump_points_at_the_waiting_lines():
    guide = (REPO / "debugging" / "README.md").read_text()
    block = next(
        "\n".join(b.lines)
        for b in markdown_blocks(guide)
        if not b.info and b.lines and re.match(r"Process \d+:", b.lines[0])
    )
    assert len(PY_SPY_FRAME.findall(block)) == 9 and py_spy_problems(block) == []
    # The check itself: a frame one line off is reported.
    moved = block.replace("    main (train.py:", "    main (train.py:1", 1)
    assert moved != block and len(py_spy_problems(moved)) == 2  # another line, another function


def test_the_global_batch_tolerance_in_the_readmes_is_the_tested_one():
    rtol = inspect.signature(assert_same_params).parameters["rtol"].default
    quoted = f"{rtol:.0e}".replace("e-0", "e-")  # 1e-05 -> 1e-5, as the READMEs write it
    assert quoted == "1e-5"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"It holds to a relative tolerance of {quoted} for a model without BatchNorm" in readme
    basic = " ".join((REPO / "01_basic_ddp" / "README.md").read_text().split())
    assert f"as 1 process with batch 32 on the same samples (relative tolerance {quoted})" in basic
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    claim = re.search(
        r"DDP with the same global batch should match one process to (\D*\d+e-\d+)", guide
    )
    assert claim and claim[1] == f"a relative {quoted}", claim and claim[0]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(doc: Path) -> list[str]:
    """The relative links of `doc` whose file, or whose #anchor's heading, does not exist."""
    problems = []
    for target in map(unquote, markdown_links(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.is_file():
            if anchor not in {slug(h) for h in markdown_headings(file.read_text())}:
                problems.append(f"{target}: no such heading")
    return problems


def test_every_relative_link_in_the_readmes_leads_to_a_file_and_heading(tmp_path):
    problems = [
        f"{doc.relative_to(REPO)}: {p}" for doc in tracked_files("*.md") for p in link_problems(doc)
    ]
    assert problems == [], problems
    # The check itself: a missing file, or heading, is reported; a link in a code block is not.
    doc = tmp_path / "README.md"
    doc.write_text(
        '## "Address already in use" (`EADDRINUSE`)\n\n[a](#address-already-in-use-eaddrinuse) '
        "[b](#address-already-in-use) [c](missing.md) [d](https://example.org)\n\n"
        "```\n[e](#x)\n```\n"
    )
    assert link_problems(doc) == [
        "#address-already-in-use: no such heading",
        "missing.md: no such file",
    ]
