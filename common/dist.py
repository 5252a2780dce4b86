"""Process-group setup and teardown for every launcher.

    ctx = setup_distributed(backend="auto", timeout_s=60)
    try:
        ...                       # train
    finally:
        cleanup_distributed()

Device: cuda:<local_rank> -> nccl, xpu:<local_rank> -> xccl, else cpu -> gloo.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from common.errors import ConfigError, LauncherError
from common.launcher import LaunchInfo, detect_launcher

BACKENDS = ("auto", "gloo", "nccl", "xccl")

# The job this process joined, kept for error reports after the group is gone
# (common.entry reads it): rank, world_size, timeout_s, and the rendezvous key-value store.
JOINED: dict = {}
# Set by common.entry.run: on an exception, keep the group until the error is reported (the
# process exits right after, which closes its connections); leaving it earlier would make the
# peers fail, and their launcher stop this process, before it has said why.
LEAVE_ON_EXIT = False


@dataclass(frozen=True)
class DistContext:
    info: LaunchInfo
    device: torch.device
    backend: str
    hostname: str

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.rank == 0


def choose_device(local_rank: int, device: str = "auto") -> torch.device:
    """One accelerator per process, picked by local rank; CPU when there is none."""
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            device = "xpu"
        else:
            device = "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device not in ("cuda", "xpu"):
        raise ConfigError(f"device: {device!r} is not one of auto, cpu, cuda, xpu")
    module = getattr(torch, device)
    count = module.device_count() if module.is_available() else 0
    if local_rank >= count:
        error = LauncherError(
            f"local rank {local_rank} needs {device}:{local_rank} but this node has {count} {device} "
            "device(s): start at most one process per device (e.g. --nproc_per_node, --ntasks-per-node)")
        error.report_here = local_rank == count  # the first rank without a device says it, once
        raise error
    return torch.device(device, local_rank)


def choose_backend(device: torch.device, backend: str = "auto") -> str:
    natural = {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")
    if backend == "auto":
        return natural
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "gloo" and backend != natural:
        raise ConfigError(f"backend: {backend} does not support {device.type} tensors (use gloo or auto)")
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
                 "xccl": getattr(dist, "is_xccl_available", lambda: False)}[backend]
    if not available():
        raise ConfigError(f"backend: this PyTorch build has no {backend} support (use --backend auto)")
    return backend


def prepare_device(info: LaunchInfo, device: str = "auto", backend: str = "auto",
                   env: Mapping[str, str] = os.environ) -> tuple[torch.device, str]:
    """This rank's device and backend, made current before the process group starts."""
    dev = choose_device(info.local_rank, device)
    backend = choose_backend(dev, backend)
    if dev.type == "cpu" and "OMP_NUM_THREADS" not in env:
        # N processes on one CPU: share the cores instead of each taking all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    if dev.type != "cpu":
        getattr(torch, dev.type).set_device(dev)  # before init, so collectives use this device
    return dev, backend


def setup_distributed(backend: str = "auto", timeout_s: float = 60.0, device: str = "auto",
                      rank: int | None = None, world_size: int | None = None,
                      env: Mapping[str, str] | None = None) -> DistContext:
    """Detect the launcher, pick device and backend, and join the process group.

    Validation happens before init_process_group, so a bad setting fails fast on every
    rank instead of leaving the others waiting for it at rendezvous.
    """
    env = os.environ if env is None else env
    info = detect_launcher(env, rank=rank, world_size=world_size)
    dev, backend = prepare_device(info, device, backend, env)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")

    # env:// rendezvous reads MASTER_*; the rest are exported as torchrun does, for any
    # library (and our error reporting) that looks for them, whatever the launcher.
    os.environ.update(MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
                      RANK=str(info.rank), LOCAL_RANK=str(info.local_rank),
                      WORLD_SIZE=str(info.world_size), LOCAL_WORLD_SIZE=str(info.local_world_size))
    from common.entry import install_failure_hook

    install_failure_hook()  # test/demo hook, inactive unless DDP_EXAMPLES_FAIL_AT_STEP is set
    store_option: dict = {"init_method": "env://"}
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart not in ("", "0"):
        # After a torchrun restart (--max-restarts) the workers share the agent's store with the
        # previous attempt, whose keys (e.g. gloo addresses of dead workers) would be read as
        # current. A per-attempt prefix keeps the attempts apart.
        agent_store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False,
                                    timeout=timedelta(seconds=timeout_s))
        store_option = {"store": dist.PrefixStore(f"restart_{restart}", agent_store)}
    dist.init_process_group(
        backend=backend,
        **store_option,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type != "cpu" else None,
    )
    JOINED.update(rank=info.rank, world_size=info.world_size, timeout_s=timeout_s,
                  store=dist.distributed_c10d._get_default_store())
    return DistContext(info, dev, backend, socket.gethostname())


def cleanup_distributed() -> None:
    """Leave the process group. Called from `finally`: when an exception is on its way out to
    common.entry.run, stay until run() has reported it and exits; elsewhere abort (NCCL) so
    nothing waits on peers that may be dead."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    failing = sys.exc_info()[0] is not None
    if failing and LEAVE_ON_EXIT:
        return
    if failing and dist.get_backend() != "gloo":
        try:
            dist.distributed_c10d._abort_process_group()
            return
        except Exception:  # noqa: BLE001 - experimental API; fall back to a normal destroy
            pass
    # Free DDP wrappers still alive in reference cycles while the group exists: destroyed
    # later, at interpreter exit, their reducer's threads can abort the process (SIGABRT,
    # "terminate called without an active exception"), turning a finished run into a failure.
    gc.collect()
    dist.destroy_process_group()
