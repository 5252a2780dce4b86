"""Start a script's ranks from a warm process: torch imported once, each rank forked from it.

    python tests/warm_ranks.py --nproc 2 01_basic_ddp/train.py --max-steps 3

For tests whose claim is what DDP computes (equality with one process, exact evaluation, resume,
accumulation), not how a launcher starts ranks. Every rank process otherwise pays its own
`import torch` (2 to 6 CPU-s on the test machine), and torchrun one more for itself.

The suite goes one step further (processes.warm_ranks): each pytest worker keeps one forkserver
(multiprocessing's) that imported torch, torch._dynamo and torchvision once, binds no thread pool
and opens no socket. Each run is a job forked from it (run_job), and the job forks one process per
rank, so a run starts in milliseconds.

A rank gets what the README's "ranks started by hand" sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR on loopback, a free MASTER_PORT), so the lessons take their `env`
launcher row. It also gets what an interpreter started with the run's environment would have: that
environment, its PYTHONPATH on sys.path with any `sitecustomize` there imported (tests/inject,
tests/record), OMP_NUM_THREADS as torch's thread count. The script runs as `__main__`; its exit
code, an uncaught exception's traceback and the atexit handlers are what the interpreter's would be.
A forked child then ends with os._exit, as Python's docs say it should: the interpreter's own
shutdown (objects finalized at exit) is not run, so an ordinary end is proven by the tests that use
real launchers (tests/test_clean_exit.py), not here.

Like torchrun, the first rank to fail fails the run: the others are killed and its exit code is
the run's (128 + N for signal N). Tests that are about a launcher, a README command or an exit
path use the real launcher instead (tests/README.md).
"""

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys
import traceback

# The imports every rank would otherwise pay for; importing them starts no threads.
import torch
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torchvision  # noqa: F401

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torchvision", "tests.warm_ranks"]


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _rank(rank: int, nproc: int, port: str, script: str, args: list[str]) -> None:
    """In the forked rank: the script as __main__, as `python SCRIPT ARGS` would run it; never
    returns. With nproc 0 the one process gets no rank variables: plain `python SCRIPT ARGS`."""
    if nproc:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(nproc: int, script: str, args: list[str]) -> int:
    """Fork `nproc` ranks of `script args`, wait for them; the first failure kills the others and
    is the result. nproc 0: one process without rank variables, as `python SCRIPT ARGS`."""
    port = str(free_loopback_port())
    ranks = {}
    for rank in range(max(nproc, 1)):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, script, args)
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        if exit_code(status) and not failed:
            failed = exit_code(status)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


def run_job(
    nproc: int, script: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str
) -> None:
    """In a process forked from the warm forkserver: become what `env python ...` started in
    `cwd` with output to the two files would be, then run the ranks; exits with their result."""
    os.setsid()  # a process group of its own, which the test kills on a timeout
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # sys.path as such an interpreter builds it: the script's folder (set by _rank), PYTHONPATH,
    # then the installation's own entries (not the folders the test runner added)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]
    sys.path[:] = ["", *paths, *installed]
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in paths):
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    if "OMP_NUM_THREADS" in env:  # read by torch at import, which happened before this env
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = run_ranks(nproc, script, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--nproc":
        sys.exit("usage: python tests/warm_ranks.py --nproc N SCRIPT [ARGS...]")
    sys.exit(run_ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
