"""02_sampler_patterns: how DistributedSampler divides data, and the patterns around it.

Every script runs under real torchrun (2 or 3 CPU processes, gloo); the tests check the
numbers the scripts write against DistributedSampler itself, the formulas, and files on disk.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from common.data import digits
from common.models import SmallCNN
from tests.helpers import PYTHON, REPO, clean_env, free_port, load_script, read_summary, run, torchrun

DIR = "02_sampler_patterns"


# ---------------------------------------------------------------- 1. partition viewer

@pytest.fixture(scope="module")
def viewer(tmp_path_factory):
    """One real 3-rank run of the viewer on 10 samples; (stdout, partition.json)."""
    out = tmp_path_factory.mktemp("viewer")
    result = torchrun(f"{DIR}/partition_viewer.py", "--num-samples", "10", "--epochs", "2",
                      "--output-dir", str(out), nproc=3)
    return result.stdout, json.loads((out / "partition.json").read_text())


def test_partition_viewer_prints_what_distributed_sampler_gives(viewer):
    n, w = 10, 3
    stdout, report = viewer
    assert report["world_size"] == w and report["num_samples"] == n
    cases = {(c["shuffle"], c["drop_last"], c["epoch"]) for c in report["results"]}
    assert cases == {(False, False, 0), (False, True, 0), (True, False, 0), (True, False, 1), (True, True, 0), (True, True, 1)}
    for case in report["results"]:
        for r in range(w):
            # What PyTorch itself gives this rank, built here independently of the script.
            sampler = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=case["shuffle"],
                                         seed=0, drop_last=case["drop_last"])
            sampler.set_epoch(case["epoch"])
            assert case["indices"][r] == list(sampler)
            assert f"rank {r}: {list(sampler)}" in stdout
    # The 10-sample, 3-rank split without shuffling, as printed.
    assert "rank 1: [1, 4, 7, 0]   <- repeats [0]" in stdout
    assert "rank 2: [2, 5, 8]" in stdout and "never read this epoch: [9]" in stdout


@pytest.mark.parametrize("n,w", [(10, 3), (10, 4), (7, 7), (5, 8), (16, 4), (1, 2)])
def test_partition_counts_follow_the_formulas(tmp_path, n, w):
    """Simulated ranks (in this process), many sizes: padding ceil(N/W), dropping floor(N/W)."""
    viewer_script = load_script(f"{DIR}/partition_viewer.py", "partition_viewer")
    viewer_script.main(["--num-samples", str(n), "--simulate-world-size", str(w), "--output-dir", str(tmp_path)])
    report = json.loads((tmp_path / "partition.json").read_text())
    for case in report["results"]:
        shards = case["indices"]
        reads = Counter(i for shard in shards for i in shard)
        if case["drop_last"]:
            assert [len(s) for s in shards] == [n // w] * w
            assert all(c == 1 for c in reads.values())  # disjoint: no index on two ranks
            assert len(reads) == n // w * w  # the rest (n mod w) is never read this epoch
        else:
            assert [len(s) for s in shards] == [math.ceil(n / w)] * w
            assert set(reads) == set(range(n))  # the union covers the data set
            assert sum(reads.values()) - n == math.ceil(n / w) * w - n  # exactly the padding is repeated


def test_shuffle_is_the_same_on_every_rank_and_changes_with_set_epoch(viewer):
    n, w = 10, 3
    shuffled = {(c["drop_last"], c["epoch"]): c for c in viewer[1]["results"] if c["shuffle"]}
    for (drop_last, epoch), case in shuffled.items():
        orders = case["order"]  # the full permutation, as each rank derived it on its own
        assert all(order == orders[0] for order in orders)
        assert sorted(orders[0]) == list(range(n))
        padded = orders[0] + orders[0][:math.ceil(n / w) * w - n]
        kept = padded if not drop_last else orders[0][:n // w * w]
        assert case["indices"] == [kept[r::w] for r in range(w)]  # each rank: every W-th index of the order
    assert shuffled[(False, 0)]["order"][0] != shuffled[(False, 1)]["order"][0]  # set_epoch reshuffles
    assert shuffled[(False, 0)]["order"][0] != list(range(n))


# ---------------------------------------------------------------- 2. no-sampler pitfall

def test_plain_dataloader_duplicates_and_distributed_sampler_does_not(tmp_path):
    torchrun(f"{DIR}/no_sampler_pitfall.py", "--output-dir", str(tmp_path), nproc=2)
    s = read_summary(tmp_path)
    n = s["dataset_size"]
    plain, fixed = s["no_sampler"], s["distributed_sampler"]
    assert plain["samples_per_rank"] == [n, n]  # every rank reads the whole data set ...
    assert plain["samples_read_by_several_ranks"] == n and plain["total_reads"] == 2 * n
    assert plain["same_order_on_all_ranks"]  # ... in the same order: identical batches on both ranks
    assert fixed["samples_per_rank"] == [math.ceil(n / 2)] * 2
    assert fixed["samples_read_by_several_ranks"] == 0 and fixed["distinct_samples"] == n
    assert fixed["steps_per_rank"][0] < plain["steps_per_rank"][0]


# ---------------------------------------------------------------- 3. exact distributed evaluation

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_distributed_eval_equals_one_process(tmp_path, world_size):
    torchrun(f"{DIR}/distributed_eval.py", "--max-steps", "8", "--output-dir", str(tmp_path),
             nproc=world_size, timeout=180)
    s = read_summary(tmp_path)
    n = s["test_size"]
    assert n % 2 and n % 3  # an odd size: neither 2 nor 3 ranks divide it

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
    if world_size > 1:
        assert s["sampler_padded"]["count"] != n and s["sampler_drop_last"]["count"] != n


# ---------------------------------------------------------------- 4. per-sample predictions, gathered in order

@pytest.fixture(scope="module")
def predictions_setup(tmp_path_factory):
    """A trained weights file (as 01 writes it) and the single-process predictions of those weights, made here."""
    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    model = SmallCNN(1, 10)
    data = digits()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = data.train.tensors
    for step in range(40):  # enough that predictions vary across classes
        batch = slice(32 * step, 32 * step + 32)
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.state_dict(), folder / "model.pt")
    model.eval()
    test_images, test_labels = data.test.tensors
    with torch.no_grad():
        probabilities = model(test_images).softmax(1)  # one process, the whole test set in one batch
    return folder / "model.pt", test_labels.tolist(), probabilities.argmax(1).tolist(), probabilities


def read_predictions(path):
    with open(path) as f:
        return [dict(index=int(r["index"]), label=int(r["label"]), prediction=int(r["prediction"]),
                     probabilities=[float(r[f"p_{c}"]) for c in range(10)]) for r in csv.DictReader(f)]


def assert_rows_equal_one_process(rows, predictions_setup):
    _, labels, predictions, probabilities = predictions_setup
    assert [r["index"] for r in rows] == list(range(len(labels)))  # every sample once, in data-set order
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


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gathered_predictions_equal_one_process_row_for_row(tmp_path, predictions_setup, world_size):
    weights, labels, predictions, _ = predictions_setup
    result = torchrun(f"{DIR}/gather_predictions.py", "--weights", str(weights), "--output-dir", str(tmp_path),
                      nproc=world_size, timeout=180)
    n = len(labels)
    assert_rows_equal_one_process(read_predictions(tmp_path / "predictions.csv"), predictions_setup)
    s = read_summary(tmp_path)
    assert s["rows_per_rank"] == [len(range(r, n, world_size)) for r in range(world_size)]
    assert s["rows"] == n and s["repeated_indices"] == []
    assert len(set(predictions)) > 5  # a real classifier, so the F1 check below means something
    assert s["macro_f1"] == pytest.approx(macro_f1_by_precision_and_recall(labels, predictions), abs=1e-12)
    assert f"macro-F1 {s['macro_f1']:.6f}" in result.stdout and "every index once" in result.stdout


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathering_over_a_padded_distributed_sampler_repeats_samples(tmp_path, predictions_setup, world_size):
    """Negative control: the same gather over DistributedSampler(drop_last=False) has ceil(N/W)*W rows."""
    weights, labels, _, _ = predictions_setup
    result = torchrun(f"{DIR}/gather_predictions.py", "--weights", str(weights), "--output-dir", str(tmp_path),
                      "--padded", nproc=world_size, timeout=180)
    n = len(labels)
    padded_total = math.ceil(n / world_size) * world_size
    rows = read_predictions(tmp_path / "predictions.csv")
    assert len(rows) == padded_total == 360 != n
    repeats = Counter(r["index"] for r in rows)
    assert sorted(i for i, c in repeats.items() if c > 1) == list(range(padded_total - n))  # the first ones again
    assert read_summary(tmp_path)["rows_per_rank"] == [math.ceil(n / world_size)] * world_size
    assert f"{padded_total} rows for {n} images" in result.stdout
    # Each row carries its index, so dropping rows whose index was seen before gives back the exact file.
    seen, unique = set(), []
    for r in rows:
        if r["index"] not in seen:
            seen.add(r["index"])
            unique.append(r)
    assert_rows_equal_one_process(unique, predictions_setup)


def test_rank_0_sorts_by_index_and_refuses_a_missing_or_repeated_index():
    in_dataset_order = load_script(f"{DIR}/gather_predictions.py", "gather_predictions").in_dataset_order
    rows = torch.tensor([[2.0, 7.0], [0.0, 5.0], [1.0, 6.0]])  # index, then any columns; as ranks deliver them
    assert in_dataset_order(rows, 3).tolist() == [[0.0, 5.0], [1.0, 6.0], [2.0, 7.0]]
    for broken in (rows[:2], torch.cat([rows, rows[:1]])):  # index 1 missing; index 2 twice
        with pytest.raises(RuntimeError, match="an index is missing or repeated"):
            in_dataset_order(broken, 3)
    assert in_dataset_order(torch.cat([rows, rows[:1]]), 3, each_once=False)[:, 0].tolist() == [0, 1, 2, 2]


def test_gather_predictions_refuses_missing_or_unfitting_weights(tmp_path):
    missing = run([PYTHON, REPO / DIR / "gather_predictions.py", "--weights", tmp_path / "none.pt",
                   "--output-dir", tmp_path], timeout=120)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: weights: no file") and missing.stderr.count("\n") == 1
    assert "01_basic_ddp/train.py" in missing.stderr
    torch.save(SmallCNN(1, 7).state_dict(), tmp_path / "seven_classes.pt")  # a head for 7 classes, not 10
    # This refusal comes after the process group (of one) has started: its own port, not the default 29500
    # that other tests running side by side may hold.
    unfitting = run([PYTHON, REPO / DIR / "gather_predictions.py", "--weights", tmp_path / "seven_classes.pt",
                     "--output-dir", tmp_path], timeout=120, env=clean_env(MASTER_PORT=str(free_port())))
    assert unfitting.returncode == 2 and unfitting.stdout == ""
    assert unfitting.stderr.startswith("error: weights:") and "does not fit --model small_cnn on digits" in unfitting.stderr
    assert unfitting.stderr.count("\n") == 1 and "size mismatch" in unfitting.stderr


def test_gather_predictions_refuses_weights_files_that_are_no_state_dict(tmp_path, capsys):
    read_weights = load_script(f"{DIR}/gather_predictions.py", "gather_predictions").read_weights
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    torch.save({"fc.weight": torch.zeros(2)}, tmp_path / "state.pt")
    assert set(read_weights(tmp_path / "state.pt")) == {"fc.weight"}  # a state_dict passes
    for name, message in (("notes.pt", "error: weights: cannot read"), ("tensor.pt", "holds a Tensor, not a state_dict")):
        with pytest.raises(SystemExit) as exit_info:
            read_weights(tmp_path / name)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: weights:") and message in err and err.count("\n") == 1


# ---------------------------------------------------------------- 5. class-balanced sampler

TOLERANCE_ALL, TOLERANCE_RANK = 0.03, 0.06  # the README states these


def test_weighted_sampler_is_disjoint_and_balanced(tmp_path):
    w = 2
    torchrun(f"{DIR}/weighted_sampler.py", "--epochs", "2", "--output-dir", str(tmp_path), nproc=w, timeout=180)
    s = read_summary(tmp_path)
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
            assert torch.bincount(labels[ix], minlength=k).tolist() == hist  # the loader delivered these
            freq = torch.tensor(hist) / sum(hist)
            assert (freq - 1 / k).abs().max() < TOLERANCE_RANK
        total = torch.tensor(epoch["total"]) / sum(epoch["total"])
        assert (total - 1 / k).abs().max() < TOLERANCE_ALL
    assert s["epochs"][0]["indices"] != s["epochs"][1]["indices"]  # set_epoch: new draws each epoch


def test_weighted_sampler_needs_labels_it_can_read(tmp_path):
    result = run([PYTHON, REPO / DIR / "weighted_sampler.py", "--dataset", "fake", "--output-dir", tmp_path],
                 timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: dataset: fake does not list its labels") and result.stderr.count("\n") == 1


# ---------------------------------------------------------------- 6. sharded loading

def test_each_rank_opens_only_its_own_shards(tmp_path):
    shards, w = tmp_path / "shards", 3
    run([PYTHON, REPO / DIR / "prepare_shards.py", "--num-shards", "12", "--out-dir", shards], timeout=90, check=True)
    out = tmp_path / "run"
    # Two DataLoader workers per rank: they must split the rank's files again, not repeat them.
    torchrun(f"{DIR}/sharded_loading.py", "--shards-dir", str(shards), "--epochs", "2", "--num-workers", "2",
             "--output-dir", str(out), nproc=w, timeout=180)
    manifest = json.loads((shards / "manifest.json").read_text())
    files = [entry["file"] for entry in manifest["shards"]]
    content = {f: set(torch.load(shards / f, weights_only=True)["indices"].tolist()) for f in files}
    assert sorted(i for f in files for i in content[f]) == list(range(manifest["total"]))

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
        assert all(len(set(names)) == len(names) for names in per_rank)  # no file opened twice
        assert sorted(n for names in per_rank for n in names) == sorted(files)  # disjoint, together all
        for r, record in enumerate(ranks):
            assert sorted(per_rank[r]) == sorted(record["shards"])
            # A rank's samples came from its own files, and from all of them.
            assert set(record["indices"]) == set().union(*(content[f] for f in per_rank[r]))
        reads = Counter(i for record in ranks for i in record["indices"])
        assert set(reads) == set(range(manifest["total"])) and set(reads.values()) == {1}  # all, once
        assert len({record["steps"] for record in ranks}) == 1  # equal step counts on all ranks
    assert sorted(opened[(0, 0)]) != sorted(opened[(1, 0)])  # shards move between ranks from epoch to epoch


def test_sharded_loading_without_shards_is_a_one_line_error(tmp_path):
    result = run([PYTHON, REPO / DIR / "sharded_loading.py", "--shards-dir", tmp_path / "missing"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "prepare_shards.py" in result.stderr


# ---------------------------------------------------------------- 7. uneven inputs

def per_step(summary):
    """{(epoch, step): [(gradient digest, weights digest) of each rank that ran that step]}."""
    by_step = {}
    for digests in summary["digests"]:
        for epoch, step, grads, weights in digests:
            by_step.setdefault((epoch, step), []).append((grads, weights))
    return by_step


def test_join_finishes_uneven_inputs_with_identical_gradients(tmp_path):
    w = 3
    torchrun(f"{DIR}/uneven_inputs.py", "--fix", "join", "--epochs", "2", "--output-dir", str(tmp_path),
             nproc=w, timeout=180)  # check=True: exit code 0, within the timeout
    s = read_summary(tmp_path)
    assert len(set(s["batches_per_rank"])) == w  # the inputs really are uneven
    assert s["steps_per_rank"] == [2 * b for b in s["batches_per_rank"]]  # every rank ran all of its batches
    by_step = per_step(s)
    assert all(len(set(ranks)) == 1 for ranks in by_step.values())  # same gradients and weights at every step
    assert any(1 < len(ranks) < w for ranks in by_step.values())  # steps with a joined rank shadowing the rest
    assert s["replicas_identical"]


def test_join_with_momentum_lets_weights_drift_in_the_next_epoch(tmp_path):
    """The README's caveat: joined ranks skip optimizer.step(), so their momentum lags."""
    torchrun(f"{DIR}/uneven_inputs.py", "--fix", "join", "--epochs", "2", "--momentum", "0.9",
             "--output-dir", str(tmp_path), nproc=2, timeout=180)
    s = read_summary(tmp_path)
    by_step = per_step(s)
    assert all(len({g for g, _ in ranks}) == 1 for ranks in by_step.values())  # gradients: still all-reduced
    assert all(len({p for _, p in by_step[(0, k)]}) == 1 for k in range(s["batches_per_rank"][1]))
    assert len({p for _, p in by_step[(1, 0)]}) == 2  # epoch 2: the weights differ between the ranks
    assert s["replicas_identical"]  # ... and the end-of-Join sync hides it from a final checksum


def test_drop_last_runs_the_smallest_rank_count(tmp_path):
    torchrun(f"{DIR}/uneven_inputs.py", "--fix", "drop_last", "--epochs", "1", "--output-dir", str(tmp_path),
             nproc=2, timeout=180)
    s = read_summary(tmp_path)
    assert s["batches_per_rank"][0] > s["batches_per_rank"][1]
    assert s["steps_per_rank"] == [min(s["batches_per_rank"])] * 2
    assert all(len(ranks) == 2 and len(set(ranks)) == 1 for ranks in per_step(s).values())
    assert s["replicas_identical"]


def test_without_a_fix_uneven_inputs_time_out_naming_the_rank_that_never_arrived(tmp_path):
    """Rank 1 runs out of batches and waits at the end-of-epoch barrier while rank 0 waits in its
    next gradient all-reduce: at --timeout-s gloo's monitored_barrier names rank 0."""
    result = torchrun(f"{DIR}/uneven_inputs.py", "--fix", "none", "--timeout-s", "5", "--epochs", "1",
                      "--output-dir", str(tmp_path), nproc=2, timeout=120, check=False)
    out = result.output
    assert result.returncode != 0
    assert ("[rank1]: RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors while "
            "waiting for send/recv from rank 0") in out, out[-3000:]
    assert "Timed out waiting 5000ms" in out
    rank1 = "\n".join(line for line in out.splitlines() if line.startswith("[rank1]:"))
    assert "dist.monitored_barrier()" in rank1, rank1
    assert not (tmp_path / "summary.json").exists()
