"""The sample outputs the READMEs show, compared with real runs and rewritten from them.

    python tests/readme_samples.py             # run each sample's commands, say which drifted
    python tests/readme_samples.py --write     # ... and rewrite the drifted lines
    python tests/readme_samples.py --write 01  # only 01's

A sample is the plain ``` block after a marker in a README: lines its README commands print.
One test per README (tests/test_readme_text.py) compares each of its samples with the run it
shows (tests/sample_runs.py), and its message names this script when they drift. Each line of a
sample must be a line the run printed: `...` stands for any text, a line that is only `...` marks
lines left out, and a sample's mask says what may differ from run to run (01, 05 and 09: decimals,
which vary from CPU to CPU; 03 and 04, compared with shorter runs: every number). --write runs the
README's commands as written (from the repository root, into runs/ and data/) and replaces each
drifted line by the printed line closest to it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: tests.paths importable
from tests.markdown import readme_sample, sample_block  # noqa: E402

DECIMAL = re.compile(r"\d+\.\d{4}\b")


def exact(line: str) -> str:
    return line


def decimals(line: str) -> str:
    """Numbers with four decimals (losses, accuracies) as N."""
    return DECIMAL.sub("N", line)


def shape(line: str) -> str:
    """A line with every number as N and runs of blanks as one."""
    return " ".join(re.sub(r"\d+(\.\d+)*", "N", line).split())


@dataclass(frozen=True)
class Sample:
    readme: str
    marker: str  # the sample is the first plain ``` block after this text
    commands: tuple[str, ...]  # the README's, run in this order
    output_dir: str = "runs/latest"  # the folder the sample shows
    mask: Callable[[str], str] = exact  # what may differ from run to run


SAMPLER = "02_sampler_patterns"
GATHER = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/gather_predictions.py"
UNEVEN = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/uneven_inputs.py --fix"
# 05's README command (its first), with the flags the sample names
CHECKPOINTING = (
    "torchrun --standalone --nproc_per_node=2 05_checkpointing/train.py --save-every-steps 20 "
    "--epochs 2 --local-batch-size 16 --log-every 30 --output-dir runs/b"
)
SAMPLES = {
    "01": Sample(
        "01_basic_ddp/README.md",
        "Output (rank 0 only",
        ("torchrun --standalone --nproc_per_node=2 01_basic_ddp/train.py",),
        mask=decimals,
    ),
    "09": Sample(
        "09_fsdp2/README.md",
        "Output (rank 0 only",
        ("torchrun --standalone --nproc_per_node=2 09_fsdp2/train.py",),
        mask=decimals,
    ),
    # the three commands above the table, one after the other
    "09-memory": Sample(
        "09_fsdp2/README.md",
        "Measured, ResNet-18",
        tuple(f"torchrun --standalone --nproc_per_node={n} 09_fsdp2/memory.py" for n in (1, 2, 4)),
    ),
    "03": Sample(
        "03_grad_accum/README.md",
        "## Output",
        (
            "torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --local-batch-size 8 "
            "--accum-steps 4 --epochs 3",
        ),
        mask=shape,
    ),
    "04": Sample(
        "04_syncbn/README.md",
        "## Output",
        ("torchrun --standalone --nproc_per_node=2 04_syncbn/train.py --log-every 1000",),
        mask=shape,
    ),
    "02-viewer": Sample(
        f"{SAMPLER}/README.md",
        "## 1. `partition_viewer.py`",
        (
            f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/partition_viewer.py "
            "--num-samples 10",
        ),
    ),
    "02-no-sampler": Sample(
        f"{SAMPLER}/README.md",
        "## 2. `no_sampler_pitfall.py`",
        (f"torchrun --standalone --nproc_per_node=2 {SAMPLER}/no_sampler_pitfall.py",),
    ),
    "02-eval": Sample(
        f"{SAMPLER}/README.md",
        "## 3. `distributed_eval.py`",
        (f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/distributed_eval.py",),
    ),
    "02-gather": Sample(
        f"{SAMPLER}/README.md",
        "## 4. `gather_predictions.py`",
        ("python 01_basic_ddp/train.py", GATHER),
        "runs/gather_predictions",
    ),
    "02-gather-padded": Sample(
        f"{SAMPLER}/README.md",
        "With `--padded` each rank reads",
        ("python 01_basic_ddp/train.py", f"{GATHER} --padded"),
        "runs/gather_predictions",
    ),
    "02-weighted": Sample(
        f"{SAMPLER}/README.md",
        "## 5. `weighted_sampler.py`",
        (f"torchrun --standalone --nproc_per_node=2 {SAMPLER}/weighted_sampler.py",),
    ),
    "02-uneven": Sample(
        f"{SAMPLER}/README.md",
        "Each rank reads its own slice",
        (f"{UNEVEN} join", f"{UNEVEN} drop_last"),
        "runs/uneven_inputs",
    ),
    # the doctor on the worked port's two scripts, before and after
    "porting-lint-plain": Sample(
        "porting/README.md",
        "Before the port:",
        ("python debugging/doctor.py lint porting/train_plain.py",),
    ),
    "porting-lint-port": Sample(
        "porting/README.md",
        "After the port:",
        ("python debugging/doctor.py lint porting/train_ddp.py",),
    ),
    # 05: the text before the sample names the flags of both runs
    "05-resume": Sample(
        "05_checkpointing/README.md",
        "Output of a run stopped at step 57",
        (
            "rm -rf runs/b",
            f"{CHECKPOINTING} --max-steps 57",
            CHECKPOINTING,
        ),
        "runs/b",
        mask=decimals,  # losses and accuracies, which vary from CPU to CPU as 01's
    ),
    "02-uneven-none": Sample(
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
    sample = SAMPLES[name]
    return [line.rstrip() for line in readme_sample(REPO / sample.readme, sample.marker)]


def paragraphs(name: str) -> list[list[str]]:
    """The sample's paragraphs (split at blank lines), each a list of lines."""
    text = "\n".join(sample_lines(name)).strip("\n")
    return [para.splitlines() for para in re.split(r"\n\s*\n", text)]


def printed_lines(output: str) -> list[str]:
    """The lines of `output`, CUDA_VISIBLE_DEVICES shown as the READMEs show it (`unset`)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    output = output.replace(f"CUDA_VISIBLE_DEVICES={visible}", "CUDA_VISIBLE_DEVICES=unset")
    return [line.rstrip() for line in output.splitlines() if line.strip()]


def drift(
    name: str, output: str, output_dir: str | Path | None = None, lines: list[str] | None = None
) -> list[str]:
    """The lines of sample `name` (or `lines` of it) that `output` does not print, masked: empty
    when every one is a printed line. A run into `output_dir` is read as if into the sample's."""
    sample = SAMPLES[name]
    if output_dir is not None:
        output = output.replace(str(output_dir), sample.output_dir)
    printed = [sample.mask(line) for line in printed_lines(output)]
    problems = []
    for line in sample_lines(name) if lines is None else lines:
        if not line.strip() or line.strip() == "..." or line.strip().endswith(":   ..."):
            continue  # lines left out
        pattern = re.compile(".*".join(map(re.escape, sample.mask(line).split("..."))))
        if not any(pattern.fullmatch(p) for p in printed):
            problems.append(f"README: {line!r} (not printed)")
    return problems


def drift_message(name: str, problems: list[str]) -> str:
    sample = SAMPLES[name]
    return (
        f"{sample.readme}: the sample after {sample.marker!r} has lines that "
        f"{' then '.join(f'`{c}`' for c in sample.commands)} no longer print:\n"
        + "\n".join(problems)
        + f"\nRegenerate it: python tests/readme_samples.py --write {name}"
    )


def run_commands(sample: Sample) -> str:
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


def write(name: str, output: str) -> list[str]:
    """Replace each line of sample `name` that `output` does not print by the printed line closest
    to it; the lines no printed line is close to (left as they are)."""
    sample = SAMPLES[name]
    printed = printed_lines(output)
    path = REPO / sample.readme
    text = path.read_text()
    block = sample_block(text, sample.marker)
    lines, unmatched = text.splitlines(), []
    for offset, line in enumerate(block.lines):
        if not drift(name, output, lines=[line.rstrip()]):
            continue
        closest = difflib.get_close_matches(line.rstrip(), printed, n=1, cutoff=0.5)
        if closest:
            lines[block.start + 1 + offset] = closest[0]
        else:
            unmatched.append(line)
    path.write_text("\n".join(lines) + "\n")
    return unmatched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"samples (default: all of {sorted(SAMPLES)})")
    parser.add_argument("--write", action="store_true", help="rewrite the drifted lines")
    args = parser.parse_args()
    drifted = 0
    for name in args.names or sorted(SAMPLES):
        output = run_commands(SAMPLES[name])
        if args.write:
            unmatched = write(name, output)
            print(f"{name}: {SAMPLES[name].readme} rewritten")
            for line in unmatched:
                print(f"  no printed line is close to {line!r}: edit it by hand")
        elif problems := drift(name, output):
            drifted += 1
            print(drift_message(name, problems))
        else:
            print(f"{name}: {SAMPLES[name].readme} agrees with a fresh run")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
