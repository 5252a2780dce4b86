r"""GPU check: ResNet-50 throughput beside pytorch/examples' imagenet/main.py on one GPU, then
every lesson's main command once on the GPU. One call, a few minutes; figures to JSON.

    # imagenet/main.py of pytorch/examples at 77f55b9 (BSD-3, not part of this repository) into
    # external/, as benchmark/README.md shows, then:
    python benchmark/gpu_check.py --imagenet-main external/imagenet_main.py

Every throughput is the same measure as benchmark/benchmark.py's: the batch over the median step
time (warm-up steps left out), the data wait included. mean_images_per_s is the batch over the
mean step: it counts the steps on which the loader fell behind. imagenet/main.py prints each
batch's time with `-p 1`; it is stopped once it has printed enough of them. Ours runs one epoch
of --fake-images a little longer than its steps, so both measure the loader's steady state.
Runs, in order (a failed or timed out run is recorded and the check goes on):

    main_py            imagenet/main.py --dummy -a resnet50 -b 256, its defaults (4 loader workers,
                       fp32 with cuDNN's TF32), DDP at world size 1 as its README shows
    fp32               benchmark/train.py at equal settings (fake data 224 px, batch 256, 4 workers)
    fp32_w             the same with --workers-best loader workers (the remaining runs use them)
    bf16_cl            --precision bf16 --channels-last
    bf16_cl_noddp      the same with --no-ddp: the loop without DDP (DDP's cost at world size 1)
    bf16_cl_2          bf16_cl again, so DDP's cost is read against two DDP runs
    bf16               --precision bf16 alone
    lessons            each lesson's main command, one rank on the GPU: exit code and accuracy
    bf16_cl_compile    --compile (last: the longest to start)

Outputs in --output-dir: gpu_check.json (rewritten after every run) and one folder per run.
A dry run on CPU: --device cpu --model resnet18 --image-size 32 --batch-size 8 --warmup 2 --steps 3.
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
    ("03", "03_grad_accum/train.py --batch-size 8 --accum-steps 4"),
    ("04", "04_syncbn/train.py --batch-norm sync --batch-size 2"),
    ("05", "05_checkpointing/train.py --save-every-steps 20"),
    ("05_preempt", "05_checkpointing/preempt.py --time-limit-s 3600"),
    ("06", "06_multinode/train.py"),
    ("07", "07_metrics/train.py --patience 1"),
    ("08_gan", "08_several_models/gan.py"),
]
# after 01, whose weights it distils
LESSON_AFTER_01 = ("08", "08_several_models/train.py --teacher {runs}/01/model.pt")


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


def run_main_py(args, out: Path, timeout: float) -> dict:
    """imagenet/main.py until it has printed warmup + steps batches; images/s from the
    median batch time of the batches after the warm-up."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    cmd = [
        sys.executable,
        str(Path(args.imagenet_main).resolve()),
        "--dummy",
        "-a",
        args.model,
        "-b",
        str(args.batch_size),
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
    measured = [t for batch, t in sorted(times.items()) if batch > args.warmup]
    if len(measured) < args.steps:
        return dict(row, error=f"printed {len(times)} batches (see {out}/output.log)")
    step = statistics.median(measured[: args.steps])
    return dict(
        row,
        images_per_s=args.batch_size / step,
        mean_images_per_s=args.batch_size / statistics.mean(measured[: args.steps]),
        step_ms=1000 * step,
        gpu_memory_used_mib=memory.peak_mib,
    )


def run_ours(args, name: str, flags: list[str], out: Path, timeout: float) -> dict:
    """One torchrun of benchmark/train.py with a step profile; figures as benchmark.py's."""
    cmd = [
        *TORCHRUN_ONE_RANK,
        "benchmark/train.py",
        "--device",
        args.device,
        "--model",
        args.model,
        "--dataset",
        "fake",
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--weight-decay",
        "0.0001",  # imagenet/main.py's default
        # one epoch longer than the steps run: the loader's steady state, as main.py's 1.28M
        "--fake-images",
        str(args.batch_size * (args.warmup + args.steps + 2)),
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
    row = {"command": " ".join(cmd[3:])}
    out.mkdir(parents=True, exist_ok=True)
    with MemoryPoller() as memory, (out / "output.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return dict(row, error=f"timed out after {timeout:.0f} s")
    if code != 0:
        return dict(row, error=f"exit code {code}: {last_error(out / 'output.log')}")
    summary = json.loads((out / "summary.json").read_text())
    return dict(
        row,
        **figures(summary),
        mean_images_per_s=summary["global_batch_size"] / summary["profile"]["mean_step_s"],
        data_wait_fraction=summary["profile"]["median_s"]["data_wait"]
        / summary["profile"]["median_s"]["step"],
        gpu_memory_used_mib=memory.peak_mib,
    )


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--imagenet-main", default="external/imagenet_main.py")
    parser.add_argument("--output-dir", default="runs/gpu_check")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224, help="ours; main.py's is 224")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="imagenet/main.py's default")
    parser.add_argument("--workers-best", type=int, default=min(12, (os.cpu_count() or 4) - 2))
    parser.add_argument("--warmup", type=int, default=10, help="steps left out")
    parser.add_argument("--steps", type=int, default=30, help="steps measured")
    parser.add_argument("--budget-s", type=float, default=480, help="the whole check")
    parser.add_argument("--skip", default="", help="comma-separated run names to leave out")
    args = parser.parse_args(argv)
    if not Path(args.imagenet_main).is_file():
        print(
            f"error: --imagenet-main {args.imagenet_main} is not a file (the docstring says "
            "where to get it)",
            file=sys.stderr,
        )
        return 2

    deadline = time.monotonic() + args.budget_s
    runs = Path(args.output_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    best = ["--num-workers", str(args.workers_best)]
    bf16_cl = best + ["--precision", "bf16", "--channels-last"]
    ours = [  # the most telling first, in case the budget runs out
        ("fp32", ["--num-workers", str(args.workers)]),
        ("fp32_w", best),
        ("bf16_cl", bf16_cl),
        ("bf16_cl_noddp", bf16_cl + ["--no-ddp"]),
        ("bf16_cl_2", bf16_cl),
        ("bf16", best + ["--precision", "bf16"]),
    ]
    compiled = ("bf16_cl_compile", bf16_cl + ["--compile"])
    skip = set(filter(None, args.skip.split(",")))
    report = {"environment": environment(args.device), "settings": vars(args), "runs": {}}

    def save():
        (runs / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")

    def left(cap: float) -> float:
        return min(cap, deadline - time.monotonic())

    save()
    print(json.dumps(report["environment"]), flush=True)
    plan = [("main_py", None)] + ours + [("lessons", None), compiled]
    for name, flags in plan:
        if name in skip:
            continue
        if left(1e9) < 20:
            report["runs"][name] = {"error": "skipped: out of --budget-s"}
            continue
        started = time.monotonic()
        if name == "main_py":
            row = run_main_py(args, runs / name, left(150))
        elif name == "lessons":
            row = {"results": run_lessons(args, runs / name, left(150))}
        else:
            row = run_ours(args, name, flags, runs / name, left(300 if "compile" in name else 150))
        row["wall_s"] = round(time.monotonic() - started, 1)
        report["runs"][name] = row
        save()
        print(f"{name}: {json.dumps(row)}", flush=True)

    rows = report["runs"]
    reference = rows.get("main_py", {}).get("images_per_s")
    table = []
    for name, row in rows.items():
        if name == "lessons" or "images_per_s" not in row:
            continue
        table.append(
            dict(
                row,
                run=name,
                vs_main_py=row["images_per_s"] / reference if reference else None,
                vs_fp32=row["images_per_s"] / rows["fp32_w"]["images_per_s"]
                if "images_per_s" in rows.get("fp32_w", {})
                else None,
            )
        )
    ddp = [rows.get(n, {}).get("step_ms") for n in ("bf16_cl", "bf16_cl_2")]
    no_ddp = rows.get("bf16_cl_noddp", {}).get("step_ms")
    if all(ddp) and no_ddp:
        report["ddp_overhead_world_size_1"] = statistics.mean(ddp) / no_ddp - 1
    save()
    print()
    print_table(
        [
            "run",
            "images_per_s",
            "vs_main_py",
            "vs_fp32",
            "mean_images_per_s",
            "step_ms",
            "data_wait_ms",
            "peak_memory_mib",
            "gpu_memory_used_mib",
        ],
        table,
        {
            "vs_main_py": 2,
            "vs_fp32": 2,
            "images_per_s": 0,
            "mean_images_per_s": 0,
            "peak_memory_mib": 0,
        },
    )
    if "ddp_overhead_world_size_1" in report:
        print(f"DDP overhead at world size 1: {100 * report['ddp_overhead_world_size_1']:.1f}%")
    lessons = rows.get("lessons", {}).get("results", {})
    for name, result in lessons.items():
        print(f"lesson {name}: exit {result['exit_code']}, accuracy {result['eval_accuracy']}")
    failed = [n for n, r in rows.items() if "error" in r]
    failed += [f"lesson {n}" for n, r in lessons.items() if r["exit_code"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
