"""Runs a script written for torchrun under srun, mpiexec or PALS, unchanged.

    srun python jobs/torchrun_env.py my_train.py --epochs 3
    mpiexec -n 8 --ppn 4 python jobs/torchrun_env.py my_train.py --epochs 3

A script ported the usual way reads torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, and init_process_group's env:// default reads MASTER_ADDR and MASTER_PORT.
srun and mpiexec set none of them. This sets all six from the launcher that started this process
(common/launcher.py: every srun MPI plugin, Open MPI, MPICH, PALS, and the rendezvous host and
port it derives), then replaces itself with `python SCRIPT ARGS...`. The job files start a script
of your own this way; this repository's scripts read the launchers themselves.

Where each rank sees only its own GPU (`srun --gpus-per-task=1`, a site's affinity script that
sets CUDA_VISIBLE_DEVICES per rank), its GPU is device 0: LOCAL_RANK is 0, as torchrun's
`--virtual-local-rank` sets it (pytorch/pytorch#166680: in 2.14.1, not in 2.8.0), so
`torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))` works.
A script that also uses LOCAL_RANK == 0 for once-a-node work then does it on every rank.
"""

import os
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common.bad_input import exit_on_bad_input  # noqa: E402
from common.launcher import free_port, launch_info  # noqa: E402


# what a per-rank binding sets: NVIDIA's, and AMD's for ROCm builds of torch
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpus() -> int | None:
    """How many GPUs this process sees, where a variable says so (None: every GPU of its node)."""
    for name in VISIBLE_DEVICES:
        if os.environ.get(name) is not None:
            return len([d for d in os.environ[name].split(",") if d.strip()])
    return None


def main() -> None:
    if len(sys.argv) < 2:
        print("error: usage: python jobs/torchrun_env.py SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    gpus = visible_gpus()
    with exit_on_bad_input():
        # with `gpus`, launch_info refuses more ranks than GPUs where a rank sees several
        launch = launch_info(os.environ, gpus=gpus or 0)
    env = dict(
        RANK=launch.rank,
        # its GPU's index among those it sees: the local rank, or 0 under a per-rank binding
        LOCAL_RANK=launch.gpu if gpus else launch.local_rank,
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
