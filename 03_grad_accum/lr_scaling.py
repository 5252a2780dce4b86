r"""Should the learning rate grow with the number of GPUs? Train and see.

For each world size, three torchrun runs of 03_grad_accum/train.py at the same local batch and
number of epochs (so more ranks means a larger global batch and fewer steps):
    as given           --lr as it is (tuned for one rank's batch)
    linear             --lr-base-batch: --lr x global batch / the base batch (Goyal et al. 2017)
    linear + warm-up   the same, reached linearly over the first --warmup-steps optimizer steps
then one table of the learning rate and the accuracy each run reached.

    python 03_grad_accum/lr_scaling.py                      # 1, 2 and 4 ranks, 3 epochs
    python 03_grad_accum/lr_scaling.py --epochs 12          # the lessons' default length

Flags after -- go to every run. Outputs: one folder per run in --output-dir.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "03_grad_accum/train.py"


def row(world_size: int, setting: str, summary: dict) -> dict:
    return {
        "world size": world_size,
        "global batch": summary["global_batch_size"],
        "setting": setting,
        "lr": summary["lr"],
        "steps": summary["steps"],
        "eval accuracy": summary["eval_accuracy"],
    }


def print_table(rows: list[dict]) -> None:
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    header = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    for line in [header] + cells:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)), flush=True)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The driver's flags, and the flags after -- that go to every run."""
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--local-batch-size", type=int, default=32, help="local batch, every run")
    parser.add_argument("--lr", type=float, default=0.1, help="tuned for --local-batch-size")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--output-dir", default="runs/lr_scaling")
    return parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv), extra


def plan(args: argparse.Namespace, extra: list[str]) -> list[tuple[int, str, list[str]]]:
    """(world size, setting, train.py's arguments) for every run."""
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    common = ["--epochs", str(args.epochs), "--local-batch-size", str(args.local_batch_size)]
    common += ["--lr", str(args.lr)]
    linear = ["--lr-base-batch", str(args.local_batch_size)]
    settings = {
        "as given": [],
        "linear": linear,
        "linear + warm-up": linear + ["--warmup-steps", str(args.warmup_steps)],
    }
    planned = []
    for world_size in world_sizes:
        for setting, flags in settings.items():
            if world_size == 1 and setting == "linear":
                continue  # the global batch is the base batch: "linear" would repeat "as given"
            name = f"w{world_size}_{setting.replace(' ', '').replace('+', '_')}"
            out = Path(args.output_dir).resolve() / name
            planned.append(
                (world_size, setting, [*common, "--output-dir", str(out), *flags, *extra])
            )
    return planned


def main(argv=None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else list(argv))
    try:
        planned = plan(args, extra)
        if min(world_size for world_size, _, _ in planned) < 1:
            raise ValueError
    except ValueError:
        print(
            f"error: --world-sizes: expected positive integers such as 1,2,4, "
            f"got {args.world_sizes!r}",
            file=sys.stderr,
        )
        return 2
    rows = []
    for world_size, setting, train_args in planned:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={world_size}", SCRIPT, *train_args]
        print(f"run: {' '.join(cmd[3:])}", flush=True)
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            print(f"error: the run above exited {done.returncode}")
            return 1
        out = Path(train_args[train_args.index("--output-dir") + 1])
        rows.append(row(world_size, setting, json.loads((out / "summary.json").read_text())))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
