r"""What DDP will cost at a world size you do not have yet, known from one CPU before the job.

    python benchmark/scale.py comm --model resnet50 --world-sizes 8,1024,16384
    python benchmark/scale.py dryrun --world-size 1024 --ranks 0,1023 01_basic_ddp/train.py
    python benchmark/scale.py rendezvous --clients 16,64 --master-addr 127.0.0.1
    python benchmark/scale.py checkpoint --model resnet50 --world-sizes 64,1024

comm        DDP built and stepped at each world size in one process, on torch's fake process
            group: the collectives and bytes at construction and per step, the bucket layout,
            and each all-reduce's time predicted for a named fabric by NCCL's own cost model.
dryrun      A torchrun script run as rank r of N on the fake process group: what breaks at N
            (data too small, a batch that no longer divides), peak memory per rank.
rendezvous  A TCPStore server on loopback and N forked clients (connect, set, add, wait, get),
            the kernel's listen-queue overflows, and the reverse lookup of the master's address.
checkpoint  torch.save against torch.distributed.checkpoint (DCP) for the model and optimizer,
            DCP's planning at N ranks, and the checkpoint interval for a failure rate.

Each prints a short table, or with --json the same as JSON. CPU only; torch and the standard
library (torchvision for the ResNets). benchmark/README.md, "Before a large job".
"""

import argparse
import contextlib
import json
import math
import os
import pickle
import resource
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import MODELS
from common.models import build_model

MB = 1e6


# ---- the fake process group -------------------------------------------------------------------


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake backend: every collective returns at once and leaves its tensors as they are,
    so one process can be any rank of any world. It is private (a Python class since torch 2.1,
    in C++ since 2.3), so this is the one place that imports it."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:
        bad_input(f"this torch ({torch.__version__}) has no fake process group: {error}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    check_fake_semantics()


def check_fake_semantics() -> None:
    """Fail loudly where a torch changes what this script relies on: the fake group reports the
    world it was given, and an all-reduce returns this rank's own numbers."""
    probe = torch.tensor([1.0, 2.0])
    dist.all_reduce(probe)
    if dist.get_backend() != "fake" or probe.tolist() != [1.0, 2.0]:
        raise RuntimeError(
            f"torch {torch.__version__}'s fake process group changed: backend "
            f"{dist.get_backend()}, all_reduce([1, 2]) gave {probe.tolist()}; "
            "benchmark/scale.py needs all_reduce to leave tensors as they are"
        )


def bad_input(message: str):
    """Bad input: one line and exit code 2, as argparse does."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def local_passthrough_hook(state, bucket):
    """A comm hook that hands DDP its bucket back: DDP's built-in all-reduce fails in backward on
    the fake group (its future holds no tensor: "expected the hook result is either a Tensor or a
    TensorList found None", torch 2.14.1)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# ---- comm: what DDP sends ---------------------------------------------------------------------


class CollectiveRecorder(TorchDispatchMode):
    """Records each c10d collective torch dispatches (DDP's own from C++ included): its name and
    the bytes each rank puts in, under the phase set in `phase`."""

    def __init__(self):
        super().__init__()
        self.phase = "construction"
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d."):
            # all-gather and reduce-scatter: the input is the second argument
            sent = args[1] if "allgather" in name or "reduce_scatter" in name else args[0]
            nbytes = sum(t.nbytes for t in flatten_tensors(sent))
            self.calls.append({"phase": self.phase, "op": name[5:].rstrip("_"), "bytes": nbytes})
        return func(*args, **(kwargs or {}))


def flatten_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flatten_tensors(item)]
    return []


def recording_hook(compress: bool):
    """A comm hook that all-reduces each bucket itself, so the recorder sees it (in bf16 with
    `compress`, as torch's bf16_compress_hook sends it), and notes the bucket's layout."""

    def hook(buckets: list, bucket):
        buffer = bucket.buffer()
        sent = buffer.to(torch.bfloat16) if compress else buffer
        dist.all_reduce(sent)
        buckets.append(
            {"index": bucket.index(), "parameters": len(bucket.parameters()), "bytes": sent.nbytes}
        )
        return local_passthrough_hook(None, bucket)

    return hook


def record_ddp(args, world_size: int) -> dict:
    """DDP built and stepped as rank 0 of `world_size` on the fake group."""
    init_fake_process_group(0, world_size)
    try:
        return record_steps(args)
    finally:
        dist.destroy_process_group()


def record_steps(args) -> dict:
    """Build DDP on the process group there is and step it: every collective of construction
    and of each step, and each step's buckets. The same on a real group (tests/test_scale.py)."""
    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes, 3, args.image_size)
    recorder = CollectiveRecorder()
    options = {"broadcast_buffers": False} if args.no_broadcast_buffers else {}
    if args.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = args.bucket_cap_mb
    with recorder:
        ddp_model = DDP(model, **options)
    buckets: list[dict] = []
    ddp_model.register_comm_hook(buckets, recording_hook(args.bf16_compress))
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.num_classes, (args.batch_size,))
    steps = []
    for step in range(1, args.steps + 1):
        buckets.clear()
        with recorder:
            recorder.phase = f"step {step} forward"
            loss = F.cross_entropy(ddp_model(images), labels)
            recorder.phase = f"step {step} backward"
            loss.backward()
        ddp_model.zero_grad(set_to_none=True)
        steps.append(sorted(buckets, key=lambda b: b["index"]))
    parameters = sum(p.numel() for p in model.parameters())
    del ddp_model  # DDP holds the process group
    return {
        "world_size": dist.get_world_size(),
        "parameters": parameters,
        "calls": recorder.calls,
        "buckets": steps,
    }


def phase_summary(calls: list[dict], phase: str) -> list[dict]:
    """The collectives of one phase, in order: op and bytes."""
    return [{"op": c["op"], "bytes": c["bytes"]} for c in calls if c["phase"] == phase]


@dataclass(frozen=True)
class Fabric:
    """A node type and its network, as bus bandwidth (nccl-tests' busbw, doc/PERFORMANCE.md):
    inside a node, and across nodes for the node's NICs together (a ring across nodes runs at the
    whole node's network bandwidth: NVIDIA/nccl-tests#119)."""

    gpus_per_node: int
    intra_busbw_gbs: float
    inter_busbw_gbs: float
    source: str


# Measured all-reduce bus bandwidths where published; "line" marks a line rate, "est." an estimate.
FABRICS = {
    "h100-ndr": Fabric(
        8,
        370,
        384,
        "8 H100 SXM, 8 NDR 400G NICs: 370 GB/s in a node "
        "(NVIDIA/nccl-tests#212), 46-48 GB/s a NIC across nodes (#290)",
    ),
    "h100-ndr-1nic": Fabric(8, 370, 48, "as h100-ndr with one NDR 400G NIC a node"),
    "a100-hdr": Fabric(
        8,
        230,
        192,
        "8 A100 SXM, 8 HDR 200G NICs: 230 GB/s in a node "
        "(NVIDIA/nccl#527), 192 GB/s across nodes (NVIDIA/nccl#812)",
    ),
    "perlmutter": Fabric(
        4,
        230,
        96,
        "NERSC Perlmutter: 4 A100, 4 Slingshot-11 200G NICs "
        "(docs.nersc.gov), about 24 GB/s a NIC (NVIDIA/nccl#1272); in-node est.",
    ),
    "polaris": Fabric(
        4,
        230,
        48,
        "ALCF Polaris: 4 A100, 2 Slingshot-11 200G NICs "
        "(docs.alcf.anl.gov), about 24 GB/s a NIC; in-node est.",
    ),
    "ethernet-100g": Fabric(
        8,
        370,
        12,
        "one 100 GbE NIC a node: 12 GB/s "
        "(NVIDIA/nccl-tests#29, NCCL's NET_BW); in-node as h100-ndr",
    ),
}

# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, 2.30.7), Simple protocol, microseconds:
# a base latency per operation, a latency per step over NVLink and over the network.
BASE_LATENCY_US = 8.4
NVLINK_STEP_US = {"ring": 3.4, "tree": 4.0}
NET_STEP_US = 14.0
RING_PLATEAU = 1.4  # a ring across nodes: its latency x 1.4 (Hopper; 1.9 before)
TREE_BANDWIDTH = 0.92  # a tree reaches 92% of the bus bandwidth


def allreduce_us(nbytes: float, world_size: int, fabric: Fabric, algorithm: str) -> float:
    """NCCL's predicted time of one all-reduce of `nbytes`: latency + bytes / bandwidth, where a
    ring moves 2(N-1)/N of the bytes in 2(N-1) steps and a tree climbs and descends log2(nodes)
    network hops and a chain of the node's GPUs."""
    if world_size == 1:
        return 0.0
    per_node = min(world_size, fabric.gpus_per_node)
    nodes = math.ceil(world_size / fabric.gpus_per_node)
    busbw = (
        fabric.intra_busbw_gbs
        if nodes == 1
        else min(fabric.intra_busbw_gbs, fabric.inter_busbw_gbs)
    )
    if algorithm == "ring":
        steps = 2 * (world_size - 1)
        network_steps = 2 * (nodes - 1)
        latency = (
            BASE_LATENCY_US
            + (steps - network_steps) * NVLINK_STEP_US["ring"]
            + network_steps * NET_STEP_US
        )
        if nodes > 1:
            latency *= RING_PLATEAU
        algorithm_bandwidth = busbw * world_size / steps
    else:
        hops = (per_node - 1) * NVLINK_STEP_US["tree"] + int(math.log2(nodes)) * NET_STEP_US
        latency = BASE_LATENCY_US + 2 * hops
        algorithm_bandwidth = busbw * TREE_BANDWIDTH * 0.5
    return latency + nbytes / (algorithm_bandwidth * 1e3)  # GB/s = 1e3 bytes per microsecond


def predict(bucket_bytes: list[int], world_size: int, fabric: Fabric, backward_ms: float | None):
    """Per step: NCCL's faster algorithm for each bucket, the total, and the time left exposed
    after backward. DDP starts a bucket's all-reduce as soon as its gradients are ready, so all
    but the last bucket can hide behind backward; the last is always exposed."""
    per_bucket = [
        min(
            allreduce_us(b, world_size, fabric, "ring"), allreduce_us(b, world_size, fabric, "tree")
        )
        for b in bucket_bytes
    ]
    ring_ms = sum(allreduce_us(b, world_size, fabric, "ring") for b in bucket_bytes) / 1e3
    total_ms = sum(per_bucket) / 1e3
    last_ms = per_bucket[-1] / 1e3 if per_bucket else 0.0
    exposed = None if backward_ms is None else max(last_ms, total_ms - backward_ms)
    return {
        "total_ms": total_ms,
        "ring_only_ms": ring_ms,
        "last_bucket_ms": last_ms,
        "exposed_ms": exposed,
    }


def comm(args) -> dict:
    runs = [record_ddp(args, n) for n in args.world_sizes]
    first = runs[0]
    steady = first["buckets"][-1]
    bucket_bytes = [
        b["bytes"] for b in reversed(steady)
    ]  # ready last: bucket 0 holds the last layers
    result = {
        "model": args.model,
        "parameters": first["parameters"],
        "settings": {
            "bucket_cap_mb": args.bucket_cap_mb,
            "broadcast_buffers": not args.no_broadcast_buffers,
            "bf16_compress": args.bf16_compress,
        },
        "construction": phase_summary(first["calls"], "construction"),
        "steps": [
            {
                "step": step,
                "forward": phase_summary(first["calls"], f"step {step} forward"),
                "all_reduces": [b["bytes"] for b in first["buckets"][step - 1]],
                "buckets": first["buckets"][step - 1],
            }
            for step in range(1, args.steps + 1)
        ],
        "same_at_every_world_size": all(
            run["calls"] == first["calls"] and run["buckets"] == first["buckets"] for run in runs
        ),
        "world_sizes": args.world_sizes,
        "predicted": {
            name: {
                str(n): predict(bucket_bytes, n, FABRICS[name], args.backward_ms)
                for n in args.world_sizes
            }
            for name in args.fabrics
        },
        "fabrics": {name: asdict(FABRICS[name]) for name in args.fabrics},
    }
    return result


def size(nbytes: float) -> str:
    if nbytes >= 0.1 * MB:
        return f"{nbytes / MB:.1f} MB"
    return f"{nbytes / 1e3:.1f} kB" if nbytes >= 100 else f"{nbytes:.0f} B"


def collectives(calls: list[dict]) -> str:
    """`calls` by op, in order of first use: "2 broadcast 213.0 kB"."""
    ops = {}
    for call in calls:
        count, nbytes = ops.get(call["op"], (0, 0))
        ops[call["op"]] = (count + 1, nbytes + call["bytes"])
    return ", ".join(f"{n} {op} {size(b)}" for op, (n, b) in ops.items()) or "none"


def print_comm(result: dict) -> None:
    settings = ", ".join(f"{k} {v}" for k, v in result["settings"].items())
    print(f"{result['model']}: {result['parameters']:,} parameters; {settings}")
    print(f"world sizes {', '.join(map(str, result['world_sizes']))} on the fake process group")
    print(f"  construction: {collectives(result['construction'])}")
    for step in result["steps"]:
        sizes = " + ".join(f"{b / MB:.2f}" for b in step["all_reduces"])
        print(
            f"  step {step['step']}: forward {collectives(step['forward'])}; backward "
            f"{len(step['all_reduces'])} all-reduce {size(sum(step['all_reduces']))} ({sizes})"
        )
    same = "yes" if result["same_at_every_world_size"] else "NO"
    print(f"  the same collectives and bytes at every world size: {same}")
    sizes = result["world_sizes"]
    print(
        "\npredicted all-reduce time a step (last step's buckets, NCCL's faster of ring and tree)"
    )
    print(
        f"  {'GPUs':<15}" + "".join(f"{n:>12,}" for n in sizes) + f"   ring only at {sizes[-1]:,}"
    )
    for name, by_size in result["predicted"].items():
        cells = "".join(f"{by_size[str(n)]['total_ms']:>9.2f} ms" for n in sizes)
        print(f"  {name:<15}{cells}   {by_size[str(sizes[-1])]['ring_only_ms']:.1f} ms")
        if by_size[str(sizes[-1])]["exposed_ms"] is not None:
            cells = "".join(f"{by_size[str(n)]['exposed_ms']:>9.2f} ms" for n in sizes)
            print(f"  {'  exposed':<15}{cells}")
    for name, fabric in result["fabrics"].items():
        print(f"  {name}: {fabric['source']}")


# ---- dryrun: a script as rank r of N ----------------------------------------------------------

DATA_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce_scatter_tensor", "all_to_all_single", "gather",
    "gather_object", "scatter", "reduce",
)  # fmt: skip


def run_as_fake_rank() -> None:
    """In a rank's own process (started by `dryrun`): torchrun's environment is set; start the
    script with init_process_group on the fake group, DDP with a passthrough hook, and a note of
    the last collective whose result the script read, in the file SCALE_DRYRUN_RESULT names."""
    script, *script_args = sys.argv[1:]
    result_file = Path(os.environ["SCALE_DRYRUN_RESULT"])
    last = {"collective": None, "where": None}
    real_init = dist.init_process_group

    def fake_init(*args, **kwargs):
        # the script's backend, address and timeout do not matter on the fake group
        dist.init_process_group = real_init
        init_fake_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        dist.init_process_group = fake_init
        last.update(collective=None, where=None)  # the probe's all-reduce is not the script's

    def noting(name, function):
        def collective(*args, **kwargs):
            frame = sys._getframe(1)
            last.update(collective=name, where=f"{frame.f_code.co_filename}:{frame.f_lineno}")
            return function(*args, **kwargs)

        return collective

    dist.init_process_group = fake_init
    for name in DATA_COLLECTIVES:
        setattr(dist, name, noting(name, getattr(dist, name)))
    real_ddp_init = DDP.__init__

    def ddp_init(self, *args, **kwargs):
        real_ddp_init(self, *args, **kwargs)
        real_register(self, None, local_passthrough_hook)

    real_register = DDP.register_comm_hook
    DDP.__init__ = ddp_init
    DDP.register_comm_hook = lambda self, state, hook: None  # the script's hook: not on fake
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    outcome = {"outcome": "finished", "error": None}
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if code:
            outcome.update(outcome=f"exit {code}", error=str(stop.code))
    except BaseException as error:  # every failure is the result
        outcome.update(outcome="failed", error=f"{type(error).__name__}: {error}")
    outcome.update(last, peak_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    result_file.write_text(json.dumps(outcome))
    sys.exit(0)


def dryrun(args) -> dict:
    script = Path(args.script).resolve()
    if not script.is_file():
        bad_input(f"no script {args.script}")
    ranks = args.ranks or sorted({0, args.world_size - 1})
    if any(not 0 <= r < args.world_size for r in ranks):
        bad_input(f"--ranks {ranks} must lie in 0..{args.world_size - 1}")
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="scale-dryrun-"))
    try:
        for rank in ranks:
            folder = workdir / f"rank-{rank}"
            folder.mkdir()
            results.append(dryrun_rank(args, script, rank, folder))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "script": str(script),
        "world_size": args.world_size,
        "nproc_per_node": args.nproc_per_node,
        "ranks": results,
    }


def dryrun_rank(args, script: Path, rank: int, folder: Path) -> dict:
    """One rank in its own process and its own empty folder (what the script writes stays
    there), with the environment torchrun gives its workers."""
    local_world = min(args.nproc_per_node, args.world_size)
    env = os.environ | {
        "RANK": str(rank),
        "WORLD_SIZE": str(args.world_size),
        "LOCAL_RANK": str(rank % local_world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(rank // local_world),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(args.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "scale-dryrun",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "SCALE_DRYRUN_RESULT": str(folder / "result.json"),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
        ),
    }
    bootstrap = "import scale; scale.run_as_fake_rank()"
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", bootstrap, str(script), *args.script_args],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    seconds = time.perf_counter() - start
    result_file = folder / "result.json"
    if result_file.exists():
        result = json.loads(result_file.read_text())
    else:
        result = {
            "outcome": f"exit {process.returncode}",
            "error": output.strip()[-500:],
            "collective": None,
            "where": None,
            "peak_mib": None,
        }
    if result["outcome"].startswith("exit") and output.strip():
        result["error"] = output.strip().splitlines()[-1]  # the script's own error line
    failed = result["outcome"] != "finished"
    # a collective's result on the fake group is this rank's own numbers, not the world's
    result["fake_values"] = failed and result["collective"] is not None
    return {
        "rank": rank,
        **result,
        "seconds": round(seconds, 1),
        "output_tail": output.strip().splitlines()[-5:],
    }


def shown(path: str) -> str:
    """`path` from the current folder where it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def print_dryrun(result: dict) -> None:
    print(
        f"{shown(result['script'])} as ranks of {result['world_size']} "
        f"({result['nproc_per_node']} a node), on the fake process group"
    )
    for rank in result["ranks"]:
        print(
            f"  rank {rank['rank']}: {rank['outcome']} in {rank['seconds']} s, "
            f"peak memory {rank['peak_mib']} MiB"
        )
        if rank["outcome"] != "finished":
            print(f"    {rank['error']}")
            if rank["fake_values"]:
                where = shown(rank["where"])
                print(
                    f"    after {rank['collective']} at {where}: on the fake group it returns "
                    "this rank's own values, so this may not happen in the real job"
                )
            else:
                print("    before any collective returned data: it happens in the real job too")


# ---- rendezvous: the store under N clients ----------------------------------------------------


def listen_overflows() -> int | None:
    """TcpExt ListenOverflows: connections the kernel dropped because a listen queue was full."""
    with contextlib.suppress(OSError, ValueError):
        lines = Path("/proc/net/netstat").read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            if names.startswith("TcpExt:"):
                return int(dict(zip(names.split(), values.split()))["ListenOverflows"])
    return None


# What c10d prints when a reverse lookup fails (torch/csrc/distributed/c10d/socket.cpp)
FAILED_LOOKUP = "The hostname of the client socket cannot be retrieved"


def client_zygote(timeout_s: float) -> tuple[int, int, int]:
    """A process forked before any store exists, which forks the clients on request. Forking
    from the process that runs the store's server would copy a lock its thread may hold (the
    resolver's, during the lookup it does per client) and hang the client. Returns its pid and
    the pipes to and from it."""
    zygote_reads, parent_writes = os.pipe()
    parent_reads, zygote_writes = os.pipe()
    pid = os.fork()
    if pid:
        os.close(zygote_reads)
        os.close(zygote_writes)
        return pid, parent_writes, parent_reads
    os.close(parent_writes)
    os.close(parent_reads)
    with os.fdopen(zygote_reads) as requests, os.fdopen(zygote_writes, "w") as answers:
        for request in requests:  # "port clients log"
            port, clients, log = request.split()
            with open(log, "w") as errors:  # the clients' stderr: torch's warnings
                pids = [
                    fork_client(int(port), index, int(clients), timeout_s, errors.fileno())
                    for index in range(int(clients))
                ]
            failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in pids)
            answers.write(f"{failed}\n")
            answers.flush()
    os._exit(0)  # lint: allow[os-exit] a forked child: not its parent's atexit or buffers


def fork_client(port: int, index: int, clients: int, timeout_s: float, stderr: int) -> int:
    """A client that connects, sets its key, adds 1, waits for the server's go, and reads its
    neighbour's key: a rendezvous's traffic."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(stderr, 2)
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        client.set(f"rank-{index}", str(index))
        client.add("arrived", 1)
        client.wait(["go"])
        neighbour = (index + 1) % clients
        code = 0 if client.get(f"rank-{neighbour}") == str(neighbour).encode() else 1
    finally:
        os._exit(code)  # lint: allow[os-exit] a forked child: no cleanup of the parent's state


def store_clients(zygote: tuple[int, int, int], clients: int, timeout_s: float) -> dict:
    """A TCPStore server on loopback and `clients` clients forked by the zygote."""
    _, requests, answers = zygote
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    overflows = listen_overflows()
    start = time.perf_counter()
    log = Path(tempfile.mkdtemp(prefix="scale-rendezvous-")) / "clients.err"
    os.write(requests, f"{server.port} {clients} {log}\n".encode())
    while server.add("arrived", 0) < clients and time.perf_counter() - start < timeout_s:
        time.sleep(0.005)
    arrived_s = time.perf_counter() - start
    server.set("go", "1")
    failed = int(os.read(answers, 64).decode().split()[0])
    total_s = time.perf_counter() - start
    after = listen_overflows()
    del server
    failed_lookups = log.read_text().count(FAILED_LOOKUP)
    shutil.rmtree(log.parent)
    return {
        "clients": clients,
        "all_arrived_s": round(arrived_s, 3),
        "total_s": round(total_s, 3),
        "ms_per_client": round(1e3 * total_s / clients, 3),
        "failed_clients": failed,
        "failed_lookups": failed_lookups,
        "listen_overflows": None if overflows is None else after - overflows,
    }


def reverse_lookup_ms(address: str) -> tuple[float, str]:
    """The time of the reverse lookup c10d's store does for each client it accepts
    (getnameinfo() without NI_NUMERICHOST, torch/csrc/distributed/c10d/socket.cpp)."""
    start = time.perf_counter()
    try:
        name = socket.getnameinfo((address, 0), socket.NI_NUMERICSERV)[0]
    except OSError as error:
        name = f"failed: {error}"
    return 1e3 * (time.perf_counter() - start), name


SLOW_LOOKUP_MS = 100.0
LOOKUP_BURST = 64


def lookup_burst_ms(address: str, count: int = LOOKUP_BURST) -> float:
    """The slowest of `count` reverse lookups of `address` made at once, as a job's ranks make
    them when they connect together: a resolver that answers one fast may drop a burst."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        return max(pool.map(lambda _: reverse_lookup_ms(address)[0], range(count)))


def rendezvous(args) -> dict:
    somaxconn = Path("/proc/sys/net/core/somaxconn")
    master = args.master_addr or socket.gethostbyname(socket.gethostname())
    # c10d connects over IPv6 where it can, so an IPv4 master is seen as ::ffff:a.b.c.d
    addresses = [master] + ([f"::ffff:{master}"] if "." in master else [])
    lookups = {address: reverse_lookup_ms(address) for address in addresses}
    burst_ms = lookup_burst_ms(addresses[-1])
    zygote = client_zygote(args.timeout_s)
    try:
        runs = [store_clients(zygote, n, args.timeout_s) for n in args.clients]
    finally:
        os.close(zygote[1])  # the zygote's end of input: it exits
        os.waitpid(zygote[0], 0)
        os.close(zygote[2])
    slowest = max([burst_ms] + [ms for ms, _ in lookups.values()])
    return {
        "somaxconn": int(somaxconn.read_text()) if somaxconn.exists() else None,
        "runs": runs,
        "reverse_lookups": {
            a: {"ms": round(ms, 2), "name": name} for a, (ms, name) in lookups.items()
        },
        "lookup_burst": {
            "address": addresses[-1],
            "count": LOOKUP_BURST,
            "slowest_ms": round(burst_ms, 1),
        },
        "slow_lookup": slowest > SLOW_LOOKUP_MS or any(run["failed_lookups"] for run in runs),
    }


def print_rendezvous(result: dict) -> None:
    print("a TCPStore on loopback, N forked clients: connect, set, add, wait, get")
    print(
        f"  {'clients':>8} {'all arrived':>12} {'all done':>10} {'per client':>11} "
        f"{'failed':>7} {'failed lookups':>15} {'listen overflows':>17}"
    )
    for run in result["runs"]:
        overflows = "?" if run["listen_overflows"] is None else run["listen_overflows"]
        print(
            f"  {run['clients']:>8} {run['all_arrived_s']:>10.2f} s {run['total_s']:>8.2f} s "
            f"{run['ms_per_client']:>8.2f} ms {run['failed_clients']:>7} "
            f"{run['failed_lookups']:>15} {overflows:>17}"
        )
    if len(result["runs"]) > 1:
        first, last = result["runs"][0], result["runs"][-1]
        print(
            f"  {last['clients'] / first['clients']:g} times the clients took "
            f"{last['total_s'] / first['total_s']:.1f} times as long"
        )
    print(f"  listen backlog: net.core.somaxconn = {result['somaxconn']} (torch asks for the most)")
    for address, lookup in result["reverse_lookups"].items():
        print(f"  reverse lookup of {address}: {lookup['ms']:.1f} ms ({lookup['name']})")
    burst = result["lookup_burst"]
    print(
        f"  {burst['count']} reverse lookups of {burst['address']} at once: the slowest "
        f"{burst['slowest_ms']:.1f} ms"
    )
    if result["slow_lookup"]:
        print(
            f"  warning: a reverse lookup took over {SLOW_LOOKUP_MS:.0f} ms or failed, and c10d "
            "looks up every peer as it connects: add /etc/hosts lines for the nodes, also as "
            '::ffff:a.b.c.d, or ask the site for fast reverse DNS (debugging/README.md, "The '
            'hostname of the client socket cannot be retrieved")'
        )


# ---- checkpoint: bytes, seconds, planning, interval -------------------------------------------

# Llama 3's training: 419 unexpected interruptions in 54 days on 16,384 GPUs
# ("The Llama 3 Herd of Models", 2024, section 3.3.4).
LLAMA3_FAILURES_PER_GPU_DAY = 419 / (54 * 16384)


def checkpoint_interval(save_s: float, mtbf_s: float) -> dict:
    """Young's optimum (Young 1974; Daly 2006): save every sqrt(2 x save time x MTBF); the time
    lost is then the saves plus, on average, half an interval of work redone per failure."""
    interval = math.sqrt(2 * save_s * mtbf_s)
    return {"interval_s": interval, "overhead": save_s / interval + interval / (2 * mtbf_s)}


def folder_bytes(folder: Path) -> tuple[int, int]:
    files = [f for f in folder.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), len(files)


def checkpoint(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = build_model(args.model, args.num_classes, 3, args.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # the momentum buffers exist from the first step on
    folder = Path(tempfile.mkdtemp(prefix="scale-checkpoint-"))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        save_s = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                folder / "checkpoint.pt",
            )
            save_s.append(time.perf_counter() - start)
        torch_save_bytes = (folder / "checkpoint.pt").stat().st_size
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp_s = []
        for repeat in range(args.repeats):
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=folder / f"dcp-{repeat}")
            dcp_s.append(time.perf_counter() - start)
        dcp_bytes, dcp_files = folder_bytes(folder / "dcp-0")
        # DCP's planning at N ranks: every rank's local plan (DDP ranks hold the same state, so
        # the same plan) pickled to the coordinator, which deduplicates them into one writer per
        # tensor
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        local = planner.create_local_plan()
        plan_items = len(local.items)
        local_plan = pickle.dumps(local)
        planning = []
        for world_size in args.world_sizes:
            plans = [pickle.loads(local_plan) for _ in range(world_size)]
            start = time.perf_counter()
            global_plans, _ = planner.create_global_plan(plans)
            planning.append(
                {
                    "world_size": world_size,
                    "plans_gathered_bytes": len(local_plan) * world_size,
                    "global_plan_s": round(time.perf_counter() - start, 2),
                    "writers": sum(1 for plan in global_plans if plan.items),
                }
            )
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    failures_per_day = args.failures_per_gpu_day
    intervals = []
    save_seconds = args.save_s if args.save_s is not None else min(save_s)
    for world_size in args.world_sizes:
        mtbf_s = 86400 / (failures_per_day * world_size)
        intervals.append(
            {
                "world_size": world_size,
                "mtbf_h": round(mtbf_s / 3600, 1),
                **checkpoint_interval(save_seconds, mtbf_s),
            }
        )
    return {
        "model": args.model,
        "torch_save": {"bytes": torch_save_bytes, "seconds": sorted(save_s)},
        "dcp": {"bytes": dcp_bytes, "files": dcp_files, "seconds": sorted(dcp_s)},
        "planning": planning,
        "plan_items": plan_items,
        "failures_per_gpu_day": failures_per_day,
        "save_s": save_seconds,
        "intervals": intervals,
    }


def print_checkpoint(result: dict) -> None:
    save, dcp_run = result["torch_save"], result["dcp"]
    print(f"{result['model']} with SGD momentum, one process")
    print(
        f"  torch.save: {save['bytes'] / MB:.1f} MB in "
        f"{save['seconds'][0]:.2f}-{save['seconds'][-1]:.2f} s"
    )
    print(
        f"  DCP:        {dcp_run['bytes'] / MB:.1f} MB in {dcp_run['files']} files in "
        f"{dcp_run['seconds'][0]:.2f}-{dcp_run['seconds'][-1]:.2f} s"
    )
    print("  DCP's planning (every rank's plan gathered to the coordinator):")
    for plan in result["planning"]:
        print(
            f"    {plan['world_size']:>6} ranks: {size(plan['plans_gathered_bytes'])} of plans, "
            f"global plan in {plan['global_plan_s']:.2f} s, {plan['writers']} ranks write"
        )
    print(
        f"  save every (Young/Daly), saves of {result['save_s']:.2f} s, "
        f"{result['failures_per_gpu_day']:.2e} failures a GPU-day:"
    )
    for row in result["intervals"]:
        print(
            f"    {row['world_size']:>6} GPUs: a failure every {row['mtbf_h']:g} h, save every "
            f"{row['interval_s'] / 60:.1f} min, {100 * row['overhead']:.2f}% of the time lost"
        )


# ---- the command line -------------------------------------------------------------------------


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return values


def rank_list(text: str) -> list[int]:
    if not all(v.strip().isdigit() for v in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated ranks (0, 1, ...)")
    return [int(v) for v in text.split(",")]


def fabric_names(text: str) -> list[str]:
    names = text.split(",")
    if unknown := [n for n in names if n not in FABRICS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(FABRICS)}")
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
        return sub

    def model_options(sub):
        sub.add_argument("--model", choices=MODELS, default="resnet50")
        sub.add_argument("--num-classes", type=int, default=1000)
        sub.add_argument(
            "--image-size",
            type=int,
            default=224,
            help="64 or more: ImageNet's stem; under 64: CIFAR's",
        )

    sub = command("comm", "what DDP sends at each world size, and how long it takes")
    model_options(sub)
    sub.add_argument("--world-sizes", type=positive_ints, default=[8, 1024, 16384])
    sub.add_argument("--batch-size", type=int, default=2, help="a rank's batch (bytes: any)")
    sub.add_argument("--steps", type=int, default=3, help="DDP rebuilds its buckets after step 1")
    sub.add_argument("--bucket-cap-mb", type=float, help="DDP's bucket_cap_mb (default: DDP's)")
    sub.add_argument("--no-broadcast-buffers", action="store_true")
    sub.add_argument(
        "--bf16-compress",
        action="store_true",
        help="gradients sent in bf16, as torch's bf16_compress_hook does",
    )
    sub.add_argument("--fabrics", type=fabric_names, default=list(FABRICS))
    sub.add_argument(
        "--backward-ms",
        type=float,
        help="a step's backward on one GPU (benchmark/ddp_cost.py --mode time)",
    )

    sub = command("dryrun", "run a torchrun script as ranks of N on the fake process group")
    sub.add_argument("--world-size", type=int, required=True)
    sub.add_argument("--ranks", type=rank_list, help="default: 0 and the last")
    sub.add_argument("--nproc-per-node", type=int, default=4)
    sub.add_argument("--timeout-s", type=float, default=300.0)
    sub.add_argument("script")
    sub.add_argument("script_args", nargs=argparse.REMAINDER)

    sub = command("rendezvous", "a TCPStore under N clients, and the reverse lookup")
    sub.add_argument("--clients", type=positive_ints, default=[128, 1024])
    sub.add_argument("--master-addr", help="the address to look up (default: this host's)")
    sub.add_argument("--timeout-s", type=float, default=120.0)

    sub = command("checkpoint", "torch.save against DCP; DCP's planning and the save interval")
    model_options(sub)
    sub.add_argument("--world-sizes", type=positive_ints, default=[64, 1024])
    sub.add_argument("--repeats", type=int, default=3)
    sub.add_argument(
        "--save-s", type=float, help="a save's seconds on your cluster (default: torch.save's here)"
    )
    sub.add_argument(
        "--failures-per-gpu-day",
        type=float,
        default=LLAMA3_FAILURES_PER_GPU_DAY,
        help="default: Llama 3's, 419 in 54 days on 16,384 GPUs",
    )
    args = parser.parse_args(argv)
    if getattr(args, "world_size", 1) < 1:
        parser.error("--world-size must be at least 1")
    return args


@record  # under torchrun, a failing rank's exception shows in torchrun's summary
def main(argv=None) -> None:
    args = parse_args(argv)
    run, show = {
        "comm": (comm, print_comm),
        "dryrun": (dryrun, print_dryrun),
        "rendezvous": (rendezvous, print_rendezvous),
        "checkpoint": (checkpoint, print_checkpoint),
    }[args.command]
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)


if __name__ == "__main__":
    main()
