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


# The errors and warnings debugging/README.md quotes, each produced for real in
# tests/test_forum_errors.py.
PICKLE_WARNING = (
    "UserWarning: Got pickle error when attempting to start a worker Process. This might be "
    "because the worker Process arguments are not picklable. Python 3.14+ changed the "
    "multiprocessing start method in non-Mac POSIX platforms to 'forkserver', which requires "
    "the worker Process arguments to be picklable. You can also try "
    "multiprocessing.set_start_method('fork')."
)  # torch 2.14.1's, before the error below
LOCAL_LAMBDA = "AttributeError: Can't pickle local object 'main.<locals>.<lambda>'"
SHUFFLE_BESIDE_A_SAMPLER = "ValueError: sampler option is mutually exclusive with shuffle"
WORKER_EXITED = "RuntimeError: DataLoader worker (pid(s) {pids}) exited unexpectedly"
NO_CPU_BACKEND = "RuntimeError: No backend type associated with device type cpu"
DEVICE_ID_ON_CPU = (
    "ValueError: init_process_group device_id parameter must be an accelerator with an index"
)
SEGFAULT = "Fatal Python error: Segmentation fault"

# torchrun's banner with several ranks a node and no OMP_NUM_THREADS
OMP_BANNER = (
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed."
)

# DDP's C++ warning where find_unused_parameters found none (two spaces after "iteration,")
UNUSED_WARNING = (
    "Warning: find_unused_parameters=True was specified in DDP constructor, but did not find any "
    "unused parameters in the forward pass. This flag results in an extra traversal of the "
    "autograd graph every iteration,  which can adversely affect performance. If your model "
    "indeed never has any unused parameters in the forward pass, consider turning this flag off. "
    "Note that this warning may be a false positive if your model has flow control causing later "
    "iterations to have unused parameters."
)

RENAMED_VARIABLE = (
    "Warning: Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use "
    "TORCH_FR_BUFFER_SIZE instead (function operator())"
)
# torchrun's line when a worker group fails with a restart left (tests/test_multinode.py)
ELASTIC_RESTART = "[default] Worker group FAILED. 1/1 attempts left; will restart worker group"
