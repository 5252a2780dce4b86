"""A correct DDP port: the reference the planted mistakes start from (tests/planted_ports.py)."""

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
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
