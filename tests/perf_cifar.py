"""CIFAR-10-format files written locally, for measuring the CIFAR input pipeline offline.

    # DATA_DIR/cifar10/cifar-10-batches-py
    python tests/perf_cifar.py write DATA_DIR [IMAGES_PER_BATCH]
    # e.g. benchmark/train.py, MD5 check off
    torchrun ... tests/perf_cifar.py run SCRIPT [flags...]

The files are the python pickle batches torchvision reads (uint8 images, 3072 bytes
each), filled with random pixels. torchvision compares each file's MD5 with the real data
set's, so `run` starts SCRIPT with those expected digests set to None (= not checked).
"""

import runpy
import sys
from pathlib import Path

# this folder is on sys.path when run as a script
from cifar_files import CIFAR_FOLDER, write_cifar10


def write(data_dir: str, per_batch: int = 10000, test_size: int = 500, seed: int = 0) -> Path:
    """Five training batches of `per_batch` images and a test batch of `test_size`."""
    root = Path(data_dir) / "cifar10"
    write_cifar10(root, per_batch, test_size, seed)
    return root / CIFAR_FOLDER


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
