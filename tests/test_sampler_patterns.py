"""02_sampler_patterns: how DistributedSampler divides data, and the patterns around it.

The README's commands run under real torchrun (2 or 3 CPU processes, gloo), the other runs on ranks
forked from one warm process (tests/warm_ranks.py); the tests check the numbers the scripts write
against DistributedSampler itself, the formulas, and files on disk.
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.config import parse_config
from common.data import digits
from common.errors import ConfigError
from common.models import SmallCNN
from tests.paths import PYTHON, REPO, load_script
from tests.processes import clean_env, free_port, run, warm_command, warm_ranks
from tests.results import read_summary
from tests.torch_versions import pinned_torch_only

DIR = "02_sampler_patterns"
# The README's commands that the tests below run as written
# on fewer ranks, adding only --output-dir and --weights; the
# rest run once for the README's samples too (tests/sample_runs.py).
GATHER = "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/gather_predictions.py"
GATHER_PADDED = (
    "torchrun --standalone --nproc_per_node=3 02_sampler_patterns/gather_predictions.py --padded"
)
SCRIPTS = sorted(p.name for p in (REPO / DIR).glob("*.py"))


# ---------------------------------------------------------------- every script


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_wrong_flag_is_one_error_line_before_any_process_group(script, capsys):
    """Each script's config class refuses an unknown flag with
    ConfigError, which load_config (main's first call, before any
    process group) turns into one `error:` line and exit code 2."""
    module = load_script(f"{DIR}/{script}", script[:-3])
    config_class = re.search(r"load_config\((\w+)", (REPO / DIR / script).read_text()).group(1)
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        parse_config(getattr(module, config_class), ["--no-such-flag"])
    with pytest.raises(SystemExit) as exit_info:
        module.load_config(getattr(module, config_class), ["--no-such-flag"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "script,args,said",
    [
        ("weighted_sampler.py", ["--dataset", "fake"], "dataset: fake does not list its labels"),
        ("sharded_loading.py", ["--shards-dir", "{tmp}/missing"], "no shards in .*prepare_shards"),
    ],
)
def test_input_a_script_cannot_use_is_one_error_line(script, args, said, tmp_path):
    """Labels the weighted sampler cannot read; no shards to load."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run([PYTHON, REPO / DIR / script, *args, "--output-dir", tmp_path], timeout=60)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert re.match(f"error: {said}", result.stderr), result.stderr


# ---------------------------------------------------------------- 1. partition viewer


@pytest.fixture(scope="module")
def viewer(sample_run):
    """The README's real 3-rank run of the viewer on 10 samples; (stdout, partition.json)."""
    ran = sample_run("02-viewer").ok()  # 2 epochs, the default
    return ran.stdout, json.loads((ran.output_dir / "partition.json").read_text())


@pytest.mark.min_torch
def test_partition_viewer_prints_what_distributed_sampler_gives(viewer):
    n, w = 10, 3
    stdout, report = viewer
    assert report["world_size"] == w and report["num_samples"] == n
    cases = {(c["shuffle"], c["drop_last"], c["epoch"]) for c in report["results"]}
    assert cases == {
        (False, False, 0),
        (False, True, 0),
        (True, False, 0),
        (True, False, 1),
        (True, True, 0),
        (True, True, 1),
    }
    for case in report["results"]:
        for r in range(w):
            # What PyTorch itself gives this rank, built here independently of the script.
            sampler = DistributedSampler(
                range(n),
                num_replicas=w,
                rank=r,
                shuffle=case["shuffle"],
                seed=0,
                drop_last=case["drop_last"],
            )
            sampler.set_epoch(case["epoch"])
            assert case["indices"][r] == list(sampler)
            assert f"rank {r}: {list(sampler)}" in stdout


@pytest.mark.parametrize("n,w", [(10, 3), (10, 4), (7, 7), (5, 8), (16, 4), (1, 2)])
def test_partition_counts_follow_the_formulas(tmp_path, n, w):
    """Simulated ranks (in this process), many sizes: padding ceil(N/W), dropping floor(N/W)."""
    viewer_script = load_script(f"{DIR}/partition_viewer.py", "partition_viewer")
    viewer_script.main(
        ["--num-samples", str(n), "--simulate-world-size", str(w), "--output-dir", str(tmp_path)]
    )
    report = json.loads((tmp_path / "partition.json").read_text())
    for case in report["results"]:
        shards = case["indices"]
        reads = Counter(i for shard in shards for i in shard)
        if case["drop_last"]:
            assert [len(s) for s in shards] == [n // w] * w
            # disjoint: no index on two ranks, so the rest (n mod w) is never read this epoch
            assert all(c == 1 for c in reads.values())
        else:
            assert [len(s) for s in shards] == [math.ceil(n / w)] * w
            # the union covers the data set, so exactly the padding is repeated
            assert set(reads) == set(range(n))


def test_shuffle_is_the_same_on_every_rank_and_changes_with_set_epoch(viewer):
    n, w = 10, 3
    shuffled = {(c["drop_last"], c["epoch"]): c for c in viewer[1]["results"] if c["shuffle"]}
    for (drop_last, epoch), case in shuffled.items():
        orders = case["order"]  # the full permutation, as each rank derived it on its own
        assert all(order == orders[0] for order in orders)
        padded = orders[0] + orders[0][: math.ceil(n / w) * w - n]
        kept = padded if not drop_last else orders[0][: n // w * w]
        # each rank: every W-th index of the order
        assert case["indices"] == [kept[r::w] for r in range(w)]
    # the order: identity, or randperm seeded with seed + epoch (seed 0 here): set_epoch reshuffles
    for case in viewer[1]["results"]:
        expected = torch.randperm(
            n, generator=torch.Generator().manual_seed(0 + case["epoch"])
        ).tolist()
        assert case["order"][0] == (expected if case["shuffle"] else list(range(n)))
    # drop_last with shuffling leaves different samples unread in different epochs.
    unread = [
        set(range(n)) - {i for shard in shuffled[(True, e)]["indices"] for i in shard}
        for e in (0, 1)
    ]
    assert len(unread[0]) == len(unread[1]) == n % w and unread[0] != unread[1]


def test_without_set_epoch_or_with_different_seeds_the_split_goes_wrong():
    """Negative controls for the two rules: no set_epoch repeats epoch
    0's order; ranks with different seeds are no longer disjoint
    (nothing but the shared permutation keeps them apart)."""
    n, w = 100, 2
    sampler = DistributedSampler(range(n), num_replicas=w, rank=0, shuffle=True, seed=0)
    assert list(sampler) == list(sampler)  # a second epoch without set_epoch: the same order
    sampler.set_epoch(1)
    assert list(sampler) != list(
        DistributedSampler(range(n), num_replicas=w, rank=0, shuffle=True, seed=0)
    )
    same_seed = [
        set(DistributedSampler(range(n), num_replicas=w, rank=r, seed=0)) for r in range(w)
    ]
    own_seed = [set(DistributedSampler(range(n), num_replicas=w, rank=r, seed=r)) for r in range(w)]
    assert not same_seed[0] & same_seed[1] and own_seed[0] & own_seed[1]
    # padding is the default
    assert inspect.signature(DistributedSampler).parameters["drop_last"].default is False


# ---------------------------------------------------------------- 2. no-sampler pitfall


def test_plain_dataloader_duplicates_and_distributed_sampler_does_not(sample_run):
    # the README's command (its printed lines: its sample, tests/test_readme_text.py)
    s = read_summary(sample_run("02-no-sampler").ok().output_dir)
    n = s["dataset_size"]
    plain, fixed = s["no_sampler"], s["distributed_sampler"]
    assert plain["samples_per_rank"] == [n, n]  # every rank reads the whole data set ...
    assert plain["samples_read_by_several_ranks"] == n and plain["total_reads"] == 2 * n
    # ... in the same order: identical batches on both ranks
    assert plain["same_order_on_all_ranks"]
    assert fixed["samples_per_rank"] == [math.ceil(n / 2)] * 2
    assert fixed["samples_read_by_several_ranks"] == 0 and fixed["distinct_samples"] == n
    assert fixed["steps_per_rank"][0] < plain["steps_per_rank"][0]


# ---------------------------------------------------------------- 3. exact distributed evaluation


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.min_torch)])
def test_distributed_eval_equals_one_process(tmp_path, sample_run, world_size):
    # 3 ranks: the README's command (40 training steps,
    # the default); 1 and 2 ranks: 8 steps, to save time.
    if world_size == 3:
        tmp_path = sample_run("02-eval").ok().output_dir
    else:
        warm_ranks(
            f"{DIR}/distributed_eval.py",
            "--max-steps",
            "8",
            "--output-dir",
            str(tmp_path),
            nproc=world_size,
            timeout=180,
        )
    s = read_summary(tmp_path)
    n = s["test_size"]
    assert n % 2 and n % 3  # an odd size: neither 2 nor 3 ranks divide it
    # the README's table is its sample (tests/test_readme_text.py); ranks of 120, 120 and 119
    # samples: the mean of their means is off the exact value
    if world_size == 3:
        assert s["mean_of_rank_means"]["accuracy"] != s["exact"]["accuracy"]

    # Reference computed here, in one process, from the weights the run saved.
    model = SmallCNN(1, 10)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    model.eval()
    images, labels = digits().test.tensors
    with torch.no_grad():
        logits = model(images)
    correct = int((logits.argmax(1) == labels).sum())
    loss_sum = float(F.cross_entropy(logits.double(), labels, reduction="sum"))

    exact = s["exact"]
    assert exact["count"] == n == len(labels)
    assert exact["correct"] == correct  # the accuracy is exactly the one-process accuracy
    assert exact["loss_sum"] == pytest.approx(loss_sum, rel=1e-5)
    assert s["reference"]["correct"] == correct
    # The usual wrong versions count padded duplicates or miss samples whenever W does not divide N.
    assert s["sampler_padded"]["count"] == math.ceil(n / world_size) * world_size
    assert s["sampler_drop_last"]["count"] == n // world_size * world_size
    assert s["rank0_only"]["count"] == math.ceil(n / world_size)
    # The same checkpoint, evaluated here as 2 and as 8
    # ranks with drop_last would: 1 and 7 samples unread,
    # two different accuracies, both off the exact one.
    right = (logits.argmax(1) == labels).tolist()
    dropped = {
        w: [
            right[i]
            for r in range(w)
            for i in DistributedSampler(range(n), w, r, False, drop_last=True)
        ]
        for w in (2, 8)
    }
    assert [n - len(dropped[w]) for w in (2, 8)] == [1, 7]
    accuracies = {w: sum(d) / len(d) for w, d in dropped.items()}
    assert accuracies[2] != accuracies[8] and correct / n not in accuracies.values()


@pinned_torch_only("reads torch facts the README names")
def test_max_steps_0_evaluates_the_initial_model_and_torch_facts_of_section_3():
    script = load_script(f"{DIR}/distributed_eval.py", "distributed_eval")
    cfg = script.EvalConfig(max_steps=0)
    assert script.EvalConfig().max_steps == 40  # the README's "trains 40 DDP steps"
    model = SmallCNN(1, 10)
    before = [p.clone() for p in model.parameters()]
    launch = type("Launch", (), dict(world_size=2, rank=0))()
    # no step: no collective either
    script.train_briefly(cfg, launch, torch.device("cpu"), model, digits().train)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Why evaluation uses model.module: a DDP forward can
    # broadcast buffers, a collective (torch 2.14.1's docs).
    assert (
        "syncing (broadcasting) buffers of the module at beginning of the ``forward`` function"
        in " ".join(inspect.getdoc(DDP).split())
    )
    # Neither DDP nor the DataLoader shards a map-style
    # data set: the DataLoader asks for the rank only to
    # shard DataPipes (torch 2.14.1's source).
    loader_source = inspect.getsource(torch.utils.data.dataloader)
    assert loader_source.count("dist.get_rank()") == 1
    assert "datapipe must be an instance of IterDataPipe or MapDataPipe" in loader_source


# ----------------------------------------------------------------
# 4. per-sample predictions, gathered in order


@pytest.fixture(scope="module")
def predictions_setup(sample_run):
    """The weights file the README's gather run read (trained a little, as 01 writes it:
    tests/sample_runs.py) and the single-process predictions of those weights, made here."""
    weights = sample_run("02-gather").ok().output_dir / "weights" / "model.pt"
    model = SmallCNN(1, 10)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    test_images, test_labels = digits().test.tensors
    with torch.no_grad():
        # one process, the whole test set in one batch
        probabilities = model(test_images).softmax(1)
    return (
        weights,
        test_labels.tolist(),
        probabilities.argmax(1).tolist(),
        probabilities,
    )


def read_predictions(path):
    with open(path) as f:
        return [
            dict(
                index=int(r["index"]),
                label=int(r["label"]),
                prediction=int(r["prediction"]),
                probabilities=[float(r[f"p_{c}"]) for c in range(10)],
            )
            for r in csv.DictReader(f)
        ]


def assert_rows_equal_one_process(rows, predictions_setup):
    _, labels, predictions, probabilities = predictions_setup
    # every sample once, in data-set order
    assert [r["index"] for r in rows] == list(range(len(labels)))
    assert [r["label"] for r in rows] == labels
    assert [r["prediction"] for r in rows] == predictions  # row for row what one process predicts
    for row in rows:
        assert row["probabilities"] == pytest.approx(probabilities[row["index"]].tolist(), abs=1e-6)


def macro_f1_by_precision_and_recall(labels, predictions):
    """Independent of the script's formula: per class the harmonic mean of precision and recall."""
    scores = []
    for c in set(labels) | set(predictions):
        tp = sum(1 for y, p in zip(labels, predictions) if y == p == c)
        precision = tp / predictions.count(c) if predictions.count(c) else 0.0
        recall = tp / labels.count(c) if labels.count(c) else 0.0
        scores.append(2 * precision * recall / (precision + recall) if tp else 0.0)
    return sum(scores) / len(scores)


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.min_torch)])
def test_gathered_predictions_equal_one_process_row_for_row(
    tmp_path, sample_run, predictions_setup, world_size
):
    weights, labels, predictions, _ = predictions_setup
    flags = ["--weights", str(weights), "--output-dir", str(tmp_path)]
    if world_size == 3:  # the README's command, as written, on the weights above
        result = sample_run("02-gather").ok()
        tmp_path = result.output_dir
    else:  # on 2 ranks, started warm: the claim is what the script gathers
        result = warm_command(GATHER, *flags, nproc=world_size, timeout=180, check=True)
    n = len(labels)
    assert_rows_equal_one_process(read_predictions(tmp_path / "predictions.csv"), predictions_setup)
    s = read_summary(tmp_path)
    assert s["rows_per_rank"] == [len(range(r, n, world_size)) for r in range(world_size)]
    assert s["rows"] == n and s["repeated_indices"] == []
    assert len(set(predictions)) > 5  # a real classifier, so the F1 check below means something
    assert s["macro_f1"] == pytest.approx(
        macro_f1_by_precision_and_recall(labels, predictions), abs=1e-12
    )
    assert s["accuracy"] == pytest.approx(
        sum(y == p for y, p in zip(labels, predictions)) / n, abs=1e-12
    )
    assert f"macro-F1 {s['macro_f1']:.6f}" in result.stdout and "every index once" in result.stdout
    # The file stores probabilities with 6 significant digits: why the test compares them to 1e-6.
    with open(tmp_path / "predictions.csv") as f:
        stored = [
            value for row in csv.DictReader(f) for key, value in row.items() if key.startswith("p_")
        ]
    assert all(value == f"{float(value):.6g}" for value in stored) and max(map(len, stored)) <= 12


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathering_over_a_padded_distributed_sampler_repeats_samples(
    tmp_path, sample_run, predictions_setup, world_size
):
    """Negative control: the same gather over
    DistributedSampler(drop_last=False) has ceil(N/W)*W rows."""
    weights, labels, _, _ = predictions_setup
    flags = ["--weights", str(weights), "--output-dir", str(tmp_path)]
    if world_size == 3:  # the README's command, as written, on the same weights
        tmp_path = sample_run("02-gather-padded").ok().output_dir
    else:  # on 2 ranks, started warm: the claim is what the script gathers
        warm_command(GATHER_PADDED, *flags, nproc=world_size, timeout=180, check=True)
    n = len(labels)
    padded_total = math.ceil(n / world_size) * world_size
    rows = read_predictions(tmp_path / "predictions.csv")
    assert len(rows) == padded_total == 360 != n
    repeats = Counter(r["index"] for r in rows)
    # the first ones again
    assert sorted(i for i, c in repeats.items() if c > 1) == list(range(padded_total - n))
    assert read_summary(tmp_path)["rows_per_rank"] == [math.ceil(n / world_size)] * world_size
    # Each row carries its index, so dropping rows whose
    # index was seen before gives back the exact file.
    seen, unique = set(), []
    for r in rows:
        if r["index"] not in seen:
            seen.add(r["index"])
            unique.append(r)
    assert_rows_equal_one_process(unique, predictions_setup)


def test_rank_0_sorts_by_index_and_refuses_a_missing_or_repeated_index():
    in_dataset_order = load_script(
        f"{DIR}/gather_predictions.py", "gather_predictions"
    ).in_dataset_order
    # index, then any columns; as ranks deliver them
    rows = torch.tensor([[2.0, 7.0], [0.0, 5.0], [1.0, 6.0]])
    assert in_dataset_order(rows, 3).tolist() == [[0.0, 5.0], [1.0, 6.0], [2.0, 7.0]]
    for broken in (rows[:2], torch.cat([rows, rows[:1]])):  # index 1 missing; index 2 twice
        with pytest.raises(RuntimeError, match="an index is missing or repeated"):
            in_dataset_order(broken, 3)


def test_rows_travel_as_one_float64_tensor_through_gather():
    """What the README says of the rows and of torch's
    gather / gather_object (torch 2.14.1's source)."""
    script = load_script(f"{DIR}/gather_predictions.py", "gather_predictions")
    images, labels = digits().test.tensors
    loader = [(torch.arange(5), images[:5], labels[:5])]
    rows = script.predict(SmallCNN(1, 10), loader, torch.device("cpu"), 10)
    assert rows.dtype == torch.float64 and rows.shape == (5, 10 + 2)  # index, label, C logits
    assert rows[:, 0].tolist() == [0, 1, 2, 3, 4] and rows[:, 1].tolist() == labels[:5].tolist()
    source = (REPO / DIR / "gather_predictions.py").read_text()
    assert "dist.gather(padded, gathered, dst=0)" in source and "all_gather(counts" in source
    assert "all tensors to be the same size" in inspect.getdoc(torch.distributed.gather)
    gather_object = inspect.getsource(torch.distributed.gather_object)
    assert re.search(
        r"all_gather\(object_size_list.*resize_\(max_object_size\).*\bgather\(", gather_object, re.S
    )
    assert (
        "incurs GPU -> CPU transfer since tensors would be\n        pickled. Please consider "
        "using :func:`gather`" in gather_object
    )


@pinned_torch_only("expects nothing on stderr but the error (older gloo logs each connection)")
def test_gather_predictions_refuses_weights_that_do_not_fit(tmp_path):
    # a head for 7 classes, not 10
    torch.save(SmallCNN(1, 7).state_dict(), tmp_path / "seven_classes.pt")
    # This refusal comes after the process group (of one)
    # has started: its own port, not the default 29500
    # that other tests running side by side may hold.
    unfitting = run(
        [
            PYTHON,
            REPO / DIR / "gather_predictions.py",
            "--weights",
            tmp_path / "seven_classes.pt",
            "--output-dir",
            tmp_path,
        ],
        timeout=120,
        env=clean_env(MASTER_PORT=str(free_port())),
    )
    assert unfitting.returncode == 2 and unfitting.stdout == ""
    assert (
        unfitting.stderr.startswith("error: weights:")
        and "does not fit --model small_cnn on digits" in unfitting.stderr
    )
    assert unfitting.stderr.count("\n") == 1 and "size mismatch" in unfitting.stderr


def test_gather_predictions_refuses_missing_weights_and_files_that_are_no_state_dict(
    tmp_path, capsys
):
    read_weights = load_script(f"{DIR}/gather_predictions.py", "gather_predictions").read_weights
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    torch.save({"fc.weight": torch.zeros(2)}, tmp_path / "state.pt")
    assert set(read_weights(tmp_path / "state.pt")) == {"fc.weight"}  # a state_dict passes
    for name, said in (
        ("none.pt", "no file .*`python 01_basic_ddp/train.py`"),
        ("notes.pt", "cannot read"),
        ("tensor.pt", ".* holds a Tensor, not a state_dict"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            read_weights(tmp_path / name)
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and out == "" and err.count("\n") == 1
        assert re.match(f"error: weights: {said}", err), err


# ---------------------------------------------------------------- 5. class-balanced sampler

TOLERANCE_ALL, TOLERANCE_RANK = 0.03, 0.06  # the README states these


@pytest.mark.min_torch
def test_weighted_sampler_is_disjoint_and_balanced(sample_run):
    w = 2
    s = read_summary(sample_run("02-weighted").ok().output_dir)  # the README's command
    labels = torch.tensor(s["labels"])
    k = len(s["class_counts_before"])
    before = torch.tensor(s["class_counts_before"]) / len(labels)
    assert (before - 1 / k).abs().max() > 2 * TOLERANCE_ALL  # the data set really is imbalanced
    for epoch in s["epochs"]:
        ranks = [set(ix) for ix in epoch["indices"]]
        assert all(not (ranks[a] & ranks[b]) for a in range(w) for b in range(a + 1, w))  # disjoint
        assert epoch["indices_in_several_ranks"] == 0
        for ix, hist in zip(epoch["indices"], epoch["histograms"]):
            assert len(ix) == math.ceil(len(labels) / w)
            # the loader delivered these
            assert torch.bincount(labels[ix], minlength=k).tolist() == hist
            freq = torch.tensor(hist) / sum(hist)
            assert (freq - 1 / k).abs().max() < TOLERANCE_RANK
        total = torch.tensor(epoch["total"]) / sum(epoch["total"])
        assert (total - 1 / k).abs().max() < TOLERANCE_ALL
    assert s["epochs"][0]["indices"] != s["epochs"][1]["indices"]  # set_epoch: new draws each epoch
    # With replacement, rare samples repeat within a rank:
    # a drawn 9 is far more often a repeat than a drawn 0.
    for epoch in s["epochs"]:
        for ix in epoch["indices"]:
            draws, rarest = Counter(ix), k - 1

            # of the draws of class c, the share that repeats an index already drawn
            def repeated_share(c):
                times = [n for i, n in draws.items() if labels[i] == c]
                return (sum(times) - len(times)) / sum(times)

            assert repeated_share(rarest) > 2 * repeated_share(0)


def test_class_balanced_shares_are_disjoint_with_every_class_split_evenly():
    """The sampler's first step: one shuffle on every rank, grouped by class, dealt round-robin."""
    script = load_script(f"{DIR}/weighted_sampler.py", "weighted_sampler")
    labels = torch.tensor([0] * 50 + [1] * 7 + [2] * 3)
    w = 3
    shares = []
    for r in range(w):
        sampler = script.DistributedClassBalancedSampler(labels, w, r, num_samples=10_000, seed=5)
        sampler.set_epoch(2)
        # 10,000 draws with replacement: every sample of the share appears
        shares.append(set(sampler))
    # disjoint, together all
    assert sorted(i for share in shares for i in share) == list(range(len(labels)))
    for c in range(3):
        per_rank = [sum(1 for i in share if labels[i] == c) for share in shares]
        assert max(per_rank) - min(per_rank) <= 1  # ~1/W of every class, even of the rarest

    # The labels come from .targets (torchvision data sets) or the digits' label tensor.
    class Targets:
        targets = [3, 1, 4]

    assert script.labels_of(Targets()).tolist() == [3, 1, 4]
    assert script.labels_of(digits().train).tolist() == digits().train.tensors[1].tolist()
    # torch's WeightedRandomSampler takes no rank or world
    # size: on every rank it draws from all of the data.
    assert not {"rank", "num_replicas"} & set(
        inspect.signature(torch.utils.data.WeightedRandomSampler).parameters
    )


# ---------------------------------------------------------------- 6. sharded loading


@pytest.mark.min_torch
def test_each_rank_opens_only_its_own_shards(tmp_path, sample_run):
    shards, w = sample_run("02-shards").ok().output_dir, 3  # the README's 12 shards
    out = tmp_path / "run"
    # Two DataLoader workers per rank: they must split the rank's files again, not repeat them.
    warm_ranks(
        f"{DIR}/sharded_loading.py",
        "--shards-dir",
        str(shards),
        "--epochs",
        "2",
        "--num-workers",
        "2",
        "--output-dir",
        str(out),
        nproc=w,
        timeout=180,
    )
    manifest = json.loads((shards / "manifest.json").read_text())
    files = [entry["file"] for entry in manifest["shards"]]
    stored = {f: torch.load(shards / f, weights_only=True) for f in files}
    content = {f: set(stored[f]["indices"].tolist()) for f in files}
    assert [entry["samples"] for entry in manifest["shards"]] == [len(content[f]) for f in files]
    # Written in a fixed shuffled order (--seed 0), each sample in one shard, so every shard mixes
    # the classes.
    order = torch.randperm(manifest["total"], generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat([stored[f]["indices"] for f in files]), order)
    assert all(len(set(stored[f]["labels"].tolist())) >= 8 for f in files)

    # What each rank really opened, from the log its data set writes on every open().
    opened = {}
    for r in range(w):
        for line in (out / "access" / f"rank{r}.log").read_text().split("\n"):
            if line:
                epoch, name = line.split()
                opened.setdefault((int(epoch), r), []).append(name)
    summary = read_summary(out)
    for epoch, ranks in enumerate(summary["epochs"]):
        per_rank = [opened[(epoch, r)] for r in range(w)]
        # disjoint, together all, no file opened twice
        assert sorted(n for names in per_rank for n in names) == sorted(files)
        for r, record in enumerate(ranks):
            assert sorted(per_rank[r]) == sorted(record["shards"])
            # A rank's samples came from its own files, and from all of them.
            assert set(record["indices"]) == set().union(*(content[f] for f in per_rank[r]))
        reads = Counter(i for record in ranks for i in record["indices"])
        # all, once
        assert set(reads) == set(range(manifest["total"])) and set(reads.values()) == {1}
        assert len({record["steps"] for record in ranks}) == 1  # equal step counts on all ranks
        # The shard list shuffled with seed + epoch (seed 0), every W-th file.
        shuffled = torch.randperm(
            len(files), generator=torch.Generator().manual_seed(epoch)
        ).tolist()
        assert [record["shards"] for record in ranks] == [
            [files[i] for i in shuffled[r::w]] for r in range(w)
        ]
    # shards move between ranks from epoch to epoch
    assert sorted(opened[(0, 0)]) != sorted(opened[(1, 0)])


def test_shards_are_shuffled_within_and_uneven_shard_counts_leave_ranks_unequal(tmp_path):
    script = load_script(f"{DIR}/sharded_loading.py", "sharded_loading")
    torch.save(
        dict(
            images=torch.zeros(8, 1, 2, 2), labels=torch.arange(8), indices=torch.arange(100, 108)
        ),
        tmp_path / "shard-00000.pt",
    )
    stream = script.ShardStream(tmp_path, seed=3, access_log=tmp_path / "log")
    stream.set_epoch(1, ["shard-00000.pt"])
    read = [int(index) for _, _, index in stream]
    assert (
        read
        == (100 + torch.randperm(8, generator=torch.Generator().manual_seed(3 + 1))).tolist()
        != sorted(read)
    )
    # 12 shards on 5 ranks: some ranks get 3 files, others
    # 2, so the step plan (the smallest) leaves data over.
    files = [f"shard-{i:05d}.pt" for i in range(12)]
    assert sorted(len(script.shards_for(r, 5, files, 0, 0)) for r in range(5)) == [2, 2, 2, 3, 3]
    # Why the IterableDataset splits its files among loader workers: torch's own warning (2.14.1).
    assert "multi-process loading yields duplicate data" in inspect.getsource(
        torch.utils.data.IterableDataset
    )
    # DistributedSampler sizes and indexes the whole data set (a map-style one) on every rank.
    assert "indices = torch.randperm(len(self.dataset), generator=g)" in inspect.getsource(
        DistributedSampler
    )


# ---------------------------------------------------------------- 7. uneven inputs


def per_step(summary):
    """{(epoch, step): [(gradient digest, weights digest) of each rank that ran that step]}."""
    by_step = {}
    for digests in summary["digests"]:
        for epoch, step, grads, weights in digests:
            by_step.setdefault((epoch, step), []).append((grads, weights))
    return by_step


@pytest.mark.min_torch
def test_join_finishes_uneven_inputs_with_identical_gradients(sample_run):
    w = 3
    # the README's command on warm ranks (the claim is what Join computes; the run without a fix
    # below keeps torchrun): exit code 0, within the timeout; 2 epochs, the default
    s = read_summary(sample_run("02-uneven-join").ok().output_dir)
    assert len(set(s["batches_per_rank"])) == w  # the inputs really are uneven
    n = len(digits().train)  # rank r: its strided share less r * 64 (--uneven)
    assert s["samples_per_rank"] == [len(range(r, n, w)) - 64 * r for r in range(w)]
    # every rank ran all of its batches
    assert s["steps_per_rank"] == [2 * b for b in s["batches_per_rank"]]
    by_step = per_step(s)
    # same gradients and weights at every step
    assert all(len(set(ranks)) == 1 for ranks in by_step.values())
    # steps with a joined rank shadowing the rest
    assert any(1 < len(ranks) < w for ranks in by_step.values())
    assert s["replicas_identical"]


def test_join_with_momentum_lets_weights_drift_in_the_next_epoch(tmp_path):
    """The README's caveat: joined ranks skip optimizer.step(), so their momentum lags."""
    warm_ranks(
        f"{DIR}/uneven_inputs.py",
        "--fix",
        "join",
        "--epochs",
        "2",
        "--momentum",
        "0.9",
        "--output-dir",
        str(tmp_path),
        nproc=2,
        timeout=180,
    )
    s = read_summary(tmp_path)
    by_step = per_step(s)
    # gradients: still all-reduced
    assert all(len({g for g, _ in ranks}) == 1 for ranks in by_step.values())
    assert all(len({p for _, p in by_step[(0, k)]}) == 1 for k in range(s["batches_per_rank"][1]))
    # epoch 2: the weights differ between the ranks
    assert len({p for _, p in by_step[(1, 0)]}) == 2
    assert s["replicas_identical"]  # ... and the end-of-Join sync hides it from a final checksum


def test_drop_last_runs_the_smallest_rank_count(sample_run):
    w = 3  # the README's command, on warm ranks
    s = read_summary(sample_run("02-uneven-drop-last").ok().output_dir)
    assert s["batches_per_rank"][0] > s["batches_per_rank"][-1]
    assert s["steps_per_rank"] == [2 * min(s["batches_per_rank"])] * w  # 2 epochs (the default)
    assert all(len(ranks) == w and len(set(ranks)) == 1 for ranks in per_step(s).values())
    assert s["replicas_identical"]


def test_without_a_fix_uneven_inputs_time_out_naming_the_rank_that_never_arrived(sample_run):
    """Rank 1 runs out of batches and waits at the end-of-epoch barrier while rank 0 waits in its
    next gradient all-reduce: at --timeout-s gloo's monitored_barrier names rank 0."""
    result = sample_run("02-uneven-none")  # the README's command
    out = result.output
    assert result.returncodes == (1,)  # torchrun's, for a failed rank
    assert (
        "[rank1]: RuntimeError: Rank 1 successfully reached monitoredBarrier, but received "
        "errors while "
        "waiting for send/recv from rank 0"
    ) in out, out[-3000:]
    assert "Timed out waiting 5000ms" in out
    rank1 = "\n".join(line for line in out.splitlines() if line.startswith("[rank1]:"))
    assert "dist.monitored_barrier()" in rank1, rank1
    assert not (result.output_dir / "summary.json").exists()
    assert "ChildFailedError" in out
    rank0 = [line for line in out.splitlines() if line.startswith("[rank0]:")]
    rank0_error = [line for line in rank0 if line.startswith("[rank0]: RuntimeError:")]
    # rank 0, unless torchrun stopped it first: in its gradient all-reduce, rank 1 gone or timed out
    if rank0_error:
        assert any("loss.backward()" in line for line in rank0), rank0
        assert (
            "Connection closed by peer" in rank0_error[0]
            or "Timed out waiting 5000ms for recv" in rank0_error[0]
        )
