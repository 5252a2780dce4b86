"""Data sets: the embedded digits split, CIFAR-10 through torchvision's real loader, clear errors."""

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from common.data import build_datasets, digits
from common.errors import DataError
from tests.cifar_files import CIFAR_FOLDER, patch_cifar_md5, write_cifar10


def test_digits_is_a_fixed_disjoint_split_of_all_1797_images():
    a, b = digits(), digits()
    assert (len(a.train), len(a.test)) == (1438, 359)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])  # same split every time, on every rank
    train_rows = {tuple(x.flatten().tolist()) for x in a.train.tensors[0]}
    test_rows = [tuple(x.flatten().tolist()) for x in a.test.tensors[0]]
    # The digits set has a few duplicate scans; apart from those the split is disjoint.
    assert sum(r in train_rows for r in test_rows) <= 5
    assert set(a.test.tensors[1].tolist()) == set(range(10))
    assert a.train.tensors[0].shape[1:] == (1, 8, 8) and (a.num_classes, a.in_channels) == (10, 1)


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
    assert "\n" not in message and f"python -m common.prepare --dataset {name} --data-dir" in message


def test_imagefolder_tree(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    data = build_datasets("imagefolder", tmp_path, image_size=32)
    assert (len(data.train), len(data.test), data.num_classes) == (6, 4, 2)
    assert data.train[0][0].shape == (3, 32, 32) and data.test[0][0].shape == (3, 32, 32)


def test_imagefolder_without_train_and_val_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="expected .*/train/<class>"):
        build_datasets("imagefolder", tmp_path)


def test_fake_data_is_deterministic_and_sized():
    a, b = build_datasets("fake", image_size=16), build_datasets("fake", image_size=16)
    assert a.train[3][0].shape == (3, 16, 16)
    assert torch.equal(a.test[5][0], b.test[5][0]) and not torch.equal(a.train[0][0], a.test[0][0])


def test_digits_read_directly_equal_scikit_learns_load_digits():
    from sklearn.datasets import load_digits

    from common.data import digits_arrays

    images, labels = digits_arrays()
    raw = load_digits()
    assert np.array_equal(images, raw.images) and np.array_equal(labels, raw.target)
    assert images.shape == (1797, 8, 8)
