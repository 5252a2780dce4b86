"""Write small data sets in CIFAR-10's on-disk format
(python pickle batches), as torchvision reads them."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np

CIFAR_FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]


def write_cifar10(
    root: Path, per_batch: int = 20, test_size: int = 30, seed: int = 0
) -> dict[str, str]:
    """Five training batches and a test batch of random 32x32 RGB images; returns {file: md5}.

    torchvision checks each file's MD5 against the real data set's: callers that load these
    files set CIFAR10.train_list/test_list to the returned digests (see `patch_cifar_md5`).
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / CIFAR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, n in [(b, per_batch) for b in TRAIN_BATCHES] + [("test_batch", test_size)]:
        batch = {
            "batch_label": name,
            "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, size=n).tolist(),
            "filenames": [f"{name}_{i}.png" for i in range(n)],
        }
        path = folder / name
        path.write_bytes(pickle.dumps(batch))
        digests[name] = hashlib.md5(path.read_bytes()).hexdigest()
    meta = {
        "label_names": [
            "airplane",
            "automobile",
            "bird",
            "cat",
            "deer",
            "dog",
            "frog",
            "horse",
            "ship",
            "truck",
        ],
        "num_cases_per_batch": per_batch,
        "num_vis": 3072,
    }
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    digests["batches.meta"] = hashlib.md5((folder / "batches.meta").read_bytes()).hexdigest()
    return digests


def patch_cifar_md5(monkeypatch, digests: dict[str, str]) -> None:
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "train_list", [[b, digests[b]] for b in TRAIN_BATCHES])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", digests["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": digests["batches.meta"]})
