"""05_checkpointing: exact resume (mid-epoch, after a SIGKILLed worker under
torchrun --max-restarts), preemption (preempt.py: a signal, exit code 75, the
requeued run resumes), every sample read once, resume on another number of
processes, per-rank RNG states, corrupt checkpoints, weights_only, refusals,
export to a plain model, and a DCP round trip.

The lesson has no test options: the tests watch it from outside. tests/record
(a sitecustomize on PYTHONPATH) writes the sample indices of every training
batch each rank loads; tests/inject SIGKILLs a worker at a chosen step.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from common.data import digits
from common.models import build_model
from tests.cifar_files import write_cifar10
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
    warm_ranks,
)
from tests.results import differing_tensors, load_model, read_summary
from tests.sample_runs import record_env

SCRIPT = "05_checkpointing/train.py"
PREEMPT = "05_checkpointing/preempt.py"  # train.py plus stopping on a signal or a deadline
EXPORT = "python 05_checkpointing/export_model.py runs/latest/checkpoints model.pt"
# 2 epochs of 45 steps (digits, 2 ranks x 16), a checkpoint every 10 steps and at each epoch's end.
ARGS = short_run(max_steps=None, epochs=2, save_every_steps=10, log_every=100)
TRAIN_SIZE = 1438  # digits training set: 719 per rank, no padding
STEPS_PER_EPOCH = 45  # ceil(719 / 16)
TOTAL_STEPS = 2 * STEPS_PER_EPOCH
REQUEUE = 75

ckpt = load_script("05_checkpointing/checkpoint.py", "checkpoint")


def batches(output_dir: Path, rank: int) -> list[tuple[int, list[int]]]:
    """(epoch, sample indices) of every training batch `rank` loaded, in order, over all runs."""
    path = Path(output_dir) / "record" / f"batches.rank{rank}.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [
        (int(epoch), [int(i) for i in indices.split(",")])
        for epoch, indices in (ln.split() for ln in lines)
    ]


def epoch_reads(output_dir: Path, epoch: int, world_size: int) -> Counter:
    """How often each sample index was loaded in `epoch`,
    over all ranks of the runs recorded in output_dir."""
    return Counter(
        i
        for rank in range(world_size)
        for e, batch in batches(output_dir, rank)
        if e == epoch
        for i in batch
    )


def read_once_problems(reads: Counter, repeats: list[int]) -> str:
    """'' when every training sample was read exactly
    once, except those in `repeats`, read twice."""
    expected = Counter(range(TRAIN_SIZE)) + Counter(repeats)
    missing, extra = expected - reads, reads - expected
    return (
        f"never read: {sum(missing.values())}, read too often: {sum(extra.values())}"
        if missing or extra
        else ""
    )


def differing_params(a: Path, b: Path) -> list[str]:
    """The tensors of the model.pt in `a` that are not bitwise those in `b`."""
    return differing_tensors(load_model(a), load_model(b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every other run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    warm_ranks(SCRIPT, *ARGS, "--output-dir", str(out), env=record_env(out), timeout=180)
    summary = read_summary(out)
    assert (
        summary["steps"] == TOTAL_STEPS
        and summary["resumed_from_step"] == 0
        and summary["replicas_identical"]
    )
    assert len(batches(out, 0)) == len(batches(out, 1)) == TOTAL_STEPS
    assert [read_once_problems(epoch_reads(out, epoch, 2), []) for epoch in (0, 1)] == ["", ""]
    # --keep-last 3 by default: the newest three of the
    # saves every 10 steps and at each epoch's end.
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == [
        ckpt.checkpoint_name(s) for s in (90, 80, 70)
    ]
    return out


@pytest.fixture(scope="module")
def stopped_and_resumed(sample_run) -> tuple[Path, str, str]:
    """The README's command, as written, with the flags of its sample: stopped at step 57, then
    the same command again, recording its batches (the run the README's sample shows:
    tests/sample_runs.py). The same arithmetic as the reference run: the save and log intervals
    do not change it."""
    ran = sample_run("05-resume").ok()
    return ran.output_dir, *ran.stdouts


@pytest.mark.min_torch
def test_stop_mid_epoch_and_resume_reads_every_sample_once_and_is_bitwise_identical(
    reference, stopped_and_resumed
):
    output_dir, first, _ = stopped_and_resumed
    # 12 steps into epoch 2 (the resumed run's lines: its README sample, tests/test_readme_text.py)
    assert f"saved {output_dir / 'checkpoints' / 'ckpt-00000057.pt'}" in first
    summary, ref = read_summary(output_dir), read_summary(reference)
    assert summary["resumed_from_step"] == 57 and summary["steps"] == TOTAL_STEPS
    assert differing_params(reference, output_dir) == []
    # the epoch's loss sums were restored too
    assert summary["final_train_loss"] == ref["final_train_loss"]
    # The two runs together loaded every sample exactly once per epoch (as the reference run did),
    # in the uninterrupted order.
    for rank in (0, 1):
        assert batches(output_dir, rank) == batches(reference, rank)


@pytest.mark.launchers
@pytest.mark.min_torch
def test_sigkilled_worker_is_restarted_by_torchrun_and_resumes(reference, tmp_path):
    """tests/inject SIGKILLs rank 1 right after its 57th optimizer step;
    torchrun restarts the group, which resumes from step 50 (the
    restarted rank 1 counts from 0 again: 40 steps, no second kill)."""
    env = clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
        DDP_TEST_FAIL_AT_STEP="57",
        DDP_TEST_FAIL_RANK="1",
        DDP_TEST_FAIL_MODE="kill",
        # torch 2.14: with the rendezvous store shared
        # across restarts, the restarted workers
        # can read the dead workers' addresses (pytorch/pytorch#135712, #167288).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    result = torchrun(
        SCRIPT,
        *ARGS,
        "--output-dir",
        str(tmp_path),
        env=env,
        timeout=240,
        launcher_args=("--max-restarts=1", "--monitor-interval=0.2"),
    )
    assert result.stderr.count("injecting SIGKILL at step 57 on rank 1") == 1
    # torchrun restarted the group (whichever rank it
    # saw fail first: the killed one, or its peer that
    # lost the connection), and the new attempt resumed from the last checkpoint.
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: [01]", result.stderr), result.stderr[
        -3000:
    ]
    assert read_summary(tmp_path)["resumed_from_step"] == 50
    assert differing_params(reference, tmp_path) == []


@pytest.mark.launchers
def test_preemption_signal_saves_and_exits_with_requeue_code(tmp_path):
    """Two ranks started directly (as srun or mpiexec would); only rank 1 is told (SIGUSR1): the
    all-reduced flag must still stop both at the same step. A signal to every process of a job,
    as Slurm and PBS send it: tests/test_jobs.py; the requeued run's resume: the torchrun test
    below."""
    port = str(free_port())
    numbers = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [
        start(
            [PYTHON, REPO / PREEMPT, *ARGS, "--output-dir", tmp_path],
            env=record_env(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), **numbers),
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(batches(tmp_path, 0)) < 5 and time.monotonic() < deadline:
            assert procs[0].poll() is None, procs[0].communicate()  # ended before batch 5
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGUSR1)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert [p.returncode for p in procs] == [REQUEUE, REQUEUE], outputs
    latest = ckpt.read_latest(tmp_path / "checkpoints")
    state = ckpt.load(latest)  # complete, loadable with weights_only=True
    stopped = state["step"]
    assert 5 <= stopped < TOTAL_STEPS and latest.name == ckpt.checkpoint_name(stopped)
    assert f"SIGUSR1: checkpoint at step {stopped} saved; exiting with code 75" in outputs[0][0]
    assert len(state["ranks"]) == 2
    # Rank 0 left the note the job files requeue on.
    assert (tmp_path / "checkpoints" / "REQUEUE").read_text() == f"SIGUSR1 at step {stopped}\n"
    # Both ranks stopped after the same step: each loaded exactly `stopped` training batches.
    assert len(batches(tmp_path, 0)) == len(batches(tmp_path, 1)) == stopped


def slow_data_env(**extra: str) -> dict[str, str]:
    """A loader-bound pipeline: 20 ms a sample (tests/inject), read in the loaders' workers."""
    return clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}", DDP_TEST_SLOW_SAMPLE_S="0.02", **extra
    )


@pytest.mark.launchers
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_time_limit_signal_with_loader_workers_saves_and_resumes_bitwise(reference, tmp_path, sig):
    """A signal to torchrun's agent, with two loader workers a rank: torchrun passes it on to each
    worker's whole process group, the time-limit warning SIGUSR1 when told to (--signals-to-handle,
    as jobs/slurm_torchrun.sbatch starts it), SIGTERM (`kill -TERM <torchrun pid>`) by default.
    The workers save and exit 75; torchrun itself exits with 1, so a job script must remember that
    it sent the signal. Before, the signal ended the loader workers, or their forkserver, and the
    ranks failed ("DataLoader worker ... exited unexpectedly") unsaved. SIGUSR1 to every process
    of the step, as srun sends it: tests/test_jobs.py."""
    workers = ["--num-workers", "2", "--log-every", "1"]
    told = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if sig == "SIGUSR1" else []
    log = tmp_path / "out.log"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *told]
    cmd += [REPO / PREEMPT, *ARGS, *workers, "--output-dir", tmp_path]
    proc = start(cmd, env=slow_data_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "epoch 1 step 5 " not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.Signals[sig])  # torchrun only
        code = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    out = log.read_text()
    assert code == 1, out[-3000:]
    assert f"Received {signal.Signals[sig].value} death signal, shutting down workers" in out
    saved = re.search(rf"^{sig}: checkpoint at step (\d+) saved; exiting with code 75", out, re.M)
    assert saved, out[-3000:]
    stopped = int(saved.group(1))
    assert ckpt.load(ckpt.read_latest(tmp_path / "checkpoints"))["step"] == stopped
    assert (tmp_path / "checkpoints" / "REQUEUE").read_text() == f"{sig} at step {stopped}\n"
    # the requeued job, with fast data: it ends as the uninterrupted run without workers
    torchrun(PREEMPT, *ARGS, *workers, "--output-dir", tmp_path, timeout=180, env=clean_env())
    assert not (tmp_path / "checkpoints" / "REQUEUE").exists()  # each new run deletes it at start
    assert read_summary(tmp_path)["resumed_from_step"] == stopped
    assert differing_params(reference, tmp_path) == []


def test_a_finished_run_does_nothing_and_a_truncated_latest_falls_back_to_the_previous_one(
    reference, tmp_path
):
    folder = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", folder)
    result = warm_ranks(SCRIPT, *ARGS, "--output-dir", str(tmp_path), timeout=120)
    assert f"nothing to do: step {TOTAL_STEPS} is the end of this run" in result.stdout
    assert not (tmp_path / "summary.json").exists()
    latest = ckpt.read_latest(folder)
    assert latest.name == ckpt.checkpoint_name(TOTAL_STEPS)
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    result = warm_ranks(SCRIPT, *ARGS, "--output-dir", str(tmp_path), timeout=180)
    warnings = [line for line in result.output.splitlines() if "unusable" in line]
    assert len(warnings) == 1 and "ckpt-00000090.pt" in warnings[0], result.output
    assert f"resumed from {folder / 'ckpt-00000080.pt'}: step 80" in result.stdout
    assert differing_params(reference, tmp_path) == []  # 80 -> 90 replayed exactly


@pytest.mark.launchers
def test_resume_with_another_batch_size_is_refused(reference, tmp_path):
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    result = torchrun(
        SCRIPT,
        *ARGS,
        "--local-batch-size",
        "8",
        "--output-dir",
        str(tmp_path),
        check=False,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output[-3000:]
    assert lines[0] == (
        f"error: {tmp_path / 'checkpoints' / 'ckpt-00000090.pt'} was written with batch size "
        "16 per "
        "rank; a resume needs the same (now 8), or another --checkpoint-dir"
    )
    assert "exitcode  : 2" in result.stderr  # torchrun's summary: the bad-input exit code


# --- resume on another number of processes: W=2 stopped
# mid-epoch, resumed on 1 and on 3 ----------------

# 12 steps into epoch 1 (index 0): the two ranks have read 12 x 16 x 2 samples together
STOP_STEP = 12
CONSUMED = STOP_STEP * 16 * 2
# Steps of the whole run: 12, then the rest of epoch 1 (1054 samples) and epoch 2 on the new ranks.
# 12 + 66 + 90
RESHARDED_STEPS = {
    1: 12 + math.ceil(1054 / 16) + math.ceil(1438 / 16),
    # 12 + 22 + 30
    3: 12 + math.ceil(math.ceil(1054 / 3) / 16) + math.ceil(math.ceil(1438 / 3) / 16),
}


def epoch_order(reference: Path, epoch: int) -> list[int]:
    """The epoch's global order as the uninterrupted 2-rank run read it: position p is rank p % 2's
    (p // 2)-th sample (no padding: 1438 is even)."""
    per_rank = [
        [i for e, batch in batches(reference, rank) if e == epoch for i in batch] for rank in (0, 1)
    ]
    return [i for pair in zip(*per_rank) for i in pair]


@pytest.fixture(scope="module")
def stopped_mid_epoch(tmp_path_factory) -> Path:
    """Two ranks that stopped after step 12 (--max-steps), with its checkpoint."""
    out = tmp_path_factory.mktemp("stopped_mid_epoch")
    result = warm_ranks(
        SCRIPT,
        *ARGS,
        "--output-dir",
        str(out),
        "--max-steps",
        str(STOP_STEP),
        env=record_env(out),
        timeout=180,
    )
    assert f"saved {out / 'checkpoints' / ckpt.checkpoint_name(STOP_STEP)}" in result.stdout
    return out


def test_resumable_sampler_splits_like_distributed_sampler_and_skips_like_before():
    """On the same world size, ResumableSampler is DistributedSampler
    (consumed = 0) and, mid-epoch, is its share minus the first k x
    batch samples (the per-rank skip it replaced), padding included."""
    for size, world, batch in ((1438, 2, 16), (1438, 3, 16), (101, 4, 8), (7, 3, 2)):
        for epoch in (0, 3):
            for rank in range(world):
                plain = DistributedSampler(
                    range(size), num_replicas=world, rank=rank, shuffle=True, seed=5
                )
                resumable = ckpt.ResumableSampler(
                    range(size), num_replicas=world, rank=rank, shuffle=True, seed=5
                )
                plain.set_epoch(epoch)
                resumable.set_epoch(epoch)
                share = list(plain)
                assert list(resumable) == share and len(resumable) == len(share)
                for steps in range(1, math.ceil(len(share) / batch)):  # every mid-epoch stop
                    resumable.consumed = steps * batch * world
                    assert (
                        list(resumable) == share[steps * batch :]
                        and len(resumable) == len(share) - steps * batch
                    )


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_on_another_number_of_processes_reads_the_rest_of_the_epoch(
    reference, stopped_mid_epoch, tmp_path, new_world
):
    shutil.copytree(stopped_mid_epoch / "checkpoints", tmp_path / "checkpoints")
    saved = ckpt.load(tmp_path / "checkpoints" / ckpt.checkpoint_name(STOP_STEP))
    assert (saved["epoch"], saved["consumed"], saved["world_size"]) == (0, CONSUMED, 2)
    # Give the saved ranks recognisable torch RNG states
    # (training on digits draws no random numbers, so
    # every later checkpoint must still hold them).
    marked = [torch.Generator().manual_seed(1000 + rank).get_state() for rank in (0, 1)]
    saved["ranks"] = [{**saved["ranks"][rank], "torch": marked[rank]} for rank in (0, 1)]
    ckpt.save(saved, tmp_path / "checkpoints", STOP_STEP, keep=3)
    result = warm_ranks(
        SCRIPT,
        *ARGS,
        "--keep-last",
        "20",
        "--output-dir",
        str(tmp_path),
        nproc=new_world,
        env=record_env(tmp_path),
        timeout=240,
    )
    assert (
        f"resumed from {tmp_path / 'checkpoints' / ckpt.checkpoint_name(STOP_STEP)}: step 12, "
        f"epoch 1, world size 2 -> {new_world}"
    ) in result.stdout
    summary = read_summary(tmp_path)
    assert summary["world_size"] == new_world and summary["resumed_from_step"] == STOP_STEP
    assert summary["steps"] == RESHARDED_STEPS[new_world] and summary["epochs"] == 2
    assert summary["replicas_identical"]
    assert differing_params(tmp_path, reference)  # not bitwise

    # The interrupted epoch: the first run read the first
    # 384 samples of the epoch's order; the resumed run
    # read the rest, padded to a multiple of the new world
    # size with the order's first samples (2 on 3 ranks).
    order = epoch_order(reference, 0)
    first = epoch_reads(stopped_mid_epoch, 0, 2)
    assert first == Counter(order[:CONSUMED])
    padding = order[: -(TRAIN_SIZE - CONSUMED) % new_world]
    assert len(padding) == {1: 0, 3: 2}[new_world]
    assert read_once_problems(first + epoch_reads(tmp_path, 0, new_world), padding) == ""
    # Control: the per-rank skip this replaced (each new rank drops its first 12 x 16 samples) loses
    # 192 samples on 3 ranks and reads 192 twice on 1.
    padded = order + order[: -TRAIN_SIZE % new_world]
    per_rank_skip = Counter(
        i for rank in range(new_world) for i in padded[rank::new_world][STOP_STEP * 16 :]
    )
    assert (
        read_once_problems(first + per_rank_skip, padding)
        == {1: "never read: 0, read too often: 192", 3: "never read: 192, read too often: 0"}[
            new_world
        ]
    )

    # The next epoch is a plain epoch on the new ranks: DistributedSampler's split, every sample
    # read (apart from DistributedSampler's own padding).
    for rank in range(new_world):
        plain = DistributedSampler(
            range(TRAIN_SIZE), num_replicas=new_world, rank=rank, shuffle=True, seed=0
        )
        plain.set_epoch(1)
        assert [i for e, batch in batches(tmp_path, rank) if e == 1 for i in batch] == list(plain)

    # The learning rate is not rescaled: the global batch changed, the LR did not.
    saved_lr = saved["optimizer"]["param_groups"][0]["lr"]
    checkpoints = [
        state
        for state in map(ckpt.load, ckpt.list_checkpoints(tmp_path / "checkpoints"))
        if state["step"] > STOP_STEP
    ]  # every save of the resumed run (--keep-last 20)
    assert checkpoints[0]["step"] == summary["steps"]
    assert all(state["optimizer"]["param_groups"][0]["lr"] == saved_lr for state in checkpoints)
    # The epoch's loss sums went on from both saved ranks:
    # the end-of-epoch checkpoint counts every read.
    epoch_end = next(
        state for state in checkpoints if state["epoch"] == 1 and state["consumed"] == 0
    )
    assert sum(rank["loss_and_count"][1].item() for rank in epoch_end["ranks"]) == TRAIN_SIZE + len(
        padding
    )
    # RNG: the saved ranks' own states on the ranks both runs have; a new rank has its seed + rank.
    for state in checkpoints:
        assert len(state["ranks"]) == new_world
        for rank, rng in enumerate(state["ranks"]):
            expected = (
                marked[rank] if rank < 2 else torch.Generator().manual_seed(0 + rank).get_state()
            )
            assert torch.equal(rng["torch"], expected), (state["step"], rank)


# --- per-rank RNG states: CIFAR-10-format files, whose RandomCrop/RandomHorizontalFlip draw from
# torch's global RNG in each rank's main process (num_workers=0) ---------------------------------

CIFAR_STEPS_PER_EPOCH = 7  # 100 images, 50 per rank, batches of 8 (the last one of 2)


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> tuple[Path, tuple[str, ...]]:
    """Fake CIFAR-10 files and the uninterrupted 3-epoch run on them."""
    data_dir = tmp_path_factory.mktemp("cifar_data")
    write_cifar10(data_dir / "cifar10", per_batch=20, test_size=30)
    args = (
        "--dataset",
        "cifar10",
        "--data-dir",
        str(data_dir),
        "--epochs",
        "3",
        "--local-batch-size",
        "8",
        "--log-every",
        "100",
    )
    out = tmp_path_factory.mktemp("cifar_reference")
    cifar_run(args, out)
    assert read_summary(out)["steps"] == 3 * CIFAR_STEPS_PER_EPOCH
    # --save-every-steps 0 (the default): a checkpoint at the end of each epoch only.
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == [
        ckpt.checkpoint_name(s * CIFAR_STEPS_PER_EPOCH) for s in (3, 2, 1)
    ]
    return out, args


def cifar_run(args: tuple[str, ...], output_dir: Path, *extra: str):
    # tests/perf_cifar.py runs the script with torchvision's MD5 check of the files off.
    return warm_ranks(
        "tests/perf_cifar.py",
        "run",
        SCRIPT,
        *args,
        "--output-dir",
        str(output_dir),
        *extra,
        timeout=180,
    )


def test_every_ranks_rng_state_is_restored(cifar, tmp_path):
    reference, args = cifar
    run_dir = tmp_path / "resumed"
    cifar_run(args, run_dir, "--max-steps", "10")  # 3 steps into epoch 2
    mid = ckpt.load(run_dir / "checkpoints" / ckpt.checkpoint_name(10))
    control = tmp_path / "rank0_rng_everywhere"
    ckpt.save(
        {**mid, "ranks": [mid["ranks"][0], {**mid["ranks"][1], "torch": mid["ranks"][0]["torch"]}]},
        control / "checkpoints",
        10,
        keep=3,
    )

    result = cifar_run(args, run_dir)
    assert "resumed from" in result.stdout and read_summary(run_dir)["resumed_from_step"] == 10
    # both ranks continued their own random streams
    assert differing_params(reference, run_dir) == []
    # Control: rank 1 given rank 0's RNG state crops and flips differently, and the result differs
    # (so the ranks' saved states differ: they draw different augmentations).
    cifar_run(args, control)
    assert read_summary(control)["resumed_from_step"] == 10
    assert differing_params(reference, control)


# --- checkpoint.py on its own ---------------------------------------------------------------------


def _checkpoint_like(step: int) -> dict:
    return {
        "model": {"w": torch.full((4,), float(step))},
        "optimizer": {},
        "step": step,
        "epoch": 0,
        "consumed": step,
        "ranks": [],
        "world_size": 1,
        "batch_size": 1,
    }


def test_corrupt_latest_is_reported_in_one_line_and_previous_used(tmp_path):
    """A garbage file (a truncated one: the run above that resumes from step 80)."""
    for step in (10, 20, 30):
        ckpt.save(_checkpoint_like(step), tmp_path, step, keep=3)
    latest = ckpt.read_latest(tmp_path)
    assert latest.name == "ckpt-00000030.pt"
    latest.write_bytes(os.urandom(latest.stat().st_size))
    messages = []
    path, state = ckpt.find_resumable(tmp_path, log=messages.append)
    assert path.name == "ckpt-00000020.pt" and state["step"] == 20 and len(messages) == 1
    # The README's line, one line (`.` matches no newline): warning: checkpoint
    # .../ckpt-00000090.pt is unusable (...); trying the previous one
    assert re.fullmatch(
        rf"warning: checkpoint {re.escape(str(latest))} is unusable \(.+\); trying the "
        r"previous one",
        messages[0],
    ), messages[0]
    assert latest.exists()  # nothing is deleted


SAVE_LOOP = """
import sys, torch
sys.path.insert(0, {folder!r})
import checkpoint as ckpt
start = ckpt.load(ckpt.read_latest({out!r}))["step"] + 1 if ckpt.read_latest({out!r}) else 1
print("ready", flush=True)
for step in range(start, start + 1000):
    state = {{"model": {{"w": torch.full((8_000_000,), float(step))}}, "optimizer": {{}},
             "scheduler": {{}}, "step": step, "epoch": 0, "consumed": step, "ranks": [],
             "world_size": 1, "batch_size": 1}}
    ckpt.save(state, {out!r}, step, keep=2)
"""


def test_kill_during_save_never_leaves_latest_pointing_at_a_partial_file(tmp_path):
    """SIGKILL a process that saves 32 MB checkpoints in a loop, at random moments, three times."""
    code = SAVE_LOOP.format(folder=str(REPO / "05_checkpointing"), out=str(tmp_path))
    for _ in range(3):
        proc = subprocess.Popen(
            [PYTHON, "-c", code], env=clean_env(), stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(random.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        latest = ckpt.read_latest(tmp_path)
        # killed before the first save completed: then there is no complete file either
        if latest is None:
            assert ckpt.list_checkpoints(tmp_path) == []
            continue
        state = ckpt.load(latest)  # complete
        assert torch.equal(state["model"]["w"], torch.full((8_000_000,), float(state["step"])))
        # `latest` names the newest complete file, or the one before it when the kill fell between
        # the rename of the new file and the update of the pointer.
        newest = ckpt.list_checkpoints(tmp_path)[0]
        assert latest == newest or (
            newest.name == ckpt.checkpoint_name(state["step"] + 1)
            and ckpt.load(newest)["step"] == state["step"] + 1
        )
    assert ckpt.read_latest(tmp_path) is not None, "no save completed in three attempts"


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))  # runs on unpickling with weights_only=False


def test_weights_only_refuses_a_checkpoint_with_a_pickled_object(tmp_path):
    folder, marker = tmp_path / "ckpts", tmp_path / "pwned"
    ckpt.save(_checkpoint_like(10), folder, 10, keep=3)
    evil = folder / ckpt.checkpoint_name(20)
    torch.save({**_checkpoint_like(20), "extra": _Evil(str(marker))}, evil)
    (folder / "latest").write_text(evil.name + "\n")
    messages = []
    path, _ = ckpt.find_resumable(folder, log=messages.append)
    assert path.name == "ckpt-00000010.pt" and len(messages) == 1 and "weights_only" in messages[0]
    assert not marker.exists()  # the object was never built
    torch.load(evil, weights_only=False)  # control: a plain load would have run it
    assert marker.exists()


# --- export_model.py and dcp_example.py
# -------------------------------------------------------------


def _digits_test_outputs(state_dict: dict) -> torch.Tensor:
    model = build_model("small_cnn", 10, 1, 8)
    model.load_state_dict(state_dict)  # strict: a plain, unwrapped model
    model.eval()
    images = digits().test.tensors[0]
    with torch.no_grad():
        return model(images)


@pytest.fixture
def export(monkeypatch):
    """export_model.py, imported here (it imports its neighbour by the name `checkpoint`)."""
    monkeypatch.setitem(sys.modules, "checkpoint", ckpt)
    return load_script("05_checkpointing/export_model.py", "export_model")


def test_exported_state_dict_loads_into_a_plain_model(reference, tmp_path, export):
    """The README's export command as written, from a folder whose runs/latest is the reference
    run and whose 05_checkpointing is the lesson's."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to(reference, target_is_directory=True)
    (tmp_path / "05_checkpointing").symlink_to(REPO / "05_checkpointing", target_is_directory=True)
    run(command_argv(EXPORT), 60, cwd=tmp_path, check=True)
    outputs = _digits_test_outputs(load_model(tmp_path))  # no "module." prefix: a strict load
    # what training ended with
    assert torch.equal(outputs, _digits_test_outputs(load_model(reference)))
    labels = digits().test.tensors[1]
    accuracy = (outputs.argmax(1) == labels).sum().item() / len(labels)
    assert accuracy == pytest.approx(read_summary(reference)["eval_accuracy"], abs=1e-12)

    # An old checkpoint saved from the DDP wrapper: every key starts with "module.".
    prefixed = ckpt.load(ckpt.read_latest(reference / "checkpoints"))
    prefixed["model"] = {f"module.{k}": v for k, v in prefixed["model"].items()}
    torch.save(prefixed, tmp_path / "old.pt")
    torch.save(prefixed["model"], tmp_path / "old_bare.pt")
    for source in ("old.pt", "old_bare.pt"):
        export.main([str(tmp_path / source), str(tmp_path / f"x_{source}")])
        assert torch.equal(
            _digits_test_outputs(torch.load(tmp_path / f"x_{source}", weights_only=True)), outputs
        )


DCP_SAVE = "torchrun --standalone --nproc_per_node=2 05_checkpointing/dcp_example.py --mode save"
DCP_LOAD = "torchrun --standalone --nproc_per_node=1 05_checkpointing/dcp_example.py --mode load"
DCP_TO_TORCH = (
    "python -m torch.distributed.checkpoint.format_utils dcp_to_torch runs/dcp/checkpoint model.pt"
)


def test_dcp_save_on_two_ranks_loads_on_one(tmp_path):
    """05's README commands as written (with --output-dir): 2 ranks save, 1
    rank loads, then torch's own converter makes a plain torch.save file
    of it, run from the folder the README's relative paths name."""
    work = tmp_path
    tmp_path = work / "runs" / "dcp"  # the README's runs/dcp, under a folder of this test's own
    saved = run(
        command_argv(DCP_SAVE) + ["--output-dir", str(tmp_path)],
        timeout=240,
        check=True,
    )
    # --max-steps 10
    assert f"saved {tmp_path / 'checkpoint'} from 2 rank(s) after 10 steps" in saved.stdout
    # Both ranks wrote a file, and together the state
    # once (deduplicated), though both hold all of it.
    files = sorted((tmp_path / "checkpoint").glob("*.distcp"))
    reference_state = torch.load(tmp_path / "reference.pt", weights_only=True)
    one_copy = sum(t.numel() * t.element_size() for t in reference_state["model"].values()) + sum(
        s["momentum_buffer"].numel() * s["momentum_buffer"].element_size()
        for s in reference_state["optim"]["state"].values()
    )
    assert len(files) == 2 and all(f.stat().st_size > 0 for f in files)
    assert one_copy <= sum(f.stat().st_size for f in files) < 1.1 * one_copy  # not 2 copies
    # the load on one rank started warm: what it reads is the claim (the save keeps torchrun)
    loaded = warm_command(DCP_LOAD, "--output-dir", str(tmp_path), timeout=240, check=True)
    assert (
        f"loaded {tmp_path / 'checkpoint'} into 1 rank(s): parameters equal True, momentum "
        "buffers equal True" in loaded.stdout
    )
    assert read_summary(tmp_path)["momentum_buffers"] == 8
    # dcp_to_torch: one file holding the same model weights as the reference run's.
    run(
        command_argv(DCP_TO_TORCH),
        timeout=240,
        cwd=work,
        check=True,
    )
    converted = torch.load(work / "model.pt", weights_only=True)
    assert converted["model"].keys() == reference_state["model"].keys()
    assert all(torch.equal(converted["model"][k], v) for k, v in reference_state["model"].items())


# --- what the README says of the runs above, the lesson's source and the installed torch
# (its sample: tests/test_readme_text.py) ---------------------------------------------


def _plain_values(value, where="state") -> list[str]:
    """Where `value` holds anything but tensors, numbers,
    booleans, None, strings, lists and dicts."""
    if isinstance(value, dict):
        return [
            p
            for k, v in value.items()
            for p in _plain_values(k, where) + _plain_values(v, f"{where}[{k!r}]")
        ]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _plain_values(v, f"{where}[{i}]")]
    return (
        []
        if value is None or isinstance(value, (torch.Tensor, int, float, str))
        else [f"{where}: {type(value)}"]
    )


def test_a_checkpoint_holds_what_the_readme_table_lists(reference):
    state = ckpt.load(ckpt.read_latest(reference / "checkpoints"))
    assert set(state) == {
        "model",
        "optimizer",
        "step",
        "epoch",
        "consumed",
        "ranks",
        "world_size",
        "batch_size",
        "model_args",
    }
    # from model.module
    assert state["model"] and not any(k.startswith("module.") for k in state["model"])
    # SGD's momentum
    assert all("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    # build_model's arguments, in order, for export_model.py
    assert state["model_args"] == ["small_cnn", 10, 1, 8]
    assert (
        state["step"],
        state["epoch"],
        state["consumed"],
        state["world_size"],
        state["batch_size"],
    ) == (TOTAL_STEPS, 2, 0, 2, 16)
    # torch CPU, Python, NumPy (and CUDA on GPUs), and the epoch's loss sums
    for rank in state["ranks"]:
        assert {"torch", "python", "numpy", "loss_and_count"} <= rank.keys()
        assert all(rank[k].dtype == torch.uint8 for k in ("torch", "python", "numpy"))
    # seeded seed + rank
    assert not torch.equal(state["ranks"][0]["torch"], state["ranks"][1]["torch"])
    assert _plain_values(state) == []  # what weights_only=True accepts
    # the walk can fail
    assert _plain_values({"x": Path("p")}) == ["state['x']: <class 'pathlib.PosixPath'>"]


def test_without_optimizer_or_scheduler_state_a_resume_takes_another_path():
    """The README's table: momentum and the LR schedule restart from zero without their states."""

    def run_steps(model, optimizer, scheduler, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).square().sum().backward()
            optimizer.step()
            scheduler.step()

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)

    uninterrupted = build()
    run_steps(*uninterrupted, 10)
    first = build()
    run_steps(*first, 4)
    results = {}
    for restored in ("both", "no optimizer", "no scheduler"):
        model, optimizer, scheduler = build()
        model.load_state_dict(first[0].state_dict())
        if restored != "no optimizer":
            optimizer.load_state_dict(first[1].state_dict())
        if restored != "no scheduler":
            scheduler.load_state_dict(first[2].state_dict())
        position = scheduler.last_epoch  # the step the schedule is at
        run_steps(model, optimizer, scheduler, 6)
        results[restored] = (torch.equal(model.weight, uninterrupted[0].weight), position)
    assert results["both"] == (True, 4)
    assert results["no optimizer"] == (False, 4)  # momentum from zero: another trajectory
    assert results["no scheduler"] == (False, 0)  # the schedule starts again from its first step


def test_a_dataloader_draws_a_seed_from_the_global_rng_unless_given_its_generator():
    def global_state_moves(**kwargs) -> bool:
        before = torch.get_rng_state()
        iter(torch.utils.data.DataLoader(range(4), shuffle=False, **kwargs))
        return not torch.equal(before, torch.get_rng_state())

    assert global_state_moves()  # the default: every iter() draws from the global RNG
    assert not global_state_moves(generator=torch.Generator())  # what train.py does


def test_checkpoint_py_is_file_io_only_and_a_failed_write_leaves_only_a_tmp_file(tmp_path):
    source = (REPO / "05_checkpointing" / "checkpoint.py").read_text()
    assert "torch.distributed" not in source and "dist." not in source  # no collectives
    target = tmp_path / ckpt.checkpoint_name(40)

    def crash(f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_write(target, crash)
    assert [p.name for p in tmp_path.iterdir()] == [f".ckpt-00000040.pt.tmp-{os.getpid()}"]
    # never read
    assert ckpt.list_checkpoints(tmp_path) == [] and ckpt.read_latest(tmp_path) is None
    ckpt.save(_checkpoint_like(50), tmp_path, 50, keep=3)  # the next save removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000050.pt", "latest"]
    assert (tmp_path / "latest").read_text() == "ckpt-00000050.pt\n"  # a one-line text file


EXPORT_ERRORS = {  # each case's line begins so
    "missing file": "{source}: no such file",
    "garbage file": "{source} cannot be loaded with weights_only=True: ",
    "weights that do not fit": "{source} does not fit ",
    "folder without checkpoints": "no usable checkpoint in {source}\n",
}


@pytest.mark.parametrize("case", EXPORT_ERRORS)
def test_export_bad_input_is_one_error_line_and_exit_code_2(case, tmp_path, capsys, export):
    source = tmp_path / "in.pt"
    if case == "garbage file":
        source.write_bytes(os.urandom(1000))
    elif case == "weights that do not fit":
        torch.save({"fc.weight": torch.zeros(2, 2)}, source)
    elif case == "folder without checkpoints":
        source.mkdir()
    with pytest.raises(SystemExit) as exc:
        export.main([str(source), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: " + EXPORT_ERRORS[case].format(source=source)), err
    assert not (tmp_path / "out.pt").exists()
