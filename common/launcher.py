"""Which launcher started this process, where rank 0 listens, which GPU is this rank's.

The rule: rank, local rank and both world sizes come from the launcher that started the process,
the first of: torchrun; a Kubernetes PyTorchJob's or Volcano Job's pod (one process, its RANK and
WORLD_SIZE); RANK and WORLD_SIZE set by hand; Open MPI's or Hydra's mpiexec (MPICH, Intel MPI); an
srun step, read from SLURM_* whatever its MPI plugin added; HPE PALS' mpiexec. Kubernetes
operators that set only torchrun's own PET_* variables (Kubeflow Trainer, JobSet, an elastic
PyTorchJob) need torchrun: without it each pod would train alone, so that is refused.
mpiexec in a Slurm job starts its daemons with srun, whose SLURM_PROCID its ranks inherit; Slurm's
cray_shasta plugin exports PALS' variables too. A local world size is a launcher's own count, never
a guess. launch_info(env) is the rule on a plain dict; this module imports no torch.
"""

import os
import re
import socket
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Mapping

from common.errors import LauncherError, exit_with_error

# torchrun's --master-port default across nodes (one node without it: a free port)
DEFAULT_PORT = 29500
# below the ephemeral range (32768+); the stride (PBS subjobs, srun steps) coprime to the span
PORT_BASE, PORT_SPAN, STRIDE = 15000, 15000, 7537
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Dialect:  # where one launcher puts the four numbers; `marker`: a variable it alone sets
    launcher: str
    marker: str
    rank: str
    local_rank: str
    world_size: str
    local_world_size: str


TORCHRUN = Dialect(
    launcher="torchrun",
    marker="TORCHELASTIC_RUN_ID",
    rank="RANK",
    local_rank="LOCAL_RANK",
    world_size="WORLD_SIZE",
    local_world_size="LOCAL_WORLD_SIZE",
)
BY_HAND = replace(TORCHRUN, launcher="env", marker="")
MPI_LAUNCHERS = (  # Hydra is also Intel MPI's (named intel-mpi where I_MPI_ROOT is set)
    Dialect(
        launcher="openmpi",
        marker="OMPI_COMM_WORLD_SIZE",
        rank="OMPI_COMM_WORLD_RANK",
        local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
        world_size="OMPI_COMM_WORLD_SIZE",
        local_world_size="OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Dialect(
        launcher="mpich",
        marker="MPI_LOCALNRANKS",
        rank="PMI_RANK",
        local_rank="MPI_LOCALRANKID",
        world_size="PMI_SIZE",
        local_world_size="MPI_LOCALNRANKS",
    ),
)
MPI_NAMES = ("openmpi", "mpich", "intel-mpi", "pals")
PALS = Dialect(
    launcher="pals",
    marker="PALS_LOCAL_RANKID",
    rank="PALS_RANKID",
    local_rank="PALS_LOCAL_RANKID",
    # Cray PMI's, which PALS sets up for every rank it starts
    world_size="PMI_SIZE",
    local_world_size="PMI_LOCAL_SIZE",
)
FOREIGN_RANKS = ("PMI_RANK", "PALS_RANKID", "PMIX_RANK")  # set, yet no rule matched: refused
# torchrun's --nnodes, --nproc-per-node, --node-rank as the Kubernetes operators pass them (its
# argparse reads PET_<FLAG>); only torchrun turns them into ranks
TORCHRUN_JOB_SHAPE = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK")
# Volcano's svc plugin, which its pytorch plugin turns on, sets VC_<TASK>_HOSTS for every task
# (pkg/controllers/job/plugins/svc: EnvTaskHostFmt); the pytorch plugin sets RANK and WORLD_SIZE.
VOLCANO_TASK_HOSTS = re.compile(r"VC_\w+_HOSTS")
_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFFA  # batch, extern, interactive, pending: not srun steps


@dataclass(frozen=True)
class Ranks:  # what a launcher says of this process (None: it says nothing of that)
    launcher: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    # under RANK and WORLD_SIZE set by a wrapper: the launcher that started the process, whose
    # rule places rank 0 (mpiexec's ranks in a Slurm job sit in its daemons' srun step)
    started_by: str = ""


@dataclass(frozen=True)
class LaunchInfo:
    # torchrun, mp.spawn, pytorchjob, volcano, env, openmpi, mpich, intel-mpi, pals, slurm, single
    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    scheduler: str = "none"  # slurm, pbs or none
    job_id: str = ""
    gpu: int = 0  # its GPU of those it sees: the local rank, or 0 where it sees only its own


def _int(env: Mapping[str, str], name: str) -> int | None:
    if env.get(name, "") == "":
        return None
    value = env[name].strip()
    if not re.fullmatch(r"-?\d+", value):
        raise LauncherError(f"{name}={value!r} is not an integer")
    return int(value)


def expand_hostlist(hostlist: str) -> list[str]:
    """The hosts of a Slurm host list such as 'gpu[001-004,010],login2' (ranges in brackets)."""
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
        lo = m.group(1)
        hi = m.group(2) or lo
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]  # keep zero padding
    return out


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """This node's count in SLURM_STEP_TASKS_PER_NODE ('2(x3),1': 2 tasks on 3 nodes, then 1)."""
    step = bool(env.get("SLURM_STEP_TASKS_PER_NODE"))
    name = "SLURM_STEP_TASKS_PER_NODE" if step else "SLURM_TASKS_PER_NODE"
    spec = env.get(name) or ""
    node_index = _int(env, "SLURM_NODEID")
    counts = []
    if not spec:
        return None
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise LauncherError(f"{name}={spec!r} is not a task count list such as '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_index] if node_index is not None and 0 <= node_index < len(counts) else None


def _scheduler(env: Mapping[str, str]) -> tuple[str, str]:
    if env.get("SLURM_JOB_ID"):
        return "slurm", env["SLURM_JOB_ID"]
    return ("pbs", env["PBS_JOBID"]) if env.get("PBS_JOBID") else ("none", "")


def master_address(env: Mapping[str, str], launcher: str = "single") -> str:
    """Rank 0's host, as it goes in a tcp:// URL (an IPv6 address in brackets): MASTER_ADDR, else
    the host where `launcher` puts rank 0 in a Slurm or PBS job, else loopback."""
    host = _rank0_host(env, launcher)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _rank0_host(env: Mapping[str, str], launcher: str) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if launcher == "single":  # its own store: in an salloc shell it is not on the job's nodes
        return LOOPBACK
    if env.get("SLURM_JOB_ID"):
        if _in_srun_step(env) and launcher not in MPI_NAMES and env.get("SLURM_STEP_NODELIST"):
            _refuse_a_step_numbered_out_of_order(env)
            return _srun_task0_host(env)
        # mpirun and mpiexec run in the batch step, on the job's first node, and put rank 0 there.
        # Open MPI starts its daemons with `srun --nodelist=<the other nodes>`: the step node list
        # its ranks inherit leaves out rank 0's node.
        if env.get("SLURM_JOB_NODELIST"):
            return expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
    if nodefile := env.get("PBS_NODEFILE"):
        try:
            lines = Path(nodefile).read_text().split()
        except OSError as exc:
            raise LauncherError(f"cannot read PBS_NODEFILE={nodefile}: {exc.strerror}") from None
        if not lines:
            raise LauncherError(f"PBS_NODEFILE={nodefile} is empty")
        return lines[0]
    return LOOPBACK


def _srun_task0_host(env: Mapping[str, str]) -> str:
    """The step's first node; with `srun -m arbitrary` the host file's first host (srun places
    task i on the file's i-th host, and SLURM_STEP_NODELIST is sorted)."""
    if env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary") and env.get("SLURM_HOSTFILE"):
        try:
            return hostfile_hosts(Path(env["SLURM_HOSTFILE"]).read_text())[0]
        except (OSError, IndexError):
            raise LauncherError(
                f"SLURM_HOSTFILE={env['SLURM_HOSTFILE']}: cannot read its first host"
            ) from None
    return expand_hostlist(env["SLURM_STEP_NODELIST"])[0]


def hostfile_hosts(text: str) -> list[str]:
    """The hosts of a Slurm host file, in order, as slurm_read_hostfile (src/api/allocate.c)
    reads them: '#' starts a comment ('\\#' is a '#'), blank lines are skipped, hosts are
    separated by commas or lines, and 'host*N' is the host N times."""
    hosts = []
    for line in text.splitlines():
        line = re.sub(r"(?<!\\)#.*", "", line).replace("\\#", "#")
        for host in filter(None, (h.strip() for h in line.split(","))):
            name, star, count = host.partition("*")
            times = int(count) if star and count.isdigit() and int(count) > 0 else 0
            hosts += [name] * times if times else [host]
    return hosts


def _refuse_a_step_numbered_out_of_order(env: Mapping[str, str]) -> None:
    """A heterogeneous job's srun step (`srun A : B`) lists its nodes sorted but numbers them
    (SLURM_NODEID) in component order (src/srun/srun.c, _reorder_het_job_recs): rank 0's host and
    this node's task count would be read wrong. SLURM_HET_SIZE marks a heterogeneous allocation;
    SLURMD_NODENAME, where it is set, shows a node numbered out of the listed order."""
    het = env.get("SLURM_HET_SIZE") or env.get("SLURM_PACK_SIZE")
    node, index = env.get("SLURMD_NODENAME"), _int(env, "SLURM_NODEID")
    listed = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    misnumbered = node and index is not None and listed[index : index + 1] != [node]
    if het or misnumbered:
        said = f"SLURM_HET_SIZE={het}" if het else f"SLURM_NODEID={index} on {node}"
        raise LauncherError(
            f"{said}: a heterogeneous srun step numbers its nodes in another order than it lists "
            "them, so rank 0's host and this node's ranks are unknown: export MASTER_ADDR=<rank "
            "0's host>, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, or start torchrun"
        )


def master_port(env: Mapping[str, str], launcher: str = "single") -> int:
    """MASTER_PORT, else one from the job id: PBS array subjob i adds i x STRIDE, and so does srun
    step i, so that the steps of one job side by side do not meet at one port."""
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise LauncherError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
        return port
    # PBS: '1234.pbs01', array subjob '1234[5].pbs01'
    if not (m := re.match(r"(\d+)(?:\[(\d+)\])?", _scheduler(env)[1])):
        return DEFAULT_PORT
    # An MPI launcher's ranks are in different steps (its daemons' and the batch step): not those.
    srun_step = _in_srun_step(env) and launcher not in MPI_NAMES
    index = int(m[2] or 0) + (int(env["SLURM_STEP_ID"]) if srun_step else 0)
    return PORT_BASE + (int(m[1]) + index * STRIDE) % PORT_SPAN


def detect_launcher(
    rank: int | None = None, world_size: int | None = None, uses_gpu: bool = True
) -> LaunchInfo:
    """This process's launch from os.environ (mp.spawn workers pass rank, world_size); bad input
    exits with code 2. uses_gpu=False: a CPU run, whose ranks are not checked against the GPUs."""
    import torch

    import_distributed_nn_before_the_process_group()
    gpus = torch.cuda.device_count() if uses_gpu and torch.cuda.is_available() else 0
    try:
        info = launch_info(os.environ, rank, world_size, gpus)
    except LauncherError as exc:
        exit_with_error(exc)  # this rank's own view of its launch: every rank that finds it says it
    if info.master_port == 0:
        # torch up to 2.7 refuses port 0 in a tcp:// URL ("port number missing"): ask the OS
        info = replace(info, master_port=free_port())
    return info


def import_distributed_nn_before_the_process_group() -> None:
    """A workaround for torch 2.14.1, called before every script's process group: imported after
    it, torch.distributed.nn.functional (DDP imports it) binds the group as a default argument,
    keeping it and gloo's threads past destroy_process_group(), where one can abort the finished
    run ("terminate called without an active exception"; debugging/README.md)."""
    import torch.distributed.nn  # noqa: F401


def choose_backend(device) -> str:
    """nccl for a GPU where this torch build has it (Linux); else gloo: CPUs, and Windows and macOS
    builds ("Distributed package doesn't have NCCL built in"). MPS has none: train on the CPU."""
    import torch.distributed as dist

    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"


def host_address() -> str:
    """What this host's name resolves to: where gloo listens unless GLOO_SOCKET_IFNAME is set."""
    try:
        return socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return "unresolved"


def free_port() -> int:
    """A TCP port free now (the OS's choice; the store binds every interface)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def launch_info(
    env: Mapping[str, str], rank: int | None = None, world_size: int | None = None, gpus: int = 0
) -> LaunchInfo:
    """Rank, local rank, world sizes, master address/port, launcher and GPU (of the `gpus` it
    sees) from `env`. A process alone, outside any job, gets port 0: any free port serves."""
    scheduler, job = _scheduler(env)
    spawned = rank is not None or world_size is not None  # mp.spawn: every rank on one node
    found = Ranks("mp.spawn", rank, rank, world_size, world_size) if spawned else launched_by(env)
    name = found.launcher
    rank = found.rank
    local_rank = found.local_rank
    world = 1 if found.world_size is None else found.world_size
    local_world = found.local_world_size
    if world < 1:
        raise LauncherError(f"{name}: world size {world} must be at least 1")
    if rank is None and world > 1:
        raise LauncherError(
            f"{name}: world size {world}, but the rank is not set: start it with a launcher"
        )
    rank = 0 if rank is None else rank
    if not 0 <= rank < world:
        raise LauncherError(
            f"{name}: rank {rank} is outside the world size {world} (must be 0..{world - 1})"
        )
    if local_world is None or local_rank is None:
        if world > 1 and scheduler != "none":
            raise LauncherError(
                f"{name}: rank {rank} of {world} in a {scheduler} job, but no launcher counts the "
                "ranks of this node: export LOCAL_RANK and LOCAL_WORLD_SIZE, or use srun, mpiexec"
            )
        # one machine outside any job (ranks started by hand, a world of one): local is global
        local_world = world if local_world is None else local_world
        local_rank = rank if local_rank is None else local_rank
    if not 0 <= local_rank < local_world or local_world > world:
        raise LauncherError(
            f"{name}: local rank {local_rank} of {local_world} does not fit world size {world}"
        )
    # 0: per-task GPU binding (srun --gpus-per-task=1, site scripts) shows one GPU
    gpu = local_rank if gpus >= local_world else 0
    # NCCL 2.30 refuses two ranks on one GPU ("Multiple Ranks are using the same GPU/Partition")
    if 1 < gpus < local_world:
        raise LauncherError(
            f"{local_world} ranks on this node but {gpus} GPUs visible to rank {rank} "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            "one rank per GPU, seeing all or its own"
        )
    if local_world < world and scheduler == "none" and not env.get("MASTER_ADDR"):
        if name not in ("torchrun", "mp.spawn"):  # torchrun sets MASTER_ADDR for its workers
            raise LauncherError(
                f"{name}: {world} ranks on more than one host ({local_world} on this one), and no "
                "Slurm or PBS job says where rank 0 is: export MASTER_ADDR=<rank 0's host> (and "
                "MASTER_PORT) to every rank"
            )
    alone = name == "single" and not env.get("MASTER_PORT")
    port = 0 if alone else master_port(env, found.started_by or name)
    addr = master_address(env, found.started_by or name)
    return LaunchInfo(name, rank, local_rank, world, local_world, addr, port, scheduler, job, gpu)


def launched_by(env: Mapping[str, str]) -> Ranks:
    """The rule at the top of this file, in its order."""
    if env.get(TORCHRUN.marker) is not None:
        return _read(TORCHRUN, env)
    if any(env.get(name) is not None for name in TORCHRUN_JOB_SHAPE):
        return _kubernetes_pod(env)
    if env.get("RANK") or env.get("WORLD_SIZE"):  # set by hand, or by a wrapper
        return _volcano_pod(env) or _by_hand(env)
    for dialect in MPI_LAUNCHERS:
        if env.get(dialect.marker) is not None:
            intel = dialect.launcher == "mpich" and env.get("I_MPI_ROOT")
            return replace(_read(dialect, env), launcher="intel-mpi" if intel else dialect.launcher)
    if _in_srun_step(env):
        return _srun_task(env)
    if env.get(PALS.marker) is not None:
        return _read(PALS, env)
    for name in FOREIGN_RANKS:
        if env.get(name) is not None:
            raise LauncherError(
                f"{name} is set, but by no launcher these scripts know: start the ranks with "
                "torchrun, srun or mpiexec, or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE"
            )
    return Ranks("single", None, None, None, None)


def _kubernetes_pod(env: Mapping[str, str]) -> Ranks:
    """A pod of a Kubernetes operator's job, started without torchrun: one process. Kubeflow's
    PyTorchJob (training-operator v1, `envvar.go`) also sets RANK (the pod's index) and
    WORLD_SIZE (pods x PET_NPROC_PER_NODE): right for one process a pod, and refused where
    WORLD_SIZE counts processes this pod does not start. Operators that set only the PET_*
    variables (Trainer v2's torch plugin, JobSet, an elastic PyTorchJob) leave the ranks to
    torchrun: refused, unless they describe one process in all."""
    shape = {name: env.get(name) for name in TORCHRUN_JOB_SHAPE if env.get(name) is not None}
    said = ", ".join(f"{name}={value}" for name, value in shape.items())
    per_pod = env.get("PET_NPROC_PER_NODE", "1")
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        if per_pod != "1":
            raise LauncherError(
                f"{said}: the job asks for {per_pod} processes a pod (WORLD_SIZE="
                f"{env['WORLD_SIZE']}), but this pod runs one: start the script with torchrun, "
                "which starts them"
            )
        return Ranks("pytorchjob", _int(env, "RANK"), 0, _int(env, "WORLD_SIZE"), 1)
    if env.get("PET_NNODES", "1") == "1" and per_pod == "1":
        return Ranks("single", None, None, None, None)
    raise LauncherError(
        f"{said} are torchrun's settings (a Kubernetes operator set them), but torchrun did not "
        "start this process: each pod would train alone. Start the script with torchrun"
    )


def _volcano_pod(env: Mapping[str, str]) -> Ranks | None:
    """A pod of a Volcano Job with the pytorch plugin, started without torchrun: one process.
    The plugin (pkg/controllers/job/plugins/distributed-framework/pytorch) sets RANK (master 0,
    worker i: i + 1) and WORLD_SIZE (the pods), nothing local; None where it is not such a pod."""
    local = env.get("LOCAL_RANK") is not None or env.get("LOCAL_WORLD_SIZE") is not None
    if local or not any(VOLCANO_TASK_HOSTS.fullmatch(name) for name in env):
        return None
    return Ranks("volcano", _int(env, "RANK"), 0, _int(env, "WORLD_SIZE"), 1)


def _read(dialect: Dialect, env: Mapping[str, str]) -> Ranks:
    names = (dialect.rank, dialect.local_rank, dialect.world_size, dialect.local_world_size)
    return Ranks(dialect.launcher, *(_int(env, name) for name in names))


def _in_srun_step(env: Mapping[str, str]) -> bool:
    """srun's tasks; a batch script has SLURM_PROCID=0 but no step id, or a special one."""
    step = env.get("SLURM_STEP_ID", "")
    return step.isdigit() and int(step) < _SLURM_SPECIAL_STEP_MIN and bool(env.get("SLURM_PROCID"))


def _srun_task(env: Mapping[str, str]) -> Ranks:
    _refuse_a_step_numbered_out_of_order(env)
    rank = _int(env, "SLURM_PROCID")
    for name in ("PMI_RANK", "PMIX_RANK", "PALS_RANKID"):  # its MPI plugin's copy agrees
        if env.get(name) is not None and _int(env, name) != rank:
            raise LauncherError(f"SLURM_PROCID={rank} but {name}={env[name]}: an unknown mpiexec")
    world = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    return Ranks("slurm", rank, _int(env, "SLURM_LOCALID"), world, _slurm_tasks_on_node(env))


def _by_hand(env: Mapping[str, str]) -> Ranks:
    """RANK and WORLD_SIZE set by hand or by a wrapper (`export RANK=$SLURM_PROCID`): a local
    rank or size not set with them is the launcher's that started the process (srun's,
    mpiexec's). With none, launch_info refuses a job (every rank would drive GPU 0)."""
    found = _read(BY_HAND, env)
    if found.rank is not None and found.world_size is None:
        raise LauncherError(
            f"RANK={found.rank} is set but WORLD_SIZE is not: export WORLD_SIZE (the number of "
            "ranks) with it, or unset RANK"
        )
    try:
        job = launched_by({k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")})
    except LauncherError:
        if None in (found.local_rank, found.local_world_size):
            raise
        job = Ranks("single", None, None, None, None)  # all four set: they are the answer
    started_by = "" if job.launcher == "single" else job.launcher
    if None not in (found.local_rank, found.local_world_size) or not started_by:
        return replace(found, started_by=started_by)
    if (job.rank, job.world_size) != (found.rank, found.world_size):
        raise LauncherError(
            f"RANK={found.rank} and WORLD_SIZE={found.world_size} disagree with {job.launcher}'s "
            f"rank {job.rank} of {job.world_size}: export LOCAL_RANK and LOCAL_WORLD_SIZE too, or "
            "unset RANK and WORLD_SIZE"
        )
    local_rank = job.local_rank if found.local_rank is None else found.local_rank
    local_world = job.local_world_size if found.local_world_size is None else found.local_world_size
    return replace(
        found, local_rank=local_rank, local_world_size=local_world, started_by=started_by
    )
