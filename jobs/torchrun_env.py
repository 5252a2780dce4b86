"""Runs a script written for torchrun under srun, mpiexec or PALS, unchanged.

    srun python jobs/torchrun_env.py my_train.py --epochs 3
    mpiexec -n 8 --ppn 4 python jobs/torchrun_env.py my_train.py --epochs 3

A script ported the usual way reads torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, and init_process_group's env:// default reads MASTER_ADDR and MASTER_PORT.
srun and mpiexec set none of them. This sets all six from the launcher that started this process
(common/launcher.py: every srun MPI plugin, Open MPI, MPICH, PALS, and the rendezvous host and
port it derives), then replaces itself with `python SCRIPT ARGS...`. The job files start a script
of your own this way; this repository's scripts read the launchers themselves.
"""

import os
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common.bad_input import exit_on_bad_input  # noqa: E402
from common.launcher import free_port, launch_info  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2:
        print("error: usage: python jobs/torchrun_env.py SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    with exit_on_bad_input():
        launch = launch_info(os.environ)
    env = dict(
        RANK=launch.rank,
        LOCAL_RANK=launch.local_rank,
        WORLD_SIZE=launch.world_size,
        LOCAL_WORLD_SIZE=launch.local_world_size,
        # brackets are for URLs; env:// takes the bare address
        MASTER_ADDR=launch.master_addr.strip("[]"),
        # a process alone: any free port
        MASTER_PORT=launch.master_port or free_port(),
    )
    os.environ.update({name: str(value) for name, value in env.items()})
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
