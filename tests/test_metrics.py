"""07_metrics: metrics across ranks, logged once by rank 0, and decisions every rank takes alike.

Every run is a real torchrun (gloo, CPU). The logged loss is read back from the TensorBoard event
file and compared with the loss computed here, in one process, on both ranks' first batches. A
non-finite loss is injected into one rank from outside the lesson (tests/inject/sitecustomize.py).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common.config import TrainConfig
from common.data import load_datasets
from common.models import build_model
from tests.paths import REPO
from tests.processes import clean_env, command_argv, run, torchrun, warm_ranks, short_run
from tests.results import load_model, read_summary, repeated_lines

SCRIPT = "07_metrics/train.py"
PATIENCE_COMMAND = "torchrun --standalone --nproc_per_node=2 07_metrics/train.py --patience 1"
INJECT = REPO / "tests" / "inject"
WRITER_ON_RANK_0 = "    writer = None\n    if launch.rank == 0:\n"
SKIP_ON_NONFINITE_GRADIENT = (
    "            if not torch.stack([g.isfinite().all() for g in grads]).all():\n"
)
# the job id the patience run is given, as inside a Slurm job (a requeued job keeps it)
JOB_ID = "4242"


def event_files(output_dir):
    return sorted((output_dir / "tensorboard").glob("*/events.out.tfevents.*"))


def scalars(event_file, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(event_file))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def variant(tmp_path, old: str, new: str):
    """The lesson with one passage replaced: a negative control, run from a copy."""
    source = (REPO / SCRIPT).read_text()
    assert source.count(old) == 1
    path = tmp_path / "train.py"
    path.write_text(source.replace(old, new))
    return path


@pytest.fixture(scope="module")
def patience_run(tmp_path_factory):
    """The README's command (2 ranks, early stopping with patience 1, 12 epochs at most) with a log
    line every step, and a Slurm job id in the environment."""
    out = tmp_path_factory.mktemp("metrics") / "patience"
    result = run(
        command_argv(PATIENCE_COMMAND) + ["--log-every", "1", "--output-dir", str(out)],
        timeout=180,
        env=clean_env(SLURM_JOB_ID=JOB_ID),
        check=True,
    )
    return out, result


def test_only_rank_0_writes_one_run_of_event_files(patience_run, tmp_path):
    out, result = patience_run
    # one run, named by the job's id
    assert [f.parent.name for f in event_files(out)] == [JOB_ID]
    # rank 0 alone prints, too
    assert repeated_lines(result.stdout) == []
    # Control: a writer on every rank makes one event file per rank (TensorBoard: two runs).
    copy = variant(tmp_path, WRITER_ON_RANK_0, "    if True:\n")
    warm_ranks(copy, "--max-steps", "2", "--output-dir", str(tmp_path / "out"))
    assert len(event_files(tmp_path / "out")) == 2
    # outside a job, the run is named by its start time
    assert all(re.fullmatch(r"\d{8}-\d{6}", f.parent.name) for f in event_files(tmp_path / "out"))


@pytest.mark.min_torch
def test_the_logged_loss_is_the_exact_mean_over_all_ranks_samples(patience_run):
    """Step 1's logged loss is the initial model's mean loss on both ranks' first batches, computed
    here in one process; rank 0's batch alone (what 01 prints) gives another number."""
    out, _ = patience_run
    cfg = TrainConfig()
    torch.manual_seed(cfg.seed)  # as the script: the seed, the data, then the model
    data = load_datasets(cfg, 2)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    first_batches = []
    for rank in range(2):
        sampler = DistributedSampler(data.train, 2, rank, shuffle=True, seed=cfg.seed)
        first_batches.append(
            next(iter(DataLoader(data.train, cfg.local_batch_size, sampler=sampler)))
        )
    images = torch.cat([batch[0] for batch in first_batches])
    labels = torch.cat([batch[1] for batch in first_batches])
    with torch.no_grad():
        mean_loss = F.cross_entropy(model(images), labels).item()
        rank_0_loss = F.cross_entropy(model(first_batches[0][0]), first_batches[0][1]).item()
    (event_file,) = event_files(out)
    logged = scalars(event_file, "train/loss")
    assert logged[1] == pytest.approx(mean_loss, rel=1e-6)
    assert abs(rank_0_loss - mean_loss) > 1e-3  # the control: not rank 0's batch alone
    # a value for every step, as logged; the eval loss once per epoch
    assert sorted(logged) == list(range(1, read_summary(out)["steps"] + 1))
    assert len(scalars(event_file, "eval/loss")) == read_summary(out)["epochs"]


@pytest.mark.min_torch
def test_early_stopping_ends_every_rank_after_the_same_epoch(patience_run):
    """Patience 1: the run stops after the first epoch whose all-reduced eval loss is no better
    than the best before it, and every rank ends there (exit 0: no rank waits for another)."""
    out, result = patience_run
    eval_losses = [float(x) for x in re.findall(r"done: .* eval loss (\S+),", result.stdout)]
    worse = [i for i in range(1, len(eval_losses)) if eval_losses[i] >= min(eval_losses[:i])]
    assert worse, eval_losses  # the data: an epoch without improvement within 12
    summary = read_summary(out)
    assert summary["epochs"] == worse[0] + 1 == len(eval_losses) < 12
    assert summary["stopped_early"] == "no better eval loss for 1 epochs"
    assert f"stopping early after epoch {worse[0] + 1}" in result.stdout
    assert summary["best_eval_loss"] == pytest.approx(min(eval_losses), abs=1e-4)
    assert summary["replicas_identical"]


def finite_weights(output_dir) -> bool:
    return all(value.isfinite().all() for value in load_model(output_dir).values())


NONFINITE_ENV = dict(
    PYTHONPATH=f"{REPO}:{INJECT}",
    DDP_TEST_NONFINITE_AT_FORWARD="2",
    DDP_TEST_NONFINITE_RANK="1",
)
NONFINITE_ARGS = short_run(max_steps=None, local_batch_size=None, log_every=1, timeout_s=10)


def test_a_non_finite_gradient_is_skipped_on_every_rank_and_fails_the_run(tmp_path):
    """inf in rank 1's 2nd forward only: after backward every rank holds the same non-finite
    gradient, so both skip step 2, save step 1's finite weights, identical on both ranks, and exit
    1 with one line naming the step and the rank. Control: without the guard the run ends with
    exit 0 and non-finite weights."""
    out = tmp_path / "out"
    # what the guard computes is the claim: ranks started warm
    result = warm_ranks(
        SCRIPT, *NONFINITE_ARGS, "--output-dir", str(out), env=NONFINITE_ENV, check=False
    )
    assert "injecting inf into forward 2 on rank 1" in result.stderr
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: a non-finite gradient at step 2 (non-finite loss on ranks [1]); "
        "stopped with the weights of step 1"
    ], result.stderr[-3000:]
    summary = read_summary(out)
    assert summary["steps"] == 1 and summary["replicas_identical"]
    assert finite_weights(out)

    unguarded = variant(tmp_path, SKIP_ON_NONFINITE_GRADIENT, "            if False:\n")
    control = warm_ranks(
        unguarded, *NONFINITE_ARGS, "--output-dir", str(tmp_path / "unguarded"), env=NONFINITE_ENV
    )
    assert control.returncode == 0
    assert not finite_weights(tmp_path / "unguarded")


@pytest.mark.launchers
def test_a_stop_decided_from_one_ranks_own_loss_fails_the_job(tmp_path):
    """The guard decides from the all-reduced gradient, the same on every rank. A copy that
    decides from each rank's own loss stops rank 1 alone, and the job fails instead of ending:
    rank 1's next collective meets rank 0's gradient all-reduce."""
    local = variant(
        tmp_path, SKIP_ON_NONFINITE_GRADIENT, "            if not torch.isfinite(loss):\n"
    )
    failed = torchrun(
        local,
        *NONFINITE_ARGS,
        "--output-dir",
        str(tmp_path / "local"),
        env=NONFINITE_ENV,
        check=False,
        timeout=90,
    )
    assert failed.returncode != 0, failed.output[-3000:]
    assert not (tmp_path / "local" / "summary.json").exists()
    # gloo: "collective mismatch", or rank 0 waited for it in vain
    assert re.search(
        r"collective mismatch|Timed out|Connection (closed|reset) by peer", failed.output
    ), failed.output[-3000:]
