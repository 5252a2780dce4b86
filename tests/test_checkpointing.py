"""05_checkpointing: exact resume, a SIGKILLed worker under torchrun --max-restarts, preemption
signals, corrupt checkpoints, weights_only, export to a plain model, and a DCP round trip."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHON, REPO, clean_env, free_port, kill_group, load_script, read_summary, run, torchrun

SCRIPT = "05_checkpointing/train.py"
# 2 epochs of 45 steps (digits, 2 ranks x 16), noise drawn from each rank's RNG, a checkpoint every 10 steps.
ARGS = ("--epochs", "2", "--batch-size", "16", "--input-noise", "0.1", "--save-every-steps", "10",
        "--record-batches", "--log-every", "100")
STEPS_PER_EPOCH = 45  # 1438 digits / 2 ranks / batch 16; a checkpoint is also written at each epoch's end
TOTAL_STEPS = 2 * STEPS_PER_EPOCH
REQUEUE = 75


ckpt = load_script("05_checkpointing/checkpoint.py", "checkpoint")


def params(output_dir: Path) -> dict:
    return torch.load(Path(output_dir) / "model.pt", weights_only=True)


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"{k} differs: max |diff| {(pa[k] - pb[k]).abs().max().item()}"


def batches(output_dir: Path, rank: int) -> dict[int, str]:
    """step -> 'epoch step fingerprint' of that rank; a step redone after a restart keeps its last line."""
    lines = (Path(output_dir) / f"batches.rank{rank}.txt").read_text().splitlines()
    return {int(line.split()[1]): line for line in lines}


def wait_for_step(output_dir: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Poll the batch record until `rank` has started `step`; returns the step it is at."""
    path = Path(output_dir) / f"batches.rank{rank}.txt"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            n = len(path.read_text().splitlines())
            if n >= step:
                return n
        if proc.poll() is not None:
            pytest.fail(f"run ended (code {proc.returncode}) before step {step}:\n{proc.communicate()}")
        time.sleep(0.005)
    kill_group(proc)
    pytest.fail(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every other run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    torchrun(SCRIPT, *ARGS, "--output-dir", str(out), timeout=180)
    assert read_summary(out)["steps"] == TOTAL_STEPS
    return out


def test_stop_mid_epoch_and_resume_is_bitwise_identical(reference, tmp_path):
    first = torchrun(SCRIPT, *ARGS, "--output-dir", str(tmp_path), "--max-steps", "57", timeout=180)
    assert "ckpt-00000057.pt" in first.stdout  # 57 = 12 steps into epoch 2 of 45-step epochs
    second = torchrun(SCRIPT, *ARGS, "--output-dir", str(tmp_path), timeout=180)
    assert "resumed from" in second.stdout and "epoch 2, step 57 (12 of 45 in the epoch)" in second.stdout
    summary, ref = read_summary(tmp_path), read_summary(reference)
    assert summary["resumed_from_step"] == 57 and summary["steps"] == TOTAL_STEPS
    assert_same_params(reference, tmp_path)
    assert summary["final_train_loss"] == ref["final_train_loss"]  # epoch loss sums were restored too
    for rank in (0, 1):  # the same batches in the same order, before and after the resume
        ref_lines = (reference / f"batches.rank{rank}.txt").read_text().splitlines()
        lines = (tmp_path / f"batches.rank{rank}.txt").read_text().splitlines()
        assert len(ref_lines) == TOTAL_STEPS and lines == ref_lines


def _worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (a child of the launcher)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    pytest.fail(f"no worker with RANK={rank} under pid {launcher_pid}")


def test_sigkilled_worker_is_restarted_by_torchrun_and_resumes(reference, tmp_path):
    kill_at = random.randint(15, 60)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=2",
           "--monitor-interval=0.2", str(REPO / SCRIPT), *ARGS, "--output-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        reached = wait_for_step(tmp_path, 1, kill_at, proc)
        os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"timed out: {proc.communicate()}")
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert reached < TOTAL_STEPS
    assert "failed (exitcode: -9)" in err  # torchrun saw the SIGKILL and restarted the group
    resumed = read_summary(tmp_path)["resumed_from_step"]
    # The last save before the kill: every 10 steps, and at the end of epoch 1 (step 45).
    assert 10 <= resumed <= reached and (resumed % 10 == 0 or resumed == STEPS_PER_EPOCH), (resumed, reached)
    assert_same_params(reference, tmp_path)
    for rank in (0, 1):
        assert batches(tmp_path, rank) == batches(reference, rank)


def _launch_env_ranks(output_dir: Path, *extra: str) -> list[subprocess.Popen]:
    """Two ranks started directly (as srun or mpiexec would), in one process group."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = clean_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        group = {"process_group": 0 if rank == 0 else procs[0].pid}  # one new process group
        procs.append(subprocess.Popen([PYTHON, str(REPO / SCRIPT), *ARGS, "--output-dir", str(output_dir), *extra],
                                      cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, **group))
    return procs


@pytest.mark.parametrize("target", ["group-SIGTERM", "rank1-SIGUSR1"])
def test_preemption_signal_saves_and_exits_with_requeue_code(reference, tmp_path, target):
    procs = _launch_env_ranks(tmp_path)
    try:
        wait_for_step(tmp_path, 0, 5, procs[0])
        if target == "group-SIGTERM":  # what Slurm and PBS do: every process of the job gets it
            os.killpg(procs[0].pid, signal.SIGTERM)
        else:  # only one rank is told; the all-reduced flag must still stop both at the same step
            procs[1].send_signal(signal.SIGUSR1)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        kill_group(procs[0])
    codes = [p.returncode for p in procs]
    assert codes == [REQUEUE, REQUEUE], (codes, outputs)
    signame = target.split("-")[1]
    assert f"{signame}: checkpoint at step" in outputs[0][0]
    folder = tmp_path / "checkpoints"
    latest = ckpt.read_latest(folder)
    state = ckpt.load(latest)  # complete, loadable with weights_only=True
    stopped = state["step"]
    assert 5 <= stopped < TOTAL_STEPS and latest.name == ckpt.checkpoint_name(stopped)
    assert len(state["ranks"]) == 2
    assert (folder / "REQUEUE").read_text().startswith(f"{signame} at step {stopped}")
    # both ranks stopped after the same step
    assert max(batches(tmp_path, 0)) == max(batches(tmp_path, 1)) == stopped
    if target == "group-SIGTERM":  # the requeued job resumes from it and ends like the uninterrupted run
        torchrun(SCRIPT, *ARGS, "--output-dir", str(tmp_path), timeout=180)
        assert read_summary(tmp_path)["resumed_from_step"] == stopped
        assert not (folder / "REQUEUE").exists()
        assert_same_params(reference, tmp_path)


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", folder)
    latest = ckpt.read_latest(folder)
    assert latest.name == ckpt.checkpoint_name(TOTAL_STEPS)
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    result = torchrun(SCRIPT, *ARGS, "--output-dir", str(tmp_path), timeout=180)
    warnings = [line for line in result.output.splitlines() if "unusable" in line]
    assert len(warnings) == 1 and "ckpt-00000090.pt" in warnings[0], result.output
    assert f"resumed from {folder / 'ckpt-00000080.pt'}" in result.stdout
    assert_same_params(reference, tmp_path)  # 80 -> 90 replayed exactly


def _checkpoint_like(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "scheduler": {}, "scaler": {},
            "epoch": 0, "step_in_epoch": step, "step": step, "ranks": []}


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_latest_is_reported_in_one_line_and_previous_used(tmp_path, damage):
    for step in (10, 20, 30):
        ckpt.save(_checkpoint_like(step), tmp_path, step, keep=3)
    latest = ckpt.read_latest(tmp_path)
    assert latest.name == "ckpt-00000030.pt"
    if damage == "truncate":
        latest.write_bytes(latest.read_bytes()[:100])
    else:
        latest.write_bytes(os.urandom(latest.stat().st_size))
    messages = []
    path, state = ckpt.find_resumable(tmp_path, log=messages.append)
    assert path.name == "ckpt-00000020.pt" and state["step"] == 20
    assert len(messages) == 1 and "\n" not in messages[0] and "ckpt-00000030.pt is unusable" in messages[0]
    assert latest.exists()  # nothing is deleted


def test_keep_last_k_and_latest_pointer(tmp_path):
    for step in range(1, 8):
        ckpt.save(_checkpoint_like(step), tmp_path, step, keep=3)
        assert ckpt.read_latest(tmp_path).name == ckpt.checkpoint_name(step)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [ckpt.checkpoint_name(s) for s in (7, 6, 5)]


SAVE_LOOP = """
import sys, torch
sys.path.insert(0, {folder!r})
import checkpoint as ckpt
start = ckpt.load(ckpt.read_latest({out!r}))["step"] + 1 if ckpt.read_latest({out!r}) else 1
print("ready", flush=True)
for step in range(start, start + 1000):
    state = {{"model": {{"w": torch.full((8_000_000,), float(step))}}, "optimizer": {{}}, "scheduler": {{}},
             "scaler": {{}}, "epoch": 0, "step_in_epoch": step, "step": step, "ranks": []}}
    ckpt.save(state, {out!r}, step, keep=2)
"""


def test_kill_during_save_never_leaves_latest_pointing_at_a_partial_file(tmp_path):
    """SIGKILL a process that saves 32 MB checkpoints in a loop, at random moments, three times."""
    code = SAVE_LOOP.format(folder=str(REPO / "05_checkpointing"), out=str(tmp_path))
    partial = set()  # temporary files left by a kill in the middle of a write
    for _ in range(3):
        proc = subprocess.Popen([PYTHON, "-c", code], env=clean_env(), stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(random.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        partial |= {p.name for p in tmp_path.iterdir() if ".tmp-" in p.name}
        latest = ckpt.read_latest(tmp_path)
        if latest is None:  # killed before the first save completed: then there is no complete file either
            assert ckpt.list_checkpoints(tmp_path) == []
            continue
        state = ckpt.load(latest)  # complete
        assert torch.equal(state["model"]["w"], torch.full((8_000_000,), float(state["step"])))
        # `latest` names the newest complete file, or the one before it when the kill fell between
        # the rename of the new file and the update of the pointer.
        newest = ckpt.list_checkpoints(tmp_path)[0]
        assert latest == newest or (newest.name == ckpt.checkpoint_name(state["step"] + 1)
                                    and ckpt.load(newest)["step"] == state["step"] + 1)
    assert ckpt.read_latest(tmp_path) is not None, "no save completed in three attempts"
    removed = ckpt.remove_partial_files(tmp_path)
    assert {p.name for p in removed} == partial and not any(".tmp-" in p.name for p in tmp_path.iterdir())
    print(f"kills that hit a write in progress: {len(partial)}/3")


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
    with pytest.raises(ValueError, match="weights_only"):
        ckpt.load(evil)
    messages = []
    path, _ = ckpt.find_resumable(folder, log=messages.append)
    assert path.name == "ckpt-00000010.pt" and len(messages) == 1 and "weights_only" in messages[0]
    assert not marker.exists()  # the object was never built
    torch.load(evil, weights_only=False)  # control: a plain load would have run it
    assert marker.exists()


def _digits_test_outputs(state_dict: dict) -> torch.Tensor:
    sys.path.insert(0, str(REPO))
    from common.data import digits
    from common.models import build_model

    model = build_model("small_cnn", 10, 1, 8)
    model.load_state_dict(state_dict)  # strict: a plain, unwrapped model
    model.eval()
    images = digits().test.tensors[0]
    with torch.no_grad():
        return model(images)


def test_exported_state_dict_loads_into_a_plain_model(reference, tmp_path):
    exported = tmp_path / "model.pt"
    run([PYTHON, REPO / "05_checkpointing/export_model.py", reference / "checkpoints", exported], 60, check=True)
    sd = torch.load(exported, weights_only=True)
    assert not any(k.startswith("module.") for k in sd)
    outputs = _digits_test_outputs(sd)
    assert torch.equal(outputs, _digits_test_outputs(params(reference)))  # what training ended with
    from common.data import digits

    labels = digits().test.tensors[1]
    accuracy = (outputs.argmax(1) == labels).sum().item() / len(labels)
    assert accuracy == pytest.approx(read_summary(reference)["eval_accuracy"], abs=1e-12)

    # An old checkpoint saved from the DDP wrapper: every key starts with "module.".
    prefixed = ckpt.load(ckpt.read_latest(reference / "checkpoints"))
    prefixed["model"] = {f"module.{k}": v for k, v in prefixed["model"].items()}
    torch.save(prefixed, tmp_path / "old.pt")
    torch.save(prefixed["model"], tmp_path / "old_bare.pt")
    for source in ("old.pt", "old_bare.pt"):
        run([PYTHON, REPO / "05_checkpointing/export_model.py", tmp_path / source, tmp_path / f"x_{source}"], 60,
            check=True)
        assert torch.equal(_digits_test_outputs(torch.load(tmp_path / f"x_{source}", weights_only=True)), outputs)


def test_dcp_save_on_two_ranks_loads_on_one(tmp_path):
    torchrun("05_checkpointing/dcp_example.py", "--mode", "save", "--output-dir", str(tmp_path), nproc=2)
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    torchrun("05_checkpointing/dcp_example.py", "--mode", "load", "--output-dir", str(tmp_path), nproc=1)
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 1 and summary["params_equal"] and summary["momentum_equal"]
    assert summary["momentum_buffers"] == 8
