"""Performance knobs: the small pieces every training example would otherwise copy.

The knob lines themselves (autocast, GradScaler, channels_last, torch.compile, the DDP
arguments, register_comm_hook) stay visible in each script; see 01_basic_ddp/train.py.
Here live only their helpers:

    check_perf_config(cfg, device)       bad combinations fail before the process group starts
    AMP_DTYPES[cfg.precision]            the autocast dtype
    COMM_HOOKS[cfg.comm_hook]            torch's default_hooks.bf16/fp16_compress_hook
    loader_kwargs(cfg, device)           DataLoader input-pipeline settings from the config
    NoDDP(model)                         the --no-ddp baseline: DDP's interface, no communication
    unwrap(model)                        the plain module under DDP / NoDDP / torch.compile
    StepProfiler                         --profile-steps: where a step's time goes
    perf_settings(model, scaler, cfg)    what the knobs set, read back from the objects (summary.json)
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from common.errors import ConfigError

AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Each hook casts a gradient bucket to 16 bits, all-reduces it, and casts back: half the bytes on the wire.
COMM_HOOKS = {"none": None,
              "bf16_compress": default_hooks.bf16_compress_hook,
              "fp16_compress": default_hooks.fp16_compress_hook}

# DDP settings that mean nothing without DDP.
_DDP_ONLY = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters", "comm_hook")


def check_perf_config(cfg, device: torch.device) -> None:
    """Refuse knob combinations that cannot work here, with the fix in the message."""
    if cfg.precision != "fp32" and not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"precision: {cfg.precision} autocast is not available on {device.type} "
                          "(use --precision fp32)")
    if cfg.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision: this GPU has no bf16 support (use --precision fp16, which adds a GradScaler)")
    if cfg.no_ddp:
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        changed = [k for k in _DDP_ONLY if getattr(cfg, k) != defaults[k]]
        if changed:
            raise ConfigError(f"no_ddp: {', '.join(changed)} configure DDP, which --no-ddp leaves out "
                              "(drop them or drop --no-ddp)")
    if cfg.compile and device.type == "cpu" and not (shutil.which("cc") or shutil.which("gcc")
                                                      or shutil.which("clang")):
        raise ConfigError("compile: torch.compile on CPU needs a C/C++ compiler (install gcc) "
                          "or run without --compile")


def loader_kwargs(cfg, device: torch.device) -> dict:
    """DataLoader settings for the input pipeline.

    pin_memory only helps copies to a GPU; persistent_workers and prefetch_factor only
    exist with worker processes (num_workers > 0).
    """
    kwargs = dict(num_workers=cfg.num_workers, pin_memory=cfg.pin_memory and device.type == "cuda")
    if cfg.num_workers > 0:
        kwargs.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
    return kwargs


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


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: under DDP/NoDDP (.module) and torch.compile (._orig_mod)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


class StepProfiler:
    """Where a training step's time goes, per step, on every rank (--profile-steps N).

        profile = StepProfiler(unwrap(model), device, cfg.profile_warmup, cfg.profile_steps)
        profile.epoch_start()                      # before each pass over the loader
        for batch in loader:
            profile.begin()                        # batch in hand: data wait ends
            ... forward, backward ...
            profile.backward_done()
            ... optimizer step ...
            profile.end()
        summary["profile"] = profile.summary()     # collective

    Splits (seconds):
      data_wait      previous step's end -> batch in hand (time inside next(loader));
      forward_backward  batch in hand -> the last parameter gradient computed;
      exposed_comm   last gradient computed -> backward() returns. DDP's backward waits
                     there for the all-reduce of the buckets still in flight, so this is
                     the communication NOT hidden behind backward compute (about 0 with --no-ddp);
      optimizer      backward() returned -> optimizer step done;
      step           previous step's end -> this step's end.
    The last gradient's time comes from a post-accumulate-grad hook on every parameter.
    On GPUs the marks are CUDA events (GPU time line), read after a synchronize per step.
    """

    PARTS = ("data_wait", "forward_backward", "exposed_comm", "optimizer", "step")

    def __init__(self, module: nn.Module, device: torch.device, warmup: int, steps: int):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.enabled = steps > 0
        self.cuda = device.type == "cuda"
        self.index = 0
        self.rows: list[list[float]] = []
        self.last_end = self.started = self.grad_ready = self.bwd_done = None
        if self.enabled:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def _active(self) -> bool:
        return self.enabled and self.warmup <= self.index < self.warmup + self.steps

    def _on_grad(self, param) -> None:
        if self._active():
            self.grad_ready = self._mark()  # the last call of a backward pass wins

    def epoch_start(self) -> None:
        if self.enabled:
            self.last_end = self._mark()

    def begin(self) -> None:
        if self._active():
            self.started = self._mark()
            self.grad_ready = None

    def backward_done(self) -> None:
        if self._active():
            self.bwd_done = self._mark()

    def end(self) -> None:
        if not self.enabled:
            return
        now = self._mark()
        if self._active() and self.last_end is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            grad_ready = self.grad_ready or self.bwd_done
            self.rows.append([self._seconds(self.last_end, self.started),
                              self._seconds(self.started, grad_ready),
                              self._seconds(grad_ready, self.bwd_done),
                              self._seconds(self.bwd_done, now),
                              self._seconds(self.last_end, now)])
        self.last_end = now
        self.index += 1

    def summary(self) -> dict | None:
        """Collective when enabled (the same on every rank): each part's median over the profiled
        steps of the mean over ranks. None when profiling is off."""
        if not self.enabled:
            return None
        world = dist.get_world_size()
        count = torch.tensor([len(self.rows)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        n = int(count.item())  # every rank runs the same steps; be safe anyway
        table = torch.tensor(self.rows[:n] or [[0.0] * len(self.PARTS)], dtype=torch.float64)
        table = table.to(self.device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        table = (table / world).cpu()
        median = {part: statistics.median(table[:n, i].tolist()) if n else None
                  for i, part in enumerate(self.PARTS)}
        return {"warmup_steps": self.warmup, "steps": n, "median_s": median}


def perf_settings(model: nn.Module, scaler: torch.amp.GradScaler, cfg) -> dict:
    """What the performance knobs actually set, read back from the objects (summary.json)."""
    ddp = model._get_ddp_logging_data() if isinstance(model, DistributedDataParallel) else {}
    # Every conv weight: a 1-channel one (digits' first conv) is channels_last by any layout.
    weights = [p for p in unwrap(model).parameters() if p.dim() == 4] if cfg.channels_last else []
    return {"precision": cfg.precision, "grad_scaler_enabled": scaler.is_enabled(),
            "grad_scale": scaler.get_scale() if scaler.is_enabled() else None,
            # torch.compile's wrapper keeps the original module as _orig_mod (checked by attribute:
            # touching torch._dynamo would import it, over a second per process, in every run).
            "compiled": hasattr(model.module, "_orig_mod"),
            "channels_last_weights": (all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
                                      if weights else None),
            "ddp": type(model).__name__,
            "ddp_bucket_cap_bytes": ddp.get("bucket_cap_bytes"), "ddp_comm_hook": ddp.get("comm_hook"),
            **{f"ddp_{key}": bool(ddp.get(key)) for key in ("gradient_as_bucket_view", "static_graph",
                                                            "find_unused_parameters")}}
