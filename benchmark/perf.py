"""Helpers of benchmark/train.py, the script with every performance knob.

The knob lines themselves (autocast, GradScaler, channels_last, model.compile(), the
DDP arguments, register_comm_hook) stay visible in benchmark/train.py. Here live only:

    check_knobs(cfg)                      bad combinations: a ConfigError, before any process group
    device_type(cfg)                      "cuda" or "cpu", from --device auto/cpu/cuda
    AMP_DTYPES[cfg.precision]             the autocast dtype
    COMM_HOOKS[cfg.comm_hook]             torch's default_hooks.bf16/fp16_compress_hook
    checkpoint_blocks(model, variant)     activation checkpointing: each block under
    torch.utils.checkpoint
    loader_kwargs(cfg, device)            DataLoader input-pipeline settings from the config
    NoDDP(model)                          the --no-ddp baseline: DDP's interface, no communication
    StepTimer                             images/s, data wait and (--profile-steps) where a step's
    time goes
    perf_settings(...)                    what the knobs set, read back from the objects
    (summary.json)
    buffer_checksum(module)               a checksum of the buffers (buffers_identical)
    peak_memory(device)                   every rank's peak memory (GPU: allocated by tensors and
    reserved by the allocator; CPU: resident)
    SYNC_BUFFERS_ARGUMENT                 DDP's name for --no-broadcast-buffers in this torch
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from common.data import worker_start_method
from common.errors import ConfigError

AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Each hook casts a gradient bucket to 16 bits, all-reduces
# it, and casts back: half the bytes on the wire.
COMM_HOOKS = {
    "none": None,
    "bf16_compress": default_hooks.bf16_compress_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
}

# --activation-checkpointing: off, or torch.utils.checkpoint with use_reentrant=False / True.
ACTIVATION_CHECKPOINTING = {"none": None, "non_reentrant": False, "reentrant": True}

# Settings that configure DDP, and so mean nothing with --no-ddp.
DDP_ONLY = (
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
    "comm_hook",
    "broadcast_buffers",
    "batched_grad_copy",
)

DDP_ARGUMENTS = inspect.signature(DistributedDataParallel).parameters
# --no-broadcast-buffers: DDP's argument that stops the broadcast of rank 0's buffers at every
# forward. torch 2.13 renamed broadcast_buffers to forward_sync_buffers; the old name warns there.
SYNC_BUFFERS_ARGUMENT = (
    "forward_sync_buffers" if "forward_sync_buffers" in DDP_ARGUMENTS else "broadcast_buffers"
)


def device_type(cfg) -> str:
    """--device auto: cuda where there is a GPU, else cpu."""
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def gpus_without_native_bf16() -> list[int]:
    """The visible GPUs older than Ampere (compute capability below 8.0), where bf16 is emulated,
    slowly. Read from each GPU's properties, which creates no CUDA context: by default
    torch.cuda.is_bf16_supported() counts emulation as support, and finds out by creating a tensor
    on the current GPU, GPU 0 of every rank before set_device."""
    if torch.version.hip:  # ROCm GPUs have bf16 (as torch.cuda.is_bf16_supported says)
        return []
    return [
        index
        for index in range(torch.cuda.device_count())
        if torch.cuda.get_device_capability(index) < (8, 0)
    ]


def check_knobs(cfg) -> None:
    """Refuse settings that cannot work here, with the fix in the message (ConfigError)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device: cuda was asked for but this machine has no usable CUDA GPU "
            "(use --device auto or cpu)"
        )
    kind = device_type(cfg)
    if cfg.backend == "nccl" and kind != "cuda":
        raise ConfigError(
            "backend: nccl needs CUDA tensors but the device is cpu (use --backend gloo or auto)"
        )
    if cfg.backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError("backend: this PyTorch build has no nccl (use --backend auto)")
    if cfg.precision == "bf16" and kind == "cuda" and (slow := gpus_without_native_bf16()):
        raise ConfigError(
            f"precision: GPU {slow[0]} has no native bf16 (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(slow[0])))}; Ampere, 8.0, and "
            "newer have it): use --precision fp16, which adds a GradScaler"
        )
    if cfg.batched_grad_copy and "batched_grad_copy" not in DDP_ARGUMENTS:
        raise ConfigError(
            f"batched_grad_copy: DDP has it from torch 2.13 on; this is torch {torch.__version__} "
            "(drop --batched-grad-copy)"
        )
    queued = cfg.num_workers * cfg.prefetch_factor
    if cfg.profile_steps and queued > cfg.profile_warmup:
        # the first steps after start-up are served from the batches the workers queued
        raise ConfigError(
            f"profile_warmup: {cfg.profile_warmup} steps, but the loader queues {queued} batches "
            f"ahead ({cfg.num_workers} workers x prefetch_factor {cfg.prefetch_factor}); measured "
            f"steps would be served from that queue: use --profile-warmup {queued} or more"
        )
    if cfg.fake_images and cfg.dataset != "fake":
        raise ConfigError(f"fake_images: applies to --dataset fake only, not {cfg.dataset}")
    if not cfg.ddp:
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        changed = [k for k in DDP_ONLY if getattr(cfg, k) != defaults[k]]
        if changed:
            raise ConfigError(
                f"ddp: {', '.join(changed)} configure DDP, which --no-ddp leaves out "
                "(drop them or drop --no-ddp)"
            )
    if (
        cfg.activation_checkpointing == "reentrant"
        and cfg.ddp
        and cfg.find_unused_parameters
        and not cfg.static_graph
    ):
        # DDP's graph walk cannot see into a reentrant checkpoint,
        # marks the parameters inside unused, and then
        # the recomputing backward marks them ready a second
        # time (tests/test_activation_checkpointing.py runs
        # it unrefused).
        raise ConfigError(
            "activation_checkpointing: reentrant with find_unused_parameters fails in DDP's "
            "backward "
            '("Expected to mark a variable ready only once"); use non_reentrant, or add '
            "--static-graph"
        )
    if cfg.compile and kind == "cpu" and not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        raise ConfigError(
            "compile: torch.compile on CPU needs a C/C++ compiler (install gcc) "
            "or run without --compile"
        )
    if cfg.compile and cfg.ddp and cfg.bucket_cap_mb < 1:
        # Under DDP, torch.compile's DDPOptimizer splits the
        # graph at DDP's buckets and asserts that they are
        # no smaller than DDP's first bucket (1 MiB) (torch
        # 2.14.1; tests/test_torch_text.py runs it unrefused).
        raise ConfigError(
            "compile: --bucket-cap-mb below 1 fails in torch.compile under DDP (its DDPOptimizer "
            "needs buckets of at least DDP's first one, 1 MiB); use 1 or more, or drop --compile"
        )


def loader_kwargs(cfg, device: torch.device) -> dict:
    """DataLoader settings for the input pipeline.

    pin_memory only helps copies to a GPU; persistent_workers and prefetch_factor only
    exist with worker processes (num_workers > 0), which start as in the lessons (not by fork(),
    common.data.worker_start_method).
    """
    kwargs = dict(num_workers=cfg.num_workers, pin_memory=cfg.pin_memory and device.type == "cuda")
    if cfg.num_workers > 0:
        kwargs.update(
            persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor,
            multiprocessing_context=worker_start_method(cfg.num_workers),
        )
    return kwargs


def checkpoint_blocks(model: nn.Module, variant: str) -> int:
    """--activation-checkpointing: run each block of `model`
    under torch.utils.checkpoint; returns how many.

    A checkpointed block keeps only its input during forward and runs its forward again
    in backward to get the activations it needs: less memory for one more forward of the
    block. The blocks are a torchvision ResNet's residual blocks (layer1..layer4) and
    SmallCNN's classifier. The first layers run as usual: their input, the images, needs
    no gradient, and the reentrant variant gives the parameters inside a checkpoint no
    gradient unless an input of it requires one (torch.utils.checkpoint's docs).

    Each block's `forward` is replaced on the instance (no wrapper module), so parameter names and
    state_dict keys stay the model's own and model.pt loads into the model without checkpointing.
    """
    use_reentrant = ACTIVATION_CHECKPOINTING[variant]
    if use_reentrant is None:
        return 0
    # torchvision ResNet
    if all(hasattr(model, name) for name in ("layer1", "layer2", "layer3", "layer4")):
        blocks = [
            block
            for name in ("layer1", "layer2", "layer3", "layer4")
            for block in getattr(model, name)
        ]
    else:  # SmallCNN
        blocks = [model.classifier]
    # training: block(x) calls checkpoint(<the block's own forward>, x, use_reentrant=...)
    for block in blocks:
        block.forward = CheckpointedForward(block.forward, use_reentrant)
    return len(blocks)


class CheckpointedForward:
    """A block's own forward, run under torch.utils.checkpoint while autograd records (training)."""

    def __init__(self, forward, use_reentrant: bool):
        self.forward, self.use_reentrant = forward, use_reentrant

    def __call__(self, *args):
        # evaluation under no_grad keeps no activations: nothing to save
        if not torch.is_grad_enabled():
            return self.forward(*args)
        return checkpoint(self.forward, *args, use_reentrant=self.use_reentrant)


def checkpointed_blocks(module: nn.Module) -> list[bool]:
    """use_reentrant of every block checkpoint_blocks changed, read back from the modules."""
    return [
        m.forward.use_reentrant
        for m in module.modules()
        if isinstance(vars(m).get("forward"), CheckpointedForward)
    ]


def buffer_checksum(module: nn.Module) -> str:
    """SHA-256 of the module's buffers (BatchNorm's running statistics and counts)."""
    digest = hashlib.sha256()
    for buffer in module.buffers():
        digest.update(buffer.detach().double().cpu().numpy().tobytes())
    return digest.hexdigest()


def peak_memory(device: torch.device) -> dict:
    """Collective: every rank's peak memory, in bytes, on all ranks.

    GPU: torch.cuda.max_memory_allocated (the most memory tensors held at once) and
    max_memory_reserved (what the caching allocator held: what a second job on the GPU could not
    use); since the measured window started when profiling (StepTimer resets both), else since
    the process started.
    CPU: the process's peak resident set (getrusage's ru_maxrss), which also counts
    the interpreter, torch's libraries and the data set, so a saving in activations
    shows as a difference between two runs, not as a fraction of this figure.
    """
    if device.type == "cuda":
        kind = "cuda_max_memory_allocated"
        peaks = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    else:
        import resource  # Unix only

        # ru_maxrss is in kilobytes on Linux, in bytes on macOS.
        kind = "cpu_max_rss"
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks = [rss * (1 if sys.platform == "darwin" else 1024), 0]
    mine = torch.tensor(peaks, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    memory = {
        "peak_memory": kind,
        "peak_memory_bytes_per_rank": [int(t[0].item()) for t in gathered],
    }
    if device.type == "cuda":
        memory["peak_reserved_bytes_per_rank"] = [int(t[1].item()) for t in gathered]
    return memory


class NoDDP(nn.Module):
    """Stands in for DistributedDataParallel in the --no-ddp baseline.

    Same `.module` and `no_sync()` as DDP, so the training loop is unchanged, but backward
    communicates nothing: every rank trains its own replica on its own shard. The time
    difference to a DDP run is the cost of gradient communication.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield


class StepTimer:
    """Images/s and data wait for the progress lines;
    with `steps` > 0 also where each step's time goes, over a window of `steps` steps.

        timer = StepTimer(model.module, optimizer, device, warmup=50, steps=200)
        for images, labels in timer.iterate(train_loader):   # the only change to the loop
            ...                                               # forward, backward, optimizer step
        images_per_s, data_wait = timer.rates()               # collective: since the epoch started
        summary["profile"] = timer.profile()                  # collective

    The method (benchmark/README.md, "How a step is measured"):
    - Nothing is called inside the step: `iterate` marks when a batch is requested and when
      it is in hand, a post-accumulate-grad hook marks the last gradient of the backward pass,
      and the optimizer's step pre- and post-hooks mark the optimizer step. A step ends when
      the loop asks for the next batch.
    - On a GPU the marks are CUDA events, recorded on the GPU's time line and read once, after
      the window: no synchronize between measured steps, so the CPU runs ahead of the GPU as it
      does in training (a synchronize per step would show DDP's CPU work as step time).
    - The headline is the window's mean step (its whole time over its steps: what a user gets,
      stalls included); each part's median is beside it.
    - The GPU's peak-memory counters are reset when the window starts, after the warm-up.
    - Only the marks that are read are recorded: the gradient hook counts the backward pass's
      gradients and records on the last one (as many as the step before had).

    The parts (seconds) of each profiled step:
      data_wait         batch requested -> batch in hand (time inside next(loader));
      forward_backward  batch in hand -> the last parameter gradient computed;
      exposed_comm      last gradient computed -> optimizer.step() starts: DDP's backward() waits
                        there for the buckets still being all-reduced, so this is the communication
                        NOT hidden behind backward compute (with --no-ddp nothing is waited
                        for: less than with DDP); with fp16 it also holds the GradScaler's
                        unscale and overflow check;
      optimizer         optimizer.step() itself;
      other             after optimizer.step() -> next batch requested (GradScaler update, loss
                        bookkeeping, progress lines);
      step              batch requested -> next batch requested (the sum of the parts).
    A part the step did not reach (a step the GradScaler skipped has
    no optimizer step) is left out.
    """

    PARTS = ("data_wait", "forward_backward", "exposed_comm", "optimizer", "other", "step")
    MARKS = ("request", "batch", "grad_ready", "step_start", "step_end", "end")

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        warmup: int = 0,
        steps: int = 0,
    ):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.cuda = device.type == "cuda"
        self.index = 0  # steps finished, over all epochs
        self.rows: list[list[float]] = []  # the window's steps, in seconds, once read
        self.window_s: float | None = None  # first request -> last end of the window
        self.pending: list[list] = []  # the window's marks, read after it
        self.marks: dict = {}
        self.grads = 0  # gradient hooks called in this step
        self.grads_per_step: int | None = None  # ... and in the step before
        self.images, self.wait_s, self.started = 0, 0.0, time.perf_counter()
        if steps > 0:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_done)
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._mark("step_start"))
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._mark("step_end"))

    def _active(self) -> bool:
        return self.warmup <= self.index < self.warmup + self.steps

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, name: str) -> None:
        if self._active():
            self.marks[name] = self._now()

    def _gradient_done(self, param) -> None:
        # Mark only the backward pass's last gradient: in the first step every one (the last
        # call wins), then the one that makes as many as the step before had.
        self.grads += 1
        if self.grads_per_step is None or self.grads == self.grads_per_step:
            self._mark("grad_ready")

    def _seconds(self, a, b) -> float:
        if a is None or b is None:
            return math.nan
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def _read_window(self) -> None:
        """Turn the window's marks into seconds: one synchronize, after the last measured step."""
        if not self.pending:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for marks in self.pending:
            self.rows.append(
                [self._seconds(a, b) for a, b in zip(marks, marks[1:])]
                + [self._seconds(marks[0], marks[-1])]
            )
        self.window_s = self._seconds(self.pending[0][0], self.pending[-1][-1])
        self.pending = []

    def iterate(self, loader):
        """Yield the loader's batches, timing the wait for each (and each step, when profiling)."""
        self.images, self.wait_s, self.started = 0, 0.0, time.perf_counter()
        batches = iter(loader)
        while True:
            self.marks, self.grads = {}, 0
            if self.cuda and self.steps and self.index == self.warmup:
                # the peaks of the measured window, not of start-up and cuDNN's autotuning
                torch.cuda.reset_peak_memory_stats(self.device)
            self._mark("request")
            requested = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - requested
            self.images += len(batch[0])
            self._mark("batch")
            yield batch  # the step runs here; a `break` ends it without a record
            self._mark("end")
            if self._active():
                self.pending.append([self.marks.get(name) for name in self.MARKS])
                if self.index == self.warmup + self.steps - 1:  # the window's last step
                    self._read_window()
            self.grads_per_step = self.grads
            self.index += 1

    def rates(self) -> tuple[float, float]:
        """Collective: (images/s over all ranks, fraction of time
        spent waiting for data) since the epoch started."""
        if self.cuda:
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: time it honestly
        totals = torch.tensor(
            [self.images, self.wait_s, time.perf_counter() - self.started],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(totals)  # sums over ranks
        images, wait_s, elapsed_s = totals.tolist()
        per_rank_s = elapsed_s / dist.get_world_size()
        return (images / per_rank_s if per_rank_s else 0.0), (
            wait_s / elapsed_s if elapsed_s else 0.0
        )

    def profile(self) -> dict:
        """Collective when profiling: the window's mean step (its time over its steps) and each
        part's median over the window's steps, of the mean over ranks (None when off)."""
        result = {"warmup_steps": self.warmup, "steps": 0, "median_s": None, "mean_step_s": None}
        if self.steps == 0:
            return result
        self._read_window()  # a window the run ended early
        count = torch.tensor([len(self.rows)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        n = int(count.item())  # every rank runs the same steps; be safe anyway
        rows = self.rows[:n]
        # the window's mean step: its whole time over its steps (the steps' sum where a rank ran
        # more steps than another, or the rows came from elsewhere)
        whole = self.window_s is not None and n == len(self.rows)
        window = self.window_s if whole else sum(row[-1] for row in rows)
        table = torch.tensor(
            [row + [window / n] for row in rows] or [[0.0] * (len(self.PARTS) + 1)],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(table)  # a part missing on any rank stays NaN and is left out
        table = (table / dist.get_world_size()).cpu()
        median = {}
        for i, part in enumerate(self.PARTS):
            values = [v for v in table[:n, i].tolist() if not math.isnan(v)]
            median[part] = statistics.median(values) if values else None
        mean_step = float(table[0, -1]) if n else None
        return dict(result, steps=n, median_s=median if n else None, mean_step_s=mean_step)


def perf_settings(
    model: nn.Module,
    scaler: torch.amp.GradScaler,
    loader,
    comm_hook,
    compiled: bool,
    logits: torch.Tensor,
    images: torch.Tensor,
) -> dict:
    """What the performance knobs set, read back from the objects (summary.json's "perf").

    `comm_hook` is the hook the script registered (None: DDP's own all-reduce), `compiled` whether
    it called model.compile(), `logits` and `images` the last training step's output and input.
    """
    ddp = model if isinstance(model, DistributedDataParallel) else None
    weights = [p for p in model.module.parameters() if p.dim() == 4]  # conv weights
    checkpointed = checkpointed_blocks(model.module)
    return {
        "ddp": type(model).__name__,
        # the forward pass's output dtype
        "autocast_dtype": str(logits.dtype).replace("torch.", ""),
        "grad_scaler_enabled": scaler.is_enabled(),
        "grad_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "compiled": compiled,
        # A tensor with one channel is channels_last in either layout (digits' images, first conv).
        "channels_last_weights": all(
            w.is_contiguous(memory_format=torch.channels_last) for w in weights
        )
        if weights
        else None,
        "channels_last_inputs": images.dim() == 4
        and images.is_contiguous(memory_format=torch.channels_last),
        "ddp_bucket_cap_bytes": ddp.bucket_bytes_cap if ddp else None,
        "ddp_gradient_as_bucket_view": ddp.gradient_as_bucket_view if ddp else None,
        "ddp_static_graph": ddp.static_graph if ddp else None,
        "ddp_find_unused_parameters": ddp.find_unused_parameters if ddp else None,
        "ddp_comm_hook": comm_hook.__name__ if comm_hook else None,
        # a property over forward_sync_buffers from torch 2.13 on
        "ddp_broadcast_buffers": ddp.broadcast_buffers if ddp else None,
        "ddp_batched_grad_copy": getattr(ddp, "batched_grad_copy", False) if ddp else None,
        "activation_checkpointing_blocks": len(checkpointed),
        # one variant for all
        "activation_checkpointing_use_reentrant": checkpointed[0] if checkpointed else None,
        "loader_num_workers": loader.num_workers,
        "loader_pin_memory": loader.pin_memory,
        "loader_persistent_workers": loader.persistent_workers,
        "loader_prefetch_factor": loader.prefetch_factor,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
