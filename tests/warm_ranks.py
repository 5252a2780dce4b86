"""Start a script's ranks from one warm process: torch imported once, each rank forked from it.

    python tests/warm_ranks.py --nproc 2 01_basic_ddp/train.py --max-steps 3

For tests whose claim is what DDP computes (equality with one process, exact evaluation, resume,
accumulation), not how a launcher starts ranks. Every rank process otherwise pays its own
`import torch` (2 to 6 CPU-s on the test machine), and torchrun one more for itself. Here this
process imports torch, torch._dynamo and torchvision once, binds no thread pool and opens no
socket, then forks each rank. A rank gets what the README's "ranks started by hand" sets (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR on loopback, a free MASTER_PORT), so the
lessons take their `env` launcher row; the script then runs as `__main__` and its interpreter ends
the ordinary way (atexit handlers included).

Like torchrun, the first rank to fail fails the run: the others are killed and its exit code is
this process's (128 + N for signal N). Tests that are about a launcher, a README command or an exit
path use the real launcher instead (tests/README.md).
"""

import os
import runpy
import signal
import socket
import sys

# The imports every rank would otherwise pay for; importing them starts no threads.
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torchvision  # noqa: F401


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if len(sys.argv) < 4 or sys.argv[1] != "--nproc":
    sys.exit("usage: python tests/warm_ranks.py --nproc N SCRIPT [ARGS...]")
nproc, script, args = int(sys.argv[2]), sys.argv[3], sys.argv[4:]
port = str(free_loopback_port())
ranks = {}
for rank in range(nproc):
    pid = os.fork()
    if pid == 0:
        # The rank: the script as __main__, as `python SCRIPT ARGS` would run it.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    ranks[pid] = rank

failed = 0
while ranks:
    pid, status = os.wait()
    ranks.pop(pid, None)
    if exit_code(status) and not failed:
        failed = exit_code(status)
        for other in ranks:
            os.kill(other, signal.SIGKILL)
sys.exit(failed)
