"""summary.json: a run's machine-readable result, which tests and benchmarks read. No communication
here: the scripts gather what needs every rank (the replica checksums) themselves."""

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch


def parameter_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameters: the same on every rank when the replicas are identical."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON to a temporary file and rename it, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_summary(output_dir: str | Path, **fields: Any) -> Path:
    """Write `fields` to <output_dir>/summary.json (call it on one rank). With `replica_checksums`
    (every rank's parameter_checksum), it adds whether the replicas are identical."""
    if "replica_checksums" in fields:
        fields["replicas_identical"] = len(set(fields["replica_checksums"])) == 1
    path = Path(output_dir) / "summary.json"
    write_json_atomic(path, fields)
    print(f"summary written to {path}", flush=True)
    return path


def run_record(cfg, launch, *, backend: str, device, start_time: float, images_seen: int, **fields):
    """The fields every lesson's summary.json holds, from its config, its launch (None for one
    process) and its timings, then `fields`: the lesson's results, which may override a default
    (03's global batch and learning rate)."""
    elapsed = time.perf_counter() - start_time
    world_size = launch.world_size if launch else 1
    record = dict(
        world_size=world_size,
        launcher=launch.launcher if launch else "none",
        backend=backend,
        global_batch_size=cfg.local_batch_size * world_size,
        images_per_second=images_seen * world_size / elapsed,  # every rank saw as many
        device=str(device),
        local_batch_size=cfg.local_batch_size,
        lr=cfg.lr,
        wall_time_s=elapsed,
    )
    return record | fields
