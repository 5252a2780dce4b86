"""Processes a test starts: a clean environment, real launchers bounded by a timeout under the hang
guard (the stacks of the whole tree, then the tree killed), and ranks started warm."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.paths import PYTHON, REPO

# Variables of launchers and schedulers: a test that runs inside a Slurm job, under mpiexec or
# torchrun must not hand them to the processes it starts.
_LAUNCHER_PREFIXES = (
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "PALS_",
    "PBS_",
    "PET_",
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


def read_env(path: Path) -> dict[str, str]:
    """An environment written by `env -0`."""
    return dict(item.split("=", 1) for item in path.read_text().split("\0") if "=" in item)


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


# Every process a test starts carries this variable (a fresh value per start), so that its whole
# tree can be found and killed: torchrun starts its workers in sessions of their own, and a worker
# whose parent died is no longer anyone's child.
TREE_MARKER = "TESTS_PROCESS_TREE"


def start(cmd: list, env: dict[str, str] | None = None, cwd: Path = REPO, **popen_kwargs):
    """subprocess.Popen in a new session, with text pipes for stdout and stderr unless given, and
    the marker that tree_pids() and kill_group() find its whole tree by."""
    marker = uuid.uuid4().hex
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**(env or clean_env()), TREE_MARKER: marker},
        text=True,
        start_new_session=True,
        **popen_kwargs,
    )
    proc.tree_marker = marker
    return proc


def _parent_pids() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name (field 2) may hold spaces: the fields after its ")" are plain
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            pass
    return parents


def _marked_pids(marker: str) -> set[int]:
    found = set()
    needle = f"{TREE_MARKER}={marker}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except (OSError, ValueError):
            pass
    return found


def tree_pids(proc: subprocess.Popen) -> list[int]:
    """The pids of `proc` and all its descendants: by parent links, plus (for processes started by
    start()) every process that carries its marker, orphans in other sessions included."""
    parents = _parent_pids()
    pids = {proc.pid}
    marker = getattr(proc, "tree_marker", None)
    if marker:
        pids |= _marked_pids(marker)
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in pids} - pids
        grew = bool(more)
        pids |= more
    return sorted(pid for pid in pids if pid == proc.pid or pid in parents)


def _py_spy_dump(pid: int, *flags: str) -> tuple[bool, str]:
    try:
        dump = subprocess.run(
            ["py-spy", "dump", *flags, "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return dump.returncode == 0, dump.stdout + dump.stderr
    except FileNotFoundError:
        return False, "(py-spy is not installed: pip install -r requirements-test.txt)"
    except subprocess.TimeoutExpired:
        return False, "(py-spy dump timed out)"


def _kernel_view(pid: int) -> str:
    """Each thread's name, state and the kernel function it sleeps in (/proc; the kernel stack
    too where readable, as root): where a process waits when its own stack cannot be read."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda t: int(t.name)):
        try:
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
            )
            wchan = (task / "wchan").read_text().strip()
            line = f"  thread {task.name} {status.get('Name', '?')}: {status.get('State', '?')}"
            lines.append(f"{line}, waiting in {wchan or '-'}")
            kernel = (task / "stack").read_text().split("\n")
            lines += [f"    {frame}" for frame in kernel if frame.strip()]
        except OSError:
            continue
    return "\n".join(lines)


def dump_stacks(proc: subprocess.Popen) -> str:
    """Python and native stacks of every process in `proc`'s tree (py-spy dump --native), to
    show where a hung run waits; where the native stack cannot be unwound, the Python stack
    alone. With each: the parent pid, and every thread's state from /proc."""
    parents = _parent_pids()
    parts = []
    for pid in tree_pids(proc):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ok, text = _py_spy_dump(pid, "--native")
        if not ok and shutil.which("py-spy"):
            text = f"{text.strip()}\n(without --native:)\n{_py_spy_dump(pid)[1]}"
        parts.append(
            f"--- pid {pid} (parent {parents.get(pid, '?')}): {cmdline.strip()}\n{text.strip()}"
            f"\n{_kernel_view(pid)}"
        )
    return "\n".join(parts)


def stop_hung_tree(proc: subprocess.Popen) -> tuple[str, str, str]:
    """For a run past its timeout: the stacks of its whole tree, then the tree killed, then what
    it printed; (stacks, stdout, stderr). Never waits unbounded on a pipe."""
    stacks = dump_stacks(proc)
    kill_group(proc)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        # something outside the tree still holds a pipe: give up on the rest of the output
        out, err = "", "(the output pipes stayed open after the process tree was killed)"
    return stacks, out or "", err or ""


def fail_timed_out(timeout: float, what: str, out: str, err: str, stacks: str) -> None:
    pytest.fail(
        f"timed out after {timeout}s: {what}\n--- stdout\n{(out or '')[-4000:]}"
        f"\n--- stderr\n{(err or '')[-4000:]}\n--- stacks (py-spy dump --native)\n{stacks}",
        pytrace=False,
    )


def checked(result: Result, what: str, check: bool) -> Result:
    """`result`, or with `check` and a non-zero exit code, the test failed with its output."""
    if check and result.returncode != 0:
        pytest.fail(
            f"exit code {result.returncode}: {what}\n--- stdout\n{(result.stdout or '')[-4000:]}"
            f"\n--- stderr\n{(result.stderr or '')[-4000:]}",
            pytrace=False,
        )
    return result


def finish(proc: subprocess.Popen, timeout: float, what: str) -> tuple[str, str]:
    """proc.communicate(timeout); on a timeout, the stacks of its whole tree, then the whole tree
    killed, and the test failed with both. Never waits unbounded on a pipe."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks, out, err = stop_hung_tree(proc)
        fail_timed_out(timeout, what, out, err, stacks)


def run(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    check: bool = False,
) -> Result:
    """Run `cmd` in its own session; on timeout dump the stacks of its whole process tree, kill
    the tree and fail the test.

    A hang (a missed collective, a rendezvous that never completes) thus fails one test
    within `timeout` seconds, with where every process waited, instead of stalling the suite.
    """
    proc = start(cmd, env=env, cwd=cwd)
    out, err = finish(proc, timeout, " ".join(map(str, cmd)))
    return checked(Result(proc.args, proc.returncode, out, err), " ".join(map(str, cmd)), check)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole tree: its process group, its descendants, and (if start() began it)
    every process with its marker, such as torchrun's workers in their own sessions."""
    pids = tree_pids(proc)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def short_run(
    max_steps: int | None = 3, epochs: int | None = 1, local_batch_size: int | None = 16, **flags
) -> list[str]:
    """A lesson's flags for a short run: --max-steps, --epochs and --local-batch-size (None: the
    lesson's own default), then each keyword as its flag (log_every=1000: --log-every 1000)."""
    named = dict(max_steps=max_steps, epochs=epochs, local_batch_size=local_batch_size, **flags)
    return [
        word
        for name, value in named.items()
        if value is not None
        for word in (f"--{name.replace('_', '-')}", str(value))
    ]


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


def torchrun_nodes(
    tmp_path, script, script_args, nodes, nproc=1, env_of_node=lambda node: clean_env(), timeout=150
):
    """`nodes` torchrun processes ("nodes") with `nproc` workers each, meeting at a c10d rendezvous
    on 127.0.0.1; each node's log is tmp_path/node<i>.log, and env_of_node(i) its environment.
    Under the hang guard: started by start(), ended by wait_all()."""
    port = free_port()
    procs = []
    with contextlib.ExitStack() as logs:
        for node in range(nodes):
            cmd = [
                PYTHON,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=test{port}",
                str(script),
                *script_args,
            ]
            log = logs.enter_context(open(tmp_path / f"node{node}.log", "w"))
            procs.append(start(cmd, env=env_of_node(node), stdout=log, stderr=subprocess.STDOUT))
        wait_all(procs, timeout, tmp_path, f"{nodes}-node torchrun")


def wait_all(procs, timeout, tmp_path, what):
    """Wait for every "node" within `timeout` seconds in all; all must exit 0. Past the timeout,
    the stacks of every node's whole tree (before any is killed: one node's end changes what the
    others do), then every tree killed, and the test failed with the stacks and the logs."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stacks = "\n".join(dump_stacks(proc) for proc in procs if proc.poll() is None)
        for proc in procs:
            kill_group(proc)
        fail_timed_out(timeout, what, node_logs(tmp_path), "", stacks)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), node_logs(tmp_path)


def node_logs(tmp_path):
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
    )


def full_logs(tmp_path):
    """Every "node"'s whole log (torchrun_nodes), node 0's first."""
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("node*.log")))


_FORKSERVER = None


def _warm_forkserver():
    """This process's forkserver, started on first use with torch imported once in it."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        from tests import warm_ranks as warm

        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(warm.PRELOAD)
    return _FORKSERVER


def warm_up() -> None:
    """Start this process's forkserver now (it imports torch: seconds), so that a test timing a
    warm run times the run alone."""
    job = _warm_forkserver().Process(target=os.getpid)  # returns once torch is imported
    job.start()
    job.join()


def warm_ranks(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: Path = REPO,
) -> Result:
    """`script args` on `nproc` ranks forked from a process that imported torch once
    (tests/warm_ranks.py): for claims about what DDP computes, not about a launcher. Each rank
    takes the lessons' `env` launcher row (RANK, WORLD_SIZE, ... set by hand); `nproc=0` runs one
    process without them, as `python script args` (env may set them). As run(): a timeout records
    the stacks of every rank, kills them all and fails the test."""
    from tests.warm_ranks import run_job

    what = f"warm ranks ({nproc or 'python'}): {script} {' '.join(map(str, args))}"
    with tempfile.TemporaryDirectory() as out:
        paths = [os.path.join(out, "stdout"), os.path.join(out, "stderr")]
        for path in paths:
            Path(path).touch()
        job = _warm_forkserver().Process(
            target=run_job,
            args=(nproc, str(REPO / script), [str(a) for a in args], env or clean_env(), str(cwd))
            + tuple(paths),
        )
        job.start()
        job.join(timeout)
        stacks = "" if job.exitcode is not None else dump_stacks(job) or "(none readable)"
        if stacks:
            kill_group(job)
            job.join(30)
        stdout, stderr = (Path(p).read_text(errors="replace") for p in paths)
    if stacks:
        fail_timed_out(timeout, what, stdout, stderr, stacks)
    return checked(Result(what, job.exitcode, stdout, stderr), what, check)


def warm_command(
    command: str,
    *extra: str,
    nproc: int | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = False,
    cwd: Path = REPO,
) -> Result:
    """A README's `torchrun --standalone --nproc_per_node=N script args`, plus `extra`, on warm
    ranks (warm_ranks): the same script, arguments and rank count (or `nproc`), without torchrun's
    agent, from `cwd` (the script's path is relative to it). For a command whose claim is what the
    script does; each script's README commands keep at least one run under the real torchrun
    (tests/README.md, "How ranks start")."""
    words = shlex.split(command)
    count = re.fullmatch(r"--nproc_per_node=(\d+)", words[2]) if len(words) > 3 else None
    assert words[:2] == ["torchrun", "--standalone"] and count, f"not a torchrun command: {command}"
    return warm_ranks(
        Path(cwd) / words[3],
        *words[4:],
        *extra,
        nproc=nproc or int(count.group(1)),
        timeout=timeout,
        env=env,
        check=check,
        cwd=cwd,
    )


def command_argv(command: str) -> list[str]:
    """The argv of a README command (the exact text a README's ```bash block shows; the marker
    above the block names the test that runs it, and tests/test_readme_commands.py holds the two
    equal), with `python` and `torchrun` run by this interpreter and leading VAR=value words given
    to `env`; relative paths need cwd=REPO."""
    argv = shlex.split(command)
    # leading VAR=value words set the command's environment, as the shell does: `env` does that
    assignments = list(itertools.takewhile(re.compile(r"[A-Za-z_]\w*=.*", re.S).fullmatch, argv))
    argv = argv[len(assignments) :]
    launchers = {"python": [PYTHON], "torchrun": [PYTHON, "-m", "torch.distributed.run"]}
    return (
        (["env", *assignments] if assignments else []) + launchers.get(argv[0], argv[:1]) + argv[1:]
    )


def node_of(local_world_size: int, local_rank: int, mask: str | None = None) -> dict[str, str]:
    """torchrun's variables for one rank of a one-node
    job, with an optional CUDA_VISIBLE_DEVICES."""
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
    }
    return env if mask is None else {**env, "CUDA_VISIBLE_DEVICES": mask}
