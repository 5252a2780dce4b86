"""benchmark/train.py --activation-checkpointing with DDP, and the peak memory the script reports.

2 ranks forked from one warm process (tests/warm_ranks.py), SmallCNN on the digits (its classifier
is the checkpointed block): the variants that work end where the run without checkpointing ends,
with identical replicas; reentrant checkpointing with find_unused_parameters fails inside DDP's
backward with torch's own message (the script refuses it; the run here goes through
tests/perf_unchecked.py, which leaves the script's checks out). In this process: the other settings
that work (as a world of one), which modules are checkpointed, the state_dict keys, BatchNorm inside
a checkpoint, and the peak-memory figure. A block checkpointed twice (needs static_graph):
tests/test_torch_text.py.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import parse_config
from common.errors import ConfigError
from common.launcher import LaunchInfo
from common.models import build_model
from tests.paths import load_script
from tests.processes import free_port, warm_ranks, short_run
from tests.quoted import READY_ONCE
from tests.results import load_model, read_summary, relative_difference

perf = sys.modules["perf"] = load_script("benchmark/perf.py", "perf")  # as tests/test_perf.py does
train_script = load_script("benchmark/train.py", "benchmark_train")

SCRIPT = "benchmark/train.py"
RUN = short_run(max_steps=6, log_every=1000)
MIB = 2**20
VARIANTS = {  # name: flags; "none" is the run without checkpointing, "lr" the negative control
    "none": [],
    "non_reentrant": ["--activation-checkpointing", "non_reentrant"],
    "reentrant_static_graph": ["--activation-checkpointing", "reentrant", "--static-graph"],
    "lr": ["--lr", "0.09"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("actckpt")
    results = {}
    for name, flags in VARIANTS.items():
        results[name] = warm_ranks(
            SCRIPT, *RUN, *flags, "--output-dir", str(root / name), timeout=240
        )
    return root, results


@pytest.mark.parametrize("name", ["non_reentrant", "reentrant_static_graph"])
def test_checkpointed_runs_end_where_the_run_without_ends(runs, name):
    """non_reentrant with plain DDP and reentrant with static_graph: within 1e-5, identical
    replicas. Negative control: the same run at lr 0.09 instead of 0.1 is far outside 1e-5."""
    root, _ = runs
    summary, reference = read_summary(root / name), read_summary(root / "none")
    assert summary["steps"] == reference["steps"] == 6 and summary["world_size"] == 2
    assert summary["replicas_identical"] is True
    assert relative_difference(load_model(root / name), load_model(root / "none")) < 1e-5
    assert relative_difference(load_model(root / "lr"), load_model(root / "none")) > 1e-3
    assert summary["final_train_loss"] == pytest.approx(reference["final_train_loss"], rel=1e-5)
    p = summary["perf"]
    assert p["activation_checkpointing_blocks"] == 1  # SmallCNN's classifier
    assert p["activation_checkpointing_use_reentrant"] is name.startswith("reentrant")
    assert p["ddp_static_graph"] is (name == "reentrant_static_graph")
    assert reference["perf"]["activation_checkpointing_blocks"] == 0
    assert reference["perf"]["activation_checkpointing_use_reentrant"] is None


def test_peak_memory_is_reported_per_rank(runs):
    root, results = runs
    for name in VARIANTS:
        p = read_summary(root / name)["perf"]
        assert p["peak_memory"] == "cpu_max_rss"
        peaks = p["peak_memory_bytes_per_rank"]
        # Two ranks; each holds at least torch's libraries
        # (hundreds of MiB), and less than the machine has.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert len(peaks) == 2 and all(100 * MIB < b < total for b in peaks), peaks
        line = f"peak memory per rank (cpu_max_rss): {peaks[0] / MIB:.0f}, {peaks[1] / MIB:.0f} MiB"
        assert results[name].stdout.count(line) == 1, results[name].stdout[-2000:]


def test_reentrant_with_find_unused_parameters_fails_in_ddp(tmp_path):
    """torch's own failure, on 2 ranks, with the script's refusal left out: DDP's graph walk
    cannot see the parameters inside a reentrant checkpoint (its forward ran under no_grad),
    marks them unused and ready, and the recompute in backward marks them ready again."""
    out = tmp_path / "out"
    result = warm_ranks(
        "tests/perf_unchecked.py",
        *RUN,
        "--log-every",
        "1",
        "--activation-checkpointing",
        "reentrant",
        "--find-unused-parameters",
        "--output-dir",
        str(out),
        timeout=240,
        check=False,
    )
    assert result.returncode != 0
    # training started (the traceback below is in its backward), the first step did not finish
    assert "epoch 1 step 1 loss" not in result.stdout
    assert f"RuntimeError: {READY_ONCE}" in result.stderr and ".backward()" in result.stderr, (
        result.output[-3000:]
    )
    assert not (out / "summary.json").exists()


def test_the_script_refuses_that_combination():
    flags = ["--activation-checkpointing", "reentrant", "--find-unused-parameters"]
    with pytest.raises(
        ConfigError,
        match=f"reentrant with find_unused_parameters fails .*{READY_ONCE}.* "
        "use non_reentrant, or add --static-graph",
    ):
        parse_config(train_script.PerfConfig, flags)
    for accepted in (
        flags + ["--static-graph"],
        ["--activation-checkpointing", "non_reentrant", "--find-unused-parameters"],
    ):
        assert parse_config(train_script.PerfConfig, accepted).find_unused_parameters


# --- in this process
# --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """Small models on a busy 2-core machine: one thread
    is several times faster than two competing ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_name,blocks", [("small_cnn", 1), ("resnet18", 8)])
@pytest.mark.parametrize("variant", ["non_reentrant", "reentrant"])
def test_checkpoint_blocks_changes_no_names_and_no_results(model_name, blocks, variant):
    """The same parameter names and state_dict keys (model.pt loads into the plain
    model), the same outputs and gradients, and the blocks read back; a ResNet's
    residual blocks, SmallCNN's classifier. Less memory: the tensors autograd
    keeps for backward (activations, not the weights) take fewer bytes."""
    torch.manual_seed(0)
    plain = build_model(model_name, 10, 3, 16)
    model = build_model(model_name, 10, 3, 16)
    model.load_state_dict(plain.state_dict())
    assert perf.checkpoint_blocks(model, variant) == blocks
    assert perf.checkpointed_blocks(model) == [variant == "reentrant"] * blocks
    assert perf.checkpointed_blocks(plain) == [] and perf.checkpoint_blocks(plain, "none") == 0
    assert list(model.state_dict()) == list(plain.state_dict())
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    # Evaluation under no_grad skips the checkpoint (nothing to save): no "None of the inputs have
    # requires_grad=True" warning from the reentrant variant.
    # (Before training: BatchNorm's statistics agree.)
    plain.eval(), model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(images), plain(images))
    plain.train(), model.train()
    kept_bytes = []
    for m in (plain, model):
        weights = {p.untyped_storage().data_ptr() for p in m.parameters()}
        # storage -> bytes of every tensor saved for
        # backward outside a checkpoint (its input included)
        kept = {}

        def keep(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = F.cross_entropy(m(images), labels)
        loss.backward()
        kept_bytes.append(sum(kept.values()))
    assert kept_bytes[1] < kept_bytes[0], kept_bytes
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", ["non_reentrant", "reentrant"])
def test_batchnorm_in_a_checkpointed_block_updates_its_statistics_twice(variant):
    """The recompute is a second training-mode forward: running statistics move twice per step (here
    the first residual block's BatchNorm), while the stem, outside any checkpoint, moves once."""
    model = build_model("resnet18", 10, 3, 16)
    plain = copy.deepcopy(model)
    perf.checkpoint_blocks(model, variant)
    images = torch.randn(4, 3, 16, 16)
    for m in (model, plain):
        F.cross_entropy(m(images), torch.tensor([0, 1, 2, 3])).backward()
    assert model.bn1.num_batches_tracked.item() == 1
    assert model.layer1[0].bn1.num_batches_tracked.item() == 2
    # So evaluation, which normalizes with the running
    # statistics, can differ from a run without checkpointing.
    assert not torch.allclose(model.layer1[0].bn1.running_mean, plain.layer1[0].bn1.running_mean)
    torch.testing.assert_close(model.bn1.running_mean, plain.bn1.running_mean)  # outside: the same


def test_more_settings_that_work_in_one_process(tmp_path):
    """In this process as a world of one, benchmark/train.py ends where the plain
    run without checkpointing ends with: non_reentrant + find_unused_parameters,
    non_reentrant + static_graph, and reentrant with plain DDP (each block is
    checkpointed once, so DDP's hooks fire once per parameter)."""
    settings = {
        "none": [],
        "non_reentrant_find_unused": ["non_reentrant", "--find-unused-parameters"],
        "non_reentrant_static_graph": ["non_reentrant", "--static-graph"],
        "reentrant": ["reentrant"],
    }
    for name, flags in settings.items():
        flags = ["--activation-checkpointing", *flags] if flags else []
        cfg = parse_config(
            train_script.PerfConfig,
            [
                *RUN,
                "--max-steps",
                "3",
                "--local-batch-size",
                "32",
                "--output-dir",
                str(tmp_path / name),
                *flags,
            ],
        )
        train_script.train(cfg, LaunchInfo("single", 0, 0, 1, 1, "127.0.0.1", free_port()))
    for name in list(settings)[1:]:
        p = read_summary(tmp_path / name)["perf"]
        assert p["activation_checkpointing_blocks"] == 1
        assert p["activation_checkpointing_use_reentrant"] is name.startswith("reentrant")
        assert p["ddp_find_unused_parameters"] is name.endswith("find_unused")
        assert p["ddp_static_graph"] is name.endswith("static_graph")
        assert (
            relative_difference(load_model(tmp_path / name), load_model(tmp_path / "none")) < 1e-5
        ), name


def proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{key}:"))  # kB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_is_this_process_peak_resident_set(one_rank_group):
    """The kernel's high-water mark of resident memory
    (VmHWM), in bytes; it holds a tensor just written."""
    resident_before = proc_status_bytes("VmRSS")
    big = torch.ones(256 * MIB // 4)  # float32, every page written: resident
    resident = proc_status_bytes("VmRSS")
    assert resident - resident_before > 250 * MIB
    result = perf.peak_memory(torch.device("cpu"))
    assert result["peak_memory"] == "cpu_max_rss" and len(result["peak_memory_bytes_per_rank"]) == 1
    peak = result["peak_memory_bytes_per_rank"][0]
    # the peak so far includes the tensor (a figure in kB would be 1024x less)
    assert peak >= resident - MIB
    assert abs(peak - proc_status_bytes("VmHWM")) < 16 * MIB
    del big


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_peak_memory_on_gpu_is_max_memory_allocated():
    device = torch.device("cuda", 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        big = torch.ones(64 * MIB // 4, device=device)
        # read before the call: its all_gather allocates small tensors of its own
        peak_before_the_call = torch.cuda.max_memory_allocated(device)
        result = perf.peak_memory(device)
        assert result["peak_memory"] == "cuda_max_memory_allocated"
        assert result["peak_memory_bytes_per_rank"] == [peak_before_the_call]
        assert result["peak_memory_bytes_per_rank"][0] >= 64 * MIB
        del big
    finally:
        dist.destroy_process_group()


def test_the_benchmark_sweeps_both_variants():
    """benchmark.py --sweep-knobs ckpt_non_reentrant,ckpt_reentrant:
    flags benchmark/train.py takes."""
    bench = load_script("benchmark/benchmark.py", "benchmark_main")
    for knob, variant in (("ckpt_non_reentrant", "non_reentrant"), ("ckpt_reentrant", "reentrant")):
        assert (
            parse_config(train_script.PerfConfig, bench.KNOBS[knob]).activation_checkpointing
            == variant
        )
    assert "peak_memory_mib" in bench.SWEEP_COLUMNS and "peak_memory_mib" in bench.SCALING_COLUMNS
