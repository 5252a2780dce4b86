"""06 - comm_check: the check to run on a new allocation before training.

1. Every rank checks in at rank 0's store (MASTER_ADDR:MASTER_PORT) with its host and
   device; rank 0 prints the table, or names the ranks that never arrived.
2. All-reduce latency and bandwidth for message sizes from --min-bytes (8 B) to
   --max-bytes (256 MiB), doubling, as nccl-tests report them:
       algbw = bytes / time          busbw = algbw * 2 (n - 1) / n
   busbw is what each link carries in a ring all-reduce, so it is comparable across
   world sizes and against the hardware's link speed.
3. A failure ends within --timeout-s with one line naming the rank, the host and the
   address it could not reach, and the environment variables to check.

Run it with the same launcher and resources as the training job:
    torchrun --standalone --nproc_per_node=2 06_multinode/comm_check.py --max-bytes 16777216
    mpiexec -n 2 python 06_multinode/comm_check.py
    srun --ntasks-per-node=4 python 06_multinode/comm_check.py       # GPUs: nccl
"""

import dataclasses
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from common.config import field, load_config
from common.errors import ConfigError, LauncherError, exit_on_bad_input
from common.launcher import detect_launcher
from common.report import write_json_atomic

MIB = 1 << 20
CHECK_VARIABLES = ("MASTER_ADDR/MASTER_PORT (reachable from every node, port open)",
                   "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the interface on the network between the nodes)",
                   "NCCL_DEBUG=INFO (NCCL's own account of what it tried)")


@dataclasses.dataclass
class CommConfig:
    """All-reduce latency and bus bandwidth across all ranks, with a clear error when a rank is unreachable."""

    min_bytes: int = field(8, "smallest message in bytes", min=4)
    max_bytes: int = field(256 * MIB, "largest message in bytes (doubling from --min-bytes)", min=4)
    iters: int = field(20, "timed all-reduces per size (fewer above 1 MiB, at least 3)", min=1)
    warmup: int = field(2, "untimed all-reduces per size", min=0)
    backend: str = field("auto", "process-group backend (auto: nccl on GPUs, gloo on CPUs)",
                         choices=("auto", "gloo", "nccl"))
    device: str = field("auto", "device type (auto: cuda if there is a GPU, else cpu)", choices=("auto", "cpu", "cuda"))
    timeout_s: float = field(60.0, "seconds to wait for every rank to check in, and for each collective", min=1.0)
    output_dir: str = field("", "if set, rank 0 writes comm_check.json here")

    def validate(self):  # called by load_config
        if self.max_bytes < self.min_bytes:
            raise ConfigError(f"--max-bytes {self.max_bytes} is below --min-bytes {self.min_bytes}")
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend: nccl does not support cpu tensors (use gloo or auto)")


def hint() -> str:
    return "check " + "; ".join(CHECK_VARIABLES)


def check_in(info, device, timeout_s):
    """Rendezvous at rank 0's TCP store; return every rank's (host, local rank, device, CUDA_VISIBLE_DEVICES).

    We build the store ourselves (the same MASTER_ADDR/PORT that env:// would use) so that
    rank 0 can tell which ranks never arrived instead of only "timed out".
    """
    host = socket.gethostname()
    where = f"{info.master_addr}:{info.master_port}"
    # Under torchrun the agent already serves the store on MASTER_PORT; the workers are clients.
    is_server = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_server,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, ValueError, OSError) as exc:
        raise LauncherError(
            f"rank {info.rank} on {host} cannot reach rank 0's store at {where} within {timeout_s:.0f} s "
            f"({_first_line(exc)}); {hint()}") from None
    prefix = f"comm_check/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(prefix, store)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")  # a site's per-rank GPU binding sets it
    store.set(f"rank{info.rank}", f"{host}|{info.local_rank}|{device}|{visible}")
    keys = [f"rank{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError):
        missing = [r for r, key in enumerate(keys) if not _has(store, key)]
        arrived = sorted({store.get(k).decode().split("|")[0] for k in keys if _has(store, k)})
        raise LauncherError(
            f"rank {info.rank} on {host}: rank(s) {_ranges(missing)} of {info.world_size} never checked in at "
            f"{where} within {timeout_s:.0f} s (arrived from: {', '.join(arrived) or 'none'}); were all "
            f"{info.world_size} processes started, and do the missing hosts reach {where}? {hint()}") from None
    table = []
    for key in keys:
        h, lr, dev, visible = store.get(key).decode().split("|")
        table.append((h, int(lr), dev, visible))
    return store, table


def _has(store, key) -> bool:
    try:
        return store.check([key])
    except RuntimeError:
        return False


def _ranges(ranks) -> str:
    return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")


def _first_line(exc) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def sizes(cfg):
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        yield size
        size *= 2


def bench(size, cfg, device, world_size):
    """Collective: (seconds per all-reduce, correct?) for one message size, slowest rank's time."""
    n = max(1, size // 4)  # float32 elements
    iters = cfg.iters if size <= MIB else max(3, cfg.iters * MIB // size)
    tensor = torch.full((n,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(tensor)  # correctness first: sum of (rank + 1) over all ranks
    correct = bool((tensor == world_size * (world_size + 1) / 2).all())
    tensor.zero_()  # zeros stay zeros, however often they are summed
    for _ in range(cfg.warmup):
        dist.all_reduce(tensor)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start, float(not correct)], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return elapsed[0].item() / iters, iters, elapsed[1].item() == 0.0


def _sync(device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def check(cfg, info, device, backend, table):
    n = info.world_size
    if info.rank == 0:
        hosts = sorted({h for h, *_ in table})
        print("\n".join([f"comm_check: {n} ranks, launcher {info.launcher} (scheduler: {info.scheduler}), "
                         f"backend {backend}, rendezvous {info.master_addr}:{info.master_port}",
                         f"{'rank':>5} {'local':>5}  {'host':<24} {'device':<8} CUDA_VISIBLE_DEVICES",
                         *(f"{rank:>5} {local_rank:>5}  {host:<24} {dev:<8} {visible}"
                           for rank, (host, local_rank, dev, visible) in enumerate(table)),
                         f"{n} ranks on {len(hosts)} host(s): {', '.join(hosts)}",
                         f"{'size(B)':>12} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
                         "  correct"]), flush=True)
    results = []
    for size in sizes(cfg):
        try:
            seconds, iters, correct = bench(size, cfg, device, n)
        except (RuntimeError, dist.DistError) as exc:
            raise LauncherError(
                f"rank {info.rank} on {socket.gethostname()}: all-reduce of {size} bytes failed "
                f"({_first_line(exc)}): a rank died or the nodes cannot open {backend}'s own connections "
                f"(ports other than MASTER_PORT); {hint()}") from None
        algbw = size / seconds / 1e9
        busbw = algbw * 2 * (n - 1) / n
        results.append(dict(bytes=size, iters=iters, time_us=seconds * 1e6, algbw_gbps=algbw,
                            busbw_gbps=busbw, correct=correct))
        if info.rank == 0:
            print(f"{size:>12} {iters:>6} {seconds * 1e6:>12.1f} {algbw:>12.4f} {busbw:>12.4f}  {correct}", flush=True)
    big = [r["busbw_gbps"] for r in results if r["bytes"] >= MIB] or [r["busbw_gbps"] for r in results]
    if info.rank == 0:
        print(f"peak busbw {max(big):.3f} GB/s; all results correct: {all(r['correct'] for r in results)}",
              flush=True)
    if cfg.output_dir and info.rank == 0:
        write_json_atomic(Path(cfg.output_dir) / "comm_check.json",
                          dict(world_size=n, launcher=info.launcher, scheduler=info.scheduler, backend=backend,
                               master_addr=info.master_addr, master_port=info.master_port,
                               ranks=[dict(rank=r, host=h, local_rank=lr, device=d, cuda_visible_devices=v)
                                      for r, (h, lr, d, v) in enumerate(table)],
                               results=results))
    if not all(r["correct"] for r in results):
        raise LauncherError("all-reduce returned wrong sums: the backend or the network corrupts data")


@record
def main():
    cfg = load_config(CommConfig)
    info = detect_launcher()
    # One GPU per process, as in 01: the local rank's, or 0 where each rank sees only its own; CPU (gloo) without.
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", info.gpu) if use_cuda else torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if use_cuda else "gloo"
    with exit_on_bad_input():  # whatever fails to connect: one "error:" line naming rank, host, address; exit code 2
        if use_cuda and not torch.cuda.is_available():
            raise LauncherError(f"--device cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        if use_cuda:
            torch.cuda.set_device(device)  # before the process group, so its collectives use this device
        store, table = check_in(info, device, cfg.timeout_s)
        dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(seconds=cfg.timeout_s))
        check(cfg, info, device, backend, table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
