"""Per-rank randomness: every rank starts from the same weights (the same seed before the model
is built; DDP also broadcasts rank 0's at the wrap), then reseeds with seed + rank, so random
augmentation and DataLoader worker seeds differ between ranks and are the same in every run.

The lessons run on 2 ranks forked from one warm process (tests/warm_ranks.py), on CIFAR-10-format
files (tests/cifar_files.py, whose training transform is RandomCrop + RandomHorizontalFlip).
tests/record (a sitecustomize) records, from outside the lesson, a hash of the augmented view of one
fixed image for every augmented sample, drawn with exactly that sample's random numbers: equal
hashes mean equal crops and flips.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cifar_files import write_cifar10
from tests.paths import REPO
from tests.processes import clean_env, warm_ranks
from tests.results import load_model, read_summary, relative_difference

LESSON = "01_basic_ddp/train.py"
# 40 training images, 20 per rank: 3 steps of 4 images = 12 augmented samples per rank.
ARGS = (
    "--dataset",
    "cifar10",
    "--local-batch-size",
    "4",
    "--epochs",
    "1",
    "--max-steps",
    "3",
    "--log-every",
    "100",
)
STEPS, BATCH = 3, 4
PER_RANK_SEED = re.compile(r"^    torch\.manual_seed\(cfg\.seed \+ launch\.rank\).*\n", re.M)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cifar")
    write_cifar10(folder / "cifar10", per_batch=8, test_size=8)
    return folder


def record_env(out: Path) -> dict[str, str]:
    # CUDA_VISIBLE_DEVICES="" keeps any GPU out (the
    # runs compare CPU draws) and shows in the banner.
    return clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'record'}",
        DDP_TEST_RECORD_DIR=str(out / "record"),
        CUDA_VISIBLE_DEVICES="",
    )


def views(out: Path, rank: int, process: str = "main") -> list[str]:
    """The recorded view hashes of `rank`, in order, from
    its main process or its DataLoader worker 0."""
    lines = (out / "record" / f"augment.rank{rank}.txt").read_text().split("\n")
    return [line.split()[1] for line in lines if line.startswith(process + " ")]


def run_lesson(script: str | Path, data_dir: Path, out: Path, *extra: str, nproc: int = 2):
    """`script` on 2 ranks (nproc=0: as `python script`), its augmentation recorded.
    tests/perf_cifar.py runs it with torchvision's MD5 check of the files off."""
    return warm_ranks(
        "tests/perf_cifar.py",
        "run",
        script,
        *ARGS,
        "--data-dir",
        str(data_dir),
        "--output-dir",
        str(out),
        *extra,
        nproc=nproc,
        env=record_env(out),
        timeout=300,
    )


@pytest.fixture(scope="module")
def lesson_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lesson")
    return run_lesson(LESSON, data_dir, out), out


def test_each_rank_draws_its_own_augmentation_the_same_in_every_run(lesson_run, data_dir, tmp_path):
    result, first = lesson_run
    rank0, rank1 = views(first, 0), views(first, 1)
    # The first view is load_datasets() reading one sample
    # for its shape, under the common seed: the same on
    # both ranks. Then one view per training sample, drawn after the per-rank seed.
    assert len(rank0) == len(rank1) == 1 + STEPS * BATCH
    assert rank0[0] == rank1[0]
    same = sum(a == b for a, b in zip(rank0[1:], rank1[1:]))
    assert same <= STEPS * BATCH // 4, (
        f"{same} of {STEPS * BATCH} augmentations alike on both ranks"
    )
    # Reproducible: a second run draws exactly the same on each rank.
    run_lesson(LESSON, data_dir, tmp_path)
    assert (views(tmp_path, 0), views(tmp_path, 1)) == (rank0, rank1)
    # The replicas still step alike (DDP averages the
    # gradients), and the banner shows the GPU mask as set.
    assert read_summary(first)["replicas_identical"]
    assert "(CUDA_VISIBLE_DEVICES=)" in result.stdout


def test_without_the_per_rank_seed_every_rank_draws_the_same(lesson_run, data_dir, tmp_path):
    """Negative control: 01 without its `torch.manual_seed(cfg.seed + launch.rank)`
    line (the behaviour before it) crops and flips alike on every rank."""
    source = (REPO / LESSON).read_text()
    assert len(PER_RANK_SEED.findall(source)) == 1
    control = tmp_path / "train.py"
    control.write_text(PER_RANK_SEED.sub("", source))  # `common` is found through PYTHONPATH
    run_lesson(control, data_dir, tmp_path / "out")
    rank0, rank1 = views(tmp_path / "out", 0), views(tmp_path / "out", 1)
    assert len(rank0) == 1 + STEPS * BATCH and rank0 == rank1
    assert rank0[1:] != views(lesson_run[1], 0)[1:]  # and rank 0 draws otherwise than with seed + 0


def test_with_random_augmentation_ranks_do_not_equal_one_process_on_the_global_batch(
    lesson_run, data_dir, tmp_path
):
    """README.md's scope: N ranks equal one process on the global batch only
    without random augmentation. Here 2 ranks x 4 and 1 process x 8 read the
    same samples in each step (test_basic_ddp.py shows them equal on the
    digits, which have no augmentation), but crop and flip them differently."""
    # the later flag wins: one rank with twice the local batch
    run_lesson(LESSON, data_dir, tmp_path, "--local-batch-size", str(2 * BATCH), nproc=1)
    assert read_summary(tmp_path)["steps"] == read_summary(lesson_run[1])["steps"] == STEPS
    assert relative_difference(load_model(lesson_run[1]), load_model(tmp_path)) > 1e-3


def test_05_loader_workers_get_per_rank_seeds(data_dir, tmp_path):
    """05's loaders have a generator of their own (the checkpoint restores
    the global RNG), seeded with seed + rank + epoch x world size: with
    --num-workers 1 the augmentation runs in a worker, and differs."""
    run_lesson("05_checkpointing/train.py", data_dir, tmp_path, "--num-workers", "1")
    n = STEPS * BATCH  # a worker may load ahead of the steps taken: compare the samples trained on
    rank0, rank1 = views(tmp_path, 0, "worker0")[:n], views(tmp_path, 1, "worker0")[:n]
    assert len(rank0) == len(rank1) == n
    same = sum(a == b for a, b in zip(rank0, rank1))
    assert same <= n // 4, f"{same} of {n} augmentations alike on both ranks"


def test_single_process_baseline_draws_as_rank_0(lesson_run, data_dir, tmp_path):
    """train_single.py reseeds with seed + 0 where 01 reseeds with seed +
    rank, so its augmentation draws are rank 0's (with one process, 01
    and train_single.py train bitwise alike: test_basic_ddp.py)."""
    run_lesson("01_basic_ddp/train_single.py", data_dir, tmp_path, nproc=0)
    assert views(tmp_path, 0) == views(lesson_run[1], 0)
