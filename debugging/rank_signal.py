"""A rank that dies by a signal, to see how torchrun reports it (`exitcode  : -N (pid: ...)`).

    torchrun --standalone --nproc_per_node=2 debugging/rank_signal.py --how abort   # -6 SIGABRT
    # -7 SIGBUS: shared memory larger than /dev/shm, as in a container started with a small
    # --shm-size; as root, without a container:
    unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm &&
        torchrun --standalone --nproc_per_node=2 debugging/rank_signal.py --how shm --shm-mb 4'

The last rank fails; the others wait until torchrun stops them (SIGTERM, -15). No process group
and no torch import: what torchrun prints is all there is to see. See debugging/README.md.
"""

import argparse
import os
import time
from multiprocessing import shared_memory


def fill_shared_memory(megabytes: int) -> None:
    """Create a POSIX shared-memory block (a file in /dev/shm) and write to every
    page of it. Creating only sets the size; each page is taken from /dev/shm when
    first written, and when /dev/shm has no page left the kernel sends SIGBUS.
    (torch's own shared memory reserves the pages up front instead: a DataLoader
    worker gets a "No space left on device" error rather than a signal.)"""
    block = shared_memory.SharedMemory(create=True, size=megabytes << 20)
    try:
        block.buf[:] = b"\x01" * block.size
        print(
            f"rank {os.environ.get('RANK', 0)} wrote {megabytes} MiB to /dev/shm/{block.name}",
            flush=True,
        )
    finally:
        block.close()
        block.unlink()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--how",
        choices=("abort", "shm"),
        required=True,
        help="abort: SIGABRT, as a C++ abort() sends (gloo, NCCL, 'terminate called ...'); "
        "shm: write to shared memory (SIGBUS when /dev/shm is too small)",
    )
    parser.add_argument(
        "--shm-mb", type=int, default=4, help="MiB of shared memory to write (--how shm)"
    )
    args = parser.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank != world_size - 1:
        time.sleep(60)  # torchrun stops this rank once the other has failed
        return
    if args.how == "abort":
        os.abort()
    else:
        fill_shared_memory(args.shm_mb)


if __name__ == "__main__":
    main()
