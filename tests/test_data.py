"""Data sets: the embedded digits split, CIFAR-10
through torchvision's real loader, clear errors."""

import hashlib
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from common.data import build_datasets, digits, digits_arrays, worker_start_method
from common.errors import DataError
from tests.cifar_files import CIFAR_FOLDER, patch_cifar_md5, write_cifar10
from tests.paths import PYTHON, REPO
from tests.processes import run
from tests.quoted import UCI_TEST_CLASS_COUNTS
from tests.results import read_summary


def test_cifar10_files_load_through_torchvision(tmp_path, monkeypatch):
    root = tmp_path / "cifar10"
    patch_cifar_md5(monkeypatch, write_cifar10(root, per_batch=20, test_size=30))
    data = build_datasets("cifar10", tmp_path)
    assert (len(data.train), len(data.test), data.in_channels, data.image_size) == (100, 30, 3, 32)
    # The test image we read back is the one we wrote, after the documented normalization.
    raw = pickle.loads((root / CIFAR_FOLDER / "test_batch").read_bytes())
    image, label = data.test[7]
    expected = torch.tensor(raw["data"][7].reshape(3, 32, 32), dtype=torch.float32) / 255
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    assert torch.allclose(image, (expected - mean) / std, atol=1e-5)
    assert label == raw["labels"][7]


def test_cifar10_with_wrong_checksums_is_reported_as_missing(tmp_path):
    write_cifar10(tmp_path / "cifar10")  # torchvision's real MD5 check rejects these files
    with pytest.raises(DataError, match="python -m common.prepare --dataset cifar10"):
        build_datasets("cifar10", tmp_path)


@pytest.mark.parametrize("name", ["cifar10", "mnist", "fashion_mnist"])
def test_missing_data_names_the_prepare_command(tmp_path, name):
    with pytest.raises(DataError) as err:
        build_datasets(name, tmp_path / "nowhere")
    message = str(err.value)
    assert (
        "\n" not in message and f"python -m common.prepare --dataset {name} --data-dir" in message
    )


def test_imagefolder_tree(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                    folder / f"{i}.png"
                )
    data = build_datasets("imagefolder", tmp_path, image_size=32)
    assert (len(data.train), len(data.test), data.num_classes) == (6, 4, 2)
    assert data.train[0][0].shape == (3, 32, 32) and data.test[0][0].shape == (3, 32, 32)


def test_imagefolder_without_train_and_val_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="expected .*/train/<class>"):
        build_datasets("imagefolder", tmp_path)


def test_fake_data_is_deterministic_and_sized_and_imagenet_main_dummy_set():
    a, b = build_datasets("fake", image_size=16), build_datasets("fake", image_size=16)
    assert a.train[3][0].shape == (3, 16, 16)
    assert torch.equal(a.test[5][0], b.test[5][0]) and not torch.equal(a.train[0][0], a.test[0][0])
    # benchmark/gpu_check.py's equal settings: the images and labels of imagenet/main.py's
    # --dummy set (FakeData of 1,000 classes through ToTensor, pytorch/examples 77f55b9), so both
    # loaders do the same work and both models end in the same 1,000-wide layer
    from torchvision import datasets, transforms

    dummy = datasets.FakeData(2048, (3, 16, 16), 1000, transforms.ToTensor())
    assert a.num_classes == 1000
    assert torch.equal(a.train[3][0], dummy[3][0]) and a.train[3][1] == dummy[3][1]
    assert len({a.train[i][1] for i in range(64)}) > 10  # not 10 classes


# Recorded from scikit-learn 1.9.1's load_digits() (images
# as uint8, row by row, then the 1,797 labels as uint8),
# which read the same file before it shipped here; the tests
# below hold the shipped file to it without scikit-learn.
DIGITS_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"
# Recorded with torch 2.14.1 from digits() when it still read
# scikit-learn's copy: the train and test tensors' bytes.
SPLIT_SHA256 = "dade5ef4ba9e5aff360a66e7767868259503a153d28a93c8f9d4827f44fbb67c"


def digits_sha256(images, labels) -> str:
    return hashlib.sha256(
        np.asarray(images, dtype=np.uint8).tobytes() + np.asarray(labels, dtype=np.uint8).tobytes()
    ).hexdigest()


def test_the_shipped_digits_are_uci_s_test_set_as_recorded():
    images, labels = digits_arrays()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert np.array_equal(images, np.round(images)) and images.min() == 0 and images.max() == 16
    assert np.bincount(labels).tolist() == UCI_TEST_CLASS_COUNTS
    assert digits_sha256(images, labels) == DIGITS_SHA256


def test_the_split_is_the_one_measured_before_the_data_shipped_here():
    """1,438 training and 359 test images, 8x8, one channel, 10 classes: bitwise the split
    measured before the data shipped here, so the same on every rank and in every run."""
    data = digits()
    assert (len(data.train), len(data.test)) == (1438, 359)
    assert data.train.tensors[0].shape[1:] == (1, 8, 8)
    assert (data.num_classes, data.in_channels) == (10, 1)
    digest = hashlib.sha256()
    for tensor in (*data.train.tensors, *data.test.tensors):
        digest.update(tensor.numpy().tobytes())
    assert digest.hexdigest() == SPLIT_SHA256


def test_digits_load_and_train_without_scikit_learn(tmp_path):
    """In a process where scikit-learn (and scipy) cannot
    be imported, the digits load and a run trains."""
    block = (
        "import runpy, sys; sys.modules['sklearn'] = sys.modules['scipy'] = None\n"
        "try:\n    import sklearn\nexcept ImportError:\n    pass\nelse:\n    raise "
        "SystemExit('not blocked')\n"
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    result = run(
        [
            PYTHON,
            "-c",
            block,
            REPO / "01_basic_ddp" / "train_single.py",
            "--epochs",
            "1",
            "--output-dir",
            tmp_path,
        ],
        timeout=180,
        check=True,
    )
    assert "not blocked" not in result.output
    summary = read_summary(tmp_path)
    assert summary["epochs"] == 1 and summary["eval_accuracy"] > 0.5


class ParentPid(torch.utils.data.Dataset):
    """Each item is the pid of the process that made the worker reading it."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return os.getppid()


def test_loader_workers_are_not_forked_from_the_rank():
    """The lessons' loaders (multiprocessing_context=worker_start_method(n)) start their workers
    from forkserver's clean process, so a worker's parent is not the rank that holds gloo's
    threads; the control, DataLoader's default on Linux, forks them from it."""

    def parents(context):
        loader = torch.utils.data.DataLoader(
            ParentPid(), batch_size=1, num_workers=1, multiprocessing_context=context
        )
        return {int(pid) for (pid,) in loader}

    assert worker_start_method(0) is None  # DataLoader refuses a context without workers
    assert worker_start_method(2) == "forkserver"
    assert os.getpid() not in parents(worker_start_method(1))
    assert parents(None) == {os.getpid()}  # the control: fork()


def test_without_forkserver_the_platforms_default_start_is_kept(monkeypatch):
    """Windows has no forkserver (its default, spawn, starts clean already)."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert worker_start_method(2) is None
