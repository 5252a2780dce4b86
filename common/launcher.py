"""Which launcher started this process, and where rank 0 listens.

`detect_launcher(env)` is a pure function of an environment mapping (plus reading
`$PBS_NODEFILE` when PBS is involved), so every launcher is unit-tested with plain
dicts. It needs no mpi4py, ssh or scontrol.

Order matters: torchrun may run inside a Slurm or PBS job, and PALS exports the
same PMI_* variables as MPICH, so the most specific launcher is checked first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Mapping

from common.errors import LauncherError

DEFAULT_PORT = 29500  # torchrun's default
PORT_BASE, PORT_SPAN = 15000, 15000  # derived ports stay below Linux's ephemeral range (32768+)
LOOPBACK = "127.0.0.1"


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


# (launcher name, variables whose presence means this launcher, rank, local rank, world size,
# local world size).
_MPI_LIKE = [
    ("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_RANK",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    # HPE PALS (PBS Pro on Cray/HPE systems) also sets PMI_RANK/PMI_SIZE: check it before MPICH.
    ("pals", ("PALS_RANKID", "PALS_LOCAL_RANKID"), "PALS_RANKID", "PALS_LOCAL_RANKID", "PMI_SIZE",
     "PALS_LOCAL_SIZE"),
    # MPICH's Hydra and Intel MPI (also Hydra) share these names.
    ("mpich", ("PMI_RANK", "PMI_SIZE"), "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
]


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or env.get(name, "") == "":
        return None
    value = env[name].strip()
    if not re.fullmatch(r"-?\d+", value):
        raise LauncherError(f"{name}={value!r} is not an integer")
    return int(value)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist such as 'gpu[001-004,010],login2' into host names."""
    if not hostlist or not hostlist.strip():
        raise LauncherError("empty host list")
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        # Each bracket group multiplies: 'r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2.
        parts = re.split(r"(\[[^\[\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], hostlist))
            else:
                if "[" in part or "]" in part:
                    raise LauncherError(f"unbalanced brackets in host list {hostlist!r}")
                choices.append([part])
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in hostlist.strip():
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise LauncherError(f"unbalanced brackets in host list {hostlist!r}")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise LauncherError(f"unbalanced brackets in host list {hostlist!r}")
    items.append(current)
    if any(not item for item in items):
        raise LauncherError(f"empty host name in host list {hostlist!r}")
    return items


def _expand_ranges(spec: str, hostlist: str) -> list[str]:
    out = []
    for rng in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", rng.strip())
        if not m:
            raise LauncherError(f"bad range {rng!r} in host list {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise LauncherError(f"descending range {rng!r} in host list {hostlist!r}")
        width = len(lo)  # keep zero padding: 001-004 -> 001 002 003 004
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
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
    if env.get("PBS_JOBID"):
        return "pbs", env["PBS_JOBID"]
    return "none", ""


def master_address(env: Mapping[str, str]) -> str:
    """MASTER_ADDR, else the job's first host (Slurm node list, PBS node file), else loopback."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("SLURM_JOB_ID") and nodelist:
        return expand_hostlist(nodelist)[0]
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        try:
            lines = [ln.strip() for ln in Path(nodefile).read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise LauncherError(f"cannot read PBS_NODEFILE={nodefile}: {exc.strerror}") from None
        if not lines:
            raise LauncherError(f"PBS_NODEFILE={nodefile} is empty")
        return lines[0]
    return LOOPBACK


def master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT, else a port derived from the job id (two jobs on a node differ), else 29500."""
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise LauncherError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
        return port
    _, job_id = _scheduler(env)
    digits = re.match(r"\d+", job_id)  # PBS ids look like '1234.pbs01', Slurm arrays '12_3'
    if digits:
        return PORT_BASE + int(digits.group()) % PORT_SPAN
    return DEFAULT_PORT


def detect_launcher(env: Mapping[str, str], rank: int | None = None,
                    world_size: int | None = None) -> LaunchInfo:
    """Rank, local rank, world sizes, master address/port and launcher name from `env`.

    `rank`/`world_size` are given explicitly by mp.spawn workers.
    """
    scheduler, job_id = _scheduler(env)
    found = _find(env, rank, world_size)
    name, r, lr, ws, lws = found
    if ws is None:
        ws = 1
    if ws < 1:
        raise LauncherError(f"{name}: world size {ws} must be at least 1")
    if r is None:
        if ws > 1:
            raise LauncherError(
                f"{name}: world size is {ws} but this process's rank is not set; "
                "start it with a launcher (torchrun, srun, mpiexec) or set RANK")
        r = 0
    if not 0 <= r < ws:
        raise LauncherError(f"{name}: rank {r} is outside the world size {ws} (must be 0..{ws - 1})")
    if lws is None:
        lws = ws if scheduler == "none" else 1 if lr is None else lr + 1
    if lr is None:
        lr = r % lws
    if not 0 <= lr < lws or lws > ws:
        raise LauncherError(f"{name}: local rank {lr} and local world size {lws} do not fit world size {ws}")
    return LaunchInfo(name, r, lr, ws, lws, master_address(env), master_port(env), scheduler, job_id)


def _find(env, rank, world_size):
    if rank is not None or world_size is not None:
        return "mp.spawn", rank, None, world_size, None
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return ("torchrun", _int(env, "RANK"), _int(env, "LOCAL_RANK"),
                _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE"))
    if env.get("RANK") or env.get("WORLD_SIZE"):
        # Set by hand or by another launcher that follows torchrun's convention.
        return ("env", _int(env, "RANK"), _int(env, "LOCAL_RANK"),
                _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE"))
    for name, markers, r, lr, ws, lws in _MPI_LIKE:
        if any(env.get(m) is not None for m in markers):
            if name == "mpich" and env.get("I_MPI_ROOT"):
                name = "intel-mpi"
            return name, _int(env, r), _int(env, lr), _int(env, ws), _int(env, lws)
    if env.get("PMIX_RANK") is not None:
        # PMIx alone exports no world size; Slurm (srun --mpi=pmix) does.
        ws = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        return "pmix", _int(env, "PMIX_RANK"), _int(env, "SLURM_LOCALID"), ws, None
    # srun exports SLURM_STEP_ID; a batch script alone has SLURM_PROCID=0 but no SLURM_STEP_ID (checked
    # on Slurm 22.05). The special steps (batch, extern, interactive: ids 0xfffffffa and up) are not srun steps.
    if _is_srun_step(env.get("SLURM_STEP_ID")) and env.get("SLURM_PROCID"):
        ws = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        lws = None
        node = _int(env, "SLURM_NODEID")
        spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if spec and node is not None:
            lws = _slurm_tasks_on_node(spec, node)
        return "slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), ws, lws
    return "single", None, None, None, None


_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFFA  # interactive, batch, extern and pending steps


def _is_srun_step(step_id: str | None) -> bool:
    if step_id is None or step_id == "batch":
        return False
    return not (step_id.isdigit() and int(step_id) >= _SLURM_SPECIAL_STEP_MIN)
