"""One process's launch as one line: `probe <cell> <json>`, what common/launcher.py detects beside
the variables in which the launchers themselves say it, this host's name and the rendezvous.
Imports common.launcher alone, no torch, so a matrix of real launches stays cheap
(tests/test_jobs.py, the launcher matrix)."""

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.launcher import launch_info  # noqa: E402

# where the launchers say rank, local rank, world size, node; Slurm's plugins' and MPIs' own
SAID_BY_LAUNCHERS = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"]
SAID_BY_LAUNCHERS += ["PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PALS_RANKID"]
SAID_BY_LAUNCHERS += ["MPI_LOCALRANKID", "MPI_LOCALNRANKS"]
SAID_BY_LAUNCHERS += [f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "LOCAL_RANK", "SIZE", "LOCAL_SIZE")]

info = launch_info(os.environ)
detected = [info.launcher, info.rank, info.local_rank, info.world_size, info.local_world_size]
said = {name: os.environ[name] for name in SAID_BY_LAUNCHERS if name in os.environ}
where = {"host": socket.gethostname(), "rendezvous": f"{info.master_addr}:{info.master_port}"}
# one write, so that lines of processes sharing the job's output do not interleave (print writes
# its parts one by one where PYTHONUNBUFFERED is set, as the tests set it)
sys.stdout.write(
    f"probe {sys.argv[1]} {json.dumps({'detected': detected, 'env': said, **where})}\n"
)
sys.stdout.flush()
