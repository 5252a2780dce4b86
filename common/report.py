"""summary.json: a run's machine-readable result, which tests
and benchmarks read; every rank calls write_summary."""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# the last checksum gather's tensors, kept until the process exits (replica_checksums)
_LAST_GATHER: list = []


def replica_checksums(model: torch.nn.Module) -> list[str]:
    """Collective: every rank's SHA-256 of its parameters, on
    all ranks; shows that DDP replicas are identical."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().float().cpu().numpy().tobytes())
    device = next(model.parameters()).device  # nccl gathers device tensors
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    # Usually a run's last collective: gloo's worker thread
    # may drop its references after all_gather returns,
    # and without Python's that drop needs the GIL, which
    # no thread gets once the interpreter exits (torch 2.14
    # aborts: "terminate called without an active
    # exception"; DDP keeps gloo's threads past destroy).
    _LAST_GATHER[:] = [mine, gathered]
    return [bytes(t.cpu().tolist()).hex() for t in gathered]


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON to a temporary file and rename it, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_summary(
    output_dir: str | Path, model: torch.nn.Module | None = None, **fields: Any
) -> Path:
    """Rank 0 writes `fields` to <output_dir>/summary.json;
    with a model, a collective adds replica checksums."""
    if model is not None:
        checksums = replica_checksums(model)
        fields.update(replica_checksums=checksums, replicas_identical=len(set(checksums)) == 1)
    path = Path(output_dir) / "summary.json"
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_json_atomic(path, fields)
        print(f"summary written to {path}", flush=True)
    return path
