"""PID 1 of a training pod: starts torchrun, passes the pod's SIGTERM on to it, and exits with a
code that the operator's restart rule reads right.

    python jobs/kubernetes/torchrun_pod.py [torchrun's options] SCRIPT [SCRIPT's options]

The words of TRAIN_ARGS come last, as in the Slurm and PBS job files. RUN_DIR is the run's output
folder: preempt.py writes its REQUEUE note in RUN_DIR/checkpoints.

Why not torchrun itself as PID 1: Kubernetes stops a pod (an eviction, a spot node reclaimed, a
deleted job) with SIGTERM to PID 1, then SIGKILL after terminationGracePeriodSeconds. torchrun
passes SIGTERM on to its workers, which save, and then exits with 1 whatever they did (its agent
raises SignalException: torch/distributed/elastic/agent/server/api.py). The operators read 1 as a
crash: a PyTorchJob with `restartPolicy: ExitCode` retries only codes 128 to 255
(training-operator v1.9.0, pkg/util/train/train_util.go, IsRetryableExitCode), and the Job
podFailurePolicy of the TrainJob and JobSet files fails the job on any code but this one.

Exit codes:
  0    the run finished.
  143  (128 + SIGTERM, "restart me") the run stopped to be restarted: this pod got SIGTERM, or
       preempt.py wrote its REQUEUE note during this run (another pod was stopped and all ranks
       saved at the same step).
  else torchrun's own: 1 where a rank crashed or refused its input (2 where torchrun refused its
       own options). The operators do not retry them.
"""

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

RESTART_ME = 128 + signal.SIGTERM


def note_version(note: Path):
    """What identifies this version of the file (None: no file); a note written later differs."""
    try:
        stat = note.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def main(torchrun_args: list[str]) -> int:
    note = Path(os.environ.get("RUN_DIR", ".")) / "checkpoints" / "REQUEUE"
    earlier_note = note_version(note)  # a note of an earlier run says nothing about this one
    stopped_by, torchrun = [], None

    def pass_on(signum, frame):
        stopped_by.append(signum)
        if torchrun is not None:
            torchrun.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    train_args = shlex.split(os.environ.get("TRAIN_ARGS", ""))
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *train_args]
    )
    if stopped_by:  # the signal came while torchrun was starting
        torchrun.send_signal(stopped_by[0])
    # PID 1 inherits every orphan of the pod (a loader worker whose rank died): wait for any child,
    # so none is left a zombie, until torchrun itself ends.
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == torchrun.pid:
            code = torchrun.returncode = os.waitstatus_to_exitcode(status)
            break
    if code == 0:
        return 0
    if stopped_by or note_version(note) not in (None, earlier_note):
        print(f"torchrun_pod: the run saved to be restarted; exit code {RESTART_ME}", flush=True)
        return RESTART_ME
    return code if code > 0 else 128 - code  # killed by a signal: 128 + its number, as a shell


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
