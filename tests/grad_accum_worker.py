"""Run under torchrun: DDP decides in forward() whether the coming backward all-reduces.

    torchrun --standalone --nproc_per_node=2 tests/grad_accum_worker.py

Counts the all-reduces with 03's communication hook (1 bucket: a tiny model).
"""

import importlib.util
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.dist import cleanup_distributed, setup_distributed  # noqa: E402
from common.report import print0  # noqa: E402

spec = importlib.util.spec_from_file_location("grad_accum_train", REPO / "03_grad_accum" / "train.py")
grad_accum = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grad_accum)


def main():
    setup_distributed("gloo", 60, "cpu")
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        counter = {"all_reduces": 0, "passes": 0}
        model.register_comm_hook(counter, grad_accum.counting_allreduce_hook)
        x = torch.randn(8, 4)
        model(x).sum().backward()  # a first synchronized pass (DDP rebuilds its buckets after it)

        before = counter["all_reduces"]
        with model.no_sync():
            model(x).sum().backward()
        print0(f"forward+backward inside no_sync: {counter['all_reduces'] - before} all-reduces")

        before = counter["all_reduces"]
        out = model(x)  # the mistake: forward outside no_sync
        with model.no_sync():
            out.sum().backward()
        print0(f"forward outside, backward inside no_sync: {counter['all_reduces'] - before} all-reduces")
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
