"""The failures people paste into forums, each produced for real with the text debugging/README.md
quotes, and each fix shown to work: a rank killed by a signal (torchrun's exit codes), "address
already in use", "unrecognized arguments: --local-rank", mp.spawn of a worker defined in
__main__, a lambda in a forkserver worker's data set, shuffle beside a sampler, two forward
passes before one backward ("modified by an inplace operation"), torch.compile with DDP (graphs
per bucket, graph breaks, recompiles), EMA weights under DDP, loader workers' host memory, "No
backend type associated with device type cpu", the exit without destroy_process_group() and
init_process_group(device_id=...) on a CPU, and TORCH_DISTRIBUTED_DEBUG=DETAIL with DDP on CPU.

(torchrun's summary with and without @record, and a
rank killed with SIGKILL: tests/test_failures.py.)
"""

from __future__ import annotations

import inspect
import random
import re
import shlex
import socket
import subprocess
import time

import pytest

from common.launcher import master_port
from tests.launcher_tools import need_root, need_tools
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
    warm_command,
)
from tests.quoted import (
    OMP_BANNER,
    RENAMED_VARIABLE,
    UNUSED_WARNING,
    DEVICE_ID_ON_CPU,
    FIXED_CELL,
    LOCAL_LAMBDA,
    NO_CPU_BACKEND,
    PICKLE_WARNING,
    SEGFAULT,
    SHUFFLE_BESIDE_A_SAMPLER,
    WORKER_EXITED,
    WORKER_FILE,
)
from tests.results import read_summary, root_cause
from tests.torch_versions import C10D_HEADERS, needs_torch

TRAIN = "01_basic_ddp/train.py"
SHORT = short_run(max_steps=1)


# --- torchrun's summary: exit codes of ranks killed
# by a signal ----------------------------------------

DATALOADER = """
import torch
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.zeros(64, 3, 64, 64))  # one batch of 3 MiB, more than /dev/shm holds
for (batch,) in DataLoader(data, batch_size=64, num_workers=1):
    print("got a batch", flush=True)
"""


@needs_torch("2.12", "torchrun names the signal on its exitcode line from torch 2.12")
def test_small_dev_shm_sigbus_is_exitcode_minus_7_and_dataloader_says_no_space(tmp_path):
    """A 1 MiB /dev/shm in a private mount namespace, as a container with a small --shm-size has:
    a rank writing 4 MiB of POSIX shared memory dies with SIGBUS; torch's DataLoader reports
    the same shortage as an error instead (torch reserves its shared memory up front)."""
    need_root("a private /dev/shm (unshare -m, mount)")
    need_tools("unshare", "mount")
    inner = (
        f"exec 2>&1; mount -t tmpfs -o size=1m tmpfs /dev/shm || exit 97; "
        f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node=2 "
        "debugging/rank_signal.py "
        f"--how shm --shm-mb 4; echo '--- DataLoader'; {PYTHON} -c {shlex.quote(DATALOADER)}"
    )
    result = run(["unshare", "-m", "sh", "-c", inner], timeout=180)
    assert result.returncode != 97, result.output[-3000:]
    torchrun_part, dataloader_part = result.stdout.split("--- DataLoader")
    root = root_cause(torchrun_part)
    m = re.search(
        r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -7 \(pid: (\d+)\)  \(SIGBUS\)\n"
        r"  error_file: <N/A>\n  traceback : Signal 7 \(SIGBUS\) received by PID (\d+)",
        root,
    )
    assert m and m[1] == m[2], result.output[-3000:]
    assert "got a batch" not in dataloader_part
    assert "Caught RuntimeError in DataLoader worker process 0" in dataloader_part, dataloader_part[
        -3000:
    ]
    assert re.search(
        r"RuntimeError: unable to allocate shared memory\(shm\) for file </torch_[\w]+>: "
        r"No space left on device \(28\)",
        dataloader_part,
    ), dataloader_part[-3000:]
    # Negative control: the same rank with this machine's own /dev/shm writes its 4 MiB and exits 0.
    fine = run(
        [PYTHON, REPO / "debugging/rank_signal.py", "--how", "shm", "--shm-mb", "4"], timeout=60
    )
    assert fine.returncode == 0 and "wrote 4 MiB to /dev/shm/" in fine.stdout, fine.output


# --- "address already in use": two jobs, one port
# -------------------------------------------------------


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        # as TCPStore: TIME_WAIT does not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def _free_job_id() -> int:
    """A Slurm-like job id whose derived port, and the next id's, are free here."""
    for _ in range(100):
        job = random.randrange(100_000, 10_000_000)
        if all(_bindable(master_port({"SLURM_JOB_ID": str(j)})) for j in (job, job + 1)):
            return job
    pytest.fail("no free derived port found")


@pytest.mark.launchers
def test_second_job_on_the_same_port_fails_with_address_already_in_use(tmp_path):
    job = _free_job_id()
    port = master_port({"SLURM_JOB_ID": str(job)})
    # Ids PORT_SPAN (15000) apart derive the same port: the residual collision the README states.
    assert master_port({"SLURM_JOB_ID": str(job + 15000)}) == port
    # The first job: rank 0 of two holds the store on the derived port and waits for rank 1.
    first = start(
        [PYTHON, REPO / TRAIN, *SHORT, "--timeout-s", "300", "--output-dir", tmp_path / "first"],
        env=clean_env(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", SLURM_JOB_ID=str(job)
        ),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while _bindable(port):
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first job never listened"
            )
            time.sleep(0.2)
        # A second job on the same node whose id derives
        # the same port (TCPStore without libuv, as before
        # torch 2.4 and with USE_LIBUV=0): the capitalised "Address already in use".
        # Its rank 0 of two, as the first's (a process alone takes any free port).
        second = run(
            [PYTHON, REPO / TRAIN, *SHORT, "--output-dir", tmp_path / "second"],
            timeout=120,
            env=clean_env(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                SLURM_JOB_ID=str(job + 15000),
                USE_LIBUV="0",
            ),
        )
        assert second.returncode != 0
        assert re.search(
            r"torch\.distributed\.DistNetworkError: The server socket has failed to listen on "
            r"any local "
            rf"network address\. The server socket has failed to bind to \S+:{port} \(errno: "
            r"98 - Address "
            r"already in use\)",
            second.stderr,
        ), second.stderr[-3000:]
        # torchrun without --standalone, told that port (--master-port): libuv's wording.
        agent = run(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=1",
                f"--master-port={port}",
                REPO / TRAIN,
                *SHORT,
                "--output-dir",
                tmp_path / "agent",
            ],
            timeout=120,
        )
        assert agent.returncode != 0
        assert (
            "torch.distributed.DistNetworkError: The server socket has failed to listen on "
            "any local network "
            f"address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: "
            "address already in use" in agent.stderr
        ), agent.stderr[-3000:]
        # The fix: another port. The next job id derives the next port, and that job runs.
        assert master_port({"SLURM_JOB_ID": str(job + 1)}) != port
        fixed = run(
            [PYTHON, REPO / TRAIN, *SHORT, "--output-dir", tmp_path / "fixed"],
            timeout=120,
            env=clean_env(SLURM_JOB_ID=str(job + 1)),
        )
        assert fixed.returncode == 0 and read_summary(tmp_path / "fixed")["world_size"] == 1, (
            fixed.output[-3000:]
        )
        assert first.poll() is None  # the first job was never disturbed
    finally:
        kill_group(first)
        first.wait()


# --- "unrecognized arguments: --local-rank=0"
# ------------------------------------------------------------

LAUNCH = [PYTHON, "-m", "torch.distributed.launch", "--nproc-per-node=2", "--master-port"]
# debugging/README.md's three commands, run as written
# (the README marks them `proven-by` this file). Neither
# launcher is --standalone: both rendezvous on --master-port,
# which they also read from PET_MASTER_PORT (torch's
# `env` argparse action), so each run gets a free port without a flag the README does not show.
LAUNCH_PLAIN = (
    "python -m torch.distributed.launch --nproc-per-node=2 debugging/local_rank_args.py --plain"
)
LAUNCH_FIXED = "python -m torch.distributed.launch --nproc-per-node=2 debugging/local_rank_args.py"
TORCHRUN_NOT_STANDALONE = "torchrun --nproc-per-node=2 debugging/local_rank_args.py"


@pytest.mark.launchers
def test_torch_distributed_launch_passes_local_rank_argument(monkeypatch):
    import torch.distributed.launch as launch_module
    import torch.distributed.run as run_module

    # both launchers take their --master-port default from it
    monkeypatch.setenv("PET_MASTER_PORT", "12345")
    assert (
        run_module.parse_args(["x.py"]).master_port
        == launch_module.parse_args(["x.py"]).master_port
        == 12345
    )

    def on_a_free_port():
        return clean_env(PET_MASTER_PORT=str(free_port()))

    plain = run(command_argv(LAUNCH_PLAIN), timeout=120, env=on_a_free_port())
    assert plain.returncode == 1  # the launcher's, for a failed rank
    # The first rank to fail ends the job: the other may be stopped before its parser prints.
    assert any(
        f"local_rank_args.py: error: unrecognized arguments: --local-rank={rank}" in plain.stderr
        for rank in (0, 1)
    ), plain.stderr
    assert "usage: local_rank_args.py [-h] [--epochs EPOCHS] [--plain]" in plain.stderr
    assert re.search(r"exitcode  : 2 \(pid: \d+\)", root_cause(plain.output))
    assert "FutureWarning: The module torch.distributed.launch is deprecated" in plain.stderr
    # The parser that accepts both spellings gets the
    # argument; under torchrun, which passes none, LOCAL_RANK.
    fixed = run(command_argv(LAUNCH_FIXED), timeout=120, env=on_a_free_port(), check=True)
    modern = run(
        command_argv(TORCHRUN_NOT_STANDALONE),
        timeout=120,
        env=on_a_free_port(),
        check=True,
    )
    for rank in (0, 1):
        assert (
            f"rank {rank}: local rank {rank} (from the --local-rank argument, LOCAL_RANK={rank})"
            in fixed.stdout
        )
        assert (
            f"rank {rank}: local rank {rank} (from LOCAL_RANK, LOCAL_RANK={rank})" in modern.stdout
        )


def test_the_examples_accept_and_ignore_local_rank():
    from common.config import TrainConfig, parse_config

    for spelling in ("--local-rank=1", "--local_rank=1"):
        assert parse_config(TrainConfig, [spelling, "--epochs", "2"]) == TrainConfig(epochs=2)
    # (A real run under torch.distributed.launch:
    # test_two_forwards_through_ddp_work_since_torch_2_12.)


# --- mp.spawn with a worker defined in __main__ (a
# notebook, python -c, the REPL) ------------------------

NOTEBOOK_CELL = """
import torch.multiprocessing as mp

def worker(rank):
    print(f"worker {rank}", flush=True)

mp.spawn(worker, nprocs=1)
"""


@pytest.mark.launchers
def test_mp_spawn_of_a_worker_defined_in_main_fails_and_an_imported_one_runs(tmp_path):
    # No file behind __main__ (python -c, as a notebook or
    # the REPL): the spawned processes cannot find `worker`.
    broken = run([PYTHON, "-c", NOTEBOOK_CELL], timeout=120, cwd=tmp_path)
    assert broken.returncode != 0
    assert (
        "AttributeError: Can't get attribute 'worker' on <module '__main__' (built-in)>"
        in broken.stderr
    )
    assert (
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 1"
        in broken.stderr
    ), broken.stderr[-3000:]
    assert "worker 0" not in broken.stdout
    # A lambda (or a function nested in another) has no
    # importable name at all: the parent cannot send it.
    lam = run(
        [
            PYTHON,
            "-c",
            "import torch.multiprocessing as mp\nmp.spawn(lambda rank: print(rank), nprocs=2)",
        ],
        timeout=120,
        cwd=tmp_path,
    )
    assert lam.returncode != 0
    assert re.search(
        r"_pickle\.PicklingError: Can't pickle <function <lambda> at 0x[0-9a-f]+>: attribute "
        r"lookup "
        r"<lambda> on __main__ failed",
        lam.stderr,
    ), lam.stderr[-3000:]
    # the parent failed before starting any process
    assert "ProcessExitedException" not in lam.stderr
    # The fix, still from python -c: the same call with the worker imported from a file.
    (tmp_path / "ddp_worker.py").write_text(WORKER_FILE)
    fixed = run(
        [PYTHON, "-c", FIXED_CELL.format(port=free_port())],
        timeout=120,
        cwd=tmp_path,
        env=clean_env(PYTHONPATH=str(tmp_path)),
    )
    assert fixed.returncode == 0, fixed.output[-3000:]
    for rank in (0, 1):  # (two processes print at once: only their newlines may interleave)
        assert f"rank {rank}: all_reduce gives 3" in fixed.stdout, fixed.output[-3000:]


# --- two forward passes before one backward (a GAN
# discriminator) ---------------------------------------

TWO_FORWARDS = "debugging/two_forwards.py"
# debugging/README.md's commands, run as written with --output-dir
# added (the README marks them `proven-by` this file)
TWO_FORWARDS_INPLACE = (
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers inplace"
)
TWO_FORWARDS_CONCAT = (
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers inplace "
    "--forward concat"
)
TWO_FORWARDS_LOCAL = (
    "torchrun --standalone --nproc_per_node=2 debugging/two_forwards.py --buffers local"
)
INPLACE_ERROR = (
    r"RuntimeError: one of the variables needed for gradient computation has been modified by an "
    r"inplace operation: \[torch\.FloatTensor \[32\]\] is at version 3; expected version 2 instead"
)


@pytest.mark.launchers
def test_two_forwards_with_buffers_synced_in_place_fail(tmp_path):
    """What DDP did up to torch 2.11: the second forward's
    buffer sync breaks the first forward's graph."""
    result = run(
        command_argv(TWO_FORWARDS_INPLACE) + ["--output-dir", str(tmp_path)],
        timeout=120,
    )
    out = result.output
    assert result.returncode == 1  # torchrun's, for a failed rank
    assert re.search(rf"^\[rank\d\]: {INPLACE_ERROR}", out, re.M), out[-3000:]
    assert "step 1 discriminator loss" not in out  # the first backward fails
    assert re.search(INPLACE_ERROR, root_cause(out))
    assert re.search(r"^\[rank\d\]:\s+loss\.backward\(\)", out, re.M)  # raised by the backward


@needs_torch("2.13", "DDP's forward_sync_buffers, which replaced broadcast_buffers")
@pytest.mark.parametrize("fix", ["concat", "local"])
def test_two_forwards_fixes_run_with_identical_replicas(tmp_path, fix):
    # what the fixes compute, not how torchrun starts them: ranks started warm
    command = {"concat": TWO_FORWARDS_CONCAT, "local": TWO_FORWARDS_LOCAL}[fix]
    result = warm_command(command, "--output-dir", str(tmp_path), check=True)
    assert "step 3 discriminator loss" in result.stdout and "done:" in result.stdout
    assert read_summary(tmp_path)["replicas_identical"]
    if fix == "local":  # broadcast_buffers=False works, and torch >= 2.13 says the name is old
        assert (
            "FutureWarning: `broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead."
            in result.stderr
        )


@needs_torch("2.12", "DDP syncs buffers without bumping their version from torch 2.12")
def test_two_forwards_through_ddp_work_since_torch_2_12(tmp_path):
    """DDP's own buffer sync no longer trips autograd (pytorch/pytorch#175851,
    torch 2.12). Launched with torch.distributed.launch, which also shows
    that the examples' parser takes its --local-rank."""
    result = run(
        [*LAUNCH, str(free_port()), REPO / TWO_FORWARDS, "--output-dir", tmp_path],
        timeout=120,
        check=True,
    )
    assert (
        "step 3 discriminator loss" in result.stdout
        and "done: separate forward(s), buffers ddp" in result.stdout
    )
    assert read_summary(tmp_path)["replicas_identical"]


LOADER_SCRIPT = """
import torch
from torch.utils.data import DataLoader, Dataset


class Mapped(Dataset):
    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return self.transform(torch.tensor(float(index)))


def double(x):
    return x * 2


def main():
    transform = {transform}
    loader = DataLoader(
        Mapped(transform), batch_size=4, num_workers=1, multiprocessing_context="{context}"
    )
    print("batches", [batch.tolist() for batch in loader])


if __name__ == "__main__":
    main()
"""


def test_a_local_lambda_in_a_data_set_fails_under_forkserver_and_a_module_function_runs(tmp_path):
    """The guide's text, for real: a lambda made inside main() in the data set of a loader with a
    forkserver worker cannot be pickled; the same loader with a module-level function runs, and so
    does the lambda with fork, which pickles nothing (why a script fails only once ported)."""
    batches = "batches [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0]]"
    for name, transform, context in (
        ("local", "lambda x: x * 2", "forkserver"),
        ("module", "double", "forkserver"),
        ("fork", "lambda x: x * 2", "fork"),
    ):
        (tmp_path / f"{name}.py").write_text(
            LOADER_SCRIPT.format(transform=transform, context=context)
        )
    failed = run([PYTHON, tmp_path / "local.py"], 120)
    assert failed.returncode != 0 and LOCAL_LAMBDA in failed.stderr, failed.stderr[-2000:]
    # torch 2.14.1's warning before the error, which suggests fork (the guide: not in DDP)
    assert PICKLE_WARNING in " ".join(failed.stderr.split()), failed.stderr[-2000:]
    for name in ("module", "fork"):
        ran = run([PYTHON, tmp_path / f"{name}.py"], 120)
        assert ran.returncode == 0 and batches in ran.stdout, (name, ran.output)


def test_shuffle_beside_a_sampler_is_refused_and_the_samplers_own_shuffle_is_not():
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    with pytest.raises(ValueError) as refused:
        DataLoader(data, sampler=sampler, shuffle=True)
    assert f"ValueError: {refused.value}" == SHUFFLE_BESIDE_A_SAMPLER
    # the fix: no shuffle on the loader; the sampler shuffles (its default), set_epoch reorders
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append([b.tolist() for b in DataLoader(data, sampler=sampler, batch_size=4)])
    assert orders[0] != orders[1] and orders[0][0] != sorted(orders[0][0])


# --- torch.compile with DDP: graphs per bucket, graph breaks in DDP's forward, recompiles
# (debugging/README.md, "torch.compile with DDP")

COMPILE_MODULE = "torchrun --standalone --nproc_per_node=2 debugging/compile_ddp.py"
COMPILE_WRAPPER = (
    "TORCH_LOGS=graph_breaks,recompiles torchrun --standalone --nproc_per_node=2 "
    "debugging/compile_ddp.py --compile wrapper --last-batch 3"
)
# torch's logs that the guide's commands show, and DDPOptimizer's own count of buckets; read from
# TORCH_LOGS when torch is imported, so these runs start under the real torchrun (compiled runs on
# ranks forked from a warm process also hit an internal assert of autograd's threads now and then).
LOGS = "graph_breaks,recompiles,torch._dynamo.backends.distributed"
NO_DDP_OPTIMIZER = """
import runpy, sys
import torch._dynamo
torch._dynamo.config.optimize_ddp = False
sys.argv[0] = "debugging/compile_ddp.py"
runpy.run_path("debugging/compile_ddp.py", run_name="__main__")
"""


def test_compiled_ddp_gets_one_graph_per_bucket_and_one_graph_without_ddp_optimizer(tmp_path):
    """The module compiled in place, then wrapped: the backend gets one graph per bucket
    (DDPOptimizer's own log counts four), none breaks, a last batch of another size compiles each
    again (one recompile), and the state_dict keys stay the module's. With DDPOptimizer switched
    off (set from outside, by a test): one graph (the control)."""
    result = run(
        command_argv(COMPILE_MODULE) + ["--last-batch", "3", "--output-dir", str(tmp_path / "on")],
        240,
        env=clean_env(TORCH_LOGS=LOGS),
        check=True,
    )
    out = result.output
    assert "DDPOptimizer used bucket cap 1048576 and created 4 buckets." in out, out[-3000:]
    assert "Graph break" not in out
    assert (
        len(re.findall(r"Recompiling function forward in \S+/debugging/compile_ddp\.py", out)) == 2
    )
    summary = read_summary(tmp_path / "on")
    assert summary["graphs_per_step"] == [4, 0, 0, 4] and summary["replicas_identical"]
    assert summary["state_dict_key"] == "module.layers.0.weight"
    assert "step 1 (batch 8): 4 graph(s) compiled" in result.stdout
    (tmp_path / "no_ddp_optimizer.py").write_text(NO_DDP_OPTIMIZER)
    torchrun(tmp_path / "no_ddp_optimizer.py", "--output-dir", str(tmp_path / "off"), timeout=240)
    assert read_summary(tmp_path / "off")["graphs_per_step"] == [1, 0, 0]


def test_compiling_the_ddp_wrapper_breaks_the_graph_in_ddps_forward(tmp_path):
    """The guide's command: compiling the DDP wrapper breaks the graph in DDP's own forward; a
    last batch of another size recompiles DDP's frames and every bucket's graph. (The module
    compiled before the wrap breaks no graph: the test above.)"""
    result = run(command_argv(COMPILE_WRAPPER) + ["--output-dir", str(tmp_path)], 240)
    out = result.output
    assert result.returncode == 0, out[-3000:]
    assert re.search(r"Graph break in user code at \S+/torch/nn/parallel/distributed\.py:\d+", out)
    said = "Dynamo does not know how to trace method `set_runtime_stats_and_log` of class `Logger`"
    assert said in out, out[-3000:]
    assert re.search(r"Recompiling function forward in \S+/debugging/compile_ddp\.py:\d+", out)
    assert "tensor 'x' size mismatch at index 0. expected 8, actual 3" in out
    assert read_summary(tmp_path)["graphs_per_step"] == [4, 0, 0, 4]


def test_torch_compile_returns_a_module_whose_keys_start_with_orig_mod_and_compile_keeps_them():
    """The guide: torch.compile(model) returns a new module, whose state_dict keys gain
    `_orig_mod.`; model.compile() compiles in place and keeps them (nothing is compiled until a
    forward: no compiler runs here)."""
    import torch
    from torch import nn

    assert list(torch.compile(nn.Linear(2, 2)).state_dict()) == [
        "_orig_mod.weight",
        "_orig_mod.bias",
    ]
    in_place = nn.Linear(2, 2)
    in_place.compile()
    assert list(in_place.state_dict()) == ["weight", "bias"]


# --- EMA weights under DDP (debugging/README.md, "EMA weights under DDP")

EMA_OF_MODULE = "torchrun --standalone --nproc_per_node=2 debugging/ema_ddp.py"
EMA_OF_WRAPPER = "torchrun --standalone --nproc_per_node=2 debugging/ema_ddp.py --ema-of wrapper"


def test_an_ema_of_the_module_is_the_same_on_every_rank_without_a_collective(tmp_path):
    """Under the real torchrun: each rank's EMA parameters are bitwise those of every other rank
    (SHA-256 of their bytes), with no collective in the update; BatchNorm's buffers are each
    rank's own (each ran its last forward on its own batch), so rank 0's are saved. The saved
    file loads into the plain model."""
    result = run(command_argv(EMA_OF_MODULE) + ["--output-dir", str(tmp_path)], 180, check=True)
    assert (
        "EMA evaluated on rank 0: loss" in result.stdout
        and "done: EMA of the module" in result.stdout
    )
    summary = read_summary(tmp_path)
    assert summary["replicas_identical"] and summary["ema_parameters_identical"]
    assert summary["ema_buffers_identical"] is False
    assert not any(key.startswith("module.") for key in summary["ema_keys"])
    demo = load_script("debugging/ema_ddp.py", "ema_ddp")
    assert "dist." not in inspect.getsource(demo.update_ema)  # no collective in the update
    import torch

    plain = demo.build_model()
    plain.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))  # strict: all keys


def test_an_ema_copied_from_the_ddp_wrapper_waits_for_the_other_ranks_on_rank_0(tmp_path):
    """The mistake: the copy of the DDP model is a DDP model, whose forward first broadcasts
    rank 0's BatchNorm buffers. Evaluated on rank 0 alone, it waits there until the timeout; the
    traceback ends in DDP's buffer sync. What the script does: warm ranks."""
    result = warm_command(EMA_OF_WRAPPER, "--output-dir", str(tmp_path))
    assert result.returncode != 0 and "done:" not in result.stdout
    err = result.stderr
    assert "self._sync_buffers()" in err, err[-3000:]
    assert "eval_loss = F.cross_entropy(ema(x), (x.sum(dim=1) > 0).long()).item()" in err, err[
        -3000:
    ]
    assert "in _sync_buffers" in err and "_broadcast_coalesced" in err, err[-3000:]
    assert re.search(
        r"RuntimeError: .*(Timed out waiting 10000ms for send operation to complete"
        r"|Application timeout caused pair closure"
        r"|Connection closed by peer)",
        err,
    ), err[-3000:]


def test_averaged_model_copies_first_then_averages_and_prefixes_its_keys():
    """The guide on torch.optim.swa_utils: AveragedModel with get_ema_multi_avg_fn copies the
    weights at its first update and averages from the second; it copies the buffers unless
    use_buffers=True; its own state_dict adds `module.` and `n_averaged`."""
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    expected = None
    for step in range(3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model(torch.randn(4, 3))  # updates BatchNorm's running statistics
        ema.update_parameters(model)
        weight = model[0].weight.detach()
        expected = weight.clone() if expected is None else expected.lerp(weight, 0.1)
        assert torch.allclose(ema.module[0].weight, expected)
        assert torch.equal(ema.module[1].running_mean, model[1].running_mean)
    keys = list(ema.state_dict())
    assert keys[0] == "n_averaged" and all(k.startswith("module.") for k in keys[1:])
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    averaged.update_parameters(model)
    model(torch.randn(4, 3) + 5)
    averaged.update_parameters(model)
    assert not torch.equal(averaged.module[1].running_mean, model[1].running_mean)


# --- host memory: ranks x (1 + workers) processes, and the data set each holds
# (debugging/README.md, "Host memory")

LOADER_MEMORY = "torchrun --standalone --nproc_per_node=2 debugging/loader_memory.py"
LOADER_MEMORY_NO_PRELOAD = (
    "torchrun --standalone --nproc_per_node=2 debugging/loader_memory.py "
    "--forms none --no-preload-torch"
)


def test_each_loader_worker_holds_its_own_copy_of_a_python_data_set_and_of_torch(tmp_path):
    """Under the real torchrun (2 ranks x 2 workers), one run: a list of Python floats costs each
    worker a copy of its own, and so does an np.memmap kept in the data set (pickled into the
    worker); a tensor is shared with the rank (one copy per rank), a file each process maps
    itself by the whole job. Ratios of one run, in copies of each form's own size. Then workers
    of a forkserver that did not import torch first: each imports it and holds several times the
    private memory of the first run's (the control)."""
    run(command_argv(LOADER_MEMORY) + ["--output-dir", str(tmp_path / "forms")], 300, check=True)
    forms = read_summary(tmp_path / "forms")["forms"]
    for form in ("list", "memmap_pickled"):  # a copy in every worker
        assert forms[form]["worker_extra_mb"] >= 0.9 * forms[form]["data_mb"], forms[form]
    for form in ("tensor", "memmap"):  # shared: a share of one copy per worker
        assert forms[form]["worker_extra_mb"] <= 0.5 * forms[form]["data_mb"], forms[form]
    copies = {form: row["copies"] for form, row in forms.items() if form != "none"}
    assert copies["list"] >= 0.9 * 2 * (1 + 2), copies  # ranks x (1 + workers)
    assert copies["memmap"] < copies["tensor"] < copies["memmap_pickled"] < copies["list"], copies
    assert copies["list"] >= 4 * copies["memmap"], copies
    no_preload = tmp_path / "no_preload"
    run(command_argv(LOADER_MEMORY_NO_PRELOAD) + ["--output-dir", str(no_preload)], 300, check=True)
    own = read_summary(no_preload)["forms"]["none"]["worker_private_mb"]
    assert own >= 5 * forms["none"]["worker_private_mb"], (own, forms["none"])


FORK_READS = """
import numpy as np, torch
from torch.utils.data import DataLoader, Dataset

def private_mb():
    rows = [line.split() for line in open("/proc/self/smaps_rollup")]
    return sum(int(r[1]) for r in rows if r[0] in ("Private_Clean:", "Private_Dirty:")) / 1024

class Numbers(Dataset):
    def __init__(self, form):
        self.values = [float(i) for i in range(2_000_000)] if form == "list" else np.arange(2e6)
    def __len__(self):
        return 1
    def __getitem__(self, index):
        before = private_mb()
        total = sum(self.values) if isinstance(self.values, list) else self.values.sum()
        return torch.tensor([before, private_mb(), float(total)])

for form in ("list", "array"):
    loader = DataLoader(Numbers(form), num_workers=1, multiprocessing_context="fork")
    before, after, _ = next(iter(loader))[0].tolist()
    print(form, before, after, flush=True)
"""


def test_a_forked_worker_copies_a_python_list_as_it_reads_it():
    """fork shares the parent's pages until written; reading a Python object writes its reference
    count, so a worker that reads a list of 2,000,000 floats (about 46 MiB of float objects) ends
    up with its own copy of their pages; reading a NumPy array of the same numbers writes nothing
    (the control). No process group here: fork from a rank with gloo's threads can hang."""
    result = run([PYTHON, "-c", FORK_READS], 120, check=True)
    grown = {
        form: float(after) - float(before)
        for form, before, after in (line.split() for line in result.stdout.splitlines())
    }
    assert grown["list"] >= 40 and abs(grown["array"]) < 5, grown


KILLED_WORKER = """
import os, signal, torch
from torch.utils.data import DataLoader, Dataset

# Batches travel by file name, not by a file descriptor that the main process fetches from the
# worker: a busy machine could otherwise see that fetch fail first, with a ConnectionResetError.
torch.multiprocessing.set_sharing_strategy("file_system")

class Numbers(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, index):
        if index == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does
        return torch.tensor(index)

for batch in DataLoader(Numbers(), batch_size=2, num_workers=2, multiprocessing_context="fork"):
    print(batch.tolist(), flush=True)
"""


def test_a_loader_worker_killed_by_a_signal_is_reported_as_exited_unexpectedly():
    result = run([PYTHON, "-c", KILLED_WORKER], 120)
    assert result.returncode == 1
    exited = re.escape(WORKER_EXITED).replace(re.escape("{pids}"), r"\d+")
    assert re.search(exited, result.stderr), result.stderr[-2000:]


# --- a CPU tensor in a group whose only backend is for CUDA
# (debugging/README.md, "No backend type associated with device type cpu")

ONE_RANK_ALL_REDUCE = """
import sys, torch, torch.distributed as dist
dist.init_process_group(sys.argv[1], init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
total = torch.ones(2)
dist.all_reduce(total)
print("all_reduce of a CPU tensor:", total.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_a_cpu_tensor_in_a_group_without_a_cpu_backend_has_no_backend_and_cpu_gloo_fixes_it():
    """A group whose only backend serves cuda ("cuda:gloo" here; "nccl" on a GPU machine) and a CPU
    tensor: torch's own error, for real on a CPU. The fix: a backend for each device type (the
    guide's "cpu:gloo,cuda:nccl"; "cpu:gloo,cuda:gloo" here, as no GPU runs NCCL)."""
    broken = run([PYTHON, "-c", ONE_RANK_ALL_REDUCE, "cuda:gloo"], 120)
    assert broken.returncode == 1 and NO_CPU_BACKEND in broken.stderr, broken.stderr[-2000:]
    fixed = run([PYTHON, "-c", ONE_RANK_ALL_REDUCE, "cpu:gloo,cuda:gloo"], 120, check=True)
    assert "all_reduce of a CPU tensor: [1.0, 1.0]" in fixed.stdout


# --- destroy_process_group() at exit (debugging/README.md, "destroy_process_group() was not
# called before program exit")

NO_DESTROY = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
total = torch.ones(1)
dist.all_reduce(total)
print("ends without destroy_process_group()", flush=True)
"""


def test_gloo_says_nothing_when_destroy_process_group_is_not_called():
    """The warning is ProcessGroupNCCL's (tests/test_torch_text.py): a gloo run that ends without
    destroy_process_group() prints nothing of the kind. Its group's threads still run at
    interpreter shutdown, so now and then the exit aborts instead (the guide's "terminate called
    without an active exception" entry, a separate matter): either way, no warning."""
    result = run([PYTHON, "-c", NO_DESTROY], 120)
    aborted = "terminate called without an active exception"
    assert result.returncode == 0 or (result.returncode == -6 and aborted in result.stderr), (
        result.output[-3000:]
    )
    assert "ends without destroy_process_group()" in result.stdout
    assert "destroy_process_group" not in result.stderr and "leak" not in result.stderr, (
        result.stderr
    )


# --- init_process_group(device_id=...) (debugging/README.md, "barrier(): using the device under
# current context")

DEVICE_ID = """
import sys, torch, torch.distributed as dist
kwargs = {"device_id": torch.device("cpu")} if sys.argv[1] == "cpu" else {}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1, **kwargs)
dist.barrier()
print("barrier passed", flush=True)
dist.destroy_process_group()
"""


def test_device_id_is_refused_for_the_cpu_and_a_cpu_run_leaves_it_out():
    refused = run([PYTHON, "-c", DEVICE_ID, "cpu"], 120)
    assert refused.returncode == 1 and DEVICE_ID_ON_CPU in refused.stderr, refused.stderr[-2000:]
    plain = run([PYTHON, "-c", DEVICE_ID, "none"], 120, check=True)
    assert "barrier passed" in plain.stdout and "barrier():" not in plain.stderr


# --- TORCH_DISTRIBUTED_DEBUG=DETAIL with DDP on CPU (debugging/README.md, "Tools")

DETAIL_DDP = """
import faulthandler, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
faulthandler.enable()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print("gloo backend:", type(backend).__name__, flush=True)
model = DDP(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
print("DDP trained a step", flush=True)
del model
dist.destroy_process_group()
"""


def test_detail_wraps_gloo_and_ddps_constructor_crashes_while_info_trains():
    """torch 2.14.1 on CPU: with TORCH_DISTRIBUTED_DEBUG=DETAIL set before the group starts, the
    group's gloo backend is the collective checker (_ProcessGroupWrapper), and DDP's constructor
    dies with SIGSEGV in _ddp_init_helper (its logger reads the backend as ProcessGroupGloo).
    The control: INFO keeps ProcessGroupGloo and trains."""
    crashed = run([PYTHON, "-c", DETAIL_DDP], 120, env=clean_env(TORCH_DISTRIBUTED_DEBUG="DETAIL"))
    assert "gloo backend: _ProcessGroupWrapper" in crashed.stdout, crashed.output[-3000:]
    assert crashed.returncode == -11, crashed.output[-3000:]
    assert SEGFAULT in crashed.stderr
    assert "in _ddp_init_helper" in crashed.stderr and "DDP trained" not in crashed.stdout
    info = run([PYTHON, "-c", DETAIL_DDP], 120, env=clean_env(TORCH_DISTRIBUTED_DEBUG="INFO"))
    assert info.returncode == 0, info.output[-3000:]
    assert "gloo backend: ProcessGroupGloo" in info.stdout and "DDP trained a step" in info.stdout


# --- torchrun's OMP_NUM_THREADS banner (debugging/README.md)

THREADS = """
import os, torch
from torch.utils.data import DataLoader


def worker_threads(_):
    return torch.tensor(torch.get_num_threads())


if __name__ == "__main__":
    rank = os.environ["RANK"]
    print(f"rank {rank} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"threads {torch.get_num_threads()}", flush=True)
    if rank == "0":
        loader = DataLoader(range(1), num_workers=1, collate_fn=worker_threads,
                            multiprocessing_context="forkserver")
        print(f"loader worker threads {next(iter(loader)).item()}", flush=True)
"""


def test_torchrun_sets_one_thread_per_rank_unless_told_and_loader_workers_use_one(tmp_path):
    """The guide's OMP_NUM_THREADS entry: torchrun with 2 ranks a node and no OMP_NUM_THREADS
    prints its banner and gives each rank 1 thread; with OMP_NUM_THREADS=2 set before it, no
    banner and 2 threads a rank. A loader worker computes on 1 thread either way."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    unset = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    banner = torchrun(script, env=unset)
    assert OMP_BANNER in " ".join(banner.stderr.split()), banner.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} OMP_NUM_THREADS=1 threads 1" in banner.stdout, banner.stdout
    told = torchrun(script, env={**unset, "OMP_NUM_THREADS": "2"})
    assert "Setting OMP_NUM_THREADS" not in told.stderr, told.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} OMP_NUM_THREADS=2 threads 2" in told.stdout, told.stdout
    assert "loader worker threads 1" in told.stdout and "loader worker threads 1" in banner.stdout


# --- find_unused_parameters' warning and static_graph (debugging/README.md)

UNUSED_SEARCH = """
import sys, warnings, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.even, self.odd = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x, step):
        return self.even(x) if step % 2 == 0 else self.odd(x)


dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
branches = sys.argv[1] == "branches"
model = DDP(Branches() if branches else torch.nn.Linear(4, 2), find_unused_parameters=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(12):
        (model(torch.ones(3, 4), step) if branches else model(torch.ones(3, 4))).sum().backward()
data = model._get_ddp_logging_data()
print("python warnings", len(caught), "can_set_static_graph", data.get("can_set_static_graph"))
del model
dist.destroy_process_group()
"""


def test_the_unused_parameter_search_warns_from_cpp_and_a_live_model_never_says_static():
    """torch 2.14.1: a model that uses every parameter under find_unused_parameters=True gets
    reducer.cpp's warning on stderr, not as a Python warning (warnings.catch_warnings sees none);
    a model whose branches leave parameters unused does not (the control). On a live model
    _get_ddp_logging_data() has "can_set_static_graph" 0 once the graph changed between steps,
    and nothing while it has not: logger.hpp writes a static graph's 1 in the logger's
    destructor only."""
    used = run([PYTHON, "-c", UNUSED_SEARCH, "all"], 120, check=True)
    assert UNUSED_WARNING in used.stderr, used.stderr[-2000:]
    assert "python warnings 0 can_set_static_graph None" in used.stdout, used.stdout
    branches = run([PYTHON, "-c", UNUSED_SEARCH, "branches"], 120, check=True)
    assert "find_unused_parameters=True was specified" not in branches.stderr
    assert "python warnings 0 can_set_static_graph 0" in branches.stdout, branches.stdout
    logger = " ".join((C10D_HEADERS / "logger.hpp").read_text().split())
    assert "~Logger() noexcept(false) {" in logger
    assert "log_if_graph_static(reducer_->ddp_graph_static()); }" in logger
    assert logger.count("log_if_graph_static(") == 2  # the destructor's call and the declaration


# --- renamed variables (debugging/README.md, "Environment variable X is deprecated")

ONE_ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
print("all-reduced", flush=True)
dist.destroy_process_group()
"""


def test_an_old_variable_name_works_and_warns_and_the_new_one_is_silent():
    """The flight recorder's old variable on a CPU run of torch 2.14.1: the warning the guide
    quotes; the new name: none (the control)."""
    old = run(
        [PYTHON, "-c", ONE_ALL_REDUCE], 120, env=clean_env(TORCH_NCCL_TRACE_BUFFER_SIZE="100")
    )
    assert old.returncode == 0 and "all-reduced" in old.stdout, old.output[-2000:]
    assert RENAMED_VARIABLE in old.stderr, old.stderr[-2000:]
    new = run([PYTHON, "-c", ONE_ALL_REDUCE], 120, env=clean_env(TORCH_FR_BUFFER_SIZE="100"))
    assert new.returncode == 0 and "is deprecated" not in new.stderr, new.output[-2000:]
