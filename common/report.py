"""Rank-0 reporting: banner, progress lines, TensorBoard, summary.json; and metrics that
are all-reduced as sums and counts (never averages of averages).

Functions whose docstring says "collective" must be called by every rank, in the same
order; everything else does plain I/O on rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """print() on rank 0 only."""
    if is_main():
        print(*args, flush=True)


def all_reduce_sums(values: Iterable[float], device: torch.device) -> list[float]:
    """Collective: element-wise sum of `values` over all ranks (float64, so counts stay exact)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def replica_checksums(model: torch.nn.Module) -> list[str]:
    """Collective: a SHA-256 of every rank's parameters, gathered on all ranks.

    DDP keeps replicas identical by construction; this shows it instead of assuming it.
    """
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().float().cpu().numpy().tobytes())
    gathered: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(gathered, digest.hexdigest())
    return gathered


def banner(ctx, cfg, **extra: Any) -> None:
    """The start-up banner: where and how this job runs, printed once by rank 0."""
    info = ctx.info
    lines = {
        "launcher": f"{info.launcher} (scheduler: {info.scheduler})",
        "backend / device": f"{ctx.backend} / {ctx.device} (rank 0 on {ctx.hostname})",
        "world size": f"{info.world_size} ({info.local_world_size} per node), "
                      f"rendezvous {info.master_addr}:{info.master_port}",
        "batch": f"local {cfg.batch_size} x world {info.world_size} = global "
                 f"{cfg.batch_size * info.world_size}",
        "learning rate": cfg.lr,
        "data": f"{cfg.dataset}, model {cfg.model}",
    }
    lines.update(extra)
    width = max(map(len, lines))
    print0("=" * 72)
    for key, value in lines.items():
        print0(f"{key:<{width}} : {value}")
    print0("=" * 72)


class StepTimer:
    """Images/s and the fraction of wall time spent waiting for data (inside next(loader)).

    Wrap the loader: `for batch in timer.iterate(loader): ...`; call global_rates() after a step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.data_s = 0.0
        self.images = 0
        self.started = None

    def iterate(self, loader: Iterable) -> Iterator:
        it = iter(loader)
        while True:
            start = time.perf_counter()
            if self.started is None:
                self.started = start
            try:
                batch = next(it)
            except StopIteration:
                return
            self.data_s += time.perf_counter() - start
            self.images += len(batch[0])
            yield batch

    def global_rates(self) -> tuple[float, float]:
        """Collective: (images/s over all ranks, data-wait fraction averaged over ranks) since reset."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: time it honestly
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        images, data_s, total_s = all_reduce_sums([self.images, self.data_s, elapsed], self.device)
        per_rank_time = total_s / dist.get_world_size()
        return (images / per_rank_time if per_rank_time else 0.0,
                data_s / total_s if total_s else 0.0)


class TensorBoard:
    """SummaryWriter on rank 0; a no-op elsewhere, so the loop needs no `if rank == 0`."""

    def __init__(self, log_dir: str | Path):
        self.writer = None
        if is_main():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir))

    def scalars(self, step: int, **values: float) -> None:
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON to a temporary file and rename it, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_summary(output_dir: str | Path, **fields: Any) -> Path:
    """Rank 0: summary.json, the machine-readable result that tests and sweeps read."""
    path = Path(output_dir) / "summary.json"
    if is_main():
        write_json_atomic(path, fields)
        print(f"summary written to {path}", file=sys.stdout, flush=True)
    return path
