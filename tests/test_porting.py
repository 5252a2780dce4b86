"""porting/: an ordinary one-process script and its DDP port. Each change the port makes is shown
by what a run does (porting/README.md names the test beside each claim): the plain script trains,
the port trains under torchrun with loader workers, saves once, evaluates every test image once,
gives each rank its own half of each epoch and its own random numbers, takes the step of one
process with the global batch, and refuses bad input before its process group. The break inside
rank 0's `if` is shown hanging.

The README's commands run from a folder of their own (`work`), which links porting/ and holds the
digits folder they make. Runs whose claim is not torchrun's start their ranks warm
(tests/README.md, "How ranks start"). Instruments go in from outside the scripts: a sitecustomize
(INSTRUMENTS) that logs saves and random states, turns dropout off, or dumps the stacks of a hung
run, and tests/record, which logs every rank's training batches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.paths import REPO, load_script
from tests.processes import clean_env, command_argv, free_port, run, warm_command, warm_ranks
from tests.results import relative_difference

MAKE = "python porting/make_digits_folder.py data/digits"
PLAIN = "python porting/train_plain.py --data-dir data/digits --save-dir runs/plain"
PORT = (
    "torchrun --standalone --nproc_per_node=2 porting/train_ddp.py --data-dir data/digits "
    "--save-dir runs/ddp --num-workers 2"
)
TRAIN_SIZE, TEST_SIZE = 1438, 359  # the digits folder's; 359 is odd: 2 ranks hold 180 and 179
EPOCHS = 3  # the scripts' default
TEST_LINE = re.compile(r"^Test set: average loss (\d+\.\d{4}), accuracy (\d+)/(\d+)$", re.M)
TRAIN_LINE = re.compile(r"^Train epoch (\d+) \[(\d+)/(\d+)\] loss (\d+\.\d+)$", re.M)

# The fix the port makes (every rank leaves the loop together), and the break put back inside
# rank 0's `if`, as a port that only wrapped the logging block would have it.
FIXED_BREAK = """\
            if dist.get_rank() == 0:
                print(f"Train epoch {epoch} [{done}/{total}] loss {loss.item():.6f}")
            # outside rank 0's `if`: every rank leaves the loop at the same step
            if args.dry_run:
                break
"""
RANK0_BREAK = """\
            if dist.get_rank() == 0:
                print(f"Train epoch {epoch} [{done}/{total}] loss {loss.item():.6f}")
                if args.dry_run:
                    break
"""

INSTRUMENTS = '''"""Test-only instruments for porting/'s scripts (tests/test_porting.py), imported
at start-up; only in ranks started warm, where torch is imported already."""
import os

LOG = os.environ.get("PORTING_TEST_LOG", "")


def _log(line):
    with open(LOG, "a") as f:
        f.write(f"rank{os.environ.get('RANK', '-')} {line}\\n")


if LOG:
    import hashlib

    import torch

    save = torch.save

    def logged_save(obj, path, *args, **kwargs):
        _log(f"save {os.path.basename(path)}")
        return save(obj, path, *args, **kwargs)

    torch.save = logged_save
    dropout, drawn = torch.nn.Dropout.forward, []

    def logged_dropout(self, x):
        if self.training and not drawn:  # the random state at this process's first dropout
            drawn.append(True)
            _log("rng " + hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
        return dropout(self, x)

    torch.nn.Dropout.forward = logged_dropout

if os.environ.get("PORTING_TEST_NO_DROPOUT"):
    import torch

    torch.nn.Dropout.forward = lambda self, x: x

if os.environ.get("PORTING_TEST_DUMP_AFTER_S"):
    # each rank's stacks after the process group has stood N seconds (rank 1 a second later, so
    # that the two dumps do not interleave); gloo gives up at 2N
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    init = dist.init_process_group
    after = float(os.environ["PORTING_TEST_DUMP_AFTER_S"])

    def init_and_arm(*args, **kwargs):
        init(*args, **kwargs, timeout=timedelta(seconds=2 * after))
        faulthandler.dump_traceback_later(after + int(os.environ["RANK"]))

    dist.init_process_group = init_and_arm

if os.environ.get("DDP_TEST_RECORD_DIR"):  # one sitecustomize a process: tests/record's too
    import runpy

    runpy.run_path(RECORD)  # its path: written in by the `work` fixture
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder for the README's commands: porting/ linked in, the digits folder made by the
    README's command, and the instruments (INSTRUMENTS) in inject/."""
    work = tmp_path_factory.mktemp("porting")
    (work / "porting").symlink_to(REPO / "porting")
    digits_folder(work)
    (work / "inject").mkdir()
    record = REPO / "tests" / "record" / "sitecustomize.py"
    instruments = INSTRUMENTS.replace("runpy.run_path(RECORD)", f"runpy.run_path({str(record)!r})")
    (work / "inject" / "sitecustomize.py").write_text(instruments)
    return work


def digits_folder(work: Path) -> None:
    """The README's command that makes data/digits, run as written in `work`."""
    run(command_argv(MAKE), 120, env=user_env(), cwd=work, check=True)


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: nothing of this repository on PYTHONPATH (the scripts import no `common`)."""
    return clean_env(PYTHONPATH="", **extra)


def instrumented(work: Path, log: Path, **extra: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(work / "inject"), PORTING_TEST_LOG=str(log), **extra)


def test_the_digits_folder_holds_every_image_once_as_an_8x8_grayscale_png(work):
    root = work / "data" / "digits"
    for split, size in (("train", TRAIN_SIZE), ("test", TEST_SIZE)):
        files = sorted((root / split).glob("*/*.png"))
        assert len(files) == size and {f.parent.name for f in files} == set("0123456789")
        with Image.open(files[0]) as image:
            assert (image.mode, image.size) == ("L", (8, 8))
    names = {f.name for f in root.glob("*/*/*.png")}  # the data set's row numbers
    assert names == {f"{row:04d}.png" for row in range(TRAIN_SIZE + TEST_SIZE)}


# --- the plain script


@pytest.fixture(scope="module")
def plain_run(work):
    """The README's plain command, as written: a real interpreter, one process."""
    return run(command_argv(PLAIN), 300, env=user_env(), cwd=work, check=True).stdout


def test_the_plain_script_trains_and_saves_a_model_every_epoch(work, plain_run):
    losses = [float(loss) for loss, _, _ in TEST_LINE.findall(plain_run)]
    assert len(losses) == EPOCHS and losses == sorted(losses, reverse=True), plain_run
    saved = sorted(p.name for p in (work / "runs" / "plain").iterdir())
    assert saved == [f"digits_cnn_{epoch}.pt" for epoch in range(1, EPOCHS + 1)]


# --- the port under torchrun


def test_the_port_runs_under_torchrun_with_two_loader_workers_per_rank(work):
    """The README's torchrun command (one epoch of it), real torchrun: workers started by
    forkserver load the data set with its module-level transform, and the run ends with exit 0."""
    argv = command_argv(PORT) + ["--epochs", "1", "--save-dir", "runs/torchrun"]
    out = run(argv, 300, env=user_env(), cwd=work, check=True).stdout
    [(_, correct, count)] = TEST_LINE.findall(out)
    assert int(count) == TEST_SIZE and int(correct) > TEST_SIZE // 2, out
    assert [p.name for p in (work / "runs" / "torchrun").iterdir()] == ["digits_cnn_1.pt"]


@pytest.fixture(scope="module")
def port_run(work):
    """The README's torchrun command for its default 3 epochs, ranks started warm, without loader
    workers (the test above has them); with every save, random state and training batch logged."""
    out = work / "port_run"
    result = warm_command(
        PORT,
        "--num-workers",
        "0",
        "--save-dir",
        str(out / "saved"),
        env=instrumented(work, out / "log", DDP_TEST_RECORD_DIR=str(out / "record")),
        cwd=work,
        check=True,
        timeout=180,
    )
    return out, result.stdout


def test_the_port_saves_once_per_epoch_on_rank_0_a_state_dict_the_plain_model_loads(port_run):
    out, _ = port_run
    saves = [line for line in (out / "log").read_text().splitlines() if " save " in line]
    assert saves == [f"rank0 save digits_cnn_{epoch}.pt" for epoch in range(1, EPOCHS + 1)]
    plain = load_script("porting/train_plain.py", "porting_train_plain")
    state = torch.load(out / "saved" / f"digits_cnn_{EPOCHS}.pt", weights_only=True)
    plain.Net().load_state_dict(state)  # strict: no "module." prefix, nothing missing
    # the wrapper's own state_dict (every name "module.<name>"), as the README quotes its refusal
    wrapped = {f"module.{name}": tensor for name, tensor in state.items()}
    with pytest.raises(
        RuntimeError, match=r'Unexpected key\(s\) in state_dict: "module\.conv1\.weight", '
    ):
        plain.Net().load_state_dict(wrapped)


def test_the_port_prints_once_and_counts_every_test_image_once(port_run):
    _, stdout = port_run
    tests = TEST_LINE.findall(stdout)
    assert [int(count) for _, _, count in tests] == [TEST_SIZE] * EPOCHS, stdout
    # rank 0's lines only: 12 batches of 64 a rank an epoch, logged at batches 0 and 10
    progress = TRAIN_LINE.findall(stdout)
    assert [(int(e), int(done)) for e, done, _, _ in progress] == [
        (epoch, done) for epoch in range(1, EPOCHS + 1) for done in (0, 640)
    ], stdout
    assert {int(total) for _, _, total, _ in progress} == {TRAIN_SIZE // 2}  # this rank's


def test_each_rank_reads_its_own_half_of_each_epoch_in_a_new_order(port_run):
    out, _ = port_run
    read = {}  # (rank, epoch): the sample indices in the order read
    for rank in (0, 1):
        for line in (out / "record" / f"batches.rank{rank}.txt").read_text().splitlines():
            epoch, indices = line.split()
            read.setdefault((rank, int(epoch)), []).extend(map(int, indices.split(",")))
    assert sorted({epoch for _, epoch in read}) == list(range(1, EPOCHS + 1))  # set_epoch's
    for epoch in range(1, EPOCHS + 1):
        halves = [read[0, epoch], read[1, epoch]]
        assert [len(h) for h in halves] == [TRAIN_SIZE // 2] * 2
        assert sorted(halves[0] + halves[1]) == list(range(TRAIN_SIZE))  # disjoint, complete
    assert read[0, 1] != read[0, 2] != read[0, 3]


def test_each_rank_draws_its_own_random_numbers_after_the_wrap(port_run):
    """seed + rank after the DDP wrap: the ranks' random states differ at their first dropout.
    With one seed only they would be equal (the same draws from the same seed)."""
    out, _ = port_run
    states = dict(
        line.split(" rng ") for line in (out / "log").read_text().splitlines() if " rng " in line
    )
    assert states.keys() == {"rank0", "rank1"} and states["rank0"] != states["rank1"]


def test_the_port_learns_though_its_numbers_are_not_the_plain_scripts(plain_run, port_run):
    """Another order, other dropout masks, twice the batch: other losses, and a model as good."""
    _, stdout = port_run
    port, plain = TEST_LINE.findall(stdout), TEST_LINE.findall(plain_run)
    losses = [float(loss) for loss, _, _ in port]
    assert losses == sorted(losses, reverse=True) and int(port[-1][1]) >= 0.85 * TEST_SIZE, stdout
    assert port != plain


# --- the global batch


def test_two_ranks_take_the_same_first_step_as_one_process_with_twice_the_batch(work, tmp_path):
    """Dropout off (the instruments), one step (--dry-run, one epoch): 2 ranks at --batch-size 32
    end with the weights of 1 rank at 64, not of 1 rank at 32. The global batch is 64."""
    weights = {}
    for nproc, batch in ((2, 32), (1, 64), (1, 32)):
        saved = tmp_path / f"{nproc}x{batch}"
        warm_command(
            PORT,
            *("--num-workers", "0", "--dry-run", "--epochs", "1"),
            *("--batch-size", str(batch), "--save-dir", str(saved)),
            nproc=nproc,
            env=instrumented(work, tmp_path / "log", PORTING_TEST_NO_DROPOUT="1"),
            cwd=work,
            check=True,
        )
        weights[nproc, batch] = torch.load(saved / "digits_cnn_1.pt", weights_only=True)
    assert relative_difference(weights[2, 32], weights[1, 64]) < 1e-5
    assert relative_difference(weights[2, 32], weights[1, 32]) > 1e-3


# --- the traps


def test_a_break_inside_rank_0s_logging_if_hangs_both_ranks(work, tmp_path):
    """The port with `if args.dry_run: break` inside rank 0's `if`: rank 0 leaves the loop after its
    first line and waits in test()'s all_reduce, rank 1 waits in its next training step. Nothing
    more is printed; gloo gives up at the process group's timeout (here 12 s, by default 30 min).
    Each rank's stack is dumped after 6 s (faulthandler, the instruments)."""
    source = (REPO / "porting" / "train_ddp.py").read_text()
    assert source.count(FIXED_BREAK) == 1
    broken = tmp_path / "train_ddp.py"
    broken.write_text(source.replace(FIXED_BREAK, RANK0_BREAK))
    env = instrumented(work, tmp_path / "log", PORTING_TEST_DUMP_AFTER_S="6")
    result = warm_ranks(
        broken, "--dry-run", "--data-dir", "data/digits", env=env, cwd=work, check=False
    )
    assert result.returncode != 0
    assert len(TRAIN_LINE.findall(result.stdout)) == 1 and "Test set" not in result.stdout
    where = re.escape(f'File "{broken}", line ')
    assert re.search(rf"{where}\d+ in test\n", result.stderr), result.stderr[-3000:]
    assert re.search(rf"{where}\d+ in train\n", result.stderr), result.stderr[-3000:]
    assert "Timed out waiting 12000ms for recv operation to complete" in result.stderr


@pytest.mark.parametrize("script", ["train_plain.py", "train_ddp.py"])
def test_a_data_dir_without_train_and_test_is_one_error_line_and_exit_2(work, script):
    """The port's rank 0 runs alone while WORLD_SIZE says 2: checked after init_process_group, the
    data folder would never be reported, as rank 0 would wait there for rank 1."""
    (work / "empty").mkdir(exist_ok=True)
    env = user_env()
    if script == "train_ddp.py":
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(free_port()))
    script = work / "porting" / script
    result = warm_ranks(
        script, "--data-dir", "empty", nproc=0, env=env, cwd=work, timeout=60, check=False
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: empty has no train/ folder; make one with "
        "python porting/make_digits_folder.py empty"
    ]
