"""torch.compile with DDP: how many graphs the compiler gets, and where the graph breaks are.

    # the module compiled in place, then wrapped: one graph per DDP bucket
    torchrun --standalone --nproc_per_node=2 debugging/compile_ddp.py
    # the DDP wrapper compiled instead: graph breaks inside DDP's own forward; a last
    # batch of another size: every bucket's graph compiled again
    TORCH_LOGS=graph_breaks,recompiles torchrun --standalone --nproc_per_node=2 \
        debugging/compile_ddp.py --compile wrapper --last-batch 3

TorchDynamo's DDPOptimizer splits the compiled forward at DDP's bucket boundaries, so that each
bucket's all-reduce can start while backward still runs. The backend here is a function that
counts the graphs it is handed and runs each one as it is: no C compiler is needed, and the count
is what torch.compile really hands a backend. A last batch of another size (--last-batch) shows a
recompile: every bucket's graph is compiled again. See debugging/README.md.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `common` importable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import field, load_config
from common.launcher import choose_backend, detect_launcher
from common.report import parameter_checksum, write_summary


@dataclasses.dataclass
class CompileConfig:
    """torch.compile with DDP: graphs per step, counted by the backend."""

    compile: str = field(
        "module",
        "module: model.compile() in place, then DDP(model); wrapper: DDP(model), then compile it",
        choices=("module", "wrapper"),
    )
    bucket_cap_mb: float = field(
        1.0, "DDP's bucket size in MiB (DDPOptimizer needs 1 or more)", min=1.0
    )
    steps: int = field(3, "training steps", min=1)
    local_batch_size: int = field(8, "samples per rank and step", min=1)
    last_batch: int = field(0, "samples in one more, last step (0: no such step)", min=0)
    timeout_s: float = field(30.0, "process-group timeout", min=1.0)
    output_dir: str = field("runs/compile_ddp", "where summary.json goes")


class Tower(nn.Module):
    """Four layers of 1 MiB each (512 x 512 float32 weights): four DDP buckets of 1 MiB."""

    def __init__(self, width: int = 512, depth: int = 4):
        super().__init__()
        self.layers = nn.Sequential(
            *(part for _ in range(depth) for part in (nn.Linear(width, width), nn.ReLU()))
        )

    def forward(self, x):
        return self.layers(x)


class CountingBackend:
    """A torch.compile backend: counts the graphs it is given, per step, and runs each as is."""

    def __init__(self):
        self.step = 0
        self.graphs_per_step = {}

    def __call__(self, graph_module, example_inputs):
        self.graphs_per_step[self.step] = self.graphs_per_step.get(self.step, 0) + 1
        return graph_module.forward


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
    module = Tower().to(device)
    backend = CountingBackend()
    device_ids = [device.index] if device.type == "cuda" else None
    if cfg.compile == "module":
        # The advice of PyTorch's "Where to apply torch.compile?": compile the module in
        # place (its state_dict keys stay as they are), then wrap it.
        module.compile(backend=backend)
        model = DDP(module, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)
    else:
        # Compiling the wrapper also traces DDP's own forward: graph breaks there.
        model = DDP(module, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)
        model.compile(backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(launch.rank)  # each rank its own batches
    sizes = [cfg.local_batch_size] * cfg.steps + ([cfg.last_batch] if cfg.last_batch else [])
    for step, size in enumerate(sizes, 1):
        backend.step = step
        x = torch.randn(size, 512, generator=data).to(device)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if launch.rank == 0:
            graphs = backend.graphs_per_step.get(step, 0)
            print(f"step {step} (batch {size}): {graphs} graph(s) compiled", flush=True)
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if launch.rank == 0:
        key = next(iter(model.state_dict()))
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            compile=cfg.compile,
            bucket_cap_mb=cfg.bucket_cap_mb,
            graphs_per_step=[
                backend.graphs_per_step.get(step, 0) for step in range(1, 1 + len(sizes))
            ],
            state_dict_key=key,
            torch_version=torch.__version__,
            replica_checksums=checksums,
        )
        print(
            f"done: compiled the {cfg.compile}, {backend.graphs_per_step.get(1, 0)} graph(s) "
            f"at step 1, state_dict keys like {key}",
            flush=True,
        )
    # Release the DDP model (it holds the process group) before destroying the group, and the
    # compiler's caches too: their guards keep the model, and so the group, alive past
    # destroy_process_group(), and gloo's threads can then abort the exit ("terminate called
    # without an active exception", debugging/README.md).
    del model, optimizer, loss
    torch.compiler.reset()
    dist.destroy_process_group()


@record  # under torchrun, a failing rank's exception and traceback show in torchrun's summary
def main():
    cfg = load_config(CompileConfig)
    train(cfg, detect_launcher())


if __name__ == "__main__":
    main()
