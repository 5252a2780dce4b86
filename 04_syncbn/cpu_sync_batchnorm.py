"""CpuSyncBatchNorm: what nn.SyncBatchNorm computes, for CPU tensors (gloo).

nn.SyncBatchNorm refuses CPU tensors (its kernels are GPU-only). This module computes
the same thing in plain PyTorch so the example runs, and can be tested, on any machine.
It communicates differently: nn.SyncBatchNorm all-gathers each rank's mean, inverse std
and count (torch 2.14.1, torch/nn/modules/_functions.py); this module all-reduces sums:

  training mode, world size > 1:
    1. each rank sums, per channel, x and x*x over its batch and spatial positions, and counts them;
    2. ONE all-reduce (sum) of [sum, sum of squares, count] gives the global numbers on every rank;
    3. mean = sum / n, biased var = sum_sq / n - mean^2: the statistics of the whole global batch;
    4. normalize with them; running stats get the unbiased variance var * n / (n - 1), as
       nn.BatchNorm does.
  The all-reduce is torch.distributed.nn's differentiable one, whose backward all-reduces the
  gradients of the sums, so the input gradients are those of BatchNorm over the global batch.

  eval mode (or no process group): plain BatchNorm; eval uses the running statistics, no collective.

It subclasses nn.BatchNorm2d (parameters, buffers and state_dict keys are BatchNorm2d's) and
converts BatchNorm2d layers, the only kind the lesson's models have; nn.SyncBatchNorm also
takes 1d and 3d. Use it like nn.SyncBatchNorm: convert the model BEFORE wrapping it in DDP:
    model = convert_to_cpu_sync_batchnorm(model)
    model = DDP(model)
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

# torch.distributed.nn.functional.all_reduce is the
# public DIFFERENTIABLE all-reduce; torch 2.14 marks it
# deprecated in favour of a private module. Keep it, without the warning on every rank.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated",
    category=FutureWarning,
)


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are those of the global batch over all ranks."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group  # None: all ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        if not (
            self.training
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(group) > 1
        ):
            return super().forward(x)  # eval mode or one process: plain BatchNorm, no communication
        if x.dim() != 4:
            raise ValueError(f"expected 4D input (N, C, H, W), got {x.dim()}D")

        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))  # every dimension but the channel
        # float64 sums: sum_sq / n - mean^2 loses digits to cancellation in float32.
        x64 = x.double()
        local = torch.cat(
            [x64.sum(dims), (x64 * x64).sum(dims), x64.new_full((1,), x.numel() // channels)]
        )
        total = dist_nn.all_reduce(local, op=dist.ReduceOp.SUM, group=group)  # differentiable
        total_sum, total_sq, n = (
            total[:channels],
            total[channels : 2 * channels],
            total[2 * channels],
        )
        if n.item() <= 1:
            raise ValueError(
                f"expected more than 1 value per channel when training, got {int(n.item())}"
            )
        mean = total_sum / n
        var = total_sq / n - mean * mean  # biased: what normalization uses

        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    (1.0 / self.num_batches_tracked.item())
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                # unbiased
                self.running_var.lerp_((var * n / (n - 1)).to(self.running_var.dtype), factor)

        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x64 - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        y = y.to(x.dtype)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_to_cpu_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm2d in `module` by a CpuSyncBatchNorm sharing its
    parameters and running statistics (like
    nn.SyncBatchNorm.convert_sync_batchnorm). Call it before the DDP wrap."""
    converted = module
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, CpuSyncBatchNorm):
        converted = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_to_cpu_sync_batchnorm(child, process_group))
    return converted
