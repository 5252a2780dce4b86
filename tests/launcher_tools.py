"""Real launchers for tests: skip when a tool is missing,
unless REQUIRE_REAL_LAUNCHERS=1 (CI), then fail."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.processes import clean_env, read_env, run, start

REQUIRED = os.environ.get("REQUIRE_REAL_LAUNCHERS") == "1"


def unavailable(reason: str) -> None:
    """Skip (locally) or fail (CI sets REQUIRE_REAL_LAUNCHERS=1) because `reason`."""
    if REQUIRED:
        pytest.fail(f"REQUIRE_REAL_LAUNCHERS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def need_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        unavailable(f"not installed: {', '.join(missing)}")


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        unavailable(f"{what} needs root")


def openmpi_env(**extra: str) -> dict[str, str]:
    """Open MPI as root, kept on loopback."""
    return clean_env(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_oob_tcp_if_include="lo",
        OMPI_MCA_btl_tcp_if_include="lo",
        **extra,
    )


PBS_JOBS = ["pbs_mpiexec.pbs", "pbs_torchrun.pbs"]


SLURM_JOBS = ["slurm_srun.sbatch", "slurm_torchrun.sbatch"]


SITE_JOBS = {"derecho": PBS_JOBS, "polaris": PBS_JOBS, "perlmutter": SLURM_JOBS}


def source_site(
    site: str, tmp_path: Path, module_exports: dict[str, str] | None = None, **extra: str
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Source jobs/sites/<site>.sh as the job files do (set -euo pipefail); return the variables it
    exported, the placement variables it set, and the module/conda calls. `module_exports`: what
    `module load` exports, as a site's module does (then a shell function, not the stub)."""
    module = ""
    if module_exports:
        exports = " ".join(f"export {k}={shlex.quote(v)};" for k, v in module_exports.items())
        module = f'module() {{ echo "module $*" >> {tmp_path}/calls; {exports} }}; '
    script = module + (
        f"set -euo pipefail; env -0 > {tmp_path}/before; source jobs/sites/{site}.sh; env -0 "
        f"> {tmp_path}/after; "
        "for v in NRANKS_PER_NODE MPIEXEC_BIND GPUS_PER_NODE; do [[ -v $v ]] && printf "
        "'%s=%s\\n' $v \"${!v}\"; done; true"
    )
    result = run(["bash", "-c", script], 30, env=site_env(tmp_path, **extra), check=True)

    before, after = read_env(tmp_path / "before"), read_env(tmp_path / "after")
    exported = {k: v for k, v in after.items() if before.get(k) != v and k not in ("_", "SHLVL")}
    placement = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return exported, placement, calls


def stub_bin(tmp_path: Path) -> Path:
    """`module` and `conda` that record their arguments (no Lmod or conda here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("module", "conda"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def site_env(tmp_path: Path, with_module: bool = True, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in clean_env().items()
        if not k.startswith(("NCCL_", "FI_")) and k not in ("LD_LIBRARY_PATH", "SITE")
    }
    env.update(extra)
    if with_module:
        env["PATH"] = f"{stub_bin(tmp_path)}:{env['PATH']}"
    return env


# What each Kubernetes operator puts into a pod's environment, written from its source (no
# Kubernetes API server exists here). Pod "index" of "pods"; "per_pod" processes a pod.
def kubernetes_pod_env(
    operator: str, index: int, pods: int, per_pod: int = 1, name: str = "job"
) -> dict[str, str]:
    if operator == "pytorchjob":
        # kubeflow/training-operator v1.9.0, pkg/controller.v1/pytorch/envvar.go, setPodEnv (a
        # Master replica and Workers): WORLD_SIZE = replicas x nprocPerNode, RANK = PET_NODE_RANK
        # = the pod's index (master 0, worker i: i + 1), PET_NNODES = replicas; PET_NPROC_PER_NODE
        # only where the job sets nprocPerNode. master.go: MASTER_ADDR = <job>-master-0,
        # MASTER_PORT = the container port, PyTorchJobDefaultPort 23456
        # (apis/kubeflow.org/v1/pytorch_types.go).
        env = {
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": f"{name}-master-0",
            "MASTER_PORT": "23456",
            "PET_MASTER_ADDR": f"{name}-master-0",
            "PET_MASTER_PORT": "23456",
            "WORLD_SIZE": str(pods * per_pod),
            "RANK": str(index),
            "PET_NODE_RANK": str(index),
            "PET_NNODES": str(pods),
        }
        if per_pod != 1:
            env["PET_NPROC_PER_NODE"] = str(per_pod)
        return env
    if operator == "elastic-pytorchjob":
        # the same operator with an elasticPolicy and Workers only (elastic.go, Generate): no
        # RANK or WORLD_SIZE (those come with a Master), PET_NNODES as a range, the rendezvous
        return {
            "PET_NNODES": f"1:{pods}",
            "PET_NPROC_PER_NODE": str(per_pod),
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": f"{name}-worker-0:23456",
            "PET_RDZV_ID": name,
            "PET_MAX_RESTARTS": "3",
        }
    if operator == "trainjob":
        # kubeflow/trainer (v2), pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy, and
        # pkg/constants/constants.go: the PET_* variables only; PET_NODE_RANK from the Indexed
        # Job's completion index, which Kubernetes also exports. Trainer v2 runs on JobSet.
        return {
            "PET_NNODES": str(pods),
            "PET_NPROC_PER_NODE": str(per_pod),
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": "29500",
            "JOB_COMPLETION_INDEX": str(index),
        }
    if operator == "volcano":
        # volcano-sh/volcano, pkg/controllers/job/plugins/distributed-framework/pytorch/pytorch.go,
        # OnPodCreate: MASTER_ADDR = <job>-master-0.<job> (generateMasterAddr), MASTER_PORT
        # DefaultPort 23456, WORLD_SIZE = master + worker replicas, RANK = 0 on the master, worker
        # i: i + 1. It turns on the svc plugin (svc.go, OnPodCreate; const.go, EnvTaskHostFmt and
        # EnvHostNumFmt): VC_<TASK>_HOSTS and VC_<TASK>_NUM for every task.
        workers = ",".join(f"{name}-worker-{i}.{name}" for i in range(pods - 1))
        return {
            "MASTER_ADDR": f"{name}-master-0.{name}",
            "MASTER_PORT": "23456",
            "WORLD_SIZE": str(pods),
            "RANK": str(index),
            "VC_MASTER_HOSTS": f"{name}-master-0.{name}",
            "VC_MASTER_NUM": "1",
            "VC_WORKER_HOSTS": workers,
            "VC_WORKER_NUM": str(pods - 1),
        }
    raise ValueError(operator)


@contextlib.contextmanager
def two_hosts(subnet: int, names: tuple[str, ...] = ()):
    """Two hosts with their own addresses: network namespaces joined by a veth pair, 10.<subnet>.0.1
    and .2. Yields (namespaces, interfaces, addresses); deletes both namespaces at the end. With
    `names` (each "host0 alias..." and "host1 alias..."), both hosts' /etc/hosts maps them to the
    hosts' addresses, as a cluster's DNS resolves its nodes' names (ip netns exec mounts
    /etc/netns/<namespace>/hosts over /etc/hosts)."""
    need_root("creating network namespaces")
    need_tools("ip", "unshare")
    tag = f"{os.getpid() % 10000}"
    ns = [f"ddp{subnet}a{tag}", f"ddp{subnet}b{tag}"]
    veth = [f"v{subnet}a{tag}", f"v{subnet}b{tag}"]
    addr = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
    created = []
    try:
        for name in ns:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            created.append(name)
        subprocess.run(
            ["ip", "link", "add", veth[0], "netns", ns[0], "type", "veth",
             "peer", "name", veth[1], "netns", ns[1]],
            check=True,
            capture_output=True,
        )  # fmt: skip
        for name, dev, ip in zip(ns, veth, addr):
            for cmd in (
                ["ip", "addr", "add", f"{ip}/24", "dev", dev],
                ["ip", "link", "set", dev, "up"],
                ["ip", "link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", "netns", "exec", name, *cmd], check=True, capture_output=True)
            if names:
                hosts = Path("/etc/netns") / name / "hosts"
                hosts.parent.mkdir(parents=True, exist_ok=True)
                lines = [f"{ip} {host}" for ip, host in zip(addr, names)]
                hosts.write_text("\n".join(["127.0.0.1 localhost", *lines, ""]))
    except (subprocess.CalledProcessError, OSError) as exc:
        _delete_namespaces(created)
        unavailable(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    try:
        yield ns, veth, addr
    finally:
        _delete_namespaces(created)


def on_host(ns: str, name: str, command: str) -> list[str]:
    """`command` (a shell line) as a process of namespace host `ns`, with its own host name."""
    return [
        "ip",
        "netns",
        "exec",
        ns,
        "unshare",
        "--uts",
        "sh",
        "-c",
        f"hostname {name} && {command}",
    ]


def start_on_host(ns: str, name: str, command: str, env: dict[str, str], log: Path):
    """`command` on namespace host `ns` named `name`, started under the hang guard, its output
    in `log`."""
    with open(log, "w") as out:
        return start(on_host(ns, name, command), env=env, stdout=out, stderr=subprocess.STDOUT)


def _delete_namespaces(names):
    for name in names:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
