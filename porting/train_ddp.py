"""train_plain.py ported to DistributedDataParallel: one process per GPU (or CPU), torchrun-style.

    python porting/make_digits_folder.py data/digits
    torchrun --standalone --nproc_per_node=2 porting/train_ddp.py --data-dir data/digits

`diff train_plain.py train_ddp.py` lists the changes; porting/README.md explains each one.
"""

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# before init_process_group: imported later (by DDP), it keeps the group alive at exit
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            done, total = batch_idx * len(data), len(train_loader.sampler)  # this rank's
            if dist.get_rank() == 0:
                print(f"Train epoch {epoch} [{done}/{total}] loss {loss.item():.6f}")
            # outside rank 0's `if`: every rank leaves the loop at the same step
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum of batch losses
            pred = output.argmax(dim=1)
            correct += (pred == target).sum().item()
    count = len(test_loader.dataset)  # this rank's shard
    # every rank's sums and counts added up: each test image counts once
    totals = torch.tensor([test_loss, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    test_loss, correct, count = totals.tolist()
    test_loss /= count
    if dist.get_rank() == 0:
        print(f"Test set: average loss {test_loss:.4f}, accuracy {correct:.0f}/{count:.0f}")


def parse_args():
    parser = argparse.ArgumentParser(description="A small CNN on an image folder of digits")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank; global: x world size")
    parser.add_argument("--test-batch-size", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta's learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate decay per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
    parser.add_argument("--dry-run", action="store_true", help="one batch per epoch")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    parser.add_argument("--data-dir", default="data/digits", help="holds train/ and test/")
    parser.add_argument("--num-workers", type=int, default=0, help="data loader processes")
    parser.add_argument("--save-dir", default="checkpoints", help="a model file per epoch")
    return parser.parse_args()


def to_grayscale(image):
    return image.convert("L")


# under torchrun, a failing rank's exception shows in torchrun's closing summary
@record
def main():
    args = parse_args()
    for split in ("train", "test"):
        if not (Path(args.data_dir) / split).is_dir():
            print(
                f"error: {args.data_dir} has no {split}/ folder; make one with "
                f"python porting/make_digits_folder.py {args.data_dir}",
                file=sys.stderr,
            )
            sys.exit(2)
    # set by torchrun for every process it starts
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    # one GPU a rank: the local rank's, or the only one a rank sees where a scheduler binds them
    gpu = local_rank % torch.cuda.device_count() if use_cuda else None
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # before the process group, which then uses this GPU
    # init_method="env://", the default: MASTER_ADDR and MASTER_PORT, set by torchrun
    dist.init_process_group("nccl" if use_cuda else "gloo")

    torch.manual_seed(args.seed)  # the same on every rank: the same initial weights

    transform = transforms.Compose(
        [
            # ImageFolder opens every image as RGB: back to one channel; a module-level function,
            # as forkserver's workers get the transform pickled
            transforms.Lambda(to_grayscale),
            transforms.ToTensor(),
            transforms.Normalize((0.3053,), (0.3759,)),  # the digits' pixel mean and std
        ]
    )
    train_set = datasets.ImageFolder(Path(args.data_dir) / "train", transform=transform)
    test_set = datasets.ImageFolder(Path(args.data_dir) / "test", transform=transform)
    # workers from a clean process: fork() can copy a lock held by one of gloo's or NCCL's threads
    context = None
    if args.num_workers > 0 and "forkserver" in multiprocessing.get_all_start_methods():
        context = "forkserver"
    # each rank its own part of every epoch; the sampler shuffles (no shuffle=True beside it)
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=train_sampler,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
        multiprocessing_context=context,
    )
    # a strided slice per rank: every test image once (DistributedSampler would pad with repeats)
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(
        test_shard,
        batch_size=args.test_batch_size,
        num_workers=args.num_workers,
        multiprocessing_context=context,
    )

    model = Net().to(device)
    # gradients averaged over all ranks in backward(): every replica takes the same step
    model = DDP(model, device_ids=[gpu] if use_cuda else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    # from here on each rank its own random numbers: its own dropout masks
    torch.manual_seed(args.seed + rank)

    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
        train(args, model, device, train_loader, optimizer, epoch)
        # the plain model: DDP's forward may run collectives, and ranks may differ in test batches
        test(model.module, device, test_loader)
        scheduler.step()
        if rank == 0:  # one writer; model.module's names have no "module." prefix
            torch.save(model.module.state_dict(), Path(args.save_dir) / f"digits_cnn_{epoch}.pt")
    # the DDP model holds the process group: release it first, so that the group ends here
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
