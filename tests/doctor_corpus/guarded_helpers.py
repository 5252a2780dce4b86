"""Correct: saves in a helper called under is_main(), a log that returns early off rank 0, a
per-rank file, a module-level transform with workers."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before the group: see debugging/README.md)
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


def make_data(size):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(size, 8, generator=generator)
    return TensorDataset(inputs, (inputs.sum(1) > 0).long())


def scaled(inputs):
    return inputs * 2


class Points(Dataset):
    def __init__(self, size, transform=None):
        self.data, self.transform = make_data(size), transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        inputs, label = self.data[index]
        return self.transform(inputs), label


def is_main():
    return dist.get_rank() == 0


def save(model, path):
    """Called on rank 0 only (below)."""
    torch.save(model.module.state_dict(), path)


def log(rank, message):
    if rank != 0:
        return
    with open("log.txt", "a") as log_file:
        log_file.write(message + "\n")


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
    dataset = Points(96, transform=scaled)
    shard_file = f"samples_rank{rank}.txt"
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="forkserver",
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
            log(rank, f"step {step} loss {loss.item():.4f}")
            if args.dry_run:
                break
    with open(shard_file, "w") as samples:
        samples.write(" ".join(str(i) for i in sampler))
    if is_main():
        save(model, "model.pt")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
