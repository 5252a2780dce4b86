"""A rank of a real gloo group under torchrun: benchmark/scale.py's record of DDP's collectives
and buckets, which rank 0 writes to the JSON file named first (tests/test_scale.py holds the
fake group's record to it). The other arguments are scale.py comm's."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import scale  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
record = scale.record_steps(scale.parse_args(["comm", *sys.argv[2:]]))
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(record))
dist.destroy_process_group()
