r"""Benchmark: throughput, scaling efficiency and where a step's time goes, per world size.

For each world size it starts a real `torchrun` of benchmark/train.py (the script
with every performance knob) twice, with DDP and with `--no-ddp` (the same loop
without gradient communication), each with `--profile-steps`, and prints one table:

    world size | images/s (mean step) | images/s (median step) | per rank | scaling efficiency |
    step ms split into data wait / forward+backward / exposed communication / optimizer /
    other | no-DDP images/s | DDP's cost over no DDP, with its spread | peak memory

The method (benchmark/README.md, "How a step is measured"): images/s is the global batch over
the mean step of a window of --steps steps after --warmup steps (the window's whole time over
its steps), the median step beside it; the parts are medians over the window of the mean over
ranks. Every run is repeated --repeats times (3), all runs interleaved; the table shows the run
with the median mean step, and each A/B figure (DDP against no DDP, a knob against the
default) is the median over the repeats of the pair measured side by side, with the smallest
and largest pair beside it. scaling efficiency = images/s at N ranks / (N x images/s of one
rank without DDP), at a fixed local batch. `--sweep` runs each knob against the default at the
largest world size.

    python benchmark/benchmark.py --world-sizes 1,2
    python benchmark/benchmark.py --world-sizes 1,2 --model resnet18 --dataset fake \
        --local-batch-size 16 --sweep
    # flags after -- go to every run
    python benchmark/benchmark.py --world-sizes 1,2 -- --precision bf16

Outputs in --output-dir: scaling.csv, sweep.csv (with --sweep), tensorboard/, one folder per run.
"""

import csv
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common.config import field, load_config
from common.errors import ConfigError
from common.bad_input import exit_on_bad_input

REPO = Path(__file__).resolve().parents[1]

# The knobs `--sweep` compares with the default (flags of benchmark/train.py).
KNOBS = {
    "bucket_1mb": ["--bucket-cap-mb", "1"],
    "bucket_5mb": ["--bucket-cap-mb", "5"],
    "bucket_100mb": ["--bucket-cap-mb", "100"],
    "grad_as_bucket_view": ["--gradient-as-bucket-view"],
    "no_broadcast_buffers": ["--no-broadcast-buffers"],
    "batched_grad_copy": ["--batched-grad-copy"],
    "static_graph": ["--static-graph"],
    "bf16_compress": ["--comm-hook", "bf16_compress"],
    "fp16_compress": ["--comm-hook", "fp16_compress"],
    "bf16_compress_view_5mb": [
        "--comm-hook",
        "bf16_compress",
        "--gradient-as-bucket-view",
        "--bucket-cap-mb",
        "5",
    ],
    "bf16": ["--precision", "bf16"],
    "fp16": ["--precision", "fp16"],
    "channels_last": ["--channels-last"],
    "compile": ["--compile"],
    "ckpt_non_reentrant": ["--activation-checkpointing", "non_reentrant"],
    "ckpt_reentrant": ["--activation-checkpointing", "reentrant"],
    "workers_1": ["--num-workers", "1"],
    "workers_2": ["--num-workers", "2"],
}
DEFAULT_SWEEP = (
    "bucket_1mb,bucket_5mb,bucket_100mb,grad_as_bucket_view,static_graph,"
    "bf16_compress,fp16_compress"
)
PARTS = ("data_wait", "forward_backward", "exposed_comm", "optimizer", "other")
SCALING_COLUMNS = [
    "world_size",
    "images_per_s",
    "images_per_s_median",
    "images_per_s_per_rank",
    "scaling_efficiency",
    "step_ms",
    "data_wait_ms",
    "forward_backward_ms",
    "exposed_comm_ms",
    "optimizer_ms",
    "other_ms",
    "data_wait_pct",
    "exposed_comm_pct",
    "no_ddp_images_per_s",
    "no_ddp_step_ms",
    "ddp_overhead_ms",
    "ddp_cost_pct",
    "ddp_cost_min_pct",
    "ddp_cost_max_pct",
    "peak_memory_mib",
    "peak_reserved_mib",
]
SWEEP_COLUMNS = [
    "knob",
    "flags",
    "world_size",
    "images_per_s",
    "step_ms",
    "exposed_comm_ms",
    "data_wait_ms",
    "images_per_s_ratio",
    "images_per_s_ratio_min",
    "images_per_s_ratio_max",
    "exposed_comm_ratio",
    "scaling_efficiency",
    "peak_memory_mib",
]


@dataclasses.dataclass
class BenchConfig:
    """Throughput and scaling efficiency of benchmark/train.py over world sizes."""

    script: str = field(
        "benchmark/train.py",
        "training script to run (must take benchmark/train.py's knob "
        "flags); may carry leading arguments, e.g. 'tests/perf_cifar.py run benchmark/train.py'",
    )
    world_sizes: str = field("1,2", "comma-separated processes per run; must include 1")
    dataset: str = field("digits", "data set (--dataset of the script)")
    data_dir: str = field("data", "data folder (--data-dir of the script)")
    model: str = field("small_cnn", "network (--model of the script)")
    image_size: int = field(0, "resize images (0: the data set's size)", min=0)
    local_batch_size: int = field(
        32, "local batch per rank (fixed over world sizes: weak scaling)", min=1
    )
    warmup: int = field(
        10, "steps left out before measuring (at least the batches the loader queues)", min=0
    )
    steps: int = field(200, "measured steps per run: the window", min=1)
    repeats: int = field(
        3,
        "runs per configuration, interleaved; A/B figures are the median pair, with the spread",
        min=1,
    )
    min_efficiency: float = field(
        0.0, "exit code 1 if a world size's scaling efficiency is below this (0: no check)", min=0.0
    )
    sweep: bool = field(
        False, "also run each knob of --sweep-knobs against the default at the largest world size"
    )
    sweep_knobs: str = field(
        DEFAULT_SWEEP, f"comma-separated knobs to sweep, from: {', '.join(KNOBS)}"
    )
    output_dir: str = field("runs/benchmark", "where CSV files, TensorBoard logs and the runs go")
    timeout_s: float = field(600.0, "seconds one run may take", min=1.0)
    threads_per_rank: int = field(
        0, "OMP_NUM_THREADS per rank on CPU (0: cores / largest world size)", min=0
    )


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ConfigError(
            f"world_sizes: expected comma-separated integers such as 1,2,4, got {text!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"world_sizes: expected positive integers, got {text!r}")
    if sizes[0] != 1:
        raise ConfigError(
            "world_sizes: must include 1 (scaling efficiency is relative to one process)"
        )
    return sizes


def launch(
    cfg: BenchConfig, nproc: int, name: str, flags: list[str], extra: list[str], threads: int
) -> dict:
    """One `torchrun` of the script; returns its summary.json.
    A failed run ends the benchmark (exit code 1)."""
    out = Path(cfg.output_dir) / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *shlex.split(cfg.script),
        "--dataset",
        cfg.dataset,
        "--data-dir",
        cfg.data_dir,
        "--model",
        cfg.model,
        "--image-size",
        str(cfg.image_size),
        "--local-batch-size",
        str(cfg.local_batch_size),
        "--epochs",
        "1000",
        "--max-steps",
        str(cfg.warmup + cfg.steps + 1),
        "--profile-warmup",
        str(cfg.warmup),
        "--profile-steps",
        str(cfg.steps),
        "--log-every",
        "1000000",
        "--output-dir",
        str(out),
        *extra,
        *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    print(f"  run {name}: {' '.join(cmd[3:])}", flush=True)
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=cfg.timeout_s
        )
    except subprocess.TimeoutExpired:
        sys.exit(
            f"error: run {name} took longer than timeout_s={cfg.timeout_s:g} s (raise --timeout-s)"
        )
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n".join([line for line in lines if line.startswith("error: ")] or lines[-15:])
        sys.exit(f"error: run {name} failed with exit code {proc.returncode}:\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    prof = summary.get("profile") or {}
    if not prof.get("steps"):
        sys.exit(
            f"error: run {name}: {cfg.script} wrote no step profile (does it take --profile-steps?)"
        )
    return summary


def figures(summary: dict) -> dict:
    """Per-run figures from the step profile: images/s from the window's mean step, and from
    the median step; the largest rank's peak memory (GPU: max_memory_allocated, and what the
    allocator reserved; CPU: peak resident set, which includes torch and the data set)."""
    profile = summary["profile"]
    median, step = profile["median_s"], profile["mean_step_s"]
    row = {
        "images_per_s": summary["global_batch_size"] / step,
        "images_per_s_median": summary["global_batch_size"] / median["step"],
        "step_ms": 1000 * step,
        "median_step_ms": 1000 * median["step"],
        "peak_memory_mib": None,
        "peak_reserved_mib": None,
    }
    # a --script may not report them
    perf = summary.get("perf", {})
    for key, column in (
        ("peak_memory_bytes_per_rank", "peak_memory_mib"),
        ("peak_reserved_bytes_per_rank", "peak_reserved_mib"),
    ):
        if perf.get(key):
            row[column] = max(perf[key]) / 2**20
    # A part no profiled step reached (the GradScaler skipped every optimizer step) stays empty.
    row.update(
        {f"{part}_ms": None if median[part] is None else 1000 * median[part] for part in PARTS}
    )
    return row


def median_run(rows: list[dict]) -> dict:
    """The repeat with the median mean step (keeps one run's parts together); with an even number
    of repeats the faster of the two middle ones, a run that was measured rather than a mean of
    two."""
    ordered = sorted(rows, key=lambda r: r["step_ms"])
    return ordered[(len(ordered) - 1) // 2]


def paired(a_rows: list[dict], b_rows: list[dict], ratio) -> tuple[float, float, float]:
    """An A/B figure over the repeats: ratio(a, b) of each pair measured side by side (repeat r
    of both), as (median, smallest, largest)."""
    values = [ratio(a, b) for a, b in zip(a_rows, b_rows)]
    return statistics.median(values), min(values), max(values)


def run_all(
    cfg: BenchConfig, jobs: list[tuple[str, int, list[str]]], extra: list[str], threads: int
) -> dict:
    """Each job `repeats` times, round-robin, so slow phases of a busy machine hit all of them;
    every repeat's figures, in order."""
    results: dict[str, list[dict]] = {name: [] for name, _, _ in jobs}
    for r in range(cfg.repeats):
        for name, nproc, flags in jobs:
            results[name].append(figures(launch(cfg, nproc, f"{name}_r{r}", flags, extra, threads)))
    return results


def fmt(value, digits=1) -> str:
    return (
        "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    )


def print_table(columns: list[str], rows: list[dict], digits: dict) -> None:
    cells = [[fmt(row.get(c), digits.get(c, 1)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def percent(part, whole):
    return None if part is None else 100 * part / whole


def step_ratio(a: dict, b: dict) -> float:
    """a's cost over b, in %: how much longer a's mean step is."""
    return 100 * (a["step_ms"] / b["step_ms"] - 1)


def speed_ratio(a: dict, b: dict) -> float:
    return a["images_per_s"] / b["images_per_s"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # flags for every training run
    cfg = load_config(BenchConfig, argv[: argv.index("--")] if "--" in argv else argv)
    with exit_on_bad_input():  # bad input: one "error:" line, exit code 2
        sizes = parse_world_sizes(cfg.world_sizes)
        knobs = [k.strip() for k in cfg.sweep_knobs.split(",") if k.strip()] if cfg.sweep else []
        unknown = [k for k in knobs if k not in KNOBS]
        if unknown:
            raise ConfigError(
                f"sweep_knobs: unknown {', '.join(unknown)} (choose from {', '.join(KNOBS)})"
            )
        if not (REPO / shlex.split(cfg.script)[0]).is_file():
            raise ConfigError(f"script: no file {shlex.split(cfg.script)[0]} in {REPO}")
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // sizes[-1])
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    print(
        f"benchmark: {cfg.script}, {cfg.model} on {cfg.dataset}, "
        f"local batch {cfg.local_batch_size}, "
        f"world sizes {sizes}, {cfg.warmup} warm-up + {cfg.steps} measured steps, "
        f"{cfg.repeats} repeat(s), "
        f"{threads} thread(s) per rank on CPU"
        + (f", extra flags {' '.join(extra)}" if extra else ""),
        flush=True,
    )
    jobs = [
        (f"ws{n}_{kind}", n, flags)
        for n in sizes
        for kind, flags in (("ddp", []), ("noddp", ["--no-ddp"]))
    ]
    jobs += [(f"ws{sizes[-1]}_{knob}", sizes[-1], KNOBS[knob]) for knob in knobs]
    repeats = run_all(cfg, jobs, extra, threads)
    result = {name: median_run(rows) for name, rows in repeats.items()}

    # one rank without DDP: what N ranks would do with no cost of distribution at all
    base = result["ws1_noddp"]["images_per_s"]
    rows = []
    for n in sizes:
        ddp, noddp = result[f"ws{n}_ddp"], result[f"ws{n}_noddp"]
        cost = paired(repeats[f"ws{n}_ddp"], repeats[f"ws{n}_noddp"], step_ratio)
        rows.append(
            {
                "world_size": n,
                **ddp,
                "images_per_s_per_rank": ddp["images_per_s"] / n,
                "scaling_efficiency": ddp["images_per_s"] / (n * base),
                "data_wait_pct": percent(ddp["data_wait_ms"], ddp["step_ms"]),
                "exposed_comm_pct": percent(ddp["exposed_comm_ms"], ddp["step_ms"]),
                "no_ddp_images_per_s": noddp["images_per_s"],
                "no_ddp_step_ms": noddp["step_ms"],
                "ddp_overhead_ms": ddp["step_ms"] - noddp["step_ms"],
                **dict(zip(("ddp_cost_pct", "ddp_cost_min_pct", "ddp_cost_max_pct"), cost)),
            }
        )
    print()
    print_table(
        SCALING_COLUMNS,
        rows,
        {
            "scaling_efficiency": 3,
            "images_per_s": 0,
            "images_per_s_median": 0,
            "images_per_s_per_rank": 0,
            "no_ddp_images_per_s": 0,
            "peak_memory_mib": 0,
            "peak_reserved_mib": 0,
        },
    )
    write_csv(out / "scaling.csv", SCALING_COLUMNS, rows)
    print(
        f"images/s: the global batch over the mean step of {cfg.steps} steps; scaling "
        "efficiency against one rank without DDP; ddp_cost_pct: DDP's step over no DDP's, "
        f"median of {cfg.repeats} side-by-side pair(s), min and max beside it"
    )

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tensorboard"))
    for row in rows:  # x axis: world size
        for column in SCALING_COLUMNS[1:]:
            if row[column] is not None:
                writer.add_scalar(f"scaling/{column}", row[column], row["world_size"])

    if knobs:
        n = sizes[-1]
        default = result[f"ws{n}_ddp"]
        sweep_rows = [
            {
                "knob": "default",
                "flags": "",
                "world_size": n,
                **default,
                "images_per_s_ratio": 1.0,
                "images_per_s_ratio_min": 1.0,
                "images_per_s_ratio_max": 1.0,
                "exposed_comm_ratio": 1.0,
                "scaling_efficiency": default["images_per_s"] / (n * base),
            }
        ]
        for knob in knobs:
            r = result[f"ws{n}_{knob}"]
            speed = paired(repeats[f"ws{n}_{knob}"], repeats[f"ws{n}_ddp"], speed_ratio)
            sweep_rows.append(
                {
                    "knob": knob,
                    "flags": " ".join(KNOBS[knob]),
                    "world_size": n,
                    **r,
                    **dict(
                        zip(
                            (
                                "images_per_s_ratio",
                                "images_per_s_ratio_min",
                                "images_per_s_ratio_max",
                            ),
                            speed,
                        )
                    ),
                    # > 1: the knob exposes less communication than the default
                    "exposed_comm_ratio": (
                        default["exposed_comm_ms"] / r["exposed_comm_ms"]
                        if default["exposed_comm_ms"] is not None and r["exposed_comm_ms"]
                        else None
                    ),
                    # relative to the DEFAULT's 1-rank
                    # throughput: what the knob buys at N
                    "scaling_efficiency": r["images_per_s"] / (n * base),
                }
            )
        print()
        print(
            f"sweep at world size {n} (ratios to the default of this run: the median of "
            f"{cfg.repeats} side-by-side pair(s), min and max beside it; exposed_comm_ratio "
            "= default / knob, of the median runs):"
        )
        print_table(
            SWEEP_COLUMNS,
            sweep_rows,
            {
                "images_per_s": 0,
                "images_per_s_ratio": 2,
                "images_per_s_ratio_min": 2,
                "images_per_s_ratio_max": 2,
                "exposed_comm_ratio": 2,
                "scaling_efficiency": 3,
                "peak_memory_mib": 0,
            },
        )
        write_csv(out / "sweep.csv", SWEEP_COLUMNS, sweep_rows)
        for i, row in enumerate(sweep_rows):
            writer.add_text("sweep/knobs", f"{i}: {row['knob']} {row['flags']}", i)
            for column in (
                "images_per_s",
                "exposed_comm_ms",
                "images_per_s_ratio",
                "exposed_comm_ratio",
                "peak_memory_mib",
            ):
                if row[column] is not None:
                    writer.add_scalar(f"sweep/{row['knob']}/{column}", row[column], n)
    writer.close()
    print(
        f"\nwrote {out / 'scaling.csv'}"
        + (f", {out / 'sweep.csv'}" if knobs else "")
        + f" and {out / 'tensorboard'} in {time.perf_counter() - started:.0f} s"
    )
    below = [r for r in rows if r["scaling_efficiency"] < cfg.min_efficiency]
    for r in below:
        print(
            f"missed: scaling efficiency {r['scaling_efficiency']:.3f} at world size "
            f"{r['world_size']}, below --min-efficiency {cfg.min_efficiency:g}"
        )
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
