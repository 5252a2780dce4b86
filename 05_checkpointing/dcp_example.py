"""05 - the same model saved and loaded with torch.distributed.checkpoint (DCP).

DCP writes one folder per checkpoint in which every rank saves its own shards in parallel
(deduplicated: a tensor replicated by DDP is written once), can save asynchronously, and
loads into a different world size (resharding). For DDP, where every rank holds the whole
model, train.py's single rank-0 file is simpler; move to DCP with FSDP/tensor parallelism or
when a single-writer save of a large model takes too long.

    # train a few steps on 2 ranks and save with DCP (also writes reference.pt for comparison)
    torchrun --standalone --nproc_per_node=2 05_checkpointing/dcp_example.py --mode save
    # load it into 1 rank (a different world size) and check it equals what was saved
    torchrun --standalone --nproc_per_node=1 05_checkpointing/dcp_example.py --mode load
    # or turn a DCP folder into one torch.save file:
    python -m torch.distributed.checkpoint.format_utils dcp_to_torch runs/dcp/checkpoint model.pt
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.config import TrainConfig, field, load_config
from common.data import check_data, download_datasets, load_datasets
from common.errors import ConfigError
from common.launcher import choose_backend, detect_launcher
from common.models import build_model
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class DcpConfig(TrainConfig):
    mode: str = field(
        "save",
        "save: train max_steps and save; load: load the saved state and verify it",
        choices=("save", "load"),
    )
    output_dir: str = field(
        "runs/dcp", "checkpoint/ (the DCP folder), reference.pt and summary.json go here"
    )
    max_steps: int = field(10, "optimizer steps to train before saving", min=1)

    def validate(self):  # called by load_config: one error line, exit code 2
        folder = Path(self.output_dir) / "checkpoint"
        if self.mode == "load" and not (folder / ".metadata").is_file():
            raise ConfigError(f"no DCP checkpoint in {folder}: run with --mode save first")


def train_and_save(cfg, launch, device, model, optimizer, data, folder):
    sampler = DistributedSampler(
        data.train, num_replicas=launch.world_size, rank=launch.rank, seed=cfg.seed
    )
    for step, (images, labels) in enumerate(
        DataLoader(data.train, batch_size=cfg.local_batch_size, sampler=sampler)
    ):
        if step == cfg.max_steps:
            break
        loss = F.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    # get_state_dict: plain keys (no "module."), optimizer state keyed by parameter name.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # collective: all ranks write
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    if launch.rank == 0:  # a plain copy, only to compare against after loading
        torch.save(
            {"model": model.module.state_dict(), "optim": optim_sd}, folder.parent / "reference.pt"
        )
        print(
            f"saved {folder} from {launch.world_size} rank(s) after {cfg.max_steps} steps",
            flush=True,
        )
    # Every rank waits for rank 0's copy and gathers the replicas' checksums: collectives, so every
    # rank calls them.
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            mode="save",
            world_size=launch.world_size,
            steps=cfg.max_steps,
            replica_checksums=checksums,
        )


def load_and_check(cfg, launch, device, model, optimizer, folder):
    # Load in place: the state_dict of a freshly built model says which tensors (and, with
    # sharded models, which shards) this rank needs; dcp.load fills them from the files.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)  # collective
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )

    reference = torch.load(folder.parent / "reference.pt", map_location=device, weights_only=True)
    params_equal = all(
        torch.equal(v, reference["model"][k]) for k, v in model.module.state_dict().items()
    )
    _, optim_now = get_state_dict(model, optimizer)
    momentum_equal = all(
        torch.equal(optim_now["state"][k]["momentum_buffer"], v["momentum_buffer"])
        for k, v in reference["optim"]["state"].items()
    )
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        print(
            f"loaded {folder} into {launch.world_size} rank(s): parameters equal {params_equal}, "
            f"momentum buffers equal {momentum_equal}",
            flush=True,
        )
        write_summary(
            cfg.output_dir,
            mode="load",
            world_size=launch.world_size,
            params_equal=params_equal,
            momentum_equal=momentum_equal,
            momentum_buffers=len(reference["optim"]["state"]),
            replica_checksums=checksums,
        )


def save_or_load(cfg, launch):
    # as in 01
    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available() else torch.device("cpu")
    # nccl where this torch has it (Linux GPUs); gloo on CPUs and on Windows and macOS
    backend = choose_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    torch.manual_seed(cfg.seed)
    if cfg.download:
        # Rank 0 downloads while the others wait at the barrier, which every rank must call.
        if launch.rank == 0:
            download_datasets(cfg)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    data = load_datasets(cfg, launch.world_size)
    model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    folder = Path(cfg.output_dir) / "checkpoint"
    if cfg.mode == "save":
        train_and_save(cfg, launch, device, model, optimizer, data, folder)
    else:
        load_and_check(cfg, launch, device, model, optimizer, folder)
    # Release the DDP model (it holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record
def main():
    cfg = load_config(DcpConfig)
    launch = detect_launcher()
    check_data(cfg, launch.world_size)
    save_or_load(cfg, launch)


if __name__ == "__main__":
    main()
