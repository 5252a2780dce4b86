"""debugging/: each bug demo fails fast with the message torch and gloo print for it, as
debugging/README.md quotes it, and each fix runs clean. (The static check that no rank-0-only
block calls a collective is doctor.py lint's: tests/test_doctor.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.paths import PYTHON, load_script
from tests.processes import clean_env, run, torchrun, warm_command, warm_ranks
from tests.results import read_summary, root_cause
from tests.torch_versions import pinned_torch_only

DEMO = "debugging/demo_bugs.py"


@pytest.mark.parametrize("fix", [None, "find_unused", "use_all"])
def test_demo_runs_clean_without_a_bug_and_with_each_unused_parameter_fix(tmp_path, fix):
    """The demo without --bug, and the unused parameter's two fixes, run to the end with identical
    replicas. What the fixes compute: ranks started warm (the error's run is real, in the
    launchers tier)."""
    bug = ["--bug", "unused_parameter", "--fix", fix] if fix else []
    result = warm_ranks(DEMO, *bug, "--output-dir", str(tmp_path), timeout=120, check=True)
    assert "done: no bug" in result.stdout
    steps = re.findall(
        r"^step (\d) mean loss \d+\.\d{4} accuracy [01]\.\d{3}$", result.stdout, re.M
    )
    assert steps == ["1", "2", "3", "4"], result.stdout
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["replicas_identical"]


@pytest.mark.launchers
def test_demo_unused_parameter_error_under_torchrun(tmp_path):
    result = torchrun(
        DEMO,
        "--bug",
        "unused_parameter",
        "--output-dir",
        str(tmp_path / "bug"),
        check=False,
        timeout=120,
    )
    out = result.output
    assert result.returncode != 0
    # DDP notices at the next forward
    assert "step 1 mean loss" in out and "step 2 mean loss" not in out
    assert re.search(
        r"^\[rank\d\]: RuntimeError: Expected to have finished reduction in the prior iteration "
        r"before starting a new one\. This error indicates that your module has parameters "
        r"that were "
        r"not used in producing loss\.",
        out,
        re.M,
    ), out[-3000:]
    # raised by the forward of step 2 (the traceback's last frame in the script)
    assert re.search(r"^\[rank\d\]:\s+logits = model\(x, use_aux=use_aux\)$", out, re.M), out[
        -3000:
    ]
    # DDP names the aux head's weight and bias (parameters 4 and 5), on each rank that reports.
    assert re.search(
        r"^\[rank\d\]: Parameter indices which did not receive grad for rank \d: 4 5$", out, re.M
    )
    root = root_cause(out)
    assert "Expected to have finished reduction" in root and re.search(
        r"did not receive grad for rank \d: 4 5", root
    )
    # Negative control for the variables other runs set:
    # without TORCH_SHOW_CPP_STACKTRACES this c10d error
    # has no C++ stack, and without TORCH_CPP_LOG_LEVEL=INFO c10d logs no store connections.
    assert (
        "Exception raised from" not in out
        and "[c10d] The client socket has connected to" not in out
    )


@pytest.mark.launchers
def test_demo_rank0_only_barrier_ends_at_the_timeout_with_both_waits_shown(tmp_path):
    env = clean_env(TORCH_CPP_LOG_LEVEL="INFO", TORCH_SHOW_CPP_STACKTRACES="1")
    result = torchrun(
        DEMO,
        *("--bug", "rank0_barrier", "--timeout-s", "5", "--output-dir", str(tmp_path)),
        env=env,
        check=False,
        timeout=120,
    )
    out = result.output
    assert result.returncode != 0 and "rank 0 writes a checkpoint" in out, out[-3000:]
    # TORCH_CPP_LOG_LEVEL=INFO: c10d logs its store
    # connections. TORCH_SHOW_CPP_STACKTRACES adds no C++ stack
    # to gloo's own timeout (it does to the errors c10d raises:
    # tests/test_torch_text.py::test_demo_mismatched_collective_named_by_debug_detail).
    assert "[c10d] The client socket has connected to" in out, out[-3000:]
    assert "Exception raised from" not in out, out[-3000:]
    # gloo raised after --timeout-s, 5 s as its message says (not its default 30 min), and
    # torchrun stopped the job; the seconds from a hang to the job's end are measured by
    # tests/test_failures.py::test_hung_rank_ends_the_job_at_the_timeout.
    # Whichever rank times out first raises gloo's timeout;
    # the other raises the same or, when the first
    # one's exit closed the connection before its own timeout fired, "Connection closed by peer".
    timed_out = [
        rank
        for rank in (0, 1)
        if re.search(
            rf"^\[rank{rank}\]: RuntimeError: \[.*/gloo/transport/tcp/unbound_buffer\.cc:78\] "
            r"Timed out waiting 5000ms for recv operation to complete$",
            out,
            re.M,
        )
    ]
    assert timed_out, out[-3000:]
    for rank in {0, 1} - set(timed_out):
        assert re.search(
            rf"^\[rank{rank}\]: RuntimeError: .*Connection closed by peer", out, re.M
        ), out[-3000:]
    # Each rank's traceback shows the line it waited in: two DIFFERENT collectives.
    rank0 = "\n".join(line for line in out.splitlines() if line.startswith("[rank0]:"))
    rank1 = "\n".join(line for line in out.splitlines() if line.startswith("[rank1]:"))
    assert "dist.barrier(device_ids=" in rank0 and "loss.backward()" not in rank0, rank0
    assert "loss.backward()" in rank1 and "dist.barrier(" not in rank1, rank1
    root = root_cause(out)
    assert "Timed out waiting 5000ms" in root or "Connection closed by peer" in root, root


# --- the unused-parameter error and its fixes, in this
# process (a group of one rank) ------------------------

demo = load_script(DEMO, "demo_bugs")


def _error_within_three_steps(model, use_aux: bool = False) -> tuple[int, str, str] | None:
    """(step, "forward" or "backward", message) of the first RuntimeError, or None."""
    for step in range(1, 4):
        where = "forward"
        try:
            out = model(torch.randn(4, 8), use_aux=use_aux)
            where = "backward"
            out.sum().backward()
        except RuntimeError as e:
            return step, where, str(e)
    return None


def test_unused_parameter_fails_at_the_next_forward_and_each_fix_runs(one_rank_group):
    """debugging/README.md: the reducer waits for a gradient that never
    comes and says so at the next forward, on each rank by itself (here
    there is no other rank); the aux head is parameters 4 and 5."""
    torch.manual_seed(0)
    step, where, message = _error_within_three_steps(DDP(demo.TwoHeads()))
    assert (step, where) == (2, "forward"), message
    assert message.startswith(
        "Expected to have finished reduction in the prior iteration before starting a new one"
    )
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in message
    # names only with TORCH_DISTRIBUTED_DEBUG
    assert "Parameters which did not receive grad" not in message
    assert [name for name, _ in demo.TwoHeads().named_parameters()][4:] == [
        "aux_head.weight",
        "aux_head.bias",
    ]
    # The README's fixes beyond the demo's two (--fix find_unused and use_all run to the end:
    # test_demo_runs_clean_without_a_bug_and_with_each_unused_parameter_fix): requires_grad_(False)
    # on what is not trained, and static_graph=True for a graph that is the same every step.
    frozen = demo.TwoHeads()
    frozen.aux_head.requires_grad_(False)
    assert _error_within_three_steps(DDP(frozen)) is None
    assert _error_within_three_steps(DDP(demo.TwoHeads(), static_graph=True)) is None


THREADS_LEFT_AFTER_DESTROY = """
import gc, json, os, sys
from pathlib import Path
import torch

first_import, wrap, release = sys.argv[1:]
if first_import == "common.launcher":  # before any process group, as every script does
    from common.launcher import detect_launcher

    detect_launcher(uses_gpu=False)
elif first_import != "none":
    __import__(first_import)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def gloo_threads():  # ids of the threads gloo started (named gloo_tcp_loop, pt_gloo_runloop)
    return {t.name for t in Path("/proc/self/task").iterdir() if "gloo" in (t / "comm").read_text()}

before = gloo_threads()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = DDP(torch.nn.Linear(2, 2)) if wrap == "ddp" else None
if model is not None:
    model(torch.randn(3, 2)).sum().backward()
else:
    dist.all_reduce(torch.ones(2))
started = gloo_threads() - before
if release == "del":
    del model
dist.destroy_process_group()
gc.collect()
print("LEFT", json.dumps([len(started), len(started & gloo_threads())]))
sys.stdout.flush()
# this probe measures, so it skips the very shutdown that can abort when threads are left
os._exit(0)
"""


def gloo_threads_left(first_import: str, wrap: str, release: str) -> tuple[int, int]:
    """(threads gloo started, of those still running after destroy_process_group()), in a fresh
    process: what it imported before its process group matters."""
    result = run(
        [PYTHON, "-c", THREADS_LEFT_AFTER_DESTROY, first_import, wrap, release],
        timeout=180,
        check=True,
    )
    started, left = json.loads(result.stdout.split("LEFT ")[-1])
    assert started > 0
    return started, left


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads thread names in /proc/self/task"
)
@pinned_torch_only("shows what keeps gloo's threads alive")
def test_what_keeps_gloos_threads_past_destroy_process_group():
    """debugging/README.md, "terminate called without an active exception": in torch 2.14.1 two
    things keep the process group, and gloo's threads, alive past destroy_process_group(): the
    DDP model (its reducer), and torch.distributed.nn.functional imported after the group exists
    (DDP's constructor imports it; its functions bind the default group as a default argument).
    Released model and early import (common.launcher.detect_launcher does it): no thread left."""
    # the group alone leaves none
    assert gloo_threads_left("none", "none", "keep")[1] == 0
    # the fix: the model released, torch.distributed.nn imported first (by detect_launcher)
    assert gloo_threads_left("common.launcher", "ddp", "del")[1] == 0
    assert gloo_threads_left("torch.distributed.nn", "ddp", "del")[1] == 0
    # each half alone is not enough
    started, left = gloo_threads_left("none", "ddp", "del")
    assert left == started, "torch.distributed.nn imported late no longer keeps the group"
    started, left = gloo_threads_left("common.launcher", "ddp", "keep")
    assert left == started, "an unreleased DDP model no longer keeps the group"


# --- the wrapper used in place of the model; DDP's bucket memory (debugging/README.md)

MODULE_PREFIX_SAVE_MODULE = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix "
    "--fix module"
)
MODULE_PREFIX_STRIP = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix "
    "--fix strip_prefix"
)
WRAPPER_ATTRIBUTE_FIX = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrapper_attribute "
    "--fix module"
)


def test_wrapper_in_place_of_the_model_errors_under_torchrun(sample_run):
    """The guide's commands: each error from rank 0 and in torchrun's Root Cause (as the guide
    quotes them: tests/test_readme_text.py). demo_bugs.py's one README command under the real
    torchrun in the default run."""
    prefix = sample_run("guide-module-prefix")
    assert prefix.returncodes == (1,)
    assert "Unexpected key(s) in state_dict" in root_cause(prefix.output)
    attribute = sample_run("guide-wrapper-attribute")
    error = "AttributeError: 'DistributedDataParallel' object has no attribute 'num_classes'"
    assert attribute.returncodes == (1,) and f"[rank0]: {error}" in attribute.output


def test_wrapper_in_place_of_the_model_fixes(tmp_path):
    """The guide's fixes run to the end (the saved weights load into the plain model); their claim
    is what the script does, so their ranks start warm (the errors' runs are real)."""
    for command, name in (
        (MODULE_PREFIX_SAVE_MODULE, "save_module"),
        (MODULE_PREFIX_STRIP, "strip"),
    ):
        fixed = warm_command(command, "--output-dir", str(tmp_path / name))
        assert fixed.returncode == 0, fixed.output[-3000:]
        assert "the saved weights load into a plain TwoHeads" in fixed.stdout
    fixed = warm_command(WRAPPER_ATTRIBUTE_FIX, "--output-dir", str(tmp_path / "attribute_fixed"))
    assert fixed.returncode == 0 and "rank 0: 4 classes" in fixed.stdout, fixed.output[-3000:]
    assert "done: no bug" in fixed.stdout


BUCKET_MEMORY = """
import json, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torchvision.models import resnet18

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
MIB = 2**20
figures = {}
for view in (False, True):
    model = resnet18(num_classes=10)
    figures["parameters"] = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    # net CPU memory each phase allocated (allocations less frees)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as wrap:
        ddp = DDP(model, gradient_as_bucket_view=view)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward:
        ddp(torch.randn(2, 3, 32, 32)).sum().backward()
    figures[f"wrap view={view}"] = sum(e.self_cpu_memory_usage for e in wrap.key_averages()) / MIB
    figures[f"backward view={view}"] = (
        sum(e.self_cpu_memory_usage for e in backward.key_averages()) / MIB
    )
    del ddp
dist.destroy_process_group()
print(json.dumps(figures))
"""


def test_ddp_buckets_hold_one_copy_of_the_gradients():
    """The guide's figures for ResNet-18 on CPU: wrapping allocates the parameters' size (the
    buckets) with or without gradient_as_bucket_view; the first backward allocates it again for
    the separate gradients without the view, nothing with it (the control)."""
    result = run([PYTHON, "-c", BUCKET_MEMORY], timeout=180, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    size = figures["parameters"]
    for view in (False, True):
        assert figures[f"wrap view={view}"] == pytest.approx(size, rel=0.01), figures
    assert figures["backward view=False"] == pytest.approx(size, rel=0.01), figures
    assert abs(figures["backward view=True"]) < 0.01 * size, figures
    # (the guide's figure is this size: tests/test_readme_text.py)


@pytest.mark.parametrize("level", ["INFO", "DETAIL"])
def test_torch_distributed_debug_adds_the_parameter_names_to_the_indices(
    one_rank_group, monkeypatch, level
):
    previous = dist.get_debug_level()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", level)
    dist.set_debug_level_from_env()
    try:
        _, _, message = _error_within_three_steps(DDP(demo.TwoHeads()))
    finally:
        dist.set_debug_level(previous)
    assert (
        "Parameters which did not receive grad for rank 0: aux_head.bias, aux_head.weight"
        in message
    )
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in message
