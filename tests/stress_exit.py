"""Stress check, run by hand (not part of the default suite): finished runs exit cleanly.

Runs the lessons' main commands round-robin under torchrun (and one single-process run), each to
its end, and counts every exit that is not 0: in particular the abort at interpreter shutdown
("terminate called without an active exception", exit code -6) that a process group outliving
destroy_process_group() can cause (debugging/README.md). Busy processes on every core (--load)
make the race likelier, as on a loaded CI machine.

    python tests/stress_exit.py --runs 100 --load 2
    python tests/stress_exit.py --control --runs 20 --load 2
    python tests/stress_exit.py --loader-workers --runs 400 --load 2
    python tests/stress_exit.py --loader-workers --only 02-shards --runs 100

--control runs a few-line DDP script instead, which imports torch.distributed.nn only after its
process group exists, as DDP's constructor does when nothing imported it earlier: the same
machine then shows the abort, so zero aborts in the main mode are not an accident of the machine.
--loader-workers runs, in turn, the two commands whose DataLoader workers were seen to hang in the
test suite: 02's sharded_loading.py with --num-workers 2 on 3 ranks, and 05 with --num-workers 1.
A run past --timeout-s is a hang: the Python and native stacks of its whole process tree
(py-spy dump --native) are printed, then the tree is killed.

Exit code 0 when every run of the chosen mode behaved as expected (main: all exit 0; control: at
least one abort), else 1.
"""

import argparse
import itertools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.processes import start, stop_hung_tree

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# The READMEs' main command of each lesson, shortened (the exit is what is tested, not the result).
COMMANDS = {
    "01": [*TORCHRUN, "01_basic_ddp/train.py", "--epochs", "1", "--max-steps", "20"],
    "01-alone": [sys.executable, "01_basic_ddp/train.py", "--epochs", "1", "--max-steps", "20"],
    "01-spawn": [
        sys.executable,
        "01_basic_ddp/train_spawn.py",
        "--epochs",
        "1",
        "--max-steps",
        "20",
    ],
    "02-eval": [*TORCHRUN, "02_sampler_patterns/distributed_eval.py"],
    "02-uneven": [*TORCHRUN, "02_sampler_patterns/uneven_inputs.py", "--epochs", "1"],
    "03": [*TORCHRUN, "03_grad_accum/train.py", "--accum-steps", "4", "--max-steps", "10"],
    "04": [*TORCHRUN, "04_syncbn/train.py", "--epochs", "1", "--max-steps", "20"],
    "05": [*TORCHRUN, "05_checkpointing/train.py", "--save-every-steps", "10", "--max-steps", "30"],
    "06": [*TORCHRUN, "06_multinode/train.py", "--epochs", "1", "--max-steps", "20"],
    "09": [*TORCHRUN, "09_fsdp2/train.py", "--epochs", "1", "--max-steps", "20"],
    "09-memory": [*TORCHRUN, "09_fsdp2/memory.py", "--model", "small_cnn"],
    "benchmark": [*TORCHRUN, "benchmark/train.py", "--epochs", "1", "--max-steps", "10"],
}
# The commands whose loader workers hung in the suite (tests/test_sampler_patterns.py,
# tests/test_randomness.py), each forking DataLoader workers in a rank that already runs gloo.
# Their collectives wait 600 s (--timeout-s), longer than a run may take here: a rank that stalls
# is then a hang, whose stacks are recorded, not its peers' gloo timeout after 60 s (exit 1).
SHARDS_DIR = Path(tempfile.gettempdir()) / "stress_exit_shards"
LOADER_COMMANDS = {
    "02-shards": [
        *TORCHRUN[:-1],
        "--nproc_per_node=3",
        "02_sampler_patterns/sharded_loading.py",
        "--shards-dir",
        str(SHARDS_DIR),
        "--epochs",
        "2",
        "--num-workers",
        "2",
        "--timeout-s",
        "600",
    ],
    "05-workers": [
        *TORCHRUN,
        "05_checkpointing/train.py",
        "--num-workers",
        "1",
        "--epochs",
        "2",
        "--save-every-steps",
        "10",
        "--max-steps",
        "30",
        "--timeout-s",
        "600",
    ],
}
ABORT_TEXT = "terminate called without an active exception"

# The control: DDP constructed after init_process_group, with nothing importing
# torch.distributed.nn before it; the group then outlives destroy_process_group().
CONTROL = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
checksums = [None] * dist.get_world_size()
dist.all_gather_object(checksums, float(sum(p.sum() for p in model.parameters())))
del model
dist.destroy_process_group()
"""


def burn() -> None:
    while True:
        pass


def run_once(name: str, command: list[str], out: Path, timeout_s: float) -> tuple[int, bool, str]:
    """(exit code, whether the abort text was printed, the output's tail); on a hang (exit 124)
    the tail holds the stacks of every process of the run."""
    if name != "control":
        command = [*command, "--output-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DDP_TEST_"))}
    proc = start(command, env=env, cwd=REPO, stderr=subprocess.STDOUT)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks, text, _ = stop_hung_tree(proc)
        return 124, ABORT_TEXT in text, f"{text[-2000:]}\n--- stacks\n{stacks}"
    return proc.returncode, ABORT_TEXT in text, text[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs in all")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--control", action="store_true", help="run the control script instead")
    parser.add_argument(
        "--loader-workers",
        action="store_true",
        help="run the two commands whose DataLoader workers hung in the suite",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    parser.add_argument(
        "--only",
        choices=sorted(COMMANDS) + sorted(LOADER_COMMANDS),
        help="run only this command of the chosen mode (e.g. --loader-workers --only 02-shards)",
    )
    args = parser.parse_args()

    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    if args.control:
        script = Path(tempfile.mkdtemp()) / "control.py"
        script.write_text(CONTROL)
        plan = itertools.repeat(("control", [*TORCHRUN, str(script)]))
    elif args.loader_workers:
        prepare = [sys.executable, "02_sampler_patterns/prepare_shards.py", "--num-shards", "12"]
        subprocess.run([*prepare, "--out-dir", str(SHARDS_DIR)], cwd=REPO, check=True)
        plan = itertools.cycle(LOADER_COMMANDS.items())
    else:
        plan = itertools.cycle(COMMANDS.items())
    if args.only and not args.control:
        commands = LOADER_COMMANDS if args.loader_workers else COMMANDS
        if args.only not in commands:
            parser.error(f"--only {args.only}: not a command of this mode ({sorted(commands)})")
        plan = itertools.repeat((args.only, commands[args.only]))
    results: dict[str, list[int]] = {}
    aborts, failures = 0, []
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for number, (name, command) in zip(range(1, args.runs + 1), plan):
                out = Path(scratch) / f"run{number}"
                code, aborted, tail = run_once(name, command, out, args.timeout_s)
                results.setdefault(name, []).append(code)
                aborts += aborted
                if code != 0:
                    failures.append((number, name, code, tail))
                print(f"run {number:4d} {name:10s} exit {code}{'  ABORT' if aborted else ''}")
                if code != 0:  # at once: a loop stopped early keeps what it found
                    print(f"--- run {number} ({name}) exit {code}, last lines:\n{tail}\n---")
                sys.stdout.flush()
    finally:
        for burner in burners:
            burner.terminate()
    minutes = (time.monotonic() - start) / 60
    print(f"\n{'command':10s} runs  non-zero exits")
    for name, codes in results.items():
        print(f"{name:10s} {len(codes):4d}  {sum(code != 0 for code in codes)}")
    total = sum(len(codes) for codes in results.values())
    print(
        f"{total} runs in {minutes:.1f} min with {args.load} busy processes: "
        f"{len(failures)} non-zero exits, {aborts} with '{ABORT_TEXT}', "
        f"{sum(code == 124 for _, _, code, _ in failures)} hangs (past {args.timeout_s:.0f} s)"
    )
    if args.control:
        return 0 if aborts else 1
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
