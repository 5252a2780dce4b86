"""The sample outputs the READMEs show, regenerated from real runs.

    python tests/readme_samples.py             # run each command, say which README sample drifted
    python tests/readme_samples.py --write     # run each command, rewrite the README samples
    python tests/readme_samples.py --write 01  # only 01's

A sample is the plain ``` block after a marker in a README, made of what the README's command
printed, abridged the same way every time (abridge_*() below). The suite compares each sample with
a run in one test per sample, whose message names this script when they drift:
- 01 (tests/test_basic_ddp.py::test_readme_sample_output_is_what_the_quick_start_prints): the same
  command, the same abridgement, line by line. Numbers with four decimals (losses, accuracies)
  differ a little from CPU to CPU: the comparison masks them, and checks the accuracy within 0.02
  of the run's.
- 03 and 04 (tests/test_grad_accum.py, tests/test_syncbn.py): a shorter run than the README's, so
  by shape (shape_drift): every line of the sample, numbers masked, is a line the run printed.
When a print line of a script changes, that one test fails.
"""

from __future__ import annotations

import argparse
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
from tests.helpers import markdown_blocks, readme_sample  # noqa: E402

DECIMAL = re.compile(r"\d+\.\d{4}\b")


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
    parser.add_argument("names", nargs="*", help=f"samples (default: all of {sorted(SAMPLES)})")
    parser.add_argument("--write", action="store_true", help="rewrite the README samples")
    args = parser.parse_args()
    drifted = 0
    for name in args.names or sorted(SAMPLES):
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
