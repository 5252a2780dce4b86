"""Test-only failure injection, loaded by Python at start-up when this folder is on PYTHONPATH.

The examples contain no test hooks: the tests put this folder on the PYTHONPATH of the
processes they start, and Python imports `sitecustomize` from it. Real runs never see it.

    DDP_TEST_FAIL_AT_STEP=N   fail right after this rank's N-th optimizer.step()
    DDP_TEST_FAIL_RANK=R      the rank that fails (default 0)
    DDP_TEST_FAIL_MODE=M      raise (RuntimeError, default), kill (SIGKILL itself) or hang (sleep)

It registers a global optimizer step hook (torch.optim.optimizer.register_optimizer_step_post_hook)
when torch.optim is first imported, so it works in every example without touching its loop.

    DDP_TEST_NONFINITE_AT_FORWARD=N  make this rank's N-th forward through a DDP model return
                                     inf (its loss and gradients turn non-finite: an fp16
                                     overflow, a diverging batch), via a global module forward
                                     hook (torch.nn.modules.module.register_module_forward_hook)
    DDP_TEST_NONFINITE_RANK=R        the rank that overflows (default 0)

    DDP_TEST_SLOW_ALL_REDUCE_S=S  sleep S seconds before every torch.distributed.all_reduce in this
                                  process: a slow node, for comm_check, when set for one node's
                                  ranks only
    DDP_TEST_SLOW_SAMPLE_S=S      sleep S seconds in every TensorDataset.__getitem__ (the digits
                                  set's samples): a data-bound pipeline, in the DataLoader's
                                  worker processes when it has them
    DDP_TEST_SLOW_WHILE=PATH      ... only while PATH exists (a test deletes it to speed up)
"""

import importlib.abc
import os
import sys

AT_STEP = os.environ.get("DDP_TEST_FAIL_AT_STEP", "")
SLOW_ALL_REDUCE_S = os.environ.get("DDP_TEST_SLOW_ALL_REDUCE_S", "")
NONFINITE_AT_FORWARD = os.environ.get("DDP_TEST_NONFINITE_AT_FORWARD", "")
SLOW_SAMPLE_S = os.environ.get("DDP_TEST_SLOW_SAMPLE_S", "")


def _install(optim=None) -> None:
    import signal
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    fail_rank, mode, steps = (
        os.environ.get("DDP_TEST_FAIL_RANK", "0"),
        os.environ.get("DDP_TEST_FAIL_MODE", "raise"),
        [],
    )

    def hook(optimizer, args, kwargs):
        import torch.distributed as dist

        if not dist.is_initialized() or str(dist.get_rank()) != fail_rank:
            return
        steps.append(1)
        if len(steps) != int(AT_STEP):
            return
        what = f"step {AT_STEP} on rank {fail_rank} (test injection, t={time.time():.2f})"
        if mode == "raise":
            raise RuntimeError(f"injected failure at {what}")
        print(
            f"injecting {'SIGKILL' if mode == 'kill' else 'a hang'} at {what}",
            file=sys.stderr,
            flush=True,
        )
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)

    register_optimizer_step_post_hook(hook)


def _nonfinite_forward(optim=None) -> None:
    from torch.nn.modules.module import register_module_forward_hook

    rank, forwards = os.environ.get("DDP_TEST_NONFINITE_RANK", "0"), []

    def hook(module, args, output):
        import torch.distributed as dist

        if type(module).__name__ != "DistributedDataParallel" or str(dist.get_rank()) != rank:
            return None
        forwards.append(1)
        if len(forwards) != int(NONFINITE_AT_FORWARD):
            return None
        print(
            f"injecting inf into forward {len(forwards)} on rank {rank} (test injection)",
            file=sys.stderr,
            flush=True,
        )
        return output * float("inf")

    register_module_forward_hook(hook)


def _slow_all_reduce(distributed) -> None:
    import time

    original, delay = distributed.all_reduce, float(SLOW_ALL_REDUCE_S)

    def all_reduce(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    distributed.all_reduce = all_reduce


def _slow_samples(dataset_module) -> None:
    import time

    original, delay = dataset_module.TensorDataset.__getitem__, float(SLOW_SAMPLE_S)
    flag = os.environ.get("DDP_TEST_SLOW_WHILE", "")

    def getitem(self, index):
        if not flag or os.path.exists(flag):
            time.sleep(delay)
        return original(self, index)

    dataset_module.TensorDataset.__getitem__ = getitem


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls install(module) right after `module_name` is imported (importing torch here
    would slow every process the tests start, torchrun's own agent included)."""

    def __init__(self, module_name, install):
        self.module_name, self.install = module_name, install

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            self.install(module)

        loader.exec_module = exec_module
        return spec


def _after_import(module_name, install) -> None:
    """install(module) now if it is imported already (ranks forked from a warm process,
    tests/warm_ranks.py), else right after its import."""
    if module_name in sys.modules:
        install(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _AfterImport(module_name, install))


if AT_STEP or SLOW_ALL_REDUCE_S or NONFINITE_AT_FORWARD or SLOW_SAMPLE_S:
    import importlib.util
if NONFINITE_AT_FORWARD:
    _after_import("torch.optim", _nonfinite_forward)
if AT_STEP:
    _after_import("torch.optim", _install)
if SLOW_ALL_REDUCE_S:
    _after_import("torch.distributed", _slow_all_reduce)
if SLOW_SAMPLE_S:
    _after_import("torch.utils.data.dataset", _slow_samples)
