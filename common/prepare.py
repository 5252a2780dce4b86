"""Download a data set once, ahead of training (on a login node: compute nodes are often offline).

python -m common.prepare --dataset cifar10 --data-dir data
"""

import argparse
import sys
from pathlib import Path

# run as a file: make `common` importable, after this file's own folder (sys.path[0])
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common.data import DOWNLOADABLE, build_datasets
from common.bad_input import exit_on_bad_input


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True, choices=DOWNLOADABLE)
    parser.add_argument("--data-dir", default="data")
    args = parser.parse_args()
    with exit_on_bad_input():  # no network here: one line, exit code 2
        data = build_datasets(args.dataset, args.data_dir, download=True)
    print(
        f"{args.dataset}: {len(data.train)} training and {len(data.test)} test images "
        f"in {Path(args.data_dir) / args.dataset}"
    )


if __name__ == "__main__":
    main()
