"""How a script ends when something is wrong: loudly, once, and fast.

    if __name__ == "__main__":
        run(main)

- Bad input (a UsageError: config, data, launcher environment) prints ONE line,
  `error: ...`, from one rank, and exits with code 2. Every rank meets the same bad
  input at the same point, so the others exit quietly instead of repeating it.
- Any other exception prints its traceback once, labelled with rank and host, and
  exits with code 1. A rank that fails only because a peer died (its collective lost
  the connection) prints one short line instead of a second traceback.
- A collective that times out prints which collective, where it was called, which
  ranks timed out with it and which never arrived, and what to check.
- The process then leaves at once (os._exit): no atexit hooks, no destructors that
  could wait on dead peers. The launcher (torchrun, srun, mpiexec) sees the non-zero
  exit and stops the other ranks within seconds.
- Under torchrun, the failing rank also writes torchelastic's error file
  (TORCHELASTIC_ERROR_FILE), so torchrun's "Root Cause" summary names the failing rank
  and the exception instead of "To enable traceback see ...".

Test and demo hook (never set it in real runs): DDP_EXAMPLES_FAIL_AT_STEP=N makes
rank DDP_EXAMPLES_FAIL_RANK (default 0) fail right after its N-th optimizer step, as
DDP_EXAMPLES_FAIL_MODE says: `raise` (default, a RuntimeError), `kill` (SIGKILL
itself) or `hang` (sleep forever, so the others time out). See install_failure_hook().
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

import common.dist
from common.errors import ConfigError, UsageError

USAGE_EXIT_CODE = 2
USAGE_GRACE_S = 5.0  # at most this long a silent rank waits for the reporting rank to print
PEER_GONE_GRACE_S = 2.0  # a rank that only lost its peer leaves this much later than the cause
TIMEOUT_REPORT_GRACE_S = 6.0  # at most this long the timeout report waits for the other ranks to time out
FAILURE_EXIT_CODE = 1
GUIDE = "debugging/README.md"

# Test/demo failure injection (see install_failure_hook).
FAIL_AT_STEP_ENV = "DDP_EXAMPLES_FAIL_AT_STEP"
FAIL_RANK_ENV = "DDP_EXAMPLES_FAIL_RANK"
FAIL_MODE_ENV = "DDP_EXAMPLES_FAIL_MODE"
FAIL_MODES = ("raise", "kill", "hang")

# Every launcher's rank variable: used when the error came before the rank was known.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")

# What gloo/NCCL/the store say when the process at the other end of a connection is gone.
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|ECONNRESET|EPIPE|"
                        r"connection refused|socket closed|remote process exited|has been aborted|"
                        r"communicator was aborted|NCCL Error 6|remote end", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_TIMEOUT_KEY = "ddp_examples/timed_out/"
_FIRST_KEY = "ddp_examples/first_failure/"


def guess_rank() -> int:
    """This process's rank, even if the process group never started (best effort)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "rank" in common.dist.JOINED:
        return common.dist.JOINED["rank"]
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _is_reporting_rank(rank: int) -> bool:
    """Rank 0 reports, or the lowest rank this launcher has if rank 0 is missing (e.g. RANK=3 WORLD_SIZE=2)."""
    if rank == 0:
        return True
    world = os.environ.get("WORLD_SIZE", "")
    return world.isdigit() and rank >= int(world) and os.environ.get("LOCAL_RANK", "0") == "0"


def _reports_usage_error(exc: UsageError, rank: int) -> bool:
    """One line per job: rank 0 says it, as every rank meets the same config. Node-specific
    problems (a data folder or a device missing on one node) are said by that node's local
    rank 0, and an error can name its own reporter (`exc.report_here`, e.g. the first local
    rank without a GPU)."""
    chosen = getattr(exc, "report_here", None)
    if chosen is not None:
        return chosen
    if _is_reporting_rank(rank):
        return True
    return not isinstance(exc, ConfigError) and os.environ.get("LOCAL_RANK", "") == "0"


def _report_usage_error(exc: UsageError, rank: int) -> None:
    """`error: ...` once. A launcher stops every rank as soon as the first one exits, so the
    reporter must have printed before any other rank leaves."""
    line = f"error: {exc}"
    pointer = "bad input (exit code 2): see the line starting with 'error:' above"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torchrun: the workers of a node share the attempt folder; the first to claim it reports.
        claim = Path(error_file).parent.parent / "ddp_examples_usage_error"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            deadline = time.monotonic() + USAGE_GRACE_S
            while time.monotonic() < deadline and claim.stat().st_size == 0:
                time.sleep(0.05)  # until the reporter has printed
            return
        except OSError:
            fd = None
        print(line, file=sys.stderr, flush=True)
        _write_error_file(pointer)
        if fd is not None:
            os.write(fd, b"printed\n")
            os.close(fd)
        return
    if _reports_usage_error(exc, rank):
        print(line, file=sys.stderr, flush=True)
    elif os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        time.sleep(USAGE_GRACE_S / 2)  # let the reporting rank print before the launcher stops it


def _label(rank: int) -> str:
    return f"[rank {rank} on {socket.gethostname()}]"


def _write_error_file(message: str, cause: bool = True) -> None:
    """torchelastic's error file: torchrun prints `message` as the failure's 'traceback' line.

    torchrun names the failure with the smallest timestamp (whole seconds) its "Root Cause".
    The ranks it stops in the same second would tie with the cause, so a cause is dated one
    second earlier and a consequence one second later.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        stamp = int(time.time()) + (-1 if cause else 1)
        # The layout of torchelastic's own @record, minus the traceback (already printed once).
        Path(path).write_text(json.dumps({"message": {"message": message, "errorCode": None,
                                                      "extraInfo": {"timestamp": str(stamp)}}}))
    except OSError:
        pass


def _exit(code: int) -> None:
    """Leave now. Flushed output first; then no atexit hooks or destructors that might wait on peers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(main: Callable[[], object]) -> None:
    common.dist.LEAVE_ON_EXIT = True  # a failure is reported before this process leaves the group
    try:
        main()
    except UsageError as exc:
        _report_usage_error(exc, guess_rank())
        if common.dist.JOINED:
            _exit(USAGE_EXIT_CODE)  # see the clean end below
        sys.exit(USAGE_EXIT_CODE)
    except KeyboardInterrupt:
        _exit(130)
    except SystemExit as exc:  # a deliberate exit code (05: 75, "requeue me"): keep it, as below
        if common.dist.JOINED and isinstance(exc.code, int):
            _exit(exc.code)
        raise
    except Exception as exc:  # noqa: BLE001 - the whole point: report any failure once
        _exit(report_failure(exc))
    else:
        if common.dist.JOINED:
            # A clean end, with the process group already destroyed and every file closed. Skip
            # the interpreter's teardown all the same: there, gloo worker threads that still hold
            # tensors can abort the process ("terminate called without an active exception",
            # pytorch/pytorch#190489) and turn a finished run into a failed job.
            _exit(0)


def report_failure(exc: BaseException) -> int:
    """Print `exc` once, in the shape that fits it; return the exit code."""
    rank = guess_rank()
    # The launcher stops every rank (SIGTERM) once one exits; finish this report first (seconds).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if type(exc).__name__ == "ProcessExitedException":  # mp.spawn's parent: a worker died
        print(f"error: {_first_line(exc)}; that worker's error, if any, is above", file=sys.stderr, flush=True)
    elif _is_timeout(exc):
        _report_timeout(exc, rank)
    elif _is_peer_gone(exc):
        # A consequence, not a cause: the rank that failed first has printed (or its launcher
        # reports) the real error. One line here, so the real one is not buried.
        print(f"{_label(rank)} stopped: lost contact with another rank during {_where(exc)} "
              f"({_first_line(exc)}); that rank failed or exited early, its error (if any) is above",
              file=sys.stderr, flush=True)
        _write_error_file(f"rank {rank} lost contact with another rank (a consequence, not the cause)",
                          cause=False)
        # Let the launcher see the failed rank's exit first, so its summary names the cause
        # (e.g. a rank killed by SIGKILL), not this consequence.
        time.sleep(PEER_GONE_GRACE_S)
    else:
        first = _first_to_fail(rank)
        if first is None or first == rank:
            print(f"{_label(rank)} failed:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
            _write_error_file(f"{type(exc).__name__} on rank {rank} ({socket.gethostname()}): "
                              "its traceback is printed above")
        else:
            # The same bug often strikes every rank at once (e.g. DDP's unused-parameter check):
            # one traceback is enough.
            print(f"{_label(rank)} failed too: {type(exc).__name__}: {_first_line(exc).split('. ')[0][:160]} "
                  f"(traceback printed by rank {first})", file=sys.stderr, flush=True)
            _write_error_file(f"rank {rank} failed too (see rank {first})", cause=False)
    return FAILURE_EXIT_CODE


def _first_to_fail(rank: int) -> int | None:
    """The rank that failed first, agreed through the job's key-value store; None if unknown."""
    store = common.dist.JOINED.get("store")
    if store is None:
        return None
    try:
        store.set_timeout(timedelta(seconds=2))
        if store.add(_FIRST_KEY + "count", 1) == 1:
            store.set(_FIRST_KEY + "rank", str(rank))
            return rank
        return int(store.get(_FIRST_KEY + "rank").decode())
    except Exception:  # noqa: BLE001 - no store, no agreement: print the traceback rather than lose it
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # gloo prefixes messages with the C++ source location: '[../gloo/transport/tcp/pair.cc:534] ...'
    line = text.splitlines()[0] if text else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return re.split(r"\. This is typically", line)[0][:300]


def _is_distributed_error(exc: BaseException) -> bool:
    joined = bool(common.dist.JOINED)
    return isinstance(exc, getattr(dist, "DistError", ())) or (isinstance(exc, RuntimeError) and joined)


def _is_timeout(exc: BaseException) -> bool:
    return _is_distributed_error(exc) and bool(_TIMED_OUT.search(str(exc)))


def _is_peer_gone(exc: BaseException) -> bool:
    return _is_distributed_error(exc) and bool(_PEER_GONE.search(str(exc)))


def _where(exc: BaseException) -> str:
    """The collective that failed and the line of the script that called it.

    The call site is the last frame outside torch; the collective is the torch function it called.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(Path(dist.__file__).resolve().parents[1])
    user = [i for i, f in enumerate(frames) if not str(Path(f.filename).resolve()).startswith(torch_dir)]
    if not user:
        return "a collective"
    i = user[-1]
    site = f"{Path(frames[i].filename).name}:{frames[i].lineno}"
    # The first torch function it called, skipping torch's logging decorators ("wrapper").
    inner = [f for f in frames[i + 1:] if f.name not in ("wrapper", "inner", "_fn")]
    callee = inner[0].name if inner else ""
    if callee == "backward":
        what = "backward() (DDP's gradient all-reduce)"
    elif callee in ("forward", "_call_impl", "_wrapped_call_impl") or callee.startswith("_pre_forward"):
        what = "the DDP forward (buffer broadcast / unused-parameter check)"
    elif callee:
        what = f"dist.{callee}" if "distributed" in (inner[0].filename or "") else callee
    else:
        what = frames[i].line or frames[i].name
    return f"{what} called at {site}"


def _report_timeout(exc: BaseException, rank: int) -> None:
    """Which collective, which ranks timed out with us, which never arrived, what to check.

    Each rank that times out records where it waited in the job's key-value store; once every
    rank has, or after a grace period (a rank that entered its collective later times out later),
    the lowest such rank prints the full report and the others one line each.
    """
    where = _where(exc)
    others: dict[int, str] = {}
    world = common.dist.JOINED.get("world_size", 1)
    try:
        store = common.dist.JOINED["store"]
        store.set_timeout(timedelta(seconds=5))
        store.set(f"{_TIMEOUT_KEY}{rank}", where)
        keys = [f"{_TIMEOUT_KEY}{r}" for r in range(world)]
        deadline = time.monotonic() + TIMEOUT_REPORT_GRACE_S
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.2)
        for r, key in enumerate(keys):
            if store.check([key]):
                others[r] = store.get(key).decode()
    except Exception:  # noqa: BLE001 - the store may be gone with rank 0; report what we know
        others = {rank: where}
    others.setdefault(rank, where)
    if rank != min(others):
        print(f"{_label(rank)} timed out too, in {where}; see rank {min(others)}'s report",
              file=sys.stderr, flush=True)
        _write_error_file(f"rank {rank} timed out too (see rank {min(others)})", cause=False)
        return
    missing = [r for r in range(world) if r not in others]
    timeout_s = f"{common.dist.JOINED.get('timeout_s', 0):g} s"
    waited = "; ".join(f"rank {r} in {w}" for r, w in sorted(others.items()))
    lines = [
        f"{_label(rank)} a collective timed out after {timeout_s} (--timeout-s): {_first_line(exc)}",
        f"  waiting: {waited}",
        f"  never arrived: {'rank(s) ' + ', '.join(map(str, missing)) if missing else 'none'}"
        + (" (still busy, hung, or in a different code path)" if missing else ""),
    ]
    if len(set(others.values())) > 1:
        lines.append("  the ranks wait in DIFFERENT collectives: the collectives are called in a different "
                     "order or number on some ranks (a collective inside `if rank == 0:`, uneven batches)")
    lines += [
        "  check: every rank must call the same collectives in the same order (no collective in a "
        "rank-0-only block; same number of steps on every rank); a slow rank (rank 0 downloading) "
        "needs a larger --timeout-s",
        "  diagnose: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (names mismatched collectives), "
        "`py-spy dump --pid <pid>` on every rank shows where each one waits; see " + GUIDE,
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
    _write_error_file(f"collective timed out on rank {rank}: {where}; never arrived: {missing or 'none'}")


def install_failure_hook() -> None:
    """Test/demo hook: fail on purpose after an optimizer step (never set in real runs).

    DDP_EXAMPLES_FAIL_AT_STEP=N    fail right after this rank's N-th optimizer.step()
    DDP_EXAMPLES_FAIL_RANK=R       the rank that fails (default 0)
    DDP_EXAMPLES_FAIL_MODE=M       raise (RuntimeError, default), kill (SIGKILL) or hang (sleep)

    It is a global optimizer hook, so it works in every example without touching its loop.
    """
    at = os.environ.get(FAIL_AT_STEP_ENV, "")
    if not at:
        return
    if not at.isdigit() or int(at) < 1:
        raise ConfigError(f"{FAIL_AT_STEP_ENV}={at!r} must be a positive integer")
    fail_rank = os.environ.get(FAIL_RANK_ENV, "0")
    mode = os.environ.get(FAIL_MODE_ENV, "raise")
    if not fail_rank.isdigit():
        raise ConfigError(f"{FAIL_RANK_ENV}={fail_rank!r} must be a rank (0, 1, ...)")
    if mode not in FAIL_MODES:
        raise ConfigError(f"{FAIL_MODE_ENV}={mode!r} must be one of {', '.join(FAIL_MODES)}")
    if guess_rank() != int(fail_rank):
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def hook(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps != int(at):
            return
        what = f"step {at} on rank {fail_rank} ({FAIL_AT_STEP_ENV} test hook, t={time.time():.2f})"
        if mode == "raise":
            raise RuntimeError(f"injected failure at {what}")
        print(f"injecting {'SIGKILL' if mode == 'kill' else 'a hang'} at {what}", file=sys.stderr, flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)

    register_optimizer_step_post_hook(hook)
