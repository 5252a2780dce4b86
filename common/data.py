"""Data sets: the embedded digits (offline, default), CIFAR-10, MNIST, Fashion-MNIST,
ImageFolder, FakeData. Rank 0 downloads while others wait, or a login node runs
`python -m common.prepare` first (compute nodes are often offline)."""

import multiprocessing
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from common.errors import DataError
from common.bad_input import exit_on_bad_input

DOWNLOADABLE = ("cifar10", "mnist", "fashion_mnist")
FAKE_TRAIN_SIZE, FAKE_TEST_SIZE = 2048, 512
FAKE_CLASSES = 1000  # imagenet/main.py's --dummy: ImageNet's classes, so the same last layer
# UCI handwritten digits; source and licence: DIGITS.md
DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")
DIGITS_SIZE, DIGITS_TEST_FRACTION = 1797, 0.2  # 20% held out
KNOWN_TRAIN_SIZE = {
    "digits": DIGITS_SIZE - int(DIGITS_SIZE * DIGITS_TEST_FRACTION),
    "fake": FAKE_TRAIN_SIZE,
}
STATS = {  # per-channel mean and std of the training sets
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def worker_start_method(num_workers: int) -> str | None:
    """DataLoader's multiprocessing_context: "forkserver" where the platform has it (Linux,
    macOS), so each loader worker starts from a clean single-threaded server process. Linux's
    default, fork(), copies a rank while one of gloo's or NCCL's threads may hold a lock, and the
    worker then waits on that lock forever, and its rank on the worker (pytorch/pytorch#130610).
    None without workers (DataLoader takes no context then) and on Windows (spawn already).
    The server imports torch once, before the first worker: each worker forked from it shares
    those pages instead of importing torch itself (debugging/README.md, on loader memory)."""
    if num_workers > 0 and "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])
        return "forkserver"
    return None


@dataclass
class DataBundle:
    train: Dataset
    test: Dataset
    num_classes: int
    in_channels: int
    image_size: int


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 with pixels 0..16, labels) from the
    shipped file: one row of 64 pixels and the label each."""
    table = np.loadtxt(DIGITS_FILE, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def digits(image_size: int = 0) -> DataBundle:
    """1,797 real 8x8 handwritten digits: no download, ever."""
    pixels, targets = digits_arrays()
    # pixels are 0..16
    images = (torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    labels = torch.tensor(targets, dtype=torch.long)
    if image_size:
        images = torch.nn.functional.interpolate(
            images, size=image_size, mode="bilinear", align_corners=False
        )
    # same on all ranks and runs
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    n_test = int(len(labels) * DIGITS_TEST_FRACTION)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return DataBundle(
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
        10,
        1,
        images.shape[-1],
    )


def prepare_command(name: str, data_dir: str | Path) -> str:
    return f"python -m common.prepare --dataset {name} --data-dir {data_dir}"


def _transforms(name: str, image_size: int):
    from torchvision import transforms as T

    resize = [T.Resize(image_size)] if image_size else []
    train, test = list(resize), list(resize)
    if name == "imagefolder":
        size = image_size or 224
        train = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
        test = [T.Resize(size * 256 // 224), T.CenterCrop(size)]
    elif name == "cifar10":  # the standard CIFAR augmentation
        train += [
            T.RandomCrop(image_size or 32, padding=(image_size or 32) // 8),
            T.RandomHorizontalFlip(),
        ]
    if name == "fake":  # made at its size; noise has no statistics (imagenet/main.py's --dummy)
        return T.ToTensor(), T.ToTensor()
    tail = [T.ToTensor(), T.Normalize(*STATS["imagenet" if name == "imagefolder" else name])]
    return T.Compose(train + tail), T.Compose(test + tail)


def build_datasets(
    name: str, data_dir: str | Path = "data", image_size: int = 0, download: bool = False
) -> DataBundle:
    """Open a data set that is on disk (or download it). In a process group use `load_datasets`."""
    if name == "digits":
        return digits(image_size)
    from torchvision import datasets

    train_tf, test_tf = _transforms(name, image_size)
    # different offsets keep train and test images apart; an index always gives one image
    if name == "fake":
        size = image_size or 32
        return DataBundle(
            datasets.FakeData(
                FAKE_TRAIN_SIZE, (3, size, size), FAKE_CLASSES, train_tf, random_offset=0
            ),
            datasets.FakeData(
                FAKE_TEST_SIZE,
                (3, size, size),
                FAKE_CLASSES,
                test_tf,
                random_offset=FAKE_TRAIN_SIZE,
            ),
            FAKE_CLASSES,
            3,
            size,
        )
    root = Path(data_dir)
    if name == "imagefolder":
        if not (root / "train").is_dir() or not (root / "val").is_dir():
            raise DataError(
                f"no ImageFolder tree at {root}: expected {root}/train/<class>/<image> "
                f"and {root}/val/<class>/<image> (set --data-dir)"
            )
        try:
            train = datasets.ImageFolder(str(root / "train"), transform=train_tf)
            test = datasets.ImageFolder(str(root / "val"), transform=test_tf)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(f"ImageFolder at {root}: {str(exc).splitlines()[0]}") from None
        if train.classes != test.classes:
            raise DataError(f"ImageFolder at {root}: train/ and val/ have different class folders")
        return DataBundle(train, test, len(train.classes), 3, image_size or 224)
    if name not in DOWNLOADABLE:
        raise DataError(f"unknown data set {name!r}")
    cls = {
        "cifar10": datasets.CIFAR10,
        "mnist": datasets.MNIST,
        "fashion_mnist": datasets.FashionMNIST,
    }[name]
    root = root / name
    try:
        train = cls(root=str(root), train=True, download=download, transform=train_tf)
        test = cls(root=str(root), train=False, download=download, transform=test_tf)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        if download:
            raise DataError(
                f"{name}: download into {root} failed ({str(exc).splitlines()[0].rstrip(': ')}); "
                f"without internet access here, prepare it elsewhere and copy {root}"
            ) from None
        raise DataError(
            f"{name} not found in {root}; prepare it where there is internet with "
            f"`{prepare_command(name, data_dir)}` or pass --download"
        ) from None
    except OSError as exc:  # no network, proxy, DNS, ...
        raise DataError(
            f"{name}: download into {root} failed ({exc}); on an offline node, "
            f"run `{prepare_command(name, data_dir)}` on a login node first"
        ) from None
    sample, _ = train[0]
    return DataBundle(train, test, 10, sample.shape[0], sample.shape[-1])


def check_world_size(name: str, train_size: int, world_size: int) -> None:
    if world_size > train_size:
        raise DataError(
            f"world size {world_size} is larger than the {name} training set "
            f"({train_size} samples): some ranks would get no data; use fewer processes"
        )


def check_data(cfg, world_size: int) -> None:
    """Before any process group: a missing data folder or more
    ranks than (known) training samples exits with 2."""
    with exit_on_bad_input():
        if cfg.dataset in KNOWN_TRAIN_SIZE:
            check_world_size(cfg.dataset, KNOWN_TRAIN_SIZE[cfg.dataset], world_size)
        if cfg.dataset in ("digits", "fake") or (cfg.download and cfg.dataset != "imagefolder"):
            return  # embedded, synthetic, or about to be downloaded
        if not Path(cfg.data_dir).is_dir():
            hint = (
                "pass --data-dir with train/ and val/ folders"
                if cfg.dataset == "imagefolder"
                else f"prepare it with `{prepare_command(cfg.dataset, cfg.data_dir)}` or pass "
                "--download"
            )
            raise DataError(
                f"data_dir: folder '{cfg.data_dir}' does not exist ({cfg.dataset}); {hint}"
            )


def download_datasets(cfg) -> None:
    """Download cfg.dataset into cfg.data_dir (call it on one rank, while the others wait at a
    barrier). A failure is printed here and not raised: load_datasets then stops every rank alike,
    so no rank is left waiting at the barrier."""
    if cfg.dataset not in DOWNLOADABLE:
        return
    try:
        build_datasets(cfg.dataset, cfg.data_dir, cfg.image_size, download=True)
    except DataError as exc:
        print(str(exc), file=sys.stderr, flush=True)


def load_datasets(cfg, world_size: int) -> DataBundle:
    """Open the data set on disk; a data problem exits with 2 (one `error:` line per node)."""
    with exit_on_bad_input():
        data = build_datasets(cfg.dataset, cfg.data_dir, cfg.image_size, download=False)
        check_world_size(cfg.dataset, len(data.train), world_size)
        return data
