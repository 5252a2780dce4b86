r"""GPU check: ResNet-50 beside pytorch/examples' imagenet/main.py on one GPU, DDP's own cost,
`--compile`, and every lesson's main command once on the GPU; each figure checked against its
target (benchmark/README.md, "Targets"). Two calls, each ended within --budget-s (470 s):

    # imagenet/main.py of pytorch/examples at 77f55b9 (BSD-3, not part of this repository) into
    # external/, as benchmark/README.md shows, then:
    python benchmark/gpu_check.py --part throughput     # call 1: the comparison and DDP's cost
    python benchmark/gpu_check.py --part compile        # call 2: --compile, then every lesson

Every throughput is measured the same way (benchmark/README.md, "How a step is measured"): the
batch over the mean step of a window of --steps steps after --warmup steps, the median step
beside it. imagenet/main.py prints each batch's time with `-p 1` and is stopped once it has
printed enough of them; ours writes its step profile. Both scripts run at world size 1 under DDP,
as main.py's README shows, on the same data (FakeData of 1,000 classes through ToTensor), with
the same loader workers. The runs of call 1, in order (a failed or timed-out run is recorded
and the check goes on):

    main_py_gpu_pace   imagenet/main.py --dummy -a resnet50 -b 256, fp32, under gpu_pace.py: its
                       loaders yield one batch kept on the GPU (the GPU's own pace)
    fp32_gpu_pace      benchmark/train.py at main.py's settings, under gpu_pace.py: fp32, cuDNN's
                       benchmark mode off as in main.py (parity target)
    bf16_cl_gpu_pace   --precision bf16 --channels-last, cuDNN's benchmark mode on (speed targets)
    ddp_cost           benchmark/ddp_cost.py --mode time at bf16 + channels_last: no DDP, DDP's
                       defaults and DDP with the knobs, --repeats windows each, interleaved
    bf16_cl            bf16 + channels_last with its loader (loader target: against its GPU pace)
    main_py            imagenet/main.py with its loader: --workers workers
    fp32               benchmark/train.py with its loader, at main.py's settings

Call 2: bf16_cl_compile_gpu_pace (--compile; evaluation runs eager, not recompiled), then each
lesson's main command on one rank (exit code and accuracy). Outputs in --output-dir:
gpu_check_<part>.json (rewritten after every run) and one folder per run. Exit code 1 when a run
failed, timed out or was skipped for want of time, or a target was missed. A dry run on the CPU:
--device cpu --model small_cnn --image-size 8 --local-batch-size 8 --workers 0 --warmup 2 --steps 3
(the targets are then missed: exit code 1).
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmark import REPO, figures, print_table  # benchmark/benchmark.py, beside this file
from common.launcher import free_port  # importable: benchmark.py put the repository on sys.path

# imagenet/main.py's progress line: "Epoch: [0][ 12/5005]\tTime  0.201 ( 0.380)\t..."
MAIN_PY_LINE = re.compile(r"Epoch: \[\d+\]\[\s*(\d+)/\d+\]\s+Time\s+([\d.]+)\s+\(\s*([\d.]+)\)")
GPU_PACE = [sys.executable, str(REPO / "benchmark" / "gpu_pace.py")]
TORCHRUN_ONE_RANK = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node=1",
]
# (name, script and flags): one rank each; {runs} is --output-dir
LESSONS = [
    ("01", "01_basic_ddp/train.py"),
    ("02_eval", "02_sampler_patterns/distributed_eval.py"),
    ("02_uneven", "02_sampler_patterns/uneven_inputs.py"),
    ("02_weighted", "02_sampler_patterns/weighted_sampler.py"),
    ("03", "03_grad_accum/train.py --local-batch-size 8 --accum-steps 4"),
    ("04", "04_syncbn/train.py --batch-norm sync --local-batch-size 2"),
    ("05", "05_checkpointing/train.py --save-every-steps 20"),
    ("05_preempt", "05_checkpointing/preempt.py --time-limit-s 3600"),
    ("06", "06_multinode/train.py"),
    ("07", "07_metrics/train.py --patience 1"),
    ("08_gan", "08_several_models/gan.py"),
]
# after 01, whose weights it distils
LESSON_AFTER_01 = ("08", "08_several_models/train.py --teacher {runs}/01/model.pt")

# The anchors (benchmark/README.md, "Targets"), images/s of ResNet-50 training on one GPU.
# MLPerf Training v3.0, 8 x H100 (closed division): time to train over the images it trained
# on, per GPU; a derived figure.
MLPERF_H100_PER_GPU = 7000
# NVIDIA DeepLearningExamples, ResNet-50 v1.5, one A100 80GB, mixed precision, batch 256.
NVIDIA_A100 = 2470
# (name, what is measured, (row, row or None), the test, lowest, highest, the GPUs it is for,
# its anchor); a figure is the first row's images/s over the second's, or one row's.
TARGETS = [
    (
        "parity",
        "fp32 at main.py's settings / main.py, both at GPU pace",
        ("fp32_gpu_pace", "main_py_gpu_pace"),
        0.97,
        1.03,
        None,
        "imagenet/main.py",
    ),
    (
        "bf16_channels_last",
        "bf16 + channels_last / main.py, both at GPU pace",
        ("bf16_cl_gpu_pace", "main_py_gpu_pace"),
        2.0,
        None,
        None,
        "imagenet/main.py",
    ),
    (
        "loader",
        "bf16 + channels_last with the loader / at GPU pace",
        ("bf16_cl", "bf16_cl_gpu_pace"),
        0.95,
        None,
        None,
        "the GPU pace",
    ),
    (
        "ddp_defaults",
        "DDP's cost at world size 1, defaults (median pair, fraction of the step)",
        ("ddp_cost:default", None),
        None,
        0.025,
        None,
        "no DDP",
    ),
    (
        "ddp_knobs",
        "DDP's cost at world size 1, with the knobs (median pair, fraction of the step)",
        ("ddp_cost:knobs", None),
        None,
        0.01,
        None,
        "no DDP",
    ),
    (
        "mlperf_eager",
        "bf16 + channels_last at GPU pace, images/s",
        ("bf16_cl_gpu_pace", None),
        0.55 * MLPERF_H100_PER_GPU,
        None,
        ("H100", "H200"),
        f"MLPerf v3.0 per H100, {MLPERF_H100_PER_GPU:,} x 0.55",
    ),
    (
        "mlperf_compile",
        "the same with --compile, images/s",
        ("bf16_cl_compile_gpu_pace", None),
        0.67 * MLPERF_H100_PER_GPU,
        None,
        ("H100", "H200"),
        f"MLPerf v3.0 per H100, {MLPERF_H100_PER_GPU:,} x 0.67",
    ),
    (
        "nvidia_a100",
        "bf16 + channels_last at GPU pace, images/s",
        ("bf16_cl_gpu_pace", None),
        NVIDIA_A100,
        None,
        ("A100",),
        f"NVIDIA's A100 80GB, {NVIDIA_A100:,}",
    ),
]


class MemoryPoller:
    """The GPU's used memory as nvidia-smi reports it, polled every 0.5 s: one measure that covers
    both scripts (imagenet/main.py reports none), context and cached blocks included."""

    def __init__(self):
        self.peak_mib, self._stop = None, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.split()
                used = max(float(v) for v in out)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                continue
            self.peak_mib = max(self.peak_mib or 0.0, used)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def stop_group(proc: subprocess.Popen) -> None:
    """End a run and everything it started (mp.spawn's children, loader workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error(log: Path) -> str:
    """The run's own `error:` line, else its last line, and where the whole log is."""
    lines = log.read_text(errors="replace").splitlines() or [""]
    errors = [line for line in lines if line.startswith("error:")]
    return f"{(errors or lines)[-1].strip()} ({log})"


def run_main_py(args, out: Path, timeout: float, gpu_pace: bool) -> dict:
    """imagenet/main.py until it has printed warmup + steps batches; images/s from the mean
    (and the median) batch time of the window after the warm-up."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    cmd = [
        *(GPU_PACE if gpu_pace else [sys.executable]),
        str(Path(args.imagenet_main).resolve()),
        "--dummy",
        "-a",
        args.model,
        "-b",
        str(args.local_batch_size),
        "-j",
        str(args.workers),
        "-p",
        "1",
        "--dist-url",
        f"tcp://127.0.0.1:{free_port()}",
        "--dist-backend",
        "nccl" if cuda else "gloo",
        "--multiprocessing-distributed",
        "--world-size",
        "1",
        "--rank",
        "0",
    ] + ([] if cuda else ["--no-accel"])
    row = {"command": " ".join(cmd[1:])}
    times: dict[int, float] = {}
    log = (out / "output.log").open("w")
    proc = subprocess.Popen(
        cmd,
        cwd=out,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    timer = threading.Timer(timeout, stop_group, [proc])
    timer.start()
    try:
        with MemoryPoller() as memory:
            for line in proc.stdout:
                log.write(line)
                match = MAIN_PY_LINE.search(line)
                if match:
                    times[int(match.group(1))] = float(match.group(2))
                    if len(times) >= args.warmup + args.steps:
                        break
    finally:
        timer.cancel()
        stop_group(proc)
        log.close()
    window = [t for batch, t in sorted(times.items()) if batch > args.warmup][: args.steps]
    if len(window) < args.steps:
        return dict(row, error=f"printed {len(times)} batches (see {out}/output.log)")
    return dict(
        row,
        images_per_s=args.local_batch_size / statistics.mean(window),
        images_per_s_median=args.local_batch_size / statistics.median(window),
        step_ms=1000 * statistics.mean(window),
        gpu_memory_used_mib=memory.peak_mib,
    )


def run_command(cmd: list[str], out: Path, timeout: float) -> tuple[dict, float | None]:
    """Run one command into out/output.log: (an error row or {}, nvidia-smi's peak MiB)."""
    out.mkdir(parents=True, exist_ok=True)
    with MemoryPoller() as memory, (out / "output.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return {"error": f"timed out after {timeout:.0f} s"}, memory.peak_mib
    if code != 0:
        return {"error": f"exit code {code}: {last_error(out / 'output.log')}"}, memory.peak_mib
    return {}, memory.peak_mib


def run_ours(args, flags: list[str], out: Path, timeout: float, gpu_pace: bool) -> dict:
    """benchmark/train.py with a step profile, at GPU pace (gpu_pace.py, one process) or with
    its loader (torchrun, one rank); figures as benchmark.py's."""
    cmd = [
        *(GPU_PACE if gpu_pace else TORCHRUN_ONE_RANK),
        "benchmark/train.py",
        "--device",
        args.device,
        "--model",
        args.model,
        "--dataset",
        "fake",
        "--image-size",
        str(args.image_size),
        "--local-batch-size",
        str(args.local_batch_size),
        "--weight-decay",
        "0.0001",  # imagenet/main.py's default
        "--num-workers",
        str(args.workers),
        # one epoch longer than the steps run: the loader's steady state, as main.py's 1.28M
        "--fake-images",
        str(args.local_batch_size * (args.warmup + args.steps + 2)),
        "--epochs",
        "1",
        "--max-steps",
        str(args.warmup + args.steps + 1),
        "--profile-warmup",
        str(args.warmup),
        "--profile-steps",
        str(args.steps),
        "--log-every",
        "1000000",
        "--timeout-s",
        "300",
        "--output-dir",
        str(out),
        *flags,
    ]
    row = {"command": " ".join(cmd[1:])}
    error, peak_mib = run_command(cmd, out, timeout)
    if error:
        return dict(row, **error)
    summary = json.loads((out / "summary.json").read_text())
    median = summary["profile"]["median_s"]
    return dict(
        row,
        **figures(summary),
        data_wait_fraction=median["data_wait"] / median["step"],
        gpu_memory_used_mib=peak_mib,
    )


def run_ddp_cost(args, out: Path, timeout: float) -> dict:
    """benchmark/ddp_cost.py --mode time: DDP's cost at world size 1, defaults and knobs."""
    cmd = [
        sys.executable,
        "benchmark/ddp_cost.py",
        "--mode",
        "time",
        "--device",
        args.device,
        "--model",
        args.model,
        "--image-size",
        str(args.image_size),
        "--local-batch-size",
        str(args.local_batch_size),
        "--precision",
        "bf16",
        "--channels-last",
        "--variants",
        "no_ddp,default,knobs",
        "--warmup",
        str(max(2, args.warmup // 2)),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--output-dir",
        str(out),
    ]
    row = {"command": " ".join(cmd[1:])}
    error, _ = run_command(cmd, out, timeout)
    if error:
        return dict(row, **error)
    return dict(row, variants=json.loads((out / "ddp_cost.json").read_text())["variants"])


def run_lessons(args, runs: Path, timeout: float) -> dict:
    """Each lesson's main command on one rank, all at once (small models), then 08 after 01."""

    def start(name: str, command: str) -> tuple[subprocess.Popen, Path]:
        out = runs / name
        out.mkdir(parents=True, exist_ok=True)
        cmd = [
            *TORCHRUN_ONE_RANK,
            *command.format(runs=runs).split(),
            "--output-dir",
            str(out),
        ]
        log = (out / "output.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return proc, out

    def finish(name: str, proc: subprocess.Popen, out: Path, deadline: float) -> dict:
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = "timeout"
        summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
        result = {
            "exit_code": code,
            # 02's distributed_eval.py reports its exact evaluation under "exact"
            "eval_accuracy": summary.get("eval_accuracy", summary.get("exact", {}).get("accuracy")),
            "replicas_identical": summary.get("replicas_identical"),
        }
        return result if code == 0 else dict(result, error=last_error(out / "output.log"))

    deadline = time.monotonic() + timeout
    started = {name: start(name, command) for name, command in LESSONS}
    results = {name: finish(name, *started[name], deadline) for name in started}
    name, command = LESSON_AFTER_01
    results[name] = finish(name, *start(name, command), deadline)
    return results


def environment(device: str) -> dict:
    """The machine and torch build the figures come from (asked in a child: no CUDA here)."""
    probe = (
        "import json, os, torch, torchvision; "
        "cuda = torch.cuda.is_available(); "
        "print(json.dumps(dict(torch=torch.__version__, torchvision=torchvision.__version__, "
        "cuda=torch.version.cuda, "
        "nccl='.'.join(map(str, torch.cuda.nccl.version())) if cuda else None, "
        "gpu=torch.cuda.get_device_name(0) if cuda else None, "
        "cudnn_allow_tf32=torch.backends.cudnn.allow_tf32, "
        "float32_matmul_precision=torch.get_float32_matmul_precision(), "
        "cpus=os.cpu_count())))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    info = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    return dict(info, device=device, python=sys.version.split()[0])


def figure(runs: dict, name: str) -> float | None:
    """A row's images/s, or ("ddp_cost:VARIANT") DDP's cost in that variant; None if not run."""
    if name.startswith("ddp_cost:"):
        return runs.get("ddp_cost", {}).get("variants", {}).get(name.split(":")[1], {}).get("cost")
    return runs.get(name, {}).get("images_per_s")


def check_targets(runs: dict, gpu: str | None) -> list[dict]:
    """Each target of TARGETS that applies to this GPU, with its figure and whether it is met
    (None: a run it needs is not in this call, or failed)."""
    checked = []
    for name, what, (first, second), lowest, highest, gpus, anchor in TARGETS:
        if gpus and not any(model in (gpu or "") for model in gpus):
            continue  # another GPU's target
        value = figure(runs, first)
        if value is not None and second is not None:
            base = figure(runs, second)
            value = value / base if base else None
        met = None
        if value is not None:
            met = (lowest is None or value >= lowest) and (highest is None or value <= highest)
        limits = [
            f">= {lowest:g}" if lowest is not None else "",
            f"<= {highest:g}" if highest is not None else "",
        ]
        checked.append(
            dict(
                target=name,
                what=what,
                figure=value,
                limit=" and ".join(filter(None, limits)),
                anchor=anchor,
                met=met,
            )
        )
    return checked


def plan(args) -> list[tuple[str, str, list[str]]]:
    """(run name, kind, flags of benchmark/train.py) of the part asked for, in order."""
    bf16_cl = ["--precision", "bf16", "--channels-last"]
    main_settings = ["--no-cudnn-benchmark"]  # main.py leaves cuDNN's benchmark mode off
    if args.part == "throughput":
        return [
            ("main_py_gpu_pace", "main_py_gpu_pace", []),
            ("fp32_gpu_pace", "ours_gpu_pace", main_settings),
            ("bf16_cl_gpu_pace", "ours_gpu_pace", bf16_cl),
            ("ddp_cost", "ddp_cost", []),
            ("bf16_cl", "ours", bf16_cl),
            # no target of their own, last in case the budget runs out
            ("main_py", "main_py", []),
            ("fp32", "ours", main_settings),
        ]
    return [
        ("bf16_cl_compile_gpu_pace", "ours_gpu_pace", bf16_cl + ["--compile"]),
        ("lessons", "lessons", []),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="throughput", choices=("throughput", "compile"))
    parser.add_argument("--imagenet-main", default="external/imagenet_main.py")
    parser.add_argument("--output-dir", default="runs/gpu_check")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224, help="ours; main.py's is 224")
    parser.add_argument("--local-batch-size", type=int, default=256)
    parser.add_argument(
        "--workers",
        type=int,
        default=min(12, (os.cpu_count() or 4) - 2),
        help="loader workers of both scripts",
    )
    parser.add_argument("--warmup", type=int, default=50, help="steps left out")
    parser.add_argument("--steps", type=int, default=200, help="steps measured: the window")
    parser.add_argument("--repeats", type=int, default=3, help="ddp_cost's interleaved windows")
    parser.add_argument("--budget-s", type=float, default=470, help="the whole call")
    parser.add_argument("--skip", default="", help="comma-separated run names to leave out")
    args = parser.parse_args(argv)
    if args.part == "throughput" and not Path(args.imagenet_main).is_file():
        print(
            f"error: --imagenet-main {args.imagenet_main} is not a file (the docstring says "
            "where to get it)",
            file=sys.stderr,
        )
        return 2
    if args.warmup < 2 * args.workers:
        print(
            f"error: --warmup {args.warmup} is less than the {2 * args.workers} batches "
            f"{args.workers} loader workers queue ahead (2 each): use --warmup {2 * args.workers}",
            file=sys.stderr,
        )
        return 2

    deadline = time.monotonic() + args.budget_s
    runs = Path(args.output_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    report = {"environment": environment(args.device), "settings": vars(args), "runs": {}}
    path = runs / f"gpu_check_{args.part}.json"

    def save():
        path.write_text(json.dumps(report, indent=2) + "\n")

    def left(cap: float) -> float:
        return min(cap, deadline - time.monotonic())

    save()
    print(json.dumps(report["environment"]), flush=True)
    for name, kind, flags in plan(args):
        if name in skip:
            continue
        if left(1e9) < 20:
            report["runs"][name] = {"error": "skipped: out of --budget-s"}
            continue
        started = time.monotonic()
        out = runs / name
        if kind.startswith("main_py"):
            row = run_main_py(args, out, left(150), gpu_pace=kind.endswith("gpu_pace"))
        elif kind.startswith("ours"):
            cap = 300 if "--compile" in flags else 150
            row = run_ours(args, flags, out, left(cap), gpu_pace=kind.endswith("gpu_pace"))
        elif kind == "ddp_cost":
            row = run_ddp_cost(args, out, left(200))
        else:
            row = {"results": run_lessons(args, out, left(150))}
        row["wall_s"] = round(time.monotonic() - started, 1)
        report["runs"][name] = row
        save()
        print(f"{name}: {json.dumps(row)}", flush=True)

    rows = report["runs"]
    reference = rows.get("main_py_gpu_pace", {}).get("images_per_s")
    table = [
        dict(row, run=name, vs_main_py=row["images_per_s"] / reference if reference else None)
        for name, row in rows.items()
        if "images_per_s" in row
    ]
    print()
    print_table(
        [
            "run",
            "images_per_s",
            "images_per_s_median",
            "vs_main_py",
            "step_ms",
            "data_wait_ms",
            "peak_memory_mib",
            "peak_reserved_mib",
            "gpu_memory_used_mib",
        ],
        table,
        {
            "vs_main_py": 2,
            "images_per_s": 0,
            "images_per_s_median": 0,
            "peak_memory_mib": 0,
            "peak_reserved_mib": 0,
            "gpu_memory_used_mib": 0,
        },
    )
    for variant, result in rows.get("ddp_cost", {}).get("variants", {}).items():
        if "cost" in result:
            print(
                f"DDP at world size 1, {variant}: {100 * result['cost']:.2f}% over no DDP "
                f"({100 * result['cost_min']:.2f} to {100 * result['cost_max']:.2f}%, "
                f"{len(result['mean_step_s'])} pairs)"
            )
    lessons = rows.get("lessons", {}).get("results", {})
    for name, result in lessons.items():
        print(f"lesson {name}: exit {result['exit_code']}, accuracy {result['eval_accuracy']}")
    report["targets"] = check_targets(rows, report["environment"].get("gpu"))
    save()
    print()
    print_table(
        ["target", "figure", "limit", "met", "anchor"],
        [
            dict(t, met={True: "met", False: "MISSED", None: "not run"}[t["met"]])
            for t in report["targets"]
        ],
        {"figure": 3},
    )
    failed = [n for n, r in rows.items() if "error" in r]
    failed += [f"lesson {n}" for n, r in lessons.items() if r["exit_code"] != 0]
    missed = [t["target"] for t in report["targets"] if t["met"] is False]
    if failed:
        print(f"failed: {', '.join(failed)}")
    if missed:
        print(f"missed: {', '.join(missed)}")
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
