"""Run real launchers as subprocesses, bounded by a timeout, in a clean environment."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Variables of launchers and schedulers: a test that runs inside a Slurm job, under mpiexec or
# torchrun must not hand them to the processes it starts.
_LAUNCHER_PREFIXES = (
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "PALS_",
    "PBS_",
    "MPI_",
    "HYDRA_",
    "I_MPI_",
    "TORCHELASTIC_",
)
_LAUNCHER_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Result(subprocess.CompletedProcess):
    @property
    def output(self) -> str:
        return (self.stdout or "") + (self.stderr or "")


def run(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    check: bool = False,
) -> Result:
    """Run `cmd` in its own process group; on timeout kill the whole group and fail the test.

    A hang (a missed collective, a rendezvous that never completes) thus fails one test
    within `timeout` seconds instead of stalling the suite.
    """
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or clean_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n--- stdout\n{out[-4000:]}"
            f"\n--- stderr\n{err[-4000:]}",
            pytrace=False,
        )
    result = Result(proc.args, proc.returncode, out, err)
    if check and result.returncode != 0:
        pytest.fail(
            f"exit code {result.returncode}: {' '.join(map(str, cmd))}\n--- stdout\n{out[-4000:]}"
            f"\n--- stderr\n{err[-4000:]}",
            pytrace=False,
        )
    return result


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = True,
    launcher_args: tuple[str, ...] = (),
) -> Result:
    """`torchrun --standalone --nproc_per_node=N script
    args` (standalone picks a free loopback port)."""
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *launcher_args,
        REPO / script,
        *args,
    ]
    return run(cmd, timeout, env=env, check=check)


def load_script(path: str | Path, name: str):
    """Import a script that is not in a package (the numbered folders start with a digit)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_summary(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "summary.json").read_text())


def root_cause(output: str) -> str:
    """The part of torchrun's closing summary that names the first failure (its "Root Cause")."""
    assert "Root Cause" in output, output[-3000:]
    return output.split("Root Cause")[-1]


def load_model(output_dir: Path) -> dict:
    """The state_dict a run wrote to output_dir/model.pt."""
    import torch

    return torch.load(Path(output_dir) / "model.pt", weights_only=True)


def relative_difference(a: dict, b: dict) -> float:
    """Largest ||a - b|| / ||b|| over the tensors of two state dicts (same keys required)."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in a)


def readme_command(readme: str, command: str) -> list[str]:
    """The argv of `command`, taken as written from a ```bash block of
    `readme` (failing if that no longer shows it), with `python` and
    `torchrun` run by this interpreter; relative paths need cwd=REPO."""
    import shlex

    shown = {c.text for c in readme_commands() if c.readme == readme}
    assert command in shown, f"{readme} no longer shows `{command}`"
    argv = shlex.split(command)
    launchers = {"python": [PYTHON], "torchrun": [PYTHON, "-m", "torch.distributed.run"]}
    return launchers.get(argv[0], argv[:1]) + argv[1:]


def readme_sample(readme: Path, after: str) -> list[str]:
    """The lines of the first plain ``` block (a sample
    output) after the text `after` in `readme`."""
    return readme.read_text().split(after, 1)[1].split("```\n", 2)[1].splitlines()


# --- the commands of the READMEs' ```bash blocks
# ----------------------------------------------------


@dataclass(frozen=True)
class Command:
    # the command, whitespace-normalised, without its trailing comment (the table's key)
    text: str
    source: str  # the command as written (continuation lines included, comment left out)
    comment: str  # its trailing `# ...` annotation, if any
    before: str  # the paragraph just before its ```bash block
    readme: str


def _split_comment(line: str) -> tuple[str, str]:
    """`cmd  # note` -> ("cmd", "note"); a # inside quotes
    or a word (`$#`, `a#b`) is not a comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def _open_quote(text: str) -> bool:
    quote = ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
    return bool(quote)


def readme_commands() -> list[Command]:
    files = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    commands = []
    for readme in files:
        lines = (REPO / readme).read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```bash":
                i += 1
                continue
            start = i
            paragraph = []
            j = start - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            while j >= 0 and lines[j].strip():
                paragraph.insert(0, lines[j])
                j -= 1
            i += 1
            pending = ""
            while lines[i].strip() != "```":
                line = lines[i]
                i += 1
                if not pending and (not line.strip() or line.lstrip().startswith("#")):
                    continue
                pending = f"{pending}\n{line}" if pending else line
                # a backslash continues the line; so does a quote left open ('... &&\n    ...')
                source, comment = _split_comment(pending)
                if source.endswith("\\") or _open_quote(source):
                    continue
                text = " ".join(source.replace("\\\n", " ").split())
                commands.append(Command(text, source, comment, " ".join(paragraph), readme))
                pending = ""
            i += 1
    return commands


def summary_fields(script: str | Path) -> set[str]:
    """The fields a script's write_summary(...) call writes to summary.json: its keyword arguments,
    and those of the `dict(...)` it unpacks with `**name` (as the lessons pass `**summary`)."""
    tree = ast.parse((REPO / script).read_text())
    [call] = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "write_summary"
    ]
    dicts = {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", "") == "dict"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    fields = {kw.arg for kw in call.keywords if kw.arg}
    for kw in call.keywords:
        if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id in dicts:
            fields |= {k.arg for k in dicts[kw.value.id].keywords if k.arg}
    if "replica_checksums" in fields:
        fields.add("replicas_identical")
    return fields
