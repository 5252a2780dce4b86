"""The runs whose output the READMEs' samples show, each run once per test session.

Two tests read each run: a behaviour test asserts what it did (numbers, files, exit codes), and the
README's sample check in tests/test_readme_text.py compares the sample with its output. Whichever
asks first runs it (the `sample_run` fixture, tests/conftest.py): under a lock, in a folder every
pytest-xdist worker of the session shares, it leaves the run's output, exit codes and output
folder; the other test reads them. So a reworded README sample fails the one prose test, and no
run happens twice.

The commands are the READMEs' (tests/readme_samples.py names them), with --output-dir moved into
the shared folder; 03's and 04's are shorter runs of the same script, whose samples are compared
by the shape of their lines.
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tests.paths import PYTHON, REPO
from tests.processes import (
    Result,
    clean_env,
    command_argv,
    full_logs,
    run,
    torchrun_nodes,
    warm_command,
)
from tests.readme_samples import SAMPLES

SAMPLER = "02_sampler_patterns"


@dataclass(frozen=True)
class Ran:
    stdouts: tuple[str, ...]  # each command's, in order
    stderrs: tuple[str, ...]
    returncodes: tuple[int, ...]
    output_dir: Path  # the --output-dir of the run (05's two runs share it)

    @property
    def stdout(self) -> str:
        return "\n".join(self.stdouts)

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderrs)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def ok(self) -> Ran:
        """This run, failing the test unless every command exited 0."""
        assert set(self.returncodes) == {0}, (
            f"exit codes {self.returncodes}:\n{self.stderr[-3000:]}"
        )
        return self


def record_env(output_dir: Path, **extra: str) -> dict[str, str]:
    """Environment that records every training batch's sample indices into <output_dir>/record."""
    return clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'record'}",
        DDP_TEST_RECORD_DIR=str(Path(output_dir) / "record"),
        **extra,
    )


def train_weights(path: Path) -> None:
    """A SmallCNN trained a little in this process (40 steps, seed 0): weights as 01 saves them,
    whose predictions vary across the classes."""
    import torch
    import torch.nn.functional as F

    from common.data import digits
    from common.models import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN(1, 10)
    images, labels = digits().train.tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(40):
        batch = slice(32 * step, 32 * step + 32)
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)


def readme_command(command: str, *flags: str, timeout: float = 180, env=None) -> Callable:
    """A README command, as written, under its real launcher, with `flags` and --output-dir."""

    def ran(out: Path) -> list[Result]:
        return [run(command_argv(command) + [*flags, "--output-dir", str(out)], timeout, env=env)]

    return the_readmes(ran, command)


def warm(command: str) -> Callable:
    """A README command on warm ranks (its claim is what the script computes)."""

    def ran(out: Path) -> list[Result]:
        return [warm_command(command, "--output-dir", str(out), timeout=180)]

    return the_readmes(ran, command, warm=True)


def the_readmes(ran: Callable, command: str, warm: bool = False) -> Callable:
    """`ran`, naming the README command it runs as written (and whether on warm ranks), which
    tests/test_readme_commands.py holds to the README's `proven-by` markers."""
    ran.readme_command, ran.warm = command, warm
    return ran


def gather(command: str, weights_from: str = "") -> Callable:
    """gather_predictions.py on weights of the run's own (train_weights), or those of the run
    `weights_from` of the same session."""

    def ran(out: Path) -> list[Result]:
        if weights_from:
            weights = shared_run(weights_from, out.parents[1]).output_dir / "weights" / "model.pt"
        else:
            weights = out / "weights" / "model.pt"
            train_weights(weights)
        flags = ["--weights", str(weights), "--output-dir", str(out)]
        return [run(command_argv(command) + flags, 180)]

    return the_readmes(ran, command)


# 05's README command; its sample adds the flags it names
CHECKPOINTING = (
    "torchrun --standalone --nproc_per_node=2 05_checkpointing/train.py --save-every-steps 20"
)


def stopped_and_resumed(out: Path) -> list[Result]:
    """05's sample: the README's command stopped at step 57, then the same command again, each
    recording its batches."""
    sample = SAMPLES["05-resume"]
    commands = [c.replace(sample.output_dir, str(out)) for c in sample.commands[1:]]
    assert all(c.startswith(f"{CHECKPOINTING} ") for c in commands), commands
    return [run(command_argv(c), 180, env=record_env(out)) for c in commands]


def nodes(script: str, *args: str, nproc: int = 1, env_of_node=lambda node: clean_env()):
    """`script args` under two torchrun "nodes" on this host (torchrun_nodes); their logs, node 0's
    first, as the output."""

    def ran(out: Path) -> list[Result]:
        flags = [a.replace("{out}", str(out)) for a in args]
        torchrun_nodes(out, REPO / script, flags, nodes=2, nproc=nproc, env_of_node=env_of_node)
        return [Result(script, 0, full_logs(out), "")]

    return ran


def slow_second_node(node: int) -> dict[str, str]:
    """Each node its own NCCL_IB_HCA; the second sleeps 50 ms before every all-reduce, injected
    from outside the script (tests/inject)."""
    slow = dict(DDP_TEST_SLOW_ALL_REDUCE_S="0.05") if node == 1 else {}
    return clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
        GLOO_SOCKET_IFNAME="lo",
        NCCL_IB_HCA=f"mlx5_{node}",
        **slow,
    )


DEMO = "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py"
UNEVEN = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/uneven_inputs.py --fix"
GATHER = f"torchrun --standalone --nproc_per_node=3 {SAMPLER}/gather_predictions.py"
# 3 optimizer steps of 2 ranks x batch 4, a progress line per step: the lines 03's sample shows
GRAD_ACCUM_SHORT = (
    "torchrun --standalone --nproc_per_node=2 03_grad_accum/train.py --max-steps 3 --epochs 1 "
    "--local-batch-size 4 --log-every 1"
)
# 2 ranks x batch 4, 3 steps, both runs (plain and synchronized): the lines 04's sample shows
SYNCBN_SHORT = (
    "torchrun --standalone --nproc_per_node=2 04_syncbn/train.py --batch-norm compare "
    "--local-batch-size 4 --max-steps 3"
)


def as_written(command: str, timeout: float = 60) -> Callable:
    """A README command as written, from the repository root, that writes no files."""

    def ran(out: Path) -> list[Result]:
        return [run(command_argv(command), timeout)]

    return the_readmes(ran, command)


RUNS: dict[str, Callable[[Path], list[Result]]] = {
    "01": readme_command(SAMPLES["01"].commands[0]),
    "09": readme_command(SAMPLES["09"].commands[0]),
    "09-memory": lambda out: [warm_command(c, timeout=180) for c in SAMPLES["09-memory"].commands],
    "02-viewer": readme_command(SAMPLES["02-viewer"].commands[0]),
    "02-no-sampler": readme_command(SAMPLES["02-no-sampler"].commands[0]),
    "02-eval": readme_command(SAMPLES["02-eval"].commands[0]),
    "02-gather": gather(GATHER),
    "02-gather-padded": gather(f"{GATHER} --padded", weights_from="02-gather"),
    "02-weighted": readme_command(SAMPLES["02-weighted"].commands[0]),
    "02-uneven-join": warm(f"{UNEVEN} join"),
    "02-uneven-drop-last": warm(f"{UNEVEN} drop_last"),
    "02-uneven-none": readme_command(SAMPLES["02-uneven-none"].commands[0], timeout=120),
    "02-shards": lambda out: [
        run(
            [PYTHON, REPO / SAMPLER / "prepare_shards.py", "--num-shards", "12", "--out-dir", out],
            90,
        )
    ],
    "porting-lint-plain": as_written(SAMPLES["porting-lint-plain"].commands[0]),
    "porting-lint-port": as_written(SAMPLES["porting-lint-port"].commands[0]),
    "03": readme_command(GRAD_ACCUM_SHORT),
    "04": readme_command(SYNCBN_SHORT),
    "05-resume": the_readmes(stopped_and_resumed, CHECKPOINTING),
    # one worker per "node", 4 steps
    "06-two-nodes": nodes(
        "06_multinode/train.py",
        *(
            "--max-steps",
            "4",
            "--epochs",
            "1",
            "--local-batch-size",
            "16",
            "--output-dir",
            "{out}/two",
        ),
    ),
    # smaller messages and fewer iterations, three settings in the environment
    "06-comm-check": readme_command(
        "torchrun --standalone --nproc_per_node=2 06_multinode/comm_check.py",
        *("--max-bytes", "65536", "--iters", "3"),
        timeout=120,
        env=clean_env(FI_PROVIDER="tcp", NCCL_SOCKET_IFNAME="lo", UNRELATED_SETTING="x"),
    ),
    # two ranks per "node", the second slow and with another NCCL_IB_HCA
    "06-comm-two-nodes": nodes(
        "06_multinode/comm_check.py",
        *("--min-bytes", "65536", "--max-bytes", "262144", "--iters", "5", "--pairs"),
        *("--output-dir", "{out}"),
        nproc=2,
        env_of_node=slow_second_node,
    ),
    # the guide's demos of an error (exit code 1)
    **{
        f"guide-{bug.replace('_', '-')}": readme_command(f"{DEMO} --bug {bug}", timeout=120)
        for bug in (
            "module_prefix",
            "wrapper_attribute",
            "wrap_frozen",
            "freeze_after_wrap",
            "different_models",
        )
    },
}


def _load(folder: Path, name: str) -> Ran:
    done = json.loads((folder / name / "ran.json").read_text())
    return Ran(
        *(tuple(done[key]) for key in ("stdouts", "stderrs", "returncodes")), folder / name / "out"
    )


def _run(folder: Path, name: str) -> Ran:
    """Run `name` unless it ran in this session; the caller holds its lock."""
    if not (folder / name / "ran.json").exists():
        out = folder / name / "out"
        out.mkdir(parents=True, exist_ok=True)
        results = RUNS[name](out)
        (folder / name / "ran.json").write_text(
            json.dumps(
                dict(
                    stdouts=[r.stdout for r in results],
                    stderrs=[r.stderr for r in results],
                    returncodes=[r.returncode for r in results],
                )
            )
        )
    return _load(folder, name)


def shared_runs(names: list[str], folder: Path) -> Iterator[tuple[str, Ran]]:
    """Each run of `names`, run here or read from where another worker ran it; those no other
    worker is running first, so that two workers asking for the same runs do not wait on each
    other in turn."""
    pending = list(names)
    while pending:
        started = []
        for name in pending:
            with open(folder / f"{name}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another worker runs it now: come back to it
                    continue
                started.append((name, _run(folder, name)))
        if not started:  # every run left is another worker's: wait for the first
            with open(folder / f"{pending[0]}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                started.append((pending[0], _run(folder, pending[0])))
        for name, ran in started:
            pending.remove(name)
            yield name, ran


def shared_run(name: str, folder: Path) -> Ran:
    """The run of sample `name`, once per session (shared_runs)."""
    return next(shared_runs([name], folder))[1]
