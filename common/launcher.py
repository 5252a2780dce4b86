"""Which launcher started this process, where rank 0 listens, which GPU is this rank's.
`detect_launcher()` reads os.environ (and the GPU count) through `launch_info(env)`, so
it is unit-tested with plain dicts. Order matters: torchrun may run in a Slurm or PBS
job, and HPE's PALS exports MPICH's PMI_* too, so the most specific comes first. Slurm's
cray_shasta MPI plugin (srun on HPE Cray EX) exports PALS_RANKID but no PALS_LOCAL_RANKID or
world size: such a task is read from its SLURM_* variables."""

import os
import re
import socket
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

# A workaround for torch's own bug, in this one place because every script imports this module
# before its process group exists. torch.distributed.nn.functional binds the default process group
# as the default argument of its functions when it is first imported, and DDP's constructor
# imports it (through torch._dynamo). Imported after init_process_group, it keeps the group, and
# gloo's threads, alive past destroy_process_group() into interpreter shutdown, where a gloo thread
# that frees a tensor aborts the finished run ("terminate called without an active exception";
# debugging/README.md). Imported now, it binds None. Seen in torch 2.14.1.
import torch.distributed.nn  # noqa: F401

from common.errors import LauncherError, exit_on_bad_input

# torchrun's --master-port default across nodes (one node without it: a free port)
DEFAULT_PORT = 29500
# below the ephemeral range (32768+); stride coprime to span
PORT_BASE, PORT_SPAN, ARRAY_STRIDE = 15000, 15000, 7537
LOOPBACK = "127.0.0.1"
_MPI_LIKE = [  # (launcher, variables that mark it, rank, local rank, world size, local world size)
    (
        "openmpi",
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    # PALS' own mpiexec; srun's cray_shasta plugin sets PALS_RANKID alone
    (
        "pals",
        ("PALS_LOCAL_RANKID",),
        "PALS_RANKID",
        "PALS_LOCAL_RANKID",
        "PMI_SIZE",
        "PALS_LOCAL_SIZE",
    ),
    # Intel MPI too
    (
        "mpich",
        ("PMI_RANK", "PMI_SIZE"),
        "PMI_RANK",
        "MPI_LOCALRANKID",
        "PMI_SIZE",
        "MPI_LOCALNRANKS",
    ),
]
# interactive, batch, extern and pending steps are not srun steps
_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFFA


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # torchrun, mp.spawn, env, openmpi, mpich, intel-mpi, pals, pmix, slurm, single
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    scheduler: str = "none"  # slurm, pbs or none
    job_id: str = ""
    # this rank's GPU among those it sees: its local rank, or 0 where it sees only its own
    gpu: int = 0


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or env.get(name, "") == "":
        return None
    value = env[name].strip()
    if not re.fullmatch(r"-?\d+", value):
        raise LauncherError(f"{name}={value!r} is not an integer")
    return int(value)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist such as 'gpu[001-004,010],login2'
    (commas in brackets separate ranges) into hosts."""
    items = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", hostlist or "")
    if not items or ",".join(items) != hostlist.strip():
        raise LauncherError(f"malformed host list {hostlist!r}")
    hosts: list[str] = []
    for item in items:
        parts = re.split(r"(\[[^\[\]]*\])", item)  # each bracket group multiplies: r[1-2]n[1-2]
        choices = [_expand_ranges(p[1:-1], hostlist) if p.startswith("[") else [p] for p in parts]
        hosts += ["".join(c) for c in product(*choices)]
    return hosts


def _expand_ranges(spec: str, hostlist: str) -> list[str]:
    out = []
    for rng in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", rng.strip())
        if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise LauncherError(f"bad range {rng!r} in host list {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]  # keep zero padding
    return out


def _slurm_tasks_on_node(spec: str, node_index: int) -> int | None:
    """SLURM_TASKS_PER_NODE looks like '2(x3),1': 2 tasks on 3 nodes, then 1."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_index] if 0 <= node_index < len(counts) else None


def _scheduler(env: Mapping[str, str]) -> tuple[str, str]:
    if env.get("SLURM_JOB_ID"):
        return "slurm", env["SLURM_JOB_ID"]
    return ("pbs", env["PBS_JOBID"]) if env.get("PBS_JOBID") else ("none", "")


def master_address(env: Mapping[str, str]) -> str:
    """MASTER_ADDR, else the job's first host (Slurm node list, PBS node file), else loopback."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if env.get("SLURM_JOB_ID") and nodelist:
        return expand_hostlist(nodelist)[0]
    if nodefile := env.get("PBS_NODEFILE"):
        try:
            lines = Path(nodefile).read_text().split()
        except OSError as exc:
            raise LauncherError(f"cannot read PBS_NODEFILE={nodefile}: {exc.strerror}") from None
        if not lines:
            raise LauncherError(f"PBS_NODEFILE={nodefile} is empty")
        return lines[0]
    return LOOPBACK


def master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT, else one from the job id (PBS array
    subjob i adds i x ARRAY_STRIDE), else 29500."""
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise LauncherError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
        return port
    # PBS: '1234.pbs01', array subjob '1234[5].pbs01'
    m = re.match(r"(\d+)(?:\[(\d+)\])?", _scheduler(env)[1])
    return (
        PORT_BASE + (int(m[1]) + int(m[2] or 0) * ARRAY_STRIDE) % PORT_SPAN if m else DEFAULT_PORT
    )


def detect_launcher(
    rank: int | None = None, world_size: int | None = None, uses_gpu: bool = True
) -> LaunchInfo:
    """This process's launch from os.environ (mp.spawn workers pass rank, world_size); bad input
    exits with code 2. uses_gpu=False: a CPU run, whose ranks are not checked against the GPUs."""
    with exit_on_bad_input():
        info = launch_info(
            os.environ,
            rank,
            world_size,
            torch.cuda.device_count() if uses_gpu and torch.cuda.is_available() else 0,
        )
    if info.master_port == 0:
        # torch up to 2.7 rejects port 0 in a tcp:// URL ("port number missing"), so a process
        # started alone asks the OS for a free port here instead of leaving it to its store
        info = replace(info, master_port=free_port())
    return info


def choose_backend(device: torch.device) -> str:
    """nccl for a GPU where this torch build has it (Linux); gloo otherwise: on CPUs, and on
    Windows and macOS, whose builds have no NCCL ("Distributed package doesn't have NCCL built
    in"). A Mac's MPS device has no backend at all: the scripts train on its CPU."""
    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"


def free_port() -> int:
    """A TCP port free now (the OS's choice; the store binds every interface)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def launch_info(
    env: Mapping[str, str], rank: int | None = None, world_size: int | None = None, gpus: int = 0
) -> LaunchInfo:
    """Rank, local rank, world sizes, master address/port, launcher name and GPU
    (of the `gpus` it sees) from `env`. A process started alone, outside any
    job, gets port 0: any free port serves (nobody connects); detect_launcher picks one."""
    scheduler, job_id = _scheduler(env)
    name, rank, local_rank, world, local_world = _find(env, rank, world_size)
    world = 1 if world is None else world
    if world < 1:
        raise LauncherError(f"{name}: world size {world} must be at least 1")
    if rank is None and world > 1:
        raise LauncherError(
            f"{name}: world size is {world} but this process's rank is not set; "
            "start it with a launcher (torchrun, srun, mpiexec) or set RANK"
        )
    rank = 0 if rank is None else rank
    if not 0 <= rank < world:
        raise LauncherError(
            f"{name}: rank {rank} is outside the world size {world} (must be 0..{world - 1})"
        )
    if local_world is None:
        local_world = world if scheduler == "none" else 1 if local_rank is None else local_rank + 1
    local_rank = rank % local_world if local_rank is None else local_rank
    if not 0 <= local_rank < local_world or local_world > world:
        raise LauncherError(
            f"{name}: local rank {local_rank} and local world size {local_world} do not fit "
            f"world size {world}"
        )
    # 0: per-task GPU binding (srun --gpus-per-task=1, site scripts) shows one GPU
    gpu = local_rank if gpus >= local_world else 0
    # two ranks would share a GPU, which NCCL 2.30 refuses when the communicator is created
    # ("Multiple Ranks are using the same GPU/Partition")
    if 1 < gpus < local_world:
        raise LauncherError(
            f"{local_world} ranks on this node but {gpus} GPUs visible to rank {rank} "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            "one rank per GPU, seeing all or its own"
        )
    port = (
        0
        if name == "single" and scheduler == "none" and not env.get("MASTER_PORT")
        else master_port(env)
    )
    return LaunchInfo(
        name,
        rank,
        local_rank,
        world,
        local_world,
        master_address(env),
        port,
        scheduler,
        job_id,
        gpu,
    )


def _find(env, rank, world_size):
    if rank is not None or world_size is not None:
        # one node: the local rank is the rank, even in a job
        return "mp.spawn", rank, rank, world_size, world_size
    torchrun_like = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return ("torchrun", *(_int(env, n) for n in torchrun_like))
    # set by hand, or by a launcher that follows torchrun
    if env.get("RANK") or env.get("WORLD_SIZE"):
        found = ("env", *(_int(env, n) for n in torchrun_like))
        return found if found[2] is not None else _local_rank_from_job(env, *found[1:])
    for name, markers, *names in _MPI_LIKE:
        if any(env.get(m) is not None for m in markers):
            name = "intel-mpi" if name == "mpich" and env.get("I_MPI_ROOT") else name
            return (name, *(_int(env, n) for n in names))
    # PMIx alone exports no world size; Slurm (srun --mpi=pmix) does
    if env.get("PMIX_RANK") is not None:
        ws = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        return "pmix", _int(env, "PMIX_RANK"), _int(env, "SLURM_LOCALID"), ws, None
    # srun sets it; a batch script alone has SLURM_PROCID=0 but no step id
    step = env.get("SLURM_STEP_ID", "batch")
    if (
        step != "batch"
        and not (step.isdigit() and int(step) >= _SLURM_SPECIAL_STEP_MIN)
        and env.get("SLURM_PROCID")
    ):
        ws = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        spec, node = (
            env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"),
            _int(env, "SLURM_NODEID"),
        )
        lws = _slurm_tasks_on_node(spec, node) if spec and node is not None else None
        return "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), ws, lws
    if env.get("PALS_RANKID") is not None:
        raise LauncherError(
            "PALS_RANKID is set but neither PALS_LOCAL_RANKID (PALS' mpiexec) nor an srun step "
            "(SLURM_PROCID, SLURM_STEP_ID): start the ranks with mpiexec or srun"
        )
    return "single", None, None, None, None


def _local_rank_from_job(env, rank, _, world, local_world):
    """RANK/WORLD_SIZE without LOCAL_RANK (a wrapper's `export RANK=$SLURM_PROCID`): the local
    rank is the job's own (srun's, mpiexec's). In a Slurm or PBS job without one, every rank
    would take local rank 0, and GPU 0: refuse."""
    if _scheduler(env)[0] == "none" or world in (None, 1):
        return "env", rank, None, world, local_world  # one machine: the local rank is the rank
    launched = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}
    name, job_rank, job_local_rank, job_world, job_local_world = _find(launched, None, None)
    if job_local_rank is None:
        raise LauncherError(
            f"RANK and WORLD_SIZE are set but LOCAL_RANK is not, and this {_scheduler(env)[0]} "
            "job has no launcher's local rank to take: export LOCAL_RANK (and LOCAL_WORLD_SIZE) "
            "too, or unset RANK and WORLD_SIZE and start the ranks with srun or mpiexec"
        )
    if (job_rank, job_world) != (rank, world):
        raise LauncherError(
            f"RANK={rank} and WORLD_SIZE={world} disagree with {name}'s rank {job_rank} of "
            f"{job_world}: export LOCAL_RANK too, or unset RANK and WORLD_SIZE"
        )
    return "env", rank, job_local_rank, world, local_world or job_local_world
