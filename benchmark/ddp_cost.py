r"""What DDP itself adds to a training step, and which DDP settings take it away.

Two modes, the same variants (a model trained without DDP, with DDP's defaults, and with each
setting of DDP that removes work at any world size):

    count  torch.profiler on a few steps: the operators, kernels, gradient copies and collectives
           per step of each variant, minus the same steps without DDP. Deterministic: the same on
           a CPU as on a GPU, so it runs here and in the tests.
    time   the step time of each variant on a GPU: the variants interleaved, each `--repeats`
           times, the batch kept on the device (the GPU's own pace, no loader), CUDA events read
           once per window. Prints each variant's mean step and its cost over no DDP, with the
           spread over the repeats.

    python benchmark/ddp_cost.py --mode count                      # ResNet-50, 32x32, batch 2, CPU
    python benchmark/ddp_cost.py --mode time --image-size 224 --local-batch-size 256 \
        --precision bf16 --channels-last                           # one GPU

One process is a world of one (the cost DDP adds before any communication); under torchrun
every rank runs the same steps. Writes <output-dir>/ddp_cost.json.
"""

import collections
import dataclasses
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import MODELS, field, load_config
from common.data import FAKE_CLASSES
from common.errors import ConfigError
from common.bad_input import exit_on_bad_input
from common.launcher import choose_backend, detect_launcher
from common.models import build_model

# benchmark/perf.py
from perf import AMP_DTYPES, DDP_ARGUMENTS, SYNC_BUFFERS_ARGUMENT

# name -> (DDP's keyword arguments, or None for no DDP; zero_grad's set_to_none)
VARIANTS = {
    "no_ddp": (None, True),
    "default": ({}, True),
    "no_broadcast_buffers": ({SYNC_BUFFERS_ARGUMENT: False}, True),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, True),
    # what benchmark/train.py did before: the gradients kept between steps, zeroed in place
    "gradient_as_bucket_view_zeroed": ({"gradient_as_bucket_view": True}, False),
    "bucket_100mb": ({"bucket_cap_mb": 100}, True),
    "static_graph": ({"static_graph": True}, True),
    "batched_grad_copy": ({"batched_grad_copy": True}, True),
    # the settings that each take work away, together
    "knobs": (
        {
            SYNC_BUFFERS_ARGUMENT: False,
            "gradient_as_bucket_view": True,
            "bucket_cap_mb": 100,
            "batched_grad_copy": True,
        },
        True,
    ),
}
if "batched_grad_copy" not in DDP_ARGUMENTS:  # torch 2.13 added it
    del VARIANTS["batched_grad_copy"]
    del VARIANTS["knobs"][0]["batched_grad_copy"]

# Operators that make a view or an empty tensor: no kernel reads or writes data.
NO_DATA = {
    "aten::view",
    "aten::as_strided",
    "aten::narrow",
    "aten::slice",
    "aten::select",
    "aten::detach",
    "aten::alias",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::lift_fresh",
    "aten::_reshape_alias",
    "aten::reshape",
    "aten::unsqueeze",
    "aten::expand",
    "aten::t",
    "aten::transpose",
    "aten::flatten",
    "aten::unflatten",
    "aten::split",
    "aten::split_with_sizes",
}
# Named records inside DDP's reducer (torch/csrc/distributed/c10d/reducer.cpp)
COPY_INTO_BUCKET = "torch::distributed::reducer::mul_out"  # a fresh .grad, divided on the way
COPY_OUT_OF_BUCKET = "torch.distributed.ddp.reducer::copy_bucket_to_grad"
COLUMNS = {  # column -> what it counts, per step
    "all_reduces": "c10d::allreduce_ calls",
    "broadcasts": "c10d::broadcast_ calls (buffers, rank 0's to all)",
    "operators": "aten operators called from outside any other operator",
    "kernels": "of those, the ones that read or write data (not views or empty tensors)",
    "gradient_copies": "copies of a gradient into or out of its bucket (a batched copy: one)",
    "gradient_zero_add_div": "aten::zero_, add_, div_ (whole-gradient passes)",
    "host_reads": "aten::item: a value read back by the host",
}


@dataclasses.dataclass
class CostConfig:
    """What DDP adds to a training step (count: operators; time: a GPU's step time)."""

    mode: str = field(
        "count", "count (torch.profiler, any device) or time", choices=("count", "time")
    )
    model: str = field("resnet50", "network", choices=MODELS)
    image_size: int = field(32, "images of this size, 3 channels", min=8)
    local_batch_size: int = field(2, "local batch per rank", min=1)
    precision: str = field("fp32", "autocast: fp32 (off), bf16 or fp16", choices=tuple(AMP_DTYPES))
    channels_last: bool = field(False, "channels_last memory format for model and inputs")
    device: str = field("auto", "auto: cuda where there is a GPU", choices=("auto", "cpu", "cuda"))
    warmup: int = field(
        0, "steps before counting or each window (0: 3 to count, 20 to time; at least 2)", min=0
    )
    steps: int = field(
        0, "steps counted, or timed in each window (0: 2 to count, 200 to time)", min=0
    )
    repeats: int = field(3, "time: windows per variant, interleaved", min=1)
    variants: str = field(",".join(VARIANTS), f"comma-separated, from: {', '.join(VARIANTS)}")
    output_dir: str = field("runs/ddp_cost", "where ddp_cost.json goes")
    timeout_s: float = field(300.0, "process-group timeout in seconds", min=1.0)


def with_defaults(cfg: CostConfig) -> CostConfig:
    """The mode's warm-up and steps where they are 0: a few steps to count, a window to time."""
    counting = cfg.mode == "count"
    return dataclasses.replace(
        cfg,
        warmup=cfg.warmup or (3 if counting else 20),
        steps=cfg.steps or (2 if counting else 200),
    )


def build(cfg: CostConfig, name: str, device: torch.device):
    """The variant's model (ResNet or the small CNN, 1,000 classes as ImageNet) and optimizer."""
    ddp_kwargs, set_to_none = VARIANTS[name]
    torch.manual_seed(0)
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model = build_model(cfg.model, FAKE_CLASSES, 3, cfg.image_size)
    model = model.to(device, memory_format=memory_format)
    if ddp_kwargs is not None:
        model = DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def step(images, labels):
        optimizer.zero_grad(set_to_none=set_to_none)
        with torch.autocast(
            device.type, dtype=AMP_DTYPES[cfg.precision], enabled=cfg.precision != "fp32"
        ):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


def outermost(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def count_step(events, steps: int) -> dict:
    """The columns of COLUMNS, per step, from the profiler's events."""
    names = collections.Counter(e.name for e in events)
    top = [e.name for e in events if e.name.startswith("aten::") and outermost(e)]
    counts = {
        "all_reduces": names["c10d::allreduce_"],
        "broadcasts": names["c10d::broadcast_"],
        "operators": len(top),
        "kernels": sum(name not in NO_DATA for name in top),
        "gradient_copies": names[COPY_INTO_BUCKET]
        + names[COPY_OUT_OF_BUCKET]
        + names["aten::_foreach_copy_"],
        "gradient_zero_add_div": sum(names[n] for n in ("aten::zero_", "aten::add_", "aten::div_")),
        "host_reads": names["aten::item"],
    }
    return {k: v / steps for k, v in counts.items()}


def count(cfg: CostConfig, names: list[str], device, images, labels) -> dict:
    """Each variant's counts per step, and the difference to no DDP."""
    per_step = {}
    for name in names:
        step = build(cfg, name, device)
        for _ in range(cfg.warmup):
            step(images, labels)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(cfg.steps):
                step(images, labels)
        per_step[name] = count_step(prof.events(), cfg.steps)
    base = per_step["no_ddp"]
    return {
        name: dict(per_step[name], **{f"added_{k}": per_step[name][k] - base[k] for k in COLUMNS})
        for name in names
    }


def time_windows(cfg: CostConfig, names: list[str], device, images, labels) -> dict:
    """Mean step of each variant's windows (seconds), the variants interleaved, repeated."""
    steps = {name: build(cfg, name, device) for name in names}
    cuda = device.type == "cuda"
    windows = {name: [] for name in names}
    for _ in range(cfg.repeats):
        for name in names:  # round-robin: a slow phase of the machine hits every variant
            for _ in range(cfg.warmup):
                steps[name](images, labels)
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            else:
                started = time.perf_counter()
            for _ in range(cfg.steps):  # no synchronize between steps: the CPU runs ahead
                steps[name](images, labels)
            if cuda:
                end.record()
                end.synchronize()
                window_s = start.elapsed_time(end) / 1000
            else:
                window_s = time.perf_counter() - started
            windows[name].append(window_s / cfg.steps)
    result = {}
    for name in names:
        mean_steps = windows[name]
        row = {"mean_step_s": mean_steps, "median_of_repeats_s": statistics.median(mean_steps)}
        if name != "no_ddp" and "no_ddp" in windows:
            # repeat r of the variant against repeat r without DDP: pairs measured side by side
            costs = [t / b - 1 for t, b in zip(mean_steps, windows["no_ddp"])]
            row.update(cost=statistics.median(costs), cost_min=min(costs), cost_max=max(costs))
        result[name] = row
    return result


# under torchrun, a failing rank's exception and traceback show in torchrun's summary
@record
def main(argv=None) -> int:
    cfg = load_config(CostConfig, argv)
    with exit_on_bad_input():  # bad input: one "error:" line, exit code 2
        names = [n.strip() for n in cfg.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise ConfigError(
                f"variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})"
            )
        if "no_ddp" not in names:
            raise ConfigError("variants: include no_ddp, the base every cost is measured against")
        if cfg.warmup == 1:  # DDP rebuilds its buckets after the first step
            raise ConfigError("warmup: at least 2 steps, after which DDP's buckets are rebuilt")
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: cuda was asked for but this machine has no usable CUDA GPU")
    cfg = with_defaults(cfg)
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    launch = detect_launcher(uses_gpu=gpu)
    device = torch.device("cuda", launch.gpu) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed shapes: the fastest convolutions
    dist.init_process_group(
        choose_backend(device),
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    # one fixed batch on the device: the loader is not what is measured
    generator = torch.Generator().manual_seed(launch.rank)
    images = torch.randn(
        cfg.local_batch_size, 3, cfg.image_size, cfg.image_size, generator=generator
    )
    labels = torch.randint(0, FAKE_CLASSES, (cfg.local_batch_size,), generator=generator)
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    images, labels = images.to(device, memory_format=memory_format), labels.to(device)
    run = count if cfg.mode == "count" else time_windows
    result = run(cfg, names, device, images, labels)
    report = {
        "settings": dataclasses.asdict(cfg),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "world_size": launch.world_size,
        "variants": result,
    }
    if launch.rank == 0:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ddp_cost.json").write_text(json.dumps(report, indent=2) + "\n")
        print(
            f"{cfg.model}, {cfg.image_size} px, batch {cfg.local_batch_size}, {report['device']}, "
            f"world size {launch.world_size}, torch {torch.__version__}"
        )
        # benchmark/benchmark.py's table printer (beside this file; imported here, where this
        # script runs as a script: the tests import the functions above without it)
        from benchmark import print_table

        if cfg.mode == "count":
            print("per step, added to the same step without DDP:")
            rows = [{"variant": n, **{k: result[n][f"added_{k}"] for k in COLUMNS}} for n in names]
            print_table(["variant", *COLUMNS], rows, dict.fromkeys(COLUMNS, 0))
        else:
            print(f"mean step over {cfg.steps} steps, {cfg.repeats} interleaved windows each:")
            rows = [
                {
                    "variant": n,
                    "step_ms": 1000 * r["median_of_repeats_s"],
                    "cost_pct": 100 * r["cost"] if "cost" in r else None,
                    "min_pct": 100 * r["cost_min"] if "cost" in r else None,
                    "max_pct": 100 * r["cost_max"] if "cost" in r else None,
                }
                for n, r in result.items()
            ]
            print_table(["variant", "step_ms", "cost_pct", "min_pct", "max_pct"], rows, {})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
