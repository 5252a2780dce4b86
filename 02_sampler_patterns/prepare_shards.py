"""02 - the prepare step for sharded loading: write the training set as shard files.

Run once, before training (one process; on a cluster, on a login node or in a job step):
    python 02_sampler_patterns/prepare_shards.py --num-shards 12 --out-dir data/digits_shards
Writes shard-00000.pt ... (images, labels, and each sample's index in the original set, in a
fixed shuffled order so every shard mixes the classes) and manifest.json (file names and
sample counts, which lets every rank plan its epoch without opening any shard).
"""

import dataclasses
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch

from common.config import DATASETS, field, load_config
from common.data import build_datasets
from common.bad_input import exit_on_bad_input
from common.report import write_json_atomic


@dataclasses.dataclass
class PrepareConfig:
    """Write a data set's training split as shard files plus manifest.json."""

    dataset: str = field("digits", "data set", choices=DATASETS)
    data_dir: str = field("data", "folder holding downloaded data sets (not used by digits)")
    num_shards: int = field(
        12, "shard files to write (use many more than ranks, a multiple of the world size)", min=1
    )
    out_dir: str = field("data/digits_shards", "where the shards and manifest.json go")
    seed: int = field(0, "seed of the fixed order in which samples are written", min=0)


def main():
    cfg = load_config(PrepareConfig)
    with exit_on_bad_input():  # a missing data set: one "error:" line, exit code 2
        data = build_datasets(cfg.dataset, cfg.data_dir)
    train = data.train
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    # sizes differ by at most 1
    for number, indices in enumerate(torch.tensor_split(order, cfg.num_shards)):
        samples = [train[i] for i in indices.tolist()]
        name = f"shard-{number:05d}.pt"
        torch.save(
            dict(
                images=torch.stack([x for x, _ in samples]),
                labels=torch.tensor([int(y) for _, y in samples]),
                indices=indices.clone(),
            ),
            out / name,
        )
        shards.append(dict(file=name, samples=len(indices)))
    write_json_atomic(
        out / "manifest.json",
        dict(
            dataset=cfg.dataset,
            total=len(train),
            num_classes=data.num_classes,
            in_channels=data.in_channels,
            image_size=data.image_size,
            shards=shards,
        ),
    )
    print(
        f"{len(train)} samples of {cfg.dataset} written as {cfg.num_shards} shards to {out} "
        f"({', '.join(str(s['samples']) for s in shards)} samples)"
    )


if __name__ == "__main__":
    main()
