"""An exponential moving average (EMA) of the weights under DDP, kept on every rank with no
collective of its own, and the tempting mistake: an EMA copied from the DDP wrapper.

    # the EMA of model.module: the same on every rank, saved from rank 0
    torchrun --standalone --nproc_per_node=2 debugging/ema_ddp.py
    # the EMA copied from the wrapper: rank 0's evaluation waits for the other ranks
    torchrun --standalone --nproc_per_node=2 debugging/ema_ddp.py --ema-of wrapper

After each optimizer.step() every rank holds the same parameters (DDP averaged the gradients),
so every rank computes the same EMA from them: no all-reduce is needed. BatchNorm's buffers are
each rank's own after its last forward; the EMA copies them, and rank 0's are the ones saved.
A copy of the DDP wrapper is a DDP model too: its forward first broadcasts rank 0's buffers, a
collective, so evaluating it on rank 0 alone waits for ranks that never come. See
debugging/README.md.
"""

import copy
import dataclasses
import hashlib
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import field, load_config
from common.errors import ConfigError
from common.launcher import choose_backend, detect_launcher
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class EmaConfig:
    """EMA weights under DDP: of model.module (right) or of the DDP wrapper (the mistake)."""

    ema_of: str = field(
        "module",
        "module: copy model.module, the plain model; wrapper: copy the DDP model (the mistake)",
        choices=("module", "wrapper"),
    )
    steps: int = field(5, "training steps", min=1)
    decay: float = field(0.9, "EMA decay: ema = decay * ema + (1 - decay) * weights", min=0.0)
    timeout_s: float = field(10.0, "process-group timeout", min=1.0)
    output_dir: str = field("runs/ema_ddp", "where summary.json and ema.pt go")

    def validate(self):
        if self.decay >= 1.0:
            raise ConfigError(f"config key 'decay' must be below 1, got {self.decay}")


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))


def buffer_checksum(model: nn.Module) -> str:
    """SHA-256 of this rank's buffers (BatchNorm's running mean and variance, batch count)."""
    digest = hashlib.sha256()
    for buffer in model.buffers():
        digest.update(buffer.detach().double().cpu().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """After optimizer.step(): move each EMA weight towards the model's; copy the buffers."""
    for averaged, current in zip(ema.parameters(), model.parameters()):
        averaged.lerp_(current, 1.0 - decay)
    for averaged, current in zip(ema.buffers(), model.buffers()):
        averaged.copy_(current)


def train(cfg, launch):
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        choose_backend(device),
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    torch.manual_seed(0)
    model = DDP(
        build_model().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    # The EMA: a copy of the plain model (model.module), never of the DDP wrapper.
    ema = copy.deepcopy(model.module if cfg.ema_of == "module" else model)
    ema.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(launch.rank)  # each rank its own batches
    for step in range(1, cfg.steps + 1):
        x = torch.randn(16, 8, generator=data).to(device)
        loss = F.cross_entropy(model(x), (x.sum(dim=1) > 0).long())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # After the step, from the weights every rank now shares: no collective needed.
        update_ema(ema, model.module if cfg.ema_of == "module" else model, cfg.decay)
        if launch.rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if launch.rank == 0:
        # Evaluating the EMA on rank 0 alone, as a script does before saving it.
        ema.eval()
        with torch.no_grad():
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(99)).to(device)
            eval_loss = F.cross_entropy(ema(x), (x.sum(dim=1) > 0).long()).item()
        torch.save(ema.state_dict(), Path(cfg.output_dir, "ema.pt"))
        print(f"EMA evaluated on rank 0: loss {eval_loss:.4f}; saved to ema.pt", flush=True)
    # Every rank's EMA checksums, gathered for the summary (the only collective for the EMA).
    checksums = [None] * launch.world_size
    mine = (parameter_checksum(model), parameter_checksum(ema), buffer_checksum(ema))
    dist.all_gather_object(checksums, mine)
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            ema_of=cfg.ema_of,
            decay=cfg.decay,
            ema_eval_loss=eval_loss,
            ema_keys=list(ema.state_dict()),
            ema_parameters_identical=len({c[1] for c in checksums}) == 1,
            ema_buffers_identical=len({c[2] for c in checksums}) == 1,
            torch_version=torch.__version__,
            replica_checksums=[c[0] for c in checksums],
        )
        print(f"done: EMA of the {cfg.ema_of}", flush=True)
    # Release the DDP model (it holds the process group) before destroying the group.
    del model, ema
    dist.destroy_process_group()


@record  # under torchrun, a failing rank's exception and traceback show in torchrun's summary
def main():
    cfg = load_config(EmaConfig)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    train(cfg, detect_launcher())


if __name__ == "__main__":
    main()
