"""Performance knobs of the training examples, the --no-ddp baseline, the step profile and the benchmark."""

from __future__ import annotations

import csv
import functools
import math
import sys

import pytest
import torch
import torch.distributed as dist

from common.config import TrainConfig, load_config
from common.dist import DistContext
from common.errors import ConfigError
from common.launcher import LaunchInfo
from common.models import SmallCNN
from common.perf import COMM_HOOKS, NoDDP, check_perf_config, loader_kwargs, unwrap
from tests.helpers import PYTHON, REPO, load_script, read_summary, run, torchrun

CPU = torch.device("cpu")
SMALL = ["--epochs", "1", "--batch-size", "8", "--log-every", "1000"]


def load_train_module():
    return load_script("01_basic_ddp/train.py", "basic_ddp_train")


@pytest.fixture
def one_rank():
    """A one-process gloo group in this process, so 01's train() can run under test instrumentation."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = LaunchInfo("single", 0, 0, 1, 1, "127.0.0.1", 0)
    try:
        yield DistContext(info, CPU, "gloo", "test")
    finally:
        dist.destroy_process_group()


def train_in_process(ctx, tmp_path, *flags):
    cfg = load_config(TrainConfig, [*SMALL, "--output-dir", str(tmp_path), *flags])
    load_train_module().train(cfg, ctx)
    return read_summary(tmp_path)


# --- knobs reach what they configure ---------------------------------------------------------------

def test_knobs_reach_ddp_under_torchrun(tmp_path):
    """2 ranks: hook, bucket size, bucket views, static graph, channels_last weights, fp16 + GradScaler."""
    torchrun("01_basic_ddp/train.py", *SMALL, "--dataset", "fake", "--image-size", "16", "--max-steps", "3",
             "--channels-last", "--precision", "fp16", "--comm-hook", "fp16_compress", "--bucket-cap-mb", "1",
             "--gradient-as-bucket-view", "--static-graph", "--output-dir", str(tmp_path), timeout=180)
    s = read_summary(tmp_path)
    perf = s["perf"]
    assert perf["ddp"] == "DistributedDataParallel"
    assert perf["ddp_comm_hook"] == "fp16_compress_hook"
    assert perf["ddp_bucket_cap_bytes"] == 1024 * 1024
    assert perf["ddp_gradient_as_bucket_view"] is True and perf["ddp_static_graph"] is True
    assert perf["ddp_find_unused_parameters"] is False
    assert perf["channels_last_weights"] is True
    assert perf["grad_scaler_enabled"] is True and perf["grad_scale"] > 1
    assert s["replicas_identical"] and math.isfinite(s["final_train_loss"])


def test_knobs_reach_ddp_under_spawn(tmp_path):
    result = run([PYTHON, REPO / "01_basic_ddp" / "train_spawn.py", "--nprocs", "2", *SMALL, "--max-steps", "2",
                  "--precision", "bf16", "--comm-hook", "bf16_compress", "--find-unused-parameters",
                  "--bucket-cap-mb", "2", "--output-dir", tmp_path], timeout=180, check=True)
    perf = read_summary(tmp_path)["perf"]
    assert perf["ddp_comm_hook"] == "bf16_compress_hook", result.output
    assert perf["ddp_find_unused_parameters"] is True
    assert perf["ddp_bucket_cap_bytes"] == 2 * 1024 * 1024
    assert perf["grad_scaler_enabled"] is False  # bf16 needs no loss scaling


def test_defaults_leave_ddp_plain(one_rank, tmp_path):
    perf = train_in_process(one_rank, tmp_path, "--max-steps", "1")["perf"]
    assert perf["ddp_comm_hook"] is None and perf["ddp_bucket_cap_bytes"] == 25 * 1024 * 1024
    assert not (perf["ddp_static_graph"] or perf["ddp_gradient_as_bucket_view"] or perf["compiled"])
    assert perf["grad_scaler_enabled"] is False


def test_channels_last_inputs_reach_the_model(one_rank, tmp_path, monkeypatch):
    train = load_train_module()
    seen = []

    class Recorder(SmallCNN):
        def forward(self, x):
            seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
            return super().forward(x)

    monkeypatch.setattr(train, "build_model", lambda name, classes, channels, size: Recorder(channels, classes))
    for flags, expected in (([], False), (["--channels-last"], True)):
        seen.clear()
        cfg = load_config(TrainConfig, [*SMALL, "--dataset", "fake", "--image-size", "8", "--max-steps", "2",
                                        "--output-dir", str(tmp_path), *flags])
        train.train(cfg, one_rank)
        assert seen and set(seen) == {expected}, flags  # training and evaluation batches alike


@pytest.mark.parametrize("precision,scaled", [("fp16", True), ("bf16", False), ("fp32", False)])
def test_grad_scaler_scales_the_loss_with_fp16_only(one_rank, tmp_path, monkeypatch, precision, scaled):
    """On CPU this torch supports fp16 autocast, so fp16 runs here too, with a real GradScaler."""
    calls = []
    original = torch.amp.GradScaler.scale

    def spy(self, outputs):
        result = original(self, outputs)
        calls.append((outputs.dtype, float(result / outputs)))
        return result

    monkeypatch.setattr(torch.amp.GradScaler, "scale", spy)
    summary = train_in_process(one_rank, tmp_path, "--max-steps", "2", "--precision", precision)
    assert len(calls) == 2
    factors = {factor for _, factor in calls}
    assert (factors == {65536.0}) if scaled else (factors == {1.0})
    assert summary["perf"]["grad_scaler_enabled"] is scaled


def test_compile_wraps_the_module_before_ddp(one_rank, tmp_path, monkeypatch):
    """torch.compile with its 'eager' backend: the same wrapping, without minutes of C++ compilation."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    summary = train_in_process(one_rank, tmp_path, "--max-steps", "1", "--compile")
    assert summary["perf"]["compiled"] is True
    # model.pt holds the plain module's weights: loads into an uncompiled SmallCNN.
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    SmallCNN(1, 10).load_state_dict(state)


def count_all_reduces(ctx, tmp_path, *flags) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_in_process(ctx, tmp_path, *flags)
    return sum(e.name == "gloo:all_reduce" for e in prof.events())


def test_no_ddp_baseline_performs_no_gradient_all_reduce(one_rank, tmp_path):
    """All-reduces counted by the profiler: DDP adds at least one per step, --no-ddp none
    (what remains are the per-epoch metric sums, the same whatever the number of steps)."""
    ddp = [count_all_reduces(one_rank, tmp_path / f"d{n}", "--max-steps", str(n)) for n in (2, 6)]
    base = [count_all_reduces(one_rank, tmp_path / f"n{n}", "--max-steps", str(n), "--no-ddp") for n in (2, 6)]
    assert ddp[1] - ddp[0] >= 4
    assert base[0] == base[1] and base[0] < ddp[0]
    assert read_summary(tmp_path / "n6")["perf"]["ddp"] == "NoDDP"


# --- configuration ----------------------------------------------------------------------------------

def test_no_ddp_flag_switches_the_baseline_on():
    assert load_config(TrainConfig, ["--no-ddp"]).no_ddp is True
    assert load_config(TrainConfig, []).no_ddp is False


@pytest.mark.parametrize("flags,message", [
    (["--no-ddp", "--comm-hook", "bf16_compress"], "comm_hook"),
    (["--no-ddp", "--static-graph"], "static_graph"),
])
def test_ddp_settings_with_no_ddp_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        check_perf_config(load_config(TrainConfig, flags), CPU)


def test_refusals_end_in_one_line_exit_2(tmp_path):
    result = run([PYTHON, REPO / "01_basic_ddp/train.py", "--no-ddp", "--bucket-cap-mb", "5",
                  "--output-dir", tmp_path], timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no_ddp: bucket_cap_mb configure DDP"), result.stderr


def test_compile_without_a_compiler_is_refused(monkeypatch):
    monkeypatch.setattr("common.perf.shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match="C/C.. compiler"):
        check_perf_config(load_config(TrainConfig, ["--compile"]), CPU)


def test_loader_kwargs():
    cfg = load_config(TrainConfig, ["--num-workers", "0"])
    assert loader_kwargs(cfg, CPU) == {"num_workers": 0, "pin_memory": False}
    cfg = load_config(TrainConfig, ["--num-workers", "3", "--prefetch-factor", "4", "--no-persistent-workers"])
    assert loader_kwargs(cfg, torch.device("cuda", 0)) == {"num_workers": 3, "pin_memory": True,
                                                           "persistent_workers": False, "prefetch_factor": 4}


def test_no_ddp_stand_in_and_unwrap():
    inner = SmallCNN()
    model = NoDDP(inner)
    with model.no_sync():
        out = model(torch.zeros(2, 1, 8, 8))
    assert out.shape == (2, 10) and unwrap(model) is inner
    assert COMM_HOOKS["bf16_compress"].__name__ == "bf16_compress_hook"


# --- the benchmark ----------------------------------------------------------------------------------

def test_benchmark_world_sizes_1_and_2(tmp_path):
    out = tmp_path / "bench"
    result = run([PYTHON, REPO / "benchmark" / "benchmark.py", "--world-sizes", "1,2", "--batch-size", "16",
                  "--warmup", "2", "--steps", "3", "--sweep", "--sweep-knobs", "bf16_compress",
                  "--output-dir", out], timeout=300, check=True)
    with (out / "scaling.csv").open() as f:
        rows = list(csv.DictReader(f))
    sys.path.insert(0, str(REPO / "benchmark"))
    from benchmark import SCALING_COLUMNS, SWEEP_COLUMNS

    assert list(rows[0]) == SCALING_COLUMNS
    assert [int(r["world_size"]) for r in rows] == [1, 2]
    one = float(rows[0]["images_per_s"])
    for r in rows:
        n, ips = int(r["world_size"]), float(r["images_per_s"])
        assert float(r["scaling_efficiency"]) == pytest.approx(ips / (n * one), rel=1e-9)
        assert float(r["images_per_s_per_rank"]) == pytest.approx(ips / n, rel=1e-9)
        parts = [float(r[c]) for c in ("data_wait_ms", "forward_backward_ms", "exposed_comm_ms", "optimizer_ms")]
        assert all(p >= 0 for p in parts) and float(r["step_ms"]) > 0 and float(r["no_ddp_images_per_s"]) > 0
    with (out / "sweep.csv").open() as f:
        sweep = list(csv.DictReader(f))
    assert list(sweep[0]) == SWEEP_COLUMNS and [s["knob"] for s in sweep] == ["default", "bf16_compress"]
    assert float(sweep[1]["images_per_s_ratio"]) == pytest.approx(
        float(sweep[1]["images_per_s"]) / float(sweep[0]["images_per_s"]), rel=1e-9)
    assert read_summary(out / "ws2_bf16_compress_r0")["perf"]["ddp_comm_hook"] == "bf16_compress_hook"
    assert read_summary(out / "ws2_noddp_r0")["perf"]["ddp"] == "NoDDP"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "scaling_efficiency" in result.stdout and "sweep at world size 2" in result.stdout


def test_benchmark_needs_world_size_1(tmp_path):
    result = run([PYTHON, REPO / "benchmark" / "benchmark.py", "--world-sizes", "2,4", "--output-dir", tmp_path],
                 timeout=60)
    assert result.returncode == 2 and "must include 1" in result.stderr
