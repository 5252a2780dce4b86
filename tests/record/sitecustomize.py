"""Test-only record of the training samples every rank reads, loaded by Python at start-up when this
folder is on PYTHONPATH (as tests/inject is; Python imports one `sitecustomize`, so a process gets
either this one or that one).

    DDP_TEST_RECORD_DIR=D   append one line per training batch to D/batches.rank<RANK>.txt:
                            "<epoch> <sample index>,<sample index>,..."

A training batch is one that a DataLoader takes from a DistributedSampler (or a subclass, such as
05's ResumableSampler): the hook wraps BatchSampler.__iter__, which hands the DataLoader the indices
of each batch as it loads it. Evaluation loaders (other samplers) are not recorded. Nothing in the
lessons changes; real runs never see this file.
"""

import importlib.abc
import importlib.util
import os
import sys

RECORD_DIR = os.environ.get("DDP_TEST_RECORD_DIR", "")


def _install(sampler_module) -> None:
    batch_sampler = sampler_module.BatchSampler
    original = batch_sampler.__iter__
    path = os.path.join(RECORD_DIR, f"batches.rank{os.environ.get('RANK', '0')}.txt")

    def recording_iter(self):
        from torch.utils.data import DistributedSampler

        if not isinstance(self.sampler, DistributedSampler):
            yield from original(self)
            return
        for batch in original(self):
            with open(path, "a") as f:  # one write per line, flushed on close: readers poll this file
                f.write(f"{self.sampler.epoch} {','.join(map(str, batch))}\n")
            yield batch

    batch_sampler.__iter__ = recording_iter


class _AfterSamplerModule(importlib.abc.MetaPathFinder):
    """Wraps BatchSampler right after torch.utils.data.sampler is imported (importing torch here
    would slow every process the tests start, torchrun's own agent included)."""

    def find_spec(self, name, path, target=None):
        if name != "torch.utils.data.sampler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec


if RECORD_DIR:
    os.makedirs(RECORD_DIR, exist_ok=True)
    sys.meta_path.insert(0, _AfterSamplerModule())
