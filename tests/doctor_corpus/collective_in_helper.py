"""Planted: a function that all-reduces, called only where is_main() (rank 0)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before the group: see debugging/README.md)
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(size):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(size, 8, generator=generator)
    return TensorDataset(inputs, (inputs.sum(1) > 0).long())


@torch.no_grad()
def evaluate(model, loader):
    """This rank's loss sum and count, summed over the ranks: every rank must call it."""
    totals = torch.zeros(2)
    for inputs, labels in loader:
        totals += torch.tensor(
            [F.cross_entropy(model(inputs), labels, reduction="sum"), len(labels)]
        )
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def is_main():
    return dist.get_rank() == 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(16, 2))
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = make_data(96)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(
        make_data(32),
        batch_size=args.batch_size,
        sampler=DistributedSampler(make_data(32), shuffle=False),
    )
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (inputs, labels) in enumerate(loader):
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 4 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if args.dry_run:
                break
        if is_main():
            eval_loss = evaluate(model, test_loader)  # planted: collective-in-rank-branch
            print(f"eval loss {eval_loss:.4f}")
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
