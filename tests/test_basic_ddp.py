"""01_basic_ddp under real launchers: it trains, DDP equals one big batch, replicas stay identical,
and the single-process baseline is the same training."""

import dataclasses
import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.config import TrainConfig, parse_config
from common.data import digits
from common.models import build_model
from tests.launcher_tools import need_tools
from tests.markdown import markdown_section
from tests.paths import PYTHON, REPO, load_script
from tests.processes import (
    short_run,
    clean_env,
    command_argv,
    free_port,
    kill_group,
    run,
    start,
    torchrun,
    warm_ranks,
)
from tests.results import assert_same_params, load_model, read_summary, repeated_lines

SCRIPT = "01_basic_ddp/train.py"
PORT_PATCH = REPO / "tests" / "port_01.diff"  # 01's README, "Your own model and data"
SPAWN = "python 01_basic_ddp/train_spawn.py --nprocs 2"
SINGLE = "python 01_basic_ddp/train_single.py"
# The port's run (01's README, "Your own model and data"), from the project folder
PORTED = "torchrun --standalone --nproc_per_node=2 train.py"


def checksum(state_dict):
    """The same SHA-256 the script computes over model.parameters() (here: the state_dict, which
    for SmallCNN holds exactly the parameters, in the same order)."""
    digest = hashlib.sha256()
    for tensor in state_dict.values():
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def quick_start(sample_run):
    """The README's quick-start command, as written, with only the output folder moved (the run
    its README's sample shows: tests/sample_runs.py)."""
    ran = sample_run("01").ok()
    return ran, ran.output_dir


@pytest.mark.min_torch
def test_quick_start_trains_to_95_percent(quick_start):
    result, out = quick_start
    summary = read_summary(out)
    assert summary["eval_accuracy"] >= 0.95
    assert (summary["world_size"], summary["launcher"], summary["backend"]) == (
        2,
        "torchrun",
        "gloo",
    )
    assert summary["global_batch_size"] == 2 * summary["local_batch_size"]
    assert summary["images_per_second"] > 0 and 0 < summary["wall_time_s"] < 180
    # README.md, "Output", and 01's README, "Run it": summary.json with the fields 01's README
    # lists (those not read above), next to model.pt; the printed lines: 01's sample
    assert {"epochs", "final_train_loss", "eval_loss", "replica_checksums"} <= summary.keys()
    assert sorted(p.name for p in out.iterdir()) == ["model.pt", "summary.json"]


def test_banner_and_progress_come_from_rank_0_only(quick_start):
    """Both ranks would print the same banner and the same per-epoch lines (their numbers are
    all-reduced): no line twice means one rank printed. The control: the output of two ranks
    that both print, as a copy of the output twice over stands for, is caught."""
    result, _ = quick_start
    lines = result.stdout.splitlines()
    assert len(lines) > 12 and repeated_lines(result.stdout) == []  # 12 epochs, each a line
    assert repeated_lines(result.stdout * 2) == sorted(set(filter(str.strip, lines)))
    assert "Traceback" not in result.output


@pytest.mark.min_torch
def test_every_rank_ends_with_identical_parameters(quick_start):
    _, out = quick_start
    summary = read_summary(out)
    checksums = summary["replica_checksums"]
    assert len(checksums) == 2 and summary["replicas_identical"] is True
    assert checksums[0] == checksums[1] == checksum(load_model(out))


STEPS = short_run(max_steps=8, epochs=None, local_batch_size=None, lr=0.05)


@pytest.fixture(scope="module")
def ddp_two_ranks(tmp_path_factory):
    """2 ranks x local batch 16, 8 steps, under torchrun: compared with other launches below."""
    out = tmp_path_factory.mktemp("ddp_b16")
    torchrun(SCRIPT, "--local-batch-size", "16", *STEPS, "--output-dir", out, nproc=2)
    return load_model(out)


@pytest.mark.min_torch
def test_two_ranks_equal_one_process_with_twice_the_batch(ddp_two_ranks, tmp_path):
    """DDP averages gradients, so 2 ranks x batch b == 1 process x batch 2b on the same samples."""
    warm_ranks(
        SCRIPT, "--local-batch-size", "32", *STEPS, "--output-dir", tmp_path / "one", nproc=1
    )
    one = load_model(tmp_path / "one")
    assert_same_params(ddp_two_ranks, one)
    # The comparison is sensitive: one process with the local batch (16) ends elsewhere.
    warm_ranks(
        SCRIPT, "--local-batch-size", "16", *STEPS, "--output-dir", tmp_path / "small", nproc=1
    )
    small = load_model(tmp_path / "small")
    assert max((small[k] - one[k]).abs().max().item() for k in one) > 1e-3


def test_the_global_batch_equivalence_needs_sgd_and_no_dropout():
    """README.md, "What DDP does": 2 ranks x batch 16 equal 1 process x batch 32 within
    assert_same_params's tolerance with SGD (the control), not with dropout (each rank draws its
    own masks, so even the first step's loss differs), nor with Adam or RMSprop (they divide by
    running gradient sizes, which blows rounding differences up into whole steps). In one 2-rank
    run: tests/global_batch_worker.py."""
    rtol = inspect.signature(assert_same_params).parameters["rtol"].default
    result = warm_ranks("tests/global_batch_worker.py", "--rtol", str(rtol), timeout=180)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    cases = json.loads(line.split(" ", 1)[1])
    sgd = cases["sgd"]
    assert sgd["outside"] == 0 and sgd["relative_difference"] < rtol, sgd
    assert sgd["first_loss_difference"] < 1e-6, sgd
    dropout = cases["sgd_dropout"]
    assert dropout["outside"] > 0 and dropout["relative_difference"] > 1e-2, dropout
    assert dropout["first_loss_difference"] > 1e-4, dropout
    for adaptive in ("adam", "rmsprop"):
        assert cases[adaptive]["outside"] > 0, (adaptive, cases[adaptive])
        assert cases[adaptive]["relative_difference"] > rtol, (adaptive, cases[adaptive])


@pytest.mark.launchers
@pytest.mark.min_torch
def test_mp_spawn_variant_matches_torchrun(ddp_two_ranks, tmp_path):
    """The README's command, as written, with a smaller batch and fewer steps."""
    result = run(
        command_argv(SPAWN)
        + ["--local-batch-size", "16", *STEPS, "--output-dir", str(tmp_path / "spawn")],
        timeout=120,
        check=True,
    )
    summary = read_summary(tmp_path / "spawn")
    assert summary["launcher"] == "mp.spawn" and summary["world_size"] == 2
    assert repeated_lines(result.stdout) == []  # rank 0 printed
    spawned = load_model(tmp_path / "spawn")
    # bitwise: the same training
    assert all(torch.equal(spawned[k], ddp_two_ranks[k]) for k in spawned)


def test_single_process_baseline_is_the_same_training_as_one_ddp_process(tmp_path):
    """train_single.py is 01 without DDP: on one process the two end
    bitwise equal (same seed, same shuffles, and an all-reduce over one
    rank changes nothing), so `diff` between them shows only DDP. The README's command, as
    written, with fewer steps."""
    run(
        command_argv(SINGLE) + ["--max-steps", "30", "--output-dir", str(tmp_path / "single")],
        timeout=120,
        check=True,
    )
    warm_ranks(SCRIPT, "--max-steps", "30", "--output-dir", tmp_path / "ddp", nproc=1)
    single, ddp = load_model(tmp_path / "single"), load_model(tmp_path / "ddp")
    assert single.keys() == ddp.keys() and all(torch.equal(single[k], ddp[k]) for k in single)
    # Negative control: another seed ends elsewhere, so the equality above is not trivially true.
    seed1 = ["--max-steps", "30", "--seed", "1", "--output-dir", str(tmp_path / "seed1")]
    run(command_argv(SINGLE) + seed1, timeout=120, check=True)
    other = load_model(tmp_path / "seed1")
    assert not all(torch.equal(other[k], ddp[k]) for k in other)
    summary = read_summary(tmp_path / "single")
    assert (summary["world_size"], summary["eval_samples"], summary["steps"]) == (1, 359, 30)


@pytest.mark.launchers
@pytest.mark.min_torch
def test_two_single_processes_side_by_side_do_not_share_a_port(tmp_path):
    """Started alone, a script's store binds any free port, so two at once
    on one machine both run. (With a fixed port, here MASTER_PORT, the
    second fails while the first holds it: the control.)"""
    for fixed_port in (None, str(free_port())):
        env = clean_env(**({"MASTER_PORT": fixed_port} if fixed_port else {}))
        first = start(
            [PYTHON, REPO / SCRIPT, "--epochs", "1000", "--output-dir", tmp_path / "first"],
            env=env,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            # its first line comes after init_process_group: the first one's store is up
            while not (line := first.stdout.readline()).strip():
                assert line and time.monotonic() < deadline, "the first run never printed"
            os.killpg(first.pid, signal.SIGSTOP)  # it keeps its port, and leaves the CPU alone
            second = run(
                [PYTHON, REPO / SCRIPT, "--max-steps", "3", "--output-dir", tmp_path / "second"],
                timeout=120,
                env=env,
            )
            assert first.poll() is None  # still running, still holding its store's port
        finally:
            kill_group(first)
            first.wait()
        if fixed_port:
            assert second.returncode != 0 and "address already in use" in second.stderr.lower(), (
                second.stderr[-2000:]
            )
        else:
            assert second.returncode == 0, second.stderr[-2000:]


def test_evaluation_is_exact_every_test_image_once(quick_start):
    """01's strided Subset per rank + one all_reduce gives the metric of one
    process on the whole test set: the saved model evaluated here, in one
    process, on all 359 images gives the summary's loss and accuracy."""
    import torch.nn.functional as F

    _, out = quick_start
    summary = read_summary(out)
    data = digits()
    model = build_model("small_cnn", data.num_classes, data.in_channels, data.image_size)
    model.load_state_dict(load_model(out))  # strict: no `module.` prefix
    model.eval()
    images, labels = data.test.tensors
    with torch.no_grad():
        logits = model(images)
    assert summary["eval_samples"] == len(labels) == 359
    assert (
        abs(F.cross_entropy(logits, labels, reduction="sum").item() / 359 - summary["eval_loss"])
        < 1e-5
    )
    assert summary["eval_accuracy"] == (logits.argmax(1) == labels).sum().item() / 359


def config_class(script: str, name: str):
    """A script's config class, imported as the script imports
    its neighbours (its folder first on the path)."""
    folder = str((REPO / script).parent)
    sys.path.insert(0, folder)
    try:
        return getattr(load_script(script, f"config_of_{Path(script).parent.name}"), name)
    finally:
        sys.path.remove(folder)
        # train_spawn.py's `from train import train`: leave no stray module
        sys.modules.pop("train", None)


@pytest.mark.parametrize(
    "script,name",
    [
        (SCRIPT, "TrainConfig"),
        ("01_basic_ddp/train_spawn.py", "SpawnConfig"),
        ("03_grad_accum/train.py", "AccumConfig"),
        ("04_syncbn/train.py", "SyncBNConfig"),
    ],
)
def test_every_setting_is_a_yaml_key_and_a_flag(script, name, tmp_path):
    """01's README: every setting is a YAML key and a flag
    (and 03's and 04's keys, and train_spawn.py's)."""
    config_class_ = config_class(script, name)
    assert config_class_ is TrainConfig or issubclass(config_class_, TrainConfig)
    for f in dataclasses.fields(config_class_):
        value = f.default if f.type not in ("bool", bool) else not f.default
        yaml_file = tmp_path / f"{f.name}.yaml"
        yaml_file.write_text(f"{f.name}: {json.dumps(value)}\n")
        flag = f"--{f.name.replace('_', '-')}"
        argv = (
            [flag if value else f"--no-{f.name.replace('_', '-')}"]
            if isinstance(value, bool)
            else [flag, str(value)]
        )
        assert (
            getattr(parse_config(config_class_, ["--config", str(yaml_file)]), f.name) == value
        ), f.name
        assert getattr(parse_config(config_class_, argv), f.name) == value, f.name


def test_same_seed_same_initial_weights_and_the_default_run_has_no_batchnorm_or_augmentation():
    """01's table: the same seed before the model is built gives every
    rank the same weights (another seed does not). The README's "digits
    and the small CNN: no BatchNorm, no random augmentation"."""

    def initial(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return list(build_model("small_cnn", 10, 1, 8).state_dict().values())

    assert all(torch.equal(a, b) for a, b in zip(initial(0), initial(0)))
    assert not all(torch.equal(a, b) for a, b in zip(initial(0), initial(1)))
    model = build_model(TrainConfig().model, 10, 1, 8)
    assert TrainConfig().dataset == "digits" and not any(
        "BatchNorm" in type(m).__name__ for m in model.modules()
    )
    data = digits()
    # fixed tensors: no transform runs per sample
    assert isinstance(data.train, torch.utils.data.TensorDataset)


def test_01_copied_out_trains_another_model_on_other_data(tmp_path):
    """The port sections: train.py and common/ copied side by side into an empty folder, 01's
    README patch applied (torchvision's ResNet-18 on FakeData), and 2 ranks under torchrun, with
    nothing of this repository on the path. They train the new model on the new data, and the
    replicas end identical. The options the patch leaves without effect are refused."""
    need_tools("patch")
    project = tmp_path / "project"
    copy_01_beside_common(project)
    # the README's patch (tests/port_01.diff; tests/test_readme_text.py holds the two equal)
    subprocess.run(["patch", "-p0"], stdin=PORT_PATCH.open(), cwd=project, check=True)
    # train.py's own sys.path entry is tmp_path, which holds no `common`: the copy is used
    run(
        command_argv(f"{PORTED} --epochs 1 --max-steps 3 --local-batch-size 16 --output-dir out"),
        timeout=180,
        env=clean_env(PYTHONPATH=""),
        cwd=project,
        check=True,
    )
    summary = read_summary(project / "out")
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["replicas_identical"]
    assert summary["eval_samples"] == 100  # FakeData's test set, not the digits'
    assert "layer4.1.conv2.weight" in load_model(project / "out")  # ResNet-18
    # the patch took them out of the copy's config: refused, not silently ignored
    for option, value in (("--dataset", "cifar10"), ("--model", "resnet50")):
        refused = run(
            [PYTHON, "train.py", option, value],
            timeout=60,
            env=clean_env(PYTHONPATH=""),
            cwd=project,
        )
        assert refused.returncode == 2, refused.output[-2000:]
        assert f"unrecognized arguments: {option} {value}" in refused.stderr, refused.stderr


def copy_01_beside_common(folder: Path) -> None:
    """README.md's port step 1: 01's train.py and the common/ folder, side by side in `folder`."""
    folder.mkdir(parents=True)
    shutil.copy(REPO / "01_basic_ddp" / "train.py", folder / "train.py")
    shutil.copytree(
        REPO / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__")
    )


def drop_the_end_of_run_record(script: Path) -> None:
    """README.md's port step 3, literally: delete the lines from the first marker it names to the
    second, both included."""
    section = markdown_section((REPO / "README.md").read_text(), "## Port your own script")
    [step] = re.findall(r"^3\. \*\*Drop\*\*.*?(?=\n\n|\n\d\. )", section, re.M | re.S)
    first, last = re.findall(r"`(# ---[^`]*)`", step)
    lines = script.read_text().splitlines(keepends=True)
    [begin] = [n for n, line in enumerate(lines) if line.strip().startswith(first)]
    [end] = [n for n, line in enumerate(lines) if line.strip().startswith(last)]
    assert begin < end
    script.write_text("".join(lines[:begin] + lines[end + 1 :]))


def test_01_ported_into_a_project_with_its_own_common_package(tmp_path):
    """README.md's port steps, done literally in a project that has a package named `common` of
    its own (without config.py): train.py and this repository's common/ copied side by side into a
    subfolder (step 1), the end-of-run record deleted between the two lines step 3 names (step 3),
    and 2 ranks under torchrun, started from the project folder. The common/ beside train.py is the
    one imported, and the copy ends with model.pt written and no summary.json."""
    project = tmp_path / "project"
    (project / "common").mkdir(parents=True)
    (project / "common" / "__init__.py").write_text("")
    (project / "common" / "util.py").write_text("def project_helper():\n    return 1\n")
    copy_01_beside_common(project / "ddp")
    drop_the_end_of_run_record(project / "ddp" / "train.py")
    ported = (project / "ddp" / "train.py").read_text()
    assert "all_gather_object(" not in ported and "write_summary(cfg" not in ported
    from_project = "torchrun --standalone --nproc_per_node=2 ddp/train.py"
    run(
        command_argv(f"{from_project} --epochs 1 --max-steps 3 --output-dir out"),
        timeout=180,
        env=clean_env(PYTHONPATH=""),
        cwd=project,
        check=True,
    )
    weights = load_model(project / "out")
    assert weights["classifier.3.weight"].shape == (10, 128)  # 01's small CNN, 10 digits
    assert not (project / "out" / "summary.json").exists()


def test_01_trains_on_an_imagefolder_tree_unpatched(tmp_path):
    """README.md's port section and 01's README: an ImageFolder tree (train/<class>/,
    val/<class>/) needs no patch; `--dataset imagefolder --data-dir DIR` trains 01 on it, with as
    many classes as the tree has folders and every val image evaluated once."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, per_class in (("train", 8), ("val", 3)):
        for label in ("cat", "dog", "fox"):
            folder = tmp_path / "tree" / split / label
            folder.mkdir(parents=True)
            for n in range(per_class):
                pixels = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8, generator=generator)
                Image.fromarray(pixels.numpy()).save(folder / f"{n}.png")
    out = tmp_path / "out"
    warm_ranks(
        SCRIPT,
        "--dataset",
        "imagefolder",
        "--data-dir",
        tmp_path / "tree",
        "--image-size",
        "16",
        "--local-batch-size",
        "4",
        "--max-steps",
        "2",
        "--output-dir",
        out,
        timeout=180,
    )
    summary = read_summary(out)
    assert (summary["world_size"], summary["steps"], summary["eval_samples"]) == (2, 2, 9)
    assert summary["replicas_identical"]
    assert load_model(out)["classifier.3.weight"].shape == (3, 128)  # 3 folders
