"""02 - every per-sample prediction on rank 0, each exactly once, in data-set order.

Metrics that are not sums (AUC, a ranking) and a predictions file need every prediction,
not the sums and counts of distributed_eval.py (F1 needs only the confusion matrix; here
it comes from the file). Each rank predicts its own strided slice of the test set and
keeps each sample's data-set index next to its prediction; rank 0 gathers all rows, sorts
them by index, checks that every index is there exactly once, writes predictions.csv and
computes macro-F1 from that file. `--padded` shows the pitfall: split by
DistributedSampler (drop_last=False), the file gets ceil(N/W)*W rows, some samples twice.

Every world size evaluates the same weights file, the model.pt that 01 writes:
    python 01_basic_ddp/train.py
    torchrun --standalone --nproc_per_node=3 02_sampler_patterns/gather_predictions.py
"""

import csv
import dataclasses
import pickle
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.errors import DataError
from common.bad_input import exit_on_bad_input
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import write_summary


@dataclasses.dataclass
class PredictConfig(TrainConfig):
    weights: str = field(
        "runs/latest/model.pt", "state_dict to evaluate (01_basic_ddp/train.py writes one)"
    )
    padded: bool = field(
        False, "the pitfall: split by DistributedSampler (padded) instead of a strided slice"
    )
    output_dir: str = field("runs/gather_predictions", "where predictions.csv and summary.json go")


class WithIndex(Dataset):
    """Each sample comes with its data-set index, so its
    prediction can be put back in place, whatever the split."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return index, image, label


@torch.no_grad()
def predict(model, loader, device, num_classes):
    """This rank's rows, one per sample: data-set index, label,
    then the logits (float64 holds all three exactly)."""
    model.eval()
    # a rank may get no samples
    rows = [torch.empty(0, 2 + num_classes, dtype=torch.float64, device=device)]
    for indices, images, labels in loader:
        logits = model(images.to(device))
        rows.append(
            torch.cat(
                [
                    indices[:, None].to(device).double(),
                    labels[:, None].to(device).double(),
                    logits.double(),
                ],
                dim=1,
            )
        )
    return torch.cat(rows)


def gather_rows(rows, device):
    """Collective: every rank's rows, concatenated on rank
    0 (None elsewhere), and the row count of each rank.

    dist.gather wants the same shape from every rank, and the slices differ by a row: share
    the counts, pad to the longest, cut the padding off on rank 0. dist.gather_object does
    the same to pickled bytes, so GPU tensors would go to the host and back (its docs
    advise gather for tensors); all_gather would put every row on every rank."""
    world_size = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64, device=device))
    counts = [int(c) for c in counts]
    padded = torch.zeros(max(counts), rows.shape[1], dtype=rows.dtype, device=device)
    padded[: len(rows)] = rows
    gathered = (
        [torch.empty_like(padded) for _ in range(world_size)] if dist.get_rank() == 0 else None
    )
    dist.gather(padded, gathered, dst=0)
    if dist.get_rank() != 0:
        return None, counts
    return torch.cat([g[:n] for g, n in zip(gathered, counts)]).cpu(), counts


def in_dataset_order(rows, n, each_once=True):
    """The rows sorted by data-set index; with each_once, fail
    unless every index 0..n-1 is there exactly once."""
    rows = rows[rows[:, 0].argsort(stable=True)]
    if each_once and not torch.equal(rows[:, 0].long(), torch.arange(n)):
        raise RuntimeError(
            f"gathered {len(rows)} rows for {n} samples: an index is missing or repeated"
        )
    return rows


def write_predictions(path, rows, num_classes):
    """index,label,prediction,p_0..p_{C-1} (softmax
    probabilities), one line per row, in the order given."""
    logits = rows[:, 2:]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["index", "label", "prediction"] + [f"p_{c}" for c in range(num_classes)])
        for (index, label), prediction, probs in zip(
            rows[:, :2].long().tolist(), logits.argmax(1).tolist(), logits.softmax(1).tolist()
        ):
            out.writerow([index, label, prediction] + [f"{p:.6g}" for p in probs])


def macro_f1(labels, predictions, num_classes):
    """Mean over the classes that occur (as label or prediction) of F1 = 2 TP / (2 TP + FP + FN)."""
    confusion = torch.bincount(labels * num_classes + predictions, minlength=num_classes**2)
    # rows: label, columns: prediction
    confusion = confusion.view(num_classes, num_classes).double()
    tp = confusion.diag()
    errors = confusion.sum(0) + confusion.sum(1) - 2 * tp  # FP + FN
    occurs = tp + errors > 0
    return (2 * tp[occurs] / (2 * tp[occurs] + errors[occurs])).mean().item()


def predict_and_gather(cfg, launch, weights):
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    # nccl where this torch has it (Linux GPUs); gloo on CPUs and on Windows and macOS
    backend = choose_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    w, rank = launch.world_size, launch.rank
    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, w)
    test, n = WithIndex(data.test), len(data.test)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    # the same on every rank: each exits with code 2 before any collective
    with exit_on_bad_input():
        try:
            model.load_state_dict(weights)
        # torch lists the missing, unexpected and misshapen weights on the next lines
        except RuntimeError as exc:
            detail = (str(exc).splitlines()[1:] or [str(exc)])[0].strip()
            raise DataError(
                f"weights: {cfg.weights} does not fit --model {cfg.model} on {cfg.dataset} "
                f"({detail[:200]})"
            ) from None
    model.to(device)  # no DDP wrapper: nothing is trained, every rank just runs the same weights

    if cfg.padded:  # WRONG: pads every rank to ceil(N/W) samples by repeating the first ones
        loader = DataLoader(
            test,
            batch_size=cfg.local_batch_size,
            num_workers=cfg.num_workers,
            # not fork(), which can copy a lock that gloo's or NCCL's threads hold (common/data.py)
            multiprocessing_context=worker_start_method(cfg.num_workers),
            sampler=DistributedSampler(test, num_replicas=w, rank=rank, shuffle=False),
        )
    # RIGHT: a strided slice per rank covers every sample exactly once (sizes differ by at most one)
    else:
        loader = DataLoader(
            Subset(test, range(rank, n, w)),
            batch_size=cfg.local_batch_size,
            num_workers=cfg.num_workers,
            multiprocessing_context=worker_start_method(cfg.num_workers),
        )
    rows, counts = gather_rows(predict(model, loader, device, data.num_classes), device)

    summary = dict(world_size=w, test_size=n, padded=cfg.padded, rows_per_rank=counts)
    if rank == 0:
        rows = in_dataset_order(rows, n, each_once=not cfg.padded)
        repeated = torch.bincount(rows[:, 0].long(), minlength=n).gt(1).nonzero().flatten().tolist()
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        path = Path(cfg.output_dir) / "predictions.csv"
        write_predictions(path, rows, data.num_classes)
        # the metric comes from the file, as anyone reading it would compute it
        with open(path, newline="") as f:
            table = list(csv.DictReader(f))
        labels = torch.tensor([int(r["label"]) for r in table])
        predictions = torch.tensor([int(r["prediction"]) for r in table])
        accuracy = (labels == predictions).double().mean().item()
        f1 = macro_f1(labels, predictions, data.num_classes)
        split = "padded DistributedSampler" if cfg.padded else "strided slices"
        print(f"{n} test images, world size {w}, rows per rank {counts} ({split})", flush=True)
        print(
            f"wrote {path}: {len(table)} rows"
            + (
                f" for {n} images, repeated: {repeated}"
                if repeated
                else ", every index once, in data-set order"
            ),
            flush=True,
        )
        print(f"from the file: accuracy {accuracy:.6f}, macro-F1 {f1:.6f}", flush=True)
        summary.update(
            rows=len(table),
            repeated_indices=repeated,
            accuracy=accuracy,
            macro_f1=f1,
            predictions=str(path),
        )
        write_summary(cfg.output_dir, **summary)
    dist.destroy_process_group()


def read_weights(path):
    """The state_dict to evaluate, read before any process
    group: a missing or unreadable file exits with 2."""
    with exit_on_bad_input():
        if not Path(path).is_file():
            raise DataError(
                f"weights: no file {path}; train a model first with `python 01_basic_ddp/train.py` "
                f"(it writes runs/latest/model.pt) or pass --weights"
            )
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        # not a torch file, or more than tensors
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise DataError(f"weights: cannot read {path} ({str(exc).splitlines()[0]})") from None
        if not isinstance(weights, dict):
            raise DataError(f"weights: {path} holds a {type(weights).__name__}, not a state_dict")
        return weights


@record
def main():
    cfg = load_config(PredictConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    weights = read_weights(cfg.weights)
    predict_and_gather(cfg, launch, weights)


if __name__ == "__main__":
    main()
