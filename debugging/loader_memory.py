"""Host memory of a DDP job's processes: ranks x (1 + loader workers), and the data set each holds.

    torchrun --standalone --nproc_per_node=2 debugging/loader_memory.py
    # each forkserver worker importing torch on its own
    torchrun --standalone --nproc_per_node=2 debugging/loader_memory.py \
        --forms none --no-preload-torch

Each rank builds the same data set in several forms, then reads it through a DataLoader with
--num-workers workers; every worker reads every sample once, as over a few shuffled epochs. With
all workers still alive, each rank reads the proportional set size (Pss in /proc/PID/smaps_rollup)
of itself and of its workers; rank 0 adds up the job's and prints how many copies of the data set
the job holds beyond the same job with an empty data set ("none").

Forms: list (Python floats: each worker gets its own copy), tensor (torch moves it to shared memory
when it sends it to a worker: one copy per rank), memmap (a .npy file each process maps itself:
the page cache holds one copy for the whole node), memmap_pickled (the np.memmap object itself in
the data set: pickling sends workers a full copy). See debugging/README.md.
"""

import dataclasses
import gc
import multiprocessing
import os
import sys
import time
from datetime import timedelta
from statistics import mean
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset

from common.config import field, load_config
from common.data import worker_start_method
from common.errors import ConfigError
from common.launcher import detect_launcher
from common.report import write_summary

FORMS = ("none", "tensor", "memmap", "memmap_pickled", "list")


@dataclasses.dataclass
class MemoryConfig:
    """How many copies of a data set a DDP job holds, by the form of the data set."""

    forms: str = field(
        ",".join(FORMS), f"comma-separated forms of the data set: {', '.join(FORMS)}"
    )
    items: int = field(2_000_000, "numbers in the data set", min=1000)
    num_workers: int = field(2, "DataLoader workers per rank", min=1)
    preload_torch: bool = field(True, "import torch once in the forkserver the workers start from")
    timeout_s: float = field(60.0, "process-group timeout", min=1.0)
    output_dir: str = field("runs/loader_memory", "where summary.json and data.npy go")

    def validate(self):
        if unknown := [form for form in self.forms.split(",") if form not in FORMS]:
            raise ConfigError(f"unknown form '{unknown[0]}' (forms: {', '.join(FORMS)})")


def memory_mb(pid: int | str = "self") -> tuple[float, float]:
    """(Pss, private) of a process in MiB: Pss counts each shared page divided by the processes
    that map it; private (Private_Clean + Private_Dirty) what only this process maps."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields["Pss"] / 1024, (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024


class Numbers(Dataset):
    """The same numbers in one of FORMS. Item i: the reading worker's pid, after it has read
    every number once."""

    def __init__(self, form: str, items: int, path: Path):
        self.form, self.path, self.items, self.array = form, path, items, None
        if form == "list":
            self.values = [float(i) for i in range(items)]
        elif form == "tensor":
            self.values = torch.from_numpy(np.arange(items, dtype=np.float64))
        elif form == "memmap_pickled":
            self.values = np.load(path, mmap_mode="r")  # pickled as a full in-memory copy
        else:
            self.values = None  # none; memmap opens the file where it is read

    def __getstate__(self):
        state = dict(self.__dict__)
        state["array"] = None  # memmap: each process maps the file itself, nothing is sent
        return state

    def size_bytes(self) -> int:
        if self.form == "list":  # the list's pointers and one float object per number
            return sys.getsizeof(self.values) + sum(sys.getsizeof(v) for v in self.values)
        return 0 if self.form == "none" else self.items * 8  # float64

    def __len__(self):
        return 1024

    def __getitem__(self, index):
        if self.form == "memmap" and self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        values = self.array if self.form == "memmap" else self.values
        total = (
            0.0 if values is None else float(sum(values) if self.form == "list" else values.sum())
        )
        return torch.tensor([os.getpid(), total], dtype=torch.float64)


def write_numbers(path: Path, items: int) -> None:
    """0, 1, 2, ... as a .npy file, written 64 KiB at a time: no large temporary array, which
    would stay in this process's heap and count as memory it holds (glibc's malloc keeps it)."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(items,))
    for start in range(0, items, 8192):
        stop = min(start + 8192, items)
        array[start:stop] = np.arange(start, stop, dtype=np.float64)
    array.flush()
    del array


def measure(form: str, cfg, path: Path, rank: int) -> dict:
    """This rank's and its workers' memory with the data set in `form`, workers alive."""
    before = memory_mb()
    data = Numbers(form, cfg.items, path)
    loader = DataLoader(
        data,
        batch_size=1,
        sampler=range(cfg.num_workers),  # one item per worker: worker i reads batch i
        num_workers=cfg.num_workers,
        multiprocessing_context=worker_start_method(cfg.num_workers),
    )
    if not cfg.preload_torch:  # the control: nothing preloaded, each worker imports torch itself
        multiprocessing.get_context("forkserver").set_forkserver_preload([])
    start = time.perf_counter()
    batches = iter(loader)  # the workers live until the iterator is done or deleted
    pids = [int(next(batches)[0, 0]) for _ in range(cfg.num_workers)]
    start_s = time.perf_counter() - start  # the first form's: the forkserver's start too
    # every worker of every rank has read the data and is still alive (gloo: no device)
    dist.barrier(device_ids=None)
    processes = [("rank", memory_mb())] + [("worker", memory_mb(pid)) for pid in pids]
    result = dict(
        data_mb=data.size_bytes() / 2**20,
        rank=rank,
        processes=processes,
        before=before,
        start_s=start_s,
    )
    del batches, loader, data  # the workers exit
    gc.collect()
    dist.barrier(device_ids=None)
    return result


def run(cfg, launch):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    path = Path(cfg.output_dir) / "data.npy"
    if launch.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_numbers(path, cfg.items)
    dist.barrier(device_ids=None)
    # "none" first: the workers' memory with an empty data set is what the others are held to
    forms = [form for form in FORMS if form == "none" or form in cfg.forms.split(",")]
    results = {}
    for form in forms:
        gathered = [None] * launch.world_size
        dist.all_gather_object(gathered, measure(form, cfg, path, launch.rank))
        results[form] = gathered
    if launch.rank == 0:
        report(cfg, launch.world_size, results)
    dist.destroy_process_group()


def report(cfg, world_size, results):
    """Per form: what each rank and each worker holds beyond the empty data set, in MiB, and the
    copies of the data set that makes for the whole job."""
    base = results["none"]
    base_worker = mean(
        pss for rank in base for role, (pss, _) in rank["processes"] if role == "worker"
    )
    rows = {}
    for form, ranks in results.items():
        rank_extra = [rank["processes"][0][1][0] - rank["before"][0] for rank in ranks]
        worker_extra = [
            pss - base_worker
            for rank in ranks
            for role, (pss, _) in rank["processes"]
            if role == "worker"
        ]
        data_mb = ranks[0]["data_mb"]
        rows[form] = dict(
            data_mb=data_mb,
            rank_extra_mb=mean(rank_extra),
            worker_extra_mb=mean(worker_extra),
            worker_private_mb=mean(
                private
                for rank in ranks
                for role, (_, private) in rank["processes"]
                if role == "worker"
            ),
            copies=(sum(rank_extra) + sum(worker_extra)) / data_mb if data_mb else 0.0,
        )
    print(
        f"{world_size} ranks x (1 + {cfg.num_workers} workers); torch imported in the forkserver "
        f"first: {cfg.preload_torch}; memory beyond the empty data set, Pss in MiB:"
    )
    print(f"{'form':16}{'data set':>10}{'per rank':>10}{'per worker':>12}{'copies in the job':>19}")
    for form, row in rows.items():
        print(
            f"{form:16}{row['data_mb']:10.1f}{row['rank_extra_mb']:10.1f}"
            f"{row['worker_extra_mb']:12.1f}{row['copies']:19.1f}",
            flush=True,
        )
    start_s = mean(rank["start_s"] for rank in base)
    print(
        "private memory of a worker with the empty data set: "
        f"{rows['none']['worker_private_mb']:.0f} MiB; a rank's first loader had its "
        f"{cfg.num_workers} workers reading after {start_s:.1f} s"
    )
    write_summary(
        cfg.output_dir,
        world_size=world_size,
        num_workers=cfg.num_workers,
        preload_torch=cfg.preload_torch,
        workers_start_s=start_s,
        forms=rows,
    )


@record  # under torchrun, a failing rank's exception and traceback show in torchrun's summary
def main():
    cfg = load_config(MemoryConfig)
    run(cfg, detect_launcher())


if __name__ == "__main__":
    main()
