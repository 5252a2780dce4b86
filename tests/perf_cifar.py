"""CIFAR-10-format files written locally, for measuring the CIFAR input pipeline offline.

    python tests/perf_cifar.py write DATA_DIR [IMAGES_PER_BATCH]      # DATA_DIR/cifar10/cifar-10-batches-py
    torchrun ... tests/perf_cifar.py run SCRIPT [flags...]             # SCRIPT with torchvision's MD5 check off

The files are the python pickle batches torchvision reads (uint8 images, 3072 bytes each),
filled with random pixels. torchvision compares each file's MD5 with the real data set's,
so `run` starts SCRIPT with those expected digests set to None (= not checked).
"""

import pickle
import runpy
import sys
from pathlib import Path

import numpy as np

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]


def write(data_dir: str, per_batch: int = 10000, test_size: int = 500, seed: int = 0) -> Path:
    """Five training batches of `per_batch` images and a test batch of `test_size`."""
    rng = np.random.default_rng(seed)
    folder = Path(data_dir) / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in [(b, per_batch) for b in TRAIN_BATCHES] + [("test_batch", test_size)]:
        batch = {"batch_label": name, "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, size=n).tolist(), "filenames": [f"{name}_{i}.png" for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                            "truck"], "num_cases_per_batch": per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return folder


def run_unchecked(script: str, args: list[str]) -> None:
    from torchvision.datasets import CIFAR10

    CIFAR10.train_list = [[name, None] for name, _ in CIFAR10.train_list]
    CIFAR10.test_list = [[name, None] for name, _ in CIFAR10.test_list]
    CIFAR10.meta = dict(CIFAR10.meta, md5=None)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        print(write(sys.argv[2], *map(int, sys.argv[3:4])))
    else:
        run_unchecked(sys.argv[2], sys.argv[3:])
