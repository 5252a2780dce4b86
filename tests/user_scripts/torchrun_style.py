"""A user's own script ported the usual way, for the job file tests: torchrun's variables, the
env:// rendezvous, its own argparse (which knows none of this repository's flags). Trains a tiny
model on random data for a few steps and writes, from every rank, what it saw to OUT/rank<N>.json.
"""

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

# Before the process group: torch 2.14.1 can otherwise abort at exit ("terminate called without an
# active exception"; debugging/README.md says why and that a script of one's own does this).
import torch.distributed.nn  # noqa: F401
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(rank)
for _ in range(args.steps):
    loss = model(torch.randn(8, 4, generator=generator)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
checksums = [None] * world_size
dist.all_gather_object(checksums, checksum)
seen = dict(
    rank=rank,
    local_rank=local_rank,
    world_size=world_size,
    local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
    host=socket.gethostname(),
    replicas_identical=len(set(checksums)) == 1,
)
Path(args.out).mkdir(parents=True, exist_ok=True)
(Path(args.out) / f"rank{rank}.json").write_text(json.dumps(seen))
del model
dist.destroy_process_group()
