r"""The classic DDP bugs, one flag each, to see what they look like and how to diagnose them.

Off by default: without --bug this is a short, correct DDP run. Every bug ends within seconds
(the process-group timeout, --timeout-s, is 10 s here) instead of hanging for gloo's 30 minutes.

    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug mismatched_collective
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug mismatched_collective         # names the two collectives
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug unused_parameter
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug unused_parameter --fix find_unused
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug unused_parameter --fix use_all
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug rank0_barrier
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrapper_attribute
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug module_prefix
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrap_frozen
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug wrap_frozen --fix no_wrap
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug freeze_after_wrap
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug freeze_after_wrap --fix freeze_first
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug freeze_after_wrap --fix rewrap
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug freeze_after_wrap --fix find_unused
    torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug different_models
    torchrun --standalone --nproc_per_node=2 \
        debugging/demo_bugs.py --bug different_models --fix data_set_size

See debugging/README.md for what each prints and why.
"""

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import field, load_config
from common.launcher import choose_backend, detect_launcher
from common.report import parameter_checksum, write_summary

BUGS = (
    "none",
    "mismatched_collective",
    "unused_parameter",
    "rank0_barrier",
    "wrapper_attribute",
    "module_prefix",
    "wrap_frozen",
    "freeze_after_wrap",
    "different_models",
)
FIXES = (
    "none",
    "find_unused",
    "use_all",
    "module",
    "strip_prefix",
    "no_wrap",
    "freeze_first",
    "rewrap",
    "data_set_size",
)


@dataclasses.dataclass
class DemoConfig:
    """Demonstrate one classic DDP bug (or none)."""

    bug: str = field("none", "the bug to demonstrate", choices=BUGS)
    fix: str = field(
        "none",
        "for --bug unused_parameter: find_unused (DDP flag) or use_all "
        "(every parameter takes part in the loss); for wrapper_attribute and module_prefix: "
        "module (the wrapped model, model.module); for module_prefix: strip_prefix; for "
        "wrap_frozen: no_wrap (the frozen model unwrapped); for freeze_after_wrap: freeze_first "
        "(before the wrap), rewrap (wrap again after freezing) or find_unused; for "
        "different_models: data_set_size (a size every rank agrees on)",
        choices=FIXES,
    )
    steps: int = field(4, "training steps", min=1)
    seed: int = field(0, "seed for the model's initial weights", min=0)
    timeout_s: float = field(
        10.0, "process-group timeout: the bugs fail this fast instead of in minutes", min=1.0
    )
    output_dir: str = field("runs/demo_bugs", "where summary.json goes")


class TwoHeads(nn.Module):
    """A trunk with a main head and an auxiliary head; the aux head is used only when asked."""

    def __init__(self, aux_head: bool = True):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        # the "unused parameter" when forward skips it
        self.aux_head = nn.Linear(16, 4) if aux_head else None
        self.num_classes = 4

    def forward(self, x, use_aux: bool = True):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        return out + self.aux_head(h) if use_aux and self.aux_head is not None else out


def train(cfg, launch):
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
    aux_head = True
    if cfg.bug == "different_models" and cfg.fix != "data_set_size":
        # BUG: the model decided from this rank's own shard: an auxiliary head only where the
        # shard holds every class (rank 1's holds 3 of 4). The ranks build different models, and
        # DDP's wrap compares them and refuses. The fix: decide from what every rank agrees on,
        # the data set (or rank 0's choice, broadcast).
        shard_classes = torch.arange(4 - launch.rank % 2).unique()
        aux_head = len(shard_classes) == 4
    model = TwoHeads(aux_head).to(device)
    if cfg.bug == "freeze_after_wrap" and cfg.fix == "freeze_first":
        # Freezing, fix 1: freeze first; DDP registers only the parameters that require grad.
        model.trunk.requires_grad_(False)
    if cfg.bug != "mismatched_collective":
        # Fix 1 for an unused parameter: let DDP look for parameters that got no gradient
        # (costs a walk of the autograd graph every step).
        model = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.fix == "find_unused",
        )
    # (The mismatched-collective demo leaves DDP out: it is about the two all-reduces below, and
    # with TORCH_DISTRIBUTED_DEBUG=DETAIL, DDP on CPU crashed intermittently (SIGSEGV) here.)
    if cfg.bug == "freeze_after_wrap" and cfg.fix != "freeze_first":
        # BUG: DDP registered the trunk's parameters at the wrap and waits for their gradients
        # in every backward; frozen, they never come
        model.module.trunk.requires_grad_(False)
        if cfg.fix == "rewrap":
            # Freezing, fix 2: wrap again, so DDP registers what requires grad now (the way to
            # change what is frozen during training)
            model = DDP(model.module, device_ids=[device.index] if device.type == "cuda" else None)
    teacher = None
    if cfg.bug == "wrap_frozen":
        # A frozen model that only gives targets, such as a distillation teacher.
        teacher = TwoHeads().requires_grad_(False).eval().to(device)
        if cfg.fix != "no_wrap":
            # BUG: DDP refuses a model with no parameter to train (nothing to all-reduce);
            # the fix: use it unwrapped, the same on every rank
            teacher = DDP(teacher, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.bug == "wrapper_attribute":
        # BUG: DDP passes calls to the model's forward, not its attributes or other methods;
        # those are on the wrapped model, model.module (the fix)
        num_classes = model.module.num_classes if cfg.fix == "module" else model.num_classes
        print(f"rank {launch.rank}: {num_classes} classes", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Fix 2: make every parameter take part in the loss (or delete the module you do not use).
    use_aux = cfg.bug != "unused_parameter" or cfg.fix == "use_all"
    generator = torch.Generator().manual_seed(launch.rank)  # each rank its own batches
    for step in range(1, cfg.steps + 1):
        x = torch.randn(16, 8, generator=generator).to(device)
        y = torch.randint(0, 4, (16,), generator=generator).to(device)
        logits = model(x, use_aux=use_aux)
        loss = F.cross_entropy(logits, y)
        if teacher is not None:
            with torch.no_grad():
                targets = teacher(x).softmax(1)
            loss = loss + F.cross_entropy(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        # Metrics: every rank all-reduces the loss, then (correct, count).
        loss_sum = torch.tensor([loss.item()], device=device)
        counts = torch.tensor(
            [(logits.argmax(1) == y).sum().item(), len(y)], device=device, dtype=torch.float64
        )
        if cfg.bug == "mismatched_collective" and launch.rank == 1:
            pass  # BUG: rank 1 skips this all-reduce (think `if loss < threshold:`, true on some
            # ranks only), so its next collective, the counts below, meets rank 0's loss all-reduce.
        else:
            dist.all_reduce(loss_sum)
        dist.all_reduce(counts)
        if launch.rank == 0:
            print(
                f"step {step} mean loss {loss_sum.item() / launch.world_size:.4f} "
                f"accuracy {counts[0].item() / counts[1].item():.3f}",
                flush=True,
            )

        if cfg.bug == "rank0_barrier" and step == 2:
            if launch.rank == 0:
                print("rank 0 writes a checkpoint", flush=True)  # plain I/O: fine on rank 0 alone
                # BUG: a collective inside a rank-0-only block; the others never come
                dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    # Every replica's parameter checksum, on every rank: a collective, so every rank calls it.
    checksums = [None] * launch.world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if cfg.bug == "module_prefix" and launch.rank == 0:
        # Saving for inference, then loading into the plain model as an inference script does.
        # BUG: the wrapper's state_dict names every weight "module.<name>".
        weights = model.module.state_dict() if cfg.fix == "module" else model.state_dict()
        if cfg.fix == "strip_prefix":  # a file saved that way: drop the prefix when loading
            consume_prefix_in_state_dict_if_present(weights, "module.")
        TwoHeads().load_state_dict(weights)
        print("the saved weights load into a plain TwoHeads", flush=True)
    if launch.rank == 0:
        write_summary(
            cfg.output_dir,
            world_size=launch.world_size,
            bug=cfg.bug,
            fix=cfg.fix,
            steps=cfg.steps,
            replica_checksums=checksums,
        )
        print("done: no bug", flush=True)
    # Release the model (DDP holds the process group) before destroying the group.
    del model
    dist.destroy_process_group()


@record  # under torchrun, a failing rank's exception and traceback show in torchrun's summary
def main():
    cfg = load_config(DemoConfig)
    launch = detect_launcher()
    train(cfg, launch)


if __name__ == "__main__":
    main()
