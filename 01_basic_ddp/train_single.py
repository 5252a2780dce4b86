"""01 - the baseline: the same training in one process, without DDP.

`diff train_single.py train.py` shows exactly what DDP adds: the process group, the sampler
that shards the data, the wrap, the all-reduced metrics, rank-0-only output.

    python 01_basic_ddp/train_single.py
"""

import sys
import time
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from common.config import TrainConfig, load_config
from common.data import check_data, download_datasets, load_datasets, worker_start_method
from common.models import build_model
from common.report import run_record, write_summary


@torch.no_grad()
def evaluate(model, loader, device):
    """Loss and accuracy over the whole test set, from sums and a count."""
    model.eval()
    # loss sum, correct, count
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        totals += torch.stack(
            [
                F.cross_entropy(logits, labels, reduction="sum"),
                (logits.argmax(1) == labels).sum(),
                torch.tensor(len(labels), device=device),
            ]
        )
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def train(cfg):
    start_time = time.perf_counter()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # Same initial weights as the DDP script.
    torch.manual_seed(cfg.seed)

    if cfg.download:
        download_datasets(cfg)
    data = load_datasets(cfg, 1)
    # The same permutations as the DDP script with one process (randperm seeded with seed + epoch).
    shuffle = torch.Generator()
    train_sampler = RandomSampler(
        data.train,
        generator=shuffle,
    )
    train_loader = DataLoader(
        data.train,
        batch_size=cfg.local_batch_size,
        sampler=train_sampler,
        num_workers=cfg.num_workers,
        # not fork(), which can copy a lock that gloo's or NCCL's threads hold (common/data.py)
        multiprocessing_context=worker_start_method(cfg.num_workers),
        pin_memory=device.type == "cuda",
    )
    # One process reads the whole test set.
    test_shard = data.test
    test_loader = DataLoader(
        test_shard,
        batch_size=cfg.local_batch_size,
        num_workers=cfg.num_workers,
        multiprocessing_context=worker_start_method(cfg.num_workers),
    )

    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)
    model = model.to(device)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    # augmentation and loader workers from here on, as train.py's rank 0 (seed + 0)
    torch.manual_seed(cfg.seed)

    print(
        f"one process on {device}, batch {cfg.local_batch_size}, train {len(data.train)}",
        flush=True,
    )
    step, images_seen = 0, 0
    for epoch in range(cfg.epochs):
        # A new shuffle each epoch; without it every epoch repeats epoch 0.
        shuffle.manual_seed(cfg.seed + epoch)
        model.train()
        # The loss sum and sample count.
        loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            images_seen += len(labels)
            loss_and_count[0] += loss.detach() * len(labels)
            loss_and_count[1] += len(labels)
            if step % cfg.log_every == 0:
                print(
                    f"epoch {epoch + 1} step {step} loss {loss.item():.4f}",
                    flush=True,
                )
            if step == cfg.max_steps:
                break
        train_loss = (loss_and_count[0] / loss_and_count[1]).item()
        eval_loss, eval_acc, eval_count = evaluate(model, test_loader, device)
        print(
            f"epoch {epoch + 1} done: train loss {train_loss:.4f}, "
            f"eval loss {eval_loss:.4f}, "
            f"eval accuracy {eval_acc:.4f} ({eval_count} images)",
            flush=True,
        )
        if step == cfg.max_steps:
            break

    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(cfg.output_dir) / "model.pt")

    # --- end-of-run record: summary.json; a copy may delete this block whole ---
    summary = run_record(
        cfg,
        None,
        backend="none",
        device=device,
        start_time=start_time,
        images_seen=images_seen,
        epochs=epoch + 1,
        steps=step,
        final_train_loss=train_loss,
        eval_loss=eval_loss,
        eval_accuracy=eval_acc,
        eval_samples=eval_count,
    )
    write_summary(cfg.output_dir, **summary)
    # --- end of the end-of-run record ---


def main():
    # bad input (here and below): one "error:" line, exit code 2
    cfg = load_config(TrainConfig)
    check_data(cfg, 1)
    train(cfg)


if __name__ == "__main__":
    main()
