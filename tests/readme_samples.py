"""The sample outputs the READMEs show, regenerated from real runs.

    python tests/readme_samples.py             # run each command, say which README sample drifted
    python tests/readme_samples.py --write     # run each command, rewrite the README samples
    python tests/readme_samples.py --write 01  # only 01's
    python tests/readme_samples.py --write frames  # traceback and py-spy frames: line numbers

A sample is the plain ``` block after a marker in a README, made of what the README's command
printed, abridged the same way every time (abridge_*() below). The suite compares each sample with
a run in one test per sample, whose message names this script when they drift:
- 01 (tests/test_basic_ddp.py::test_readme_sample_output_is_what_the_quick_start_prints): the same
  command, the same abridgement, line by line. Numbers with four decimals (losses, accuracies)
  differ a little from CPU to CPU: the comparison masks them, and checks the accuracy within 0.02
  of the run's.
- 03 and 04 (tests/test_grad_accum.py, tests/test_syncbn.py): a shorter run than the README's, so
  by shape (shape_drift): every line of the sample, numbers masked, is a line the run printed.
- 02's and 05's samples (Printed below; tests/test_sampler_patterns.py, each in the test of its
  section, and tests/test_checkpointing.py):
  every line of the sample is a line the run printed (printed_drift); `...` stands for any text.
  These samples are picked lines, not a fixed abridgement: --write runs the README's commands as
  written (from the repository root, into runs/ and data/) and replaces each line the run no
  longer prints by the printed line closest to it.
When a print line of a script changes, that one test fails.
The traceback frames and py-spy dumps the READMEs quote point at lines of the scripts
(tests/test_doc_consistency.py checks them); when a script's lines move, `--write frames` renumbers
them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: tests.helpers importable
from tests.helpers import markdown_blocks, readme_sample, tracked_files  # noqa: E402

DECIMAL = re.compile(r"\d+\.\d{4}\b")


# --- traceback frames and py-spy dumps the READMEs quote, by line number -----------------------

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
RENUMBER = "python tests/readme_samples.py --write frames"


def site_packages() -> Path:
    """Where torch is installed, found without importing it."""
    import importlib.util

    return Path(importlib.util.find_spec("torch").origin).parents[1]


def enclosing_function(source: str, line: int) -> str:
    """The innermost def containing `line`, or <module>."""
    import ast

    name, start = "<module>", 0
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.lineno <= line <= node.end_lineno
        ):
            if node.lineno >= start:
                name, start = node.name, node.lineno
    return name


def in_repository(file: Path | None) -> bool:
    """Whether `file` is one of the repository's own files: inside it, and not in the installed
    packages (a virtual environment may sit inside the clone, or beside it with a longer name)."""
    return (
        file is not None and file.is_relative_to(REPO) and not file.is_relative_to(site_packages())
    )


def frame_file(path: str) -> Path | None:
    return next((root / path for root in (REPO, site_packages()) if (root / path).is_file()), None)


def py_spy_frames(block: str) -> list[tuple[str, Path | None, int]]:
    """(function, file, line) of each frame in a py-spy dump quoted by a
    README; a bare file name is looked for beside the script the dump's
    `Process N: python -u <script>` line names, then in tests/inject."""
    script = re.search(r"^Process \d+: \S+ -u (\S+\.py)", block, re.M)
    folders = (
        [REPO, site_packages()]
        + ([(REPO / script[1]).parent] if script else [])
        + [REPO / "tests" / "inject"]
    )
    frames = []
    for frame in PY_SPY_FRAME.finditer(block):
        file = next(
            (folder / frame["path"] for folder in folders if (folder / frame["path"]).is_file()),
            None,
        )
        frames.append((frame["function"], file, int(frame["line"])))
    return frames


def closest_line(file: Path, function: str, text: str, near: int) -> int | None:
    """The line of `file` nearest `near` that reads `text` (comment aside) inside `function`."""
    source = file.read_text()
    found = [
        number
        for number, line in enumerate(source.splitlines(), 1)
        if line.split("  #")[0].strip() == text
        and enclosing_function(source, number) == function.split(".")[-1]
    ]
    return min(found, key=lambda number: abs(number - near)) if found else None


def renumber_frames(text: str) -> str:
    """`text` with each quoted traceback frame of a repository file pointing at the line it
    quotes, and each py-spy frame of the repository's files at its PY_SPY_WAITS line."""

    def traceback_frame(match):
        file = frame_file(match["path"])
        if not in_repository(file):
            return match[0]
        number = closest_line(file, match["function"], match["source"].strip(), int(match["line"]))
        return (
            match[0]
            if number is None
            else match[0].replace(f'", line {match["line"]}, in', f'", line {number}, in', 1)
        )

    text = FRAME.sub(traceback_frame, text)
    waits = iter(PY_SPY_WAITS)
    for block in re.findall(r"^Process \d+:.*?(?=^```)", text, re.M | re.S):
        frames = iter(py_spy_frames(block))

        def py_spy_frame(match):
            function, file, line = next(frames)
            if not in_repository(file):
                return match[0]
            number = closest_line(file, function, next(waits), line)
            return match[0] if number is None else match[0].replace(f":{line})", f":{number})")

        text = text.replace(block, PY_SPY_FRAME.sub(py_spy_frame, block), 1)
    return text


def write_frames() -> list[str]:
    """Renumber the frames every README quotes; the READMEs changed."""
    changed = []
    for doc in tracked_files("*.md"):
        text = doc.read_text()
        if (renumbered := renumber_frames(text)) != text:
            doc.write_text(renumbered)
            changed.append(str(doc.relative_to(REPO)))
    return changed


def _visible_devices_unset(text: str) -> str:
    """The banner shows CUDA_VISIBLE_DEVICES as the run inherits it; the READMEs show `unset`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    return text.replace(f"CUDA_VISIBLE_DEVICES={visible}", "CUDA_VISIBLE_DEVICES=unset")


def abridge_all(stdout: str, output_dir: str, default_output_dir: str) -> list[str]:
    """Everything rank 0 printed, with the default output folder."""
    text = _visible_devices_unset(stdout).replace(str(output_dir), default_output_dir)
    return [line for line in text.splitlines() if line.strip()]


def abridge_01(stdout: str, output_dir: str, default_output_dir: str) -> list[str]:
    """01's quick start as its README shows it: the banner, the first progress line, `...`, the
    last epoch's line and the summary line (with the default output folder)."""
    lines = abridge_all(stdout, output_dir, default_output_dir)
    return [lines[0], lines[1], "...", lines[-2], lines[-1]]


@dataclass(frozen=True)
class Sample:
    readme: str
    marker: str  # the sample is the first plain ``` block after this text
    command: str  # as the README shows it; run with --output-dir added
    abridge: Callable[[str, str, str], list[str]]
    default_output_dir: str = "runs/latest"


SAMPLES = {
    "01": Sample(
        "01_basic_ddp/README.md",
        "Output (rank 0 only",
        "torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py",
        abridge_01,
    ),
    "03": Sample(
        "03_grad_accum/README.md",
        "## Output",
        "torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --batch-size 8 "
        "--accum-steps 4 --epochs 3",
        abridge_all,
    ),
    "04": Sample(
        "04_syncbn/README.md",
        "## Output",
        "torchrun --standalone --nproc_per_node=2 04_syncbn/train.py --log-every 1000",
        abridge_all,
    ),
}


@dataclass(frozen=True)
class Printed:
    """A sample whose every line is one that `commands` (the README's, run in this order) print:
    `...` in a line stands for any text; a line that is only `...`, after a `[rankN]:` prefix or
    not, marks lines left out. `output_dir` is the folder the sample shows."""

    readme: str
    marker: str  # the sample is the first plain ``` block after this text
    commands: tuple[str, ...]
    output_dir: str = ""


SAMPLER = "02_sampler_patterns"
GATHER = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/gather_predictions.py"
UNEVEN = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/uneven_inputs.py --fix"
# 05's README command (its first), with the flags the sample names
CHECKPOINTING = (
    "torchrun --standalone --nproc_per_node=2 05_checkpointing/train.py --save-every-steps 20 "
    "--epochs 2 --batch-size 16 --log-every 30 --output-dir runs/b"
)
PRINTED = {
    "02-viewer": Printed(
        f"{SAMPLER}/README.md",
        "## 1. `partition_viewer.py`",
        (
            f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/partition_viewer.py "
            "--num-samples 10",
        ),
    ),
    "02-no-sampler": Printed(
        f"{SAMPLER}/README.md",
        "## 2. `no_sampler_pitfall.py`",
        (f"torchrun --standalone --nproc_per_node=2 {SAMPLER}/no_sampler_pitfall.py",),
    ),
    "02-eval": Printed(
        f"{SAMPLER}/README.md",
        "## 3. `distributed_eval.py`",
        (f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/distributed_eval.py",),
    ),
    "02-gather": Printed(
        f"{SAMPLER}/README.md",
        "## 4. `gather_predictions.py`",
        ("python 01_basic_ddp/train.py", GATHER),
        "runs/gather_predictions",
    ),
    "02-gather-padded": Printed(
        f"{SAMPLER}/README.md",
        "With `--padded` each rank reads",
        ("python 01_basic_ddp/train.py", f"{GATHER} --padded"),
        "runs/gather_predictions",
    ),
    "02-weighted": Printed(
        f"{SAMPLER}/README.md",
        "## 5. `weighted_sampler.py`",
        (f"torchrun --standalone --nproc_per_node=2 {SAMPLER}/weighted_sampler.py",),
    ),
    "02-uneven": Printed(
        f"{SAMPLER}/README.md",
        "Each rank reads its own slice",
        (f"{UNEVEN} join", f"{UNEVEN} drop_last"),
        "runs/uneven_inputs",
    ),
    # 05: the text before the sample names the flags of both runs
    "05-resume": Printed(
        "05_checkpointing/README.md",
        "Output of a run stopped at step 57",
        (
            "rm -rf runs/b",
            f"{CHECKPOINTING} --max-steps 57",
            CHECKPOINTING,
        ),
        "runs/b",
    ),
    "02-uneven-none": Printed(
        f"{SAMPLER}/README.md",
        "torch's own messages (the command above, abridged)",
        (
            f"torchrun --standalone --nproc_per_node=2 {SAMPLER}/uneven_inputs.py --fix none "
            "--timeout-s 5",
        ),
    ),
}


def sample_lines(name: str) -> list[str]:
    """The lines of the README's sample `name`, trailing blanks cut."""
    sample = PRINTED[name]
    return [line.rstrip() for line in readme_sample(REPO / sample.readme, sample.marker)]


def paragraphs(name: str) -> list[list[str]]:
    """The sample's paragraphs (split at blank lines), each a list of lines."""
    text = "\n".join(sample_lines(name)).strip("\n")
    return [para.splitlines() for para in re.split(r"\n\s*\n", text)]


def _elided(line: str) -> bool:
    return line.strip() == "..." or line.strip().endswith(":   ...")


def _pattern(line: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


def printed_drift(
    name: str, output: str, output_dir: str | Path | None = None, lines: list[str] | None = None
) -> list[str]:
    """The lines of sample `name` (or `lines` of it) that `output` does not print: empty when
    every one is a printed line. A run into `output_dir` is read as if into the sample's."""
    if output_dir is not None:
        output = output.replace(str(output_dir), PRINTED[name].output_dir)
    printed = [line.rstrip() for line in _visible_devices_unset(output).splitlines()]
    return [
        f"README: {line!r} (not printed)"
        for line in (sample_lines(name) if lines is None else lines)
        if line.strip()
        and not _elided(line)
        and not any(_pattern(line).fullmatch(p) for p in printed)
    ]


def printed_drift_message(name: str, problems: list[str]) -> str:
    sample = PRINTED[name]
    return (
        f"{sample.readme}: the sample after {sample.marker!r} has lines that "
        f"{' then '.join(f'`{c}`' for c in sample.commands)} no longer print:\n"
        + "\n".join(problems)
        + f"\nRegenerate it: python tests/readme_samples.py --write {name}"
    )


def run_printed(sample: Printed) -> str:
    """The README's commands as written, from the repository root; their output, whatever their
    exit codes (a sample may show a failure)."""
    output = []
    for command in sample.commands:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        output.append(done.stdout + done.stderr)
    return "\n".join(output)


def write_printed(name: str, output: str) -> list[str]:
    """Replace each line of sample `name` that `output` does not print by the printed line closest
    to it; the lines no printed line is close to (left as they are)."""
    sample = PRINTED[name]
    printed = [
        line.rstrip() for line in _visible_devices_unset(output).splitlines() if line.strip()
    ]
    path = REPO / sample.readme
    text = path.read_text()
    marker_line = text[: text.index(sample.marker)].count("\n")
    block = next(b for b in markdown_blocks(text) if b.start >= marker_line and not b.info)
    lines, unmatched = text.splitlines(), []
    for offset, line in enumerate(block.lines):
        if not printed_drift(name, output, lines=[line.rstrip()]):
            continue
        closest = difflib.get_close_matches(line.rstrip(), printed, n=1, cutoff=0.5)
        if closest:
            lines[block.start + 1 + offset] = closest[0]
        else:
            unmatched.append(line)
    path.write_text("\n".join(lines) + "\n")
    return unmatched


def shape(line: str) -> str:
    """A line with every number as N and runs of blanks as one."""
    return " ".join(re.sub(r"\d+(\.\d+)*", "N", line).split())


def shape_drift(name: str, stdout: str, output_dir: str) -> list[str]:
    """The lines of the README's sample `name` whose shape no line of a (shorter) run of its
    script has: empty when every line the README shows is one the script prints."""
    sample = SAMPLES[name]
    ran = {shape(line) for line in sample.abridge(stdout, output_dir, sample.default_output_dir)}
    shown = readme_sample(REPO / sample.readme, sample.marker)
    return [
        f"README: {line!r} (no such line in the run)" for line in shown if shape(line) not in ran
    ]


def drift(name: str, stdout: str, output_dir: str) -> list[str]:
    """What differs between the README's sample `name` and the same abridgement of a run's
    output (empty when they agree): the lines with decimals masked, and the last decimal of
    the sample's second-to-last line (01: the accuracy) within 0.02 of the run's."""
    sample = SAMPLES[name]
    shown = readme_sample(REPO / sample.readme, sample.marker)
    ran = sample.abridge(stdout, output_dir, sample.default_output_dir)
    problems = [
        f"README: {a!r}\n   run: {b!r}"
        for a, b in zip(shown, ran)
        if DECIMAL.sub("N", a) != DECIMAL.sub("N", b)
    ]
    if len(shown) != len(ran):
        problems.append(f"README shows {len(shown)} lines, the run's abridgement {len(ran)}")
    if not problems:
        shown_last, ran_last = DECIMAL.findall(shown[-2]), DECIMAL.findall(ran[-2])
        if shown_last and abs(float(shown_last[-1]) - float(ran_last[-1])) >= 0.02:
            problems.append(f"README: {shown[-2]!r}\n   run: {ran[-2]!r} (more than 0.02 apart)")
    return problems


def drift_message(name: str, problems: list[str]) -> str:
    return (
        f"{SAMPLES[name].readme}: the sample after {SAMPLES[name].marker!r} is not what "
        f"`{SAMPLES[name].command}` prints:\n"
        + "\n".join(problems)
        + f"\nRegenerate it: python tests/readme_samples.py --write {name}"
    )


def run_command(sample: Sample, output_dir: Path) -> str:
    argv = shlex.split(sample.command)
    launchers = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }
    argv = launchers.get(argv[0], argv[:1]) + argv[1:] + ["--output-dir", str(output_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{sample.command} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def write(name: str, stdout: str, output_dir: str) -> None:
    """Replace the lines of the README's sample block by the abridgement of `stdout`."""
    sample = SAMPLES[name]
    path = REPO / sample.readme
    text = path.read_text()
    marker_line = text[: text.index(sample.marker)].count("\n")
    block = next(b for b in markdown_blocks(text) if b.start >= marker_line and not b.info)
    lines = text.splitlines()
    new = sample.abridge(stdout, output_dir, sample.default_output_dir)
    lines[block.start + 1 : block.start + 1 + len(block.lines)] = new
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(SAMPLES) + sorted(PRINTED)
    parser.add_argument(
        "names", nargs="*", help=f"samples (default: all of {names}), or frames (with --write)"
    )
    parser.add_argument("--write", action="store_true", help="rewrite the README samples")
    args = parser.parse_args()
    drifted = 0
    for name in args.names or names:
        if name == "frames":
            if not args.write:
                parser.error("frames: only --write (the suite checks them)")
            print(f"frames renumbered in {write_frames() or 'no README'}")
            continue
        if name in PRINTED:
            output = run_printed(PRINTED[name])
            if args.write:
                unmatched = write_printed(name, output)
                print(f"{name}: {PRINTED[name].readme} rewritten")
                for line in unmatched:
                    print(f"  no printed line is close to {line!r}: edit it by hand")
            elif problems := printed_drift(name, output):
                drifted += 1
                print(printed_drift_message(name, problems))
            else:
                print(f"{name}: {PRINTED[name].readme} agrees with a fresh run")
            continue
        with tempfile.TemporaryDirectory() as output_dir:
            stdout = run_command(SAMPLES[name], Path(output_dir))
            if args.write:
                write(name, stdout, output_dir)
                print(f"{name}: {SAMPLES[name].readme} rewritten")
            elif problems := drift(name, stdout, output_dir):
                drifted += 1
                print(drift_message(name, problems))
            else:
                print(f"{name}: {SAMPLES[name].readme} agrees with a fresh run")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
