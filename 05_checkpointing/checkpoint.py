"""Checkpoint files for 05_checkpointing: atomic writes, keep-last-K, a `latest`
pointer, safe loading with fallback, RNG states as plain tensors, and the sampler that
resumes an epoch part-way.

No collectives: train.py calls save() on rank 0 and puts the gather and the barrier
around it itself, where a reader sees them.

Folder layout:
    ckpt-00000040.pt     one complete checkpoint per saved step (the last `keep` are kept)
    latest               a one-line text file naming the newest complete checkpoint
    .ckpt-*.tmp-<pid>    a write in progress, or one killed mid-write (removed by the next save);
    never read
"""

from __future__ import annotations

import math
import os
import random
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DistributedSampler

# Exit code after a preemption save: EX_TEMPFAIL from sysexits.h ("temporary failure, retry later").
# Distinct from 143 (128 + SIGTERM), which is what a
# process killed by SIGTERM *without* saving reports.
REQUEUE_EXIT_CODE = 75
NAME_RE = re.compile(r"^ckpt-(\d{8})\.pt$")
REQUIRED_KEYS = (
    "model",
    "optimizer",
    "step",
    "epoch",
    "consumed",
    "ranks",
    "world_size",
    "batch_size",
)


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable: the directory entry itself must reach the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write via a temporary file in the same folder, fsync it, then rename over `path`.

    os.replace is atomic within one file system: a reader sees the old file or the new one,
    never half of one. A crash before the rename leaves only a `.tmp-` file behind.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save(state: dict, folder: str | Path, step: int, keep: int) -> Path:
    """Rank 0: write ckpt-<step>.pt atomically, then point `latest` at it, then
    prune to `keep` files and remove the leftovers of writes that were killed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / checkpoint_name(step)
    atomic_write(path, lambda f: torch.save(state, f))
    # Only now, with the checkpoint complete and durable, does `latest` move to it.
    atomic_write(folder / "latest", lambda f: f.write(f"{path.name}\n".encode()))
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    remove_partial_files(folder)
    return path


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoint files, newest step first (temporary files never match)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if NAME_RE.match(p.name)), reverse=True)


def read_latest(folder: str | Path) -> Path | None:
    """The file named by `latest`, or None when there is no usable pointer."""
    pointer = Path(folder) / "latest"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(folder) / name if NAME_RE.match(name) else None


def load(path: str | Path, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with weights_only=True: tensors,
    numbers, booleans, None, strings, lists and dicts only.

    Unpickling an arbitrary object could run arbitrary code; weights_only refuses it instead.
    Raises ValueError with a one-line reason for anything that is not a complete checkpoint.
    """
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, garbage bytes, a forbidden pickled object, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            first = "it holds a pickled object that weights_only=True refuses to load"
        raise ValueError(f"{type(exc).__name__}: {first[:200]}") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
        raise ValueError(f"not a training checkpoint (missing {', '.join(missing)})")
    return state


def _print(line: str) -> None:
    print(line, flush=True)


def find_resumable(
    folder: str | Path, log: Callable[[str], None] = _print, map_location: Any = "cpu"
) -> tuple[Path | None, dict | None]:
    """The newest checkpoint that loads, and its contents: `latest` first, then older files by step.

    A bad file is reported in one line and skipped; nothing is deleted or overwritten.
    """
    folder = Path(folder)
    candidates = list_checkpoints(folder)
    pointed = read_latest(folder)
    if pointed is not None and pointed in candidates:
        candidates.remove(pointed)
        candidates.insert(0, pointed)
    for path in candidates:
        try:
            return path, load(path, map_location)
        except (ValueError, OSError) as exc:
            log(f"warning: checkpoint {path} is unusable ({exc}); trying the previous one")
    return None, None


def remove_partial_files(folder: str | Path) -> list[Path]:
    """Delete `.tmp-` leftovers of writes that were killed (never complete files).
    Only the one writer (rank 0) calls it, after its own write has completed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    leftovers = [p for p in folder.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
    for p in leftovers:
        p.unlink(missing_ok=True)
    return leftovers


# --- RNG states as plain tensors (weights_only-loadable) ---------------------------------------


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: torch CPU and accelerator, and Python `random` and NumPy for
    augmentation code that draws from them."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),  # uint8 tensor
        "python": torch.from_numpy(np.array(py_state, dtype=np.uint32).view(np.uint8)),
        "python_version": py_version,
        "python_gauss": py_gauss,
        "numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.uint32).view(np.uint8).copy()),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    if device.type in ("cuda", "xpu"):
        state[device.type] = getattr(torch, device.type).get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    py_state = tuple(int(x) for x in state["python"].cpu().numpy().view(np.uint32))
    random.setstate((state["python_version"], py_state, state["python_gauss"]))
    np.random.set_state(
        (
            "MT19937",
            state["numpy"].cpu().numpy().view(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    if device.type in state:
        getattr(torch, device.type).set_rng_state(state[device.type].cpu(), device)


# --- the epoch resumed part-way ----------------------------------------------------------------


class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffle=True, drop_last=False) that can start an epoch part-way, on
    any number of ranks. After k steps of batch b on W ranks, the ranks have together read
    the first k x b x W samples of the epoch's order (randperm seeded with seed + epoch;
    rank r reads positions r, r + W, ...). So a resume drops the first `consumed` samples
    of that order and splits the rest as DistributedSampler splits an epoch: rank r takes
    every W-th from r, padded to a multiple of W with the order's first samples."""

    consumed = 0  # samples of this epoch that the ranks have trained on before the checkpoint

    def __iter__(self):
        order = torch.randperm(
            len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        order = order.tolist()
        rest = order[self.consumed :]
        rest += (order * self.num_replicas)[: len(self) * self.num_replicas - len(rest)]  # padding
        return iter(rest[self.rank :: self.num_replicas])

    def __len__(self):
        return math.ceil((len(self.dataset) - self.consumed) / self.num_replicas)
