"""05 - preemption: save on a signal or a deadline, then exit with code 75 (requeue me).

05_checkpointing/train.py's training, which this file imports, plus what a scheduler's preemption
needs. SIGTERM or SIGUSR1 (Slurm's warning), or the --time-limit-s deadline (PBS warns no one
before its wall time), make all ranks save at the same step boundary, write checkpoints/REQUEUE
and exit with code 75; the job files in jobs/ requeue on it. This file holds preemption only.

    torchrun --standalone --nproc_per_node=2 05_checkpointing/preempt.py --time-limit-s 60
"""

import dataclasses
import multiprocessing
import signal
import sys
import time
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# 05_checkpointing/checkpoint.py: atomic files, `latest`, RNG states, the resumable sampler
import checkpoint as ckpt
from common.config import field, load_config
from common.data import check_data, worker_start_method
from common.launcher import detect_launcher
from train import CheckpointConfig, train  # the training and its checkpoints are train.py's


@dataclasses.dataclass
class PreemptConfig(CheckpointConfig):
    time_limit_s: float = field(
        0.0,
        "save and exit with code 75 after this many seconds (0: no limit); set it "
        "below the job's wall time where the scheduler gives no warning",
        min=0.0,
    )


# Slurm's time-limit warning (the job files' --signal) and a scheduler's or torchrun's stop.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """SIGTERM / SIGUSR1 only set a flag, and the deadline is only compared; the ranks act together
    at a step boundary. A rank that saved and exited on its own would leave the others hanging in
    their next all-reduce. requested() is a collective (MAX over ranks): if any rank was signalled
    or is past the deadline, every rank learns it after the same step.

    srun and torchrun send the signal to every process of the step, DataLoader workers included.
    A worker it ends fails the rank, waiting for its next batch, before the rank saves. So the
    workers ignore it: see start_loader_server and ignore_preemption_signals."""

    def __init__(self, time_limit_s=0.0, loader_start_method=None):
        self.signum, self.deadline = 0, time.monotonic() + (time_limit_s or float("inf"))
        if loader_start_method == "forkserver":
            start_loader_server()
        for s in PREEMPTION_SIGNALS:
            signal.signal(s, self.handler)

    def handler(self, signum, frame):
        self.signum = signum

    def requested(self, device) -> str:
        """Why to stop after this step ("SIGTERM", "SIGUSR1", "time limit"), or "" to go on."""
        flag = torch.tensor([self.signum, time.monotonic() >= self.deadline], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum, late = flag.tolist()
        return signal.Signals(signum).name if signum else "time limit" if late else ""

    def saved(self, cfg, launch, device, step, why):
        """Collective, once the checkpoint of the step is saved: rank 0 writes the note the job
        files requeue on, before any rank leaves, as the launcher may stop rank 0 once another
        rank has exited."""
        if launch.rank == 0:
            (cfg.checkpoints / "REQUEUE").write_text(f"{why} at step {step}\n")
            print(
                f"{why}: checkpoint at step {step} saved; exiting with code "
                f"{ckpt.REQUEUE_EXIT_CODE} (requeue me)",
                flush=True,
            )
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)

    @staticmethod
    def worker_init_fn(worker_id):
        """The loaders' worker_init_fn: a loader worker sets its own SIGTERM handler as it starts,
        which ends it on a SIGTERM from anyone but its parent; this puts "ignore" back."""
        for s in PREEMPTION_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def start_loader_server():
    """Starts the forkserver that the loaders' workers are forked from, with the signals ignored.
    Ignored signals stay ignored in a child, so the server and every worker forked from it ignore
    them from their first instant. Started later by the first loader, the server would die of the
    signal, and every worker with it (a worker exits once its parent is gone). This process ignores
    the signals too while the server starts (a second or so, before any training)."""
    for s in PREEMPTION_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    server_started = multiprocessing.get_context("forkserver").Process(target=int)
    server_started.start()
    server_started.join()


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(PreemptConfig)
    # rank, local rank, world size, rendezvous address: torchrun, srun, mpiexec
    launch = detect_launcher()
    # before any process group, so no rank waits for a failed one
    check_data(cfg, launch.world_size)
    if launch.rank == 0:  # an earlier run's note; this run's own stop writes a new one
        (cfg.checkpoints / "REQUEUE").unlink(missing_ok=True)
    # Before the training: a signal from now on is not lost (but while the loaders' server starts,
    # a second).
    preemption = Preemption(cfg.time_limit_s, worker_start_method(cfg.num_workers))
    stopped = train(cfg, launch, preemption)
    return ckpt.REQUEUE_EXIT_CODE if stopped else 0  # 75: saved, requeue me


if __name__ == "__main__":
    sys.exit(main())
