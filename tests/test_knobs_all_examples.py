"""Every training example takes the performance knobs, and each knob changes what it claims.

Parametrized over SCRIPTS: an example added there gets every test. What a knob set is read
back from the objects (summary.json's "perf" section, common.perf.perf_settings) or watched
while the example trains:
  - one real 2-rank torchrun per example with the DDP knobs combined (hook, buckets, bucket
    views, static graph, channels_last, fp16 + GradScaler, step profile);
  - the rest in this process as a world of one (gloo on loopback), where spies watch the
    DataLoader arguments, the model's inputs, the GradScaler, the hook calls and the all-reduces.
tests/test_perf.py covers 01 (and train_spawn); this file covers the other training examples.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import common.perf
from common.errors import ConfigError
from tests.helpers import REPO, free_port, load_script, read_summary, torchrun

# example -> flags that keep its own topic in play in every run
# 01 (and train_spawn.py) is covered knob by knob in tests/test_perf.py.
SCRIPTS = {
    "03_grad_accum/train.py": ["--accum-steps", "2"],  # windows of 2 micro-batches with no_sync
    "04_syncbn/train.py": ["--batch-norm", "sync"],  # the knobs apply to the converted model
    "05_checkpointing/train.py": [],
    "06_multinode/train.py": [],
}
# All-reduces an example makes every step besides DDP's (05 agrees on preemption signals each step).
OWN_ALL_REDUCES_PER_STEP = {"05_checkpointing/train.py": 1}
# DDP(static_graph=True) fails inside no_sync(); 03 refuses the pair (test below).
STATIC_GRAPH_REFUSED = {"03_grad_accum/train.py"}
# Fake 3-channel images: with digits' single channel every layout counts as channels_last.
SMALL = ["--dataset", "fake", "--image-size", "8", "--epochs", "1", "--batch-size", "8", "--log-every", "1000"]


def all_reduce_hook(summary: dict) -> str | None:
    """The hook that all-reduced the buckets; an example that registers its own hook around it
    (03 counts the buckets) names the inner one in summary.json as all_reduce_hook."""
    return summary.get("all_reduce_hook", summary["perf"]["ddp_comm_hook"])


# --- in this process, as one rank ------------------------------------------------------------------

@pytest.fixture
def example(monkeypatch):
    """Load an example's train.py as a module; `here(module, out, *flags)` runs its main() in this
    process as rank 0 of 1 and returns summary.json."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "SIZE" in name else "0")  # restored after the test
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))

    def load(script: str):
        path = REPO / script
        monkeypatch.syspath_prepend(str(path.parent))  # modules next to the script (04's cpu_sync_batchnorm)
        return load_script(path, f"example_{path.parent.name}")

    def here(module, output_dir, *flags) -> dict:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        module.main([*SMALL, *flags, "--output-dir", str(output_dir)])
        return read_summary(output_dir)

    load.here = here
    return load


def count_all_reduces(run) -> tuple[int, dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        summary = run()
    return sum(e.name == "gloo:all_reduce" for e in prof.events()), summary


# --- the DDP knobs on two ranks --------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_ddp_knobs_reach_ddp_on_two_ranks(script, tmp_path):
    static = script not in STATIC_GRAPH_REFUSED
    torchrun(script, *SMALL, *SCRIPTS[script], "--max-steps", "2", "--precision", "fp16",
             "--comm-hook", "fp16_compress", "--bucket-cap-mb", "1", "--gradient-as-bucket-view",
             *(["--static-graph"] if static else []), "--channels-last", "--profile-steps", "1",
             "--profile-warmup", "0", "--output-dir", str(tmp_path), timeout=180)
    summary = read_summary(tmp_path)
    perf = summary["perf"]
    assert perf["ddp"] == "DistributedDataParallel"
    assert all_reduce_hook(summary) == "fp16_compress_hook"
    assert perf["ddp_bucket_cap_bytes"] == 1024 * 1024
    assert perf["ddp_gradient_as_bucket_view"] is True
    assert perf["ddp_static_graph"] is static
    assert perf["ddp_find_unused_parameters"] is False
    assert perf["channels_last_weights"] is True
    assert perf["precision"] == "fp16" and perf["grad_scaler_enabled"] is True and perf["grad_scale"] > 1
    assert perf["compiled"] is False
    assert summary["profile"]["steps"] == 1 and summary["profile"]["median_s"]["step"] > 0
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert summary["replicas_identical"] and math.isfinite(summary["final_train_loss"])
    if script == "03_grad_accum/train.py":  # no_sync still skips all but one pass per step
        assert summary["all_reduce_passes_per_step"] == [1, 1]


# --- what the knobs do inside the loop -------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS)
def test_knobs_reach_the_loader_the_inputs_the_scaler_and_the_hook(script, tmp_path, example, monkeypatch):
    module = example(script)
    loaders, layouts, factors, hook_calls = [], [], [], []
    optimizer_steps = {"step": 0, "update": 0}

    real_loader = module.DataLoader

    def recording_loader(*args, **kwargs):
        loaders.append(kwargs)
        return real_loader(*args, **kwargs)

    real_build = module.build_model

    def recording_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, inputs: layouts.append(
            inputs[0].is_contiguous(memory_format=torch.channels_last) and not inputs[0].is_contiguous()))
        return model

    real_hook = common.perf.COMM_HOOKS["bf16_compress"]

    def bf16_compress_hook(state, bucket):
        hook_calls.append(bucket.index())
        return real_hook(state, bucket)

    scaler = torch.amp.GradScaler
    real_scale, real_step, real_update = scaler.scale, scaler.step, scaler.update

    def scale(self, outputs):
        result = real_scale(self, outputs)
        factors.append(float(result.detach() / outputs.detach()))
        return result

    def counted(name, real):
        def method(self, *args, **kwargs):
            optimizer_steps[name] += 1
            return real(self, *args, **kwargs)
        return method

    monkeypatch.setattr(module, "DataLoader", recording_loader)
    monkeypatch.setattr(module, "build_model", recording_build)
    monkeypatch.setitem(common.perf.COMM_HOOKS, "bf16_compress", bf16_compress_hook)
    monkeypatch.setattr(scaler, "scale", scale)
    monkeypatch.setattr(scaler, "step", counted("step", real_step))
    monkeypatch.setattr(scaler, "update", counted("update", real_update))

    summary = example.here(module, tmp_path, *SCRIPTS[script], "--max-steps", "2", "--precision", "fp16",
                           "--comm-hook", "bf16_compress", "--find-unused-parameters", "--bucket-cap-mb", "2",
                           "--channels-last", "--num-workers", "1", "--prefetch-factor", "3",
                           "--no-persistent-workers")
    perf = summary["perf"]
    micro_batches = summary.get("accum_steps", 1)
    # Input pipeline: every DataLoader (train and test) gets the settings; no pinning on CPU.
    assert len(loaders) >= 2
    for kwargs in loaders:
        assert (kwargs["num_workers"], kwargs["prefetch_factor"], kwargs["persistent_workers"],
                kwargs["pin_memory"]) == (1, 3, False, False)
    # channels_last: every batch reaches the model in NHWC, training and evaluation alike.
    assert layouts and set(layouts) == {True}
    assert perf["channels_last_weights"] is True
    # fp16: every micro-batch's loss is scaled; the scaler steps and updates once per optimizer step.
    assert factors == [65536.0] * (2 * micro_batches)
    assert optimizer_steps == {"step": 2, "update": 2} and summary["steps"] == 2
    assert perf["grad_scaler_enabled"] is True
    # The compression hook all-reduces the buckets (03: wrapped by its counting hook, once per step).
    assert len(hook_calls) >= 2
    if script == "03_grad_accum/train.py":
        assert summary["all_reduces"] == len(hook_calls)
    assert perf["ddp_find_unused_parameters"] is True and perf["ddp_bucket_cap_bytes"] == 2 * 1024 * 1024
    assert perf["ddp_static_graph"] is False and perf["ddp_gradient_as_bucket_view"] is False
    assert math.isfinite(summary["final_train_loss"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_ddp_performs_no_gradient_all_reduce(script, tmp_path, example):
    """All-reduces counted by the profiler: DDP adds at least one per optimizer step, --no-ddp none
    (what remains are the metric sums, the same whatever the number of steps, and the example's own
    per-step collectives)."""
    module = example(script)
    flags = [*SCRIPTS[script], "--dataset", "digits", "--image-size", "0", "--batch-size", "64"]  # few ops to profile
    ddp, _ = count_all_reduces(lambda: example.here(module, tmp_path / "ddp", *flags, "--max-steps", "3"))
    base = [count_all_reduces(lambda n=n: example.here(module, tmp_path / f"no_ddp{n}", *flags, "--no-ddp",
                                                       "--precision", "bf16", "--max-steps", str(n)))
            for n in (1, 3)]
    (base1, _), (base3, summary) = base
    assert base3 - base1 == 2 * OWN_ALL_REDUCES_PER_STEP.get(script, 0)
    assert ddp - base3 >= 3
    assert summary["steps"] == 3 and summary["perf"]["ddp"] == "NoDDP"
    assert summary["perf"]["grad_scaler_enabled"] is False  # bf16 needs no loss scaling
    if script == "03_grad_accum/train.py":
        assert summary["all_reduces"] == 0  # its counting hook: nothing to count without DDP


@pytest.mark.parametrize("script", SCRIPTS)
def test_compile_wraps_the_module_before_ddp(script, tmp_path, example, monkeypatch):
    """torch.compile with its 'eager' backend: the same wrapping, without minutes of C++ compilation."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    module = example(script)
    summary = example.here(module, tmp_path, *SCRIPTS[script], "--max-steps", "1", "--compile")
    assert summary["perf"]["compiled"] is True and summary["perf"]["ddp"] == "DistributedDataParallel"
    assert summary["perf"]["grad_scaler_enabled"] is False  # fp32
    # The saved weights are the plain module's: no "module." or "_orig_mod." in the keys.
    saved = list(tmp_path.glob("model*.pt"))
    assert saved
    for path in saved:
        keys = torch.load(path, weights_only=True).keys()
        assert keys and not any(k.startswith("module.") or "_orig_mod." in k for k in keys), path


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_example_checks_the_knobs(script, tmp_path, example):
    module = example(script)
    with pytest.raises(ConfigError, match="no_ddp: comm_hook configure DDP"):
        example.here(module, tmp_path, *SCRIPTS[script], "--no-ddp", "--comm-hook", "bf16_compress")


# --- 03: static_graph and no_sync ------------------------------------------------------------------

def test_grad_accum_refuses_static_graph_with_no_sync_and_takes_it_without(tmp_path, example):
    module = example("03_grad_accum/train.py")
    with pytest.raises(ConfigError, match="static_graph: .* no_sync"):
        example.here(module, tmp_path / "refused", "--accum-steps", "2", "--static-graph")
    summary = example.here(module, tmp_path / "sync_every", "--accum-steps", "2", "--static-graph",
                           "--no-use-no-sync", "--max-steps", "2")
    assert summary["perf"]["ddp_static_graph"] is True
    assert summary["all_reduce_passes_per_step"] == [2, 2]  # without no_sync every micro-batch communicates
