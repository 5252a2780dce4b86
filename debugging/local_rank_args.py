"""`error: unrecognized arguments: --local-rank=0`: a script launched with the old
`python -m torch.distributed.launch` whose argument parser has no --local-rank option.

    # the error
    python -m torch.distributed.launch --nproc-per-node=2 debugging/local_rank_args.py --plain
    # accepted
    python -m torch.distributed.launch --nproc-per-node=2 debugging/local_rank_args.py
    # from LOCAL_RANK
    torchrun --nproc-per-node=2 debugging/local_rank_args.py

torch.distributed.launch (deprecated, still in torch 2.14) appends `--local-rank=N` to
each process's arguments (`--local_rank=N` before torch 2.0) unless given --use-env;
torchrun appends nothing. Both set the environment variable LOCAL_RANK. Read that, or
accept the argument in both spellings, as below. See debugging/README.md.
"""

import argparse
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Where each process's local rank comes from.")
    parser.add_argument("--epochs", type=int, default=1, help="stands for the script's own options")
    parser.add_argument(
        "--plain", action="store_true", help="leave the --local-rank option out (the error)"
    )
    if "--plain" not in argv:
        # The fix: both spellings (torch >= 2.0 passes
        # --local-rank, older --local_rank); without the
        # argument (torchrun, srun, mpiexec) the environment's LOCAL_RANK.
        parser.add_argument(
            "--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0))
        )
    return parser.parse_args(argv)


def main():
    args = parse_args(sys.argv[1:])
    local_rank = getattr(args, "local_rank", int(os.environ.get("LOCAL_RANK", 0)))
    given = any(arg.startswith(("--local-rank", "--local_rank")) for arg in sys.argv[1:])
    print(
        f"rank {os.environ.get('RANK', 0)}: local rank {local_rank} "
        f"(from {'the --local-rank argument' if given else 'LOCAL_RANK'}, "
        f"LOCAL_RANK={os.environ.get('LOCAL_RANK')})",
        flush=True,
    )


if __name__ == "__main__":
    main()
