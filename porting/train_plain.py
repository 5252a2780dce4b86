"""An ordinary one-process training script: a small CNN on an image folder of handwritten digits.

    python porting/make_digits_folder.py data/digits
    python porting/train_plain.py --data-dir data/digits

train_ddp.py is its port to DistributedDataParallel; `diff train_plain.py train_ddp.py` lists the
changes and porting/README.md explains each one.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
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
            done, total = batch_idx * len(data), len(train_loader.dataset)
            print(f"Train epoch {epoch} [{done}/{total}] loss {loss.item():.6f}")
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
    count = len(test_loader.dataset)
    test_loss /= count
    print(f"Test set: average loss {test_loss:.4f}, accuracy {correct}/{count}")


def parse_args():
    parser = argparse.ArgumentParser(description="A small CNN on an image folder of digits")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
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
    use_cuda = not args.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")

    torch.manual_seed(args.seed)

    transform = transforms.Compose(
        [
            # ImageFolder opens every image as RGB: back to one channel
            transforms.Lambda(lambda image: image.convert("L")),
            transforms.ToTensor(),
            transforms.Normalize((0.3053,), (0.3759,)),  # the digits' pixel mean and std
        ]
    )
    train_set = datasets.ImageFolder(Path(args.data_dir) / "train", transform=transform)
    test_set = datasets.ImageFolder(Path(args.data_dir) / "test", transform=transform)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=use_cuda,
    )
    test_loader = DataLoader(
        test_set,
        batch_size=args.test_batch_size,
        num_workers=args.num_workers,
    )

    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
        torch.save(model.state_dict(), Path(args.save_dir) / f"digits_cnn_{epoch}.pt")


if __name__ == "__main__":
    main()
