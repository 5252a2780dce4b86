"""Process-group setup and teardown for every launcher.

    ctx = setup_distributed(backend="auto", timeout_s=60)
    try:
        ...                       # train
    finally:
        cleanup_distributed()

Device: cuda:<local_rank> -> nccl, xpu:<local_rank> -> xccl, else cpu -> gloo.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from common.errors import ConfigError, LauncherError
from common.launcher import LaunchInfo, detect_launcher

BACKENDS = ("auto", "gloo", "nccl", "xccl")


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
        raise LauncherError(
            f"local rank {local_rank} needs {device}:{local_rank} but this node has {count} {device} "
            "device(s): start at most one process per device (e.g. --nproc_per_node, --ntasks-per-node)")
    return torch.device(device, local_rank)


def choose_backend(device: torch.device, backend: str = "auto") -> str:
    natural = {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")
    if backend == "auto":
        return natural
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "gloo" and backend != natural:
        raise ConfigError(f"backend: {backend} does not support {device.type} tensors (use gloo or auto)")
    return backend


def setup_distributed(backend: str = "auto", timeout_s: float = 60.0, device: str = "auto",
                      rank: int | None = None, world_size: int | None = None,
                      env: Mapping[str, str] | None = None) -> DistContext:
    """Detect the launcher, pick device and backend, and join the process group.

    Validation happens before init_process_group, so a bad setting fails fast on every
    rank instead of leaving the others waiting for it at rendezvous.
    """
    env = os.environ if env is None else env
    info = detect_launcher(env, rank=rank, world_size=world_size)
    dev = choose_device(info.local_rank, device)
    backend = choose_backend(dev, backend)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")

    # env:// rendezvous reads MASTER_*; the rest are exported as torchrun does, for any
    # library (and our error reporting) that looks for them, whatever the launcher.
    os.environ.update(MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
                      RANK=str(info.rank), LOCAL_RANK=str(info.local_rank),
                      WORLD_SIZE=str(info.world_size), LOCAL_WORLD_SIZE=str(info.local_world_size))
    if dev.type == "cpu" and "OMP_NUM_THREADS" not in env:
        # N processes on one CPU: share the cores instead of each taking all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    if dev.type != "cpu":
        getattr(torch, dev.type).set_device(dev)  # before init, so collectives use this device
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
    return DistContext(info, dev, backend, socket.gethostname())


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
