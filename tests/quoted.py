"""Texts the READMEs quote: each a constant that a behaviour test finds in what a run prints (or
runs as code) and tests/test_readme_text.py finds in the README."""

from __future__ import annotations

READY_ONCE = "Expected to mark a variable ready only once"


# optdigits.tes, UCI's description
UCI_TEST_CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


# The end of torch's line for a rendezvous that timed out (debugging/README.md quotes it:
# tests/test_readme_text.py)
RENDEZVOUS_TIMED_OUT = "waiting for clients. 1/2 clients joined."


NEVER_CHECKED_IN = "rank(s) {ranks} of {world} never checked in"


# comm_check's two errors, as the README's table of errors quotes them with its own values
# (tests/test_readme_text.py)
UNREACHABLE = "error: rank {rank} on {host} cannot reach rank 0's store at {addr} within {s} s"


# The two lines the README quotes (tests/test_readme_text.py)
TEACHER_ERRORS = (
    "error: --teacher is required: a model.pt saved by 01_basic_ddp/train.py",
    "error: teacher: no file runs/teacher/model.pt (train one with 01 first)",
)


FIXED_CELL = """
import torch.multiprocessing as mp
from ddp_worker import worker

mp.spawn(worker, args=(2, {port}), nprocs=2)
"""


# The fix: the worker in a file of its own (in a
# notebook: a %%writefile ddp_worker.py cell), imported.
WORKER_FILE = """
import torch
import torch.distributed as dist


def worker(rank, world_size, port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {rank}: all_reduce gives {total.item():.0f}", flush=True)
    dist.destroy_process_group()
"""
