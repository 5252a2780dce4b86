"""Test-only record of the training samples every rank reads, loaded by Python
at start-up when this folder is on PYTHONPATH (as tests/inject is; Python
imports one `sitecustomize`, so a process gets either this one or that one).

    DDP_TEST_RECORD_DIR=D   append one line per training batch to D/batches.rank<RANK>.txt:
                            "<epoch> <sample index>,<sample index>,..."
                            and one line per randomly augmented sample to D/augment.rank<RANK>.txt:
                            "<process> <hash of the augmented view of one fixed image>"

A training batch is one that a DataLoader takes from a DistributedSampler (or a subclass, such
as 05's ResumableSampler): the hook wraps BatchSampler.__iter__, which hands the DataLoader the
indices of each batch as it loads it. Evaluation loaders (other samplers) are not recorded.

An augmented sample is one that goes through a torchvision Compose holding a Random* transform
(CIFAR-10's RandomCrop + RandomHorizontalFlip, ImageFolder's). The hook saves torch's RNG state,
applies the same Compose to a fixed reference image, restores the state and then transforms the real
sample: the reference view shows exactly the random draws the real sample gets (in the main process,
or in a DataLoader worker: <process> is "main" or "worker<id>"), and training is unchanged.

Nothing in the lessons changes; real runs never see this file.
"""

import importlib.abc
import importlib.util
import os
import sys

RECORD_DIR = os.environ.get("DDP_TEST_RECORD_DIR", "")


def _rank_file(kind: str) -> str:
    """Read when written: a rank forked from a warm process (tests/warm_ranks.py) gets its RANK
    after this module was imported."""
    return os.path.join(RECORD_DIR, f"{kind}.rank{os.environ.get('RANK', '0')}.txt")


def _install(sampler_module) -> None:
    batch_sampler = sampler_module.BatchSampler
    original = batch_sampler.__iter__

    def recording_iter(self):
        from torch.utils.data import DistributedSampler

        if not isinstance(self.sampler, DistributedSampler):
            yield from original(self)
            return
        for batch in original(self):
            # one write per line, flushed on close: readers poll this file
            with open(_rank_file("batches"), "a") as f:
                f.write(f"{self.sampler.epoch} {','.join(map(str, batch))}\n")
            yield batch

    batch_sampler.__iter__ = recording_iter


def reference_image():
    """A fixed 32x32 RGB image without symmetry, so every crop and flip gives other bytes."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.arange(32 * 32 * 3) * 7 % 251).astype(np.uint8).reshape(32, 32, 3))


def _install_augment_record(transforms_module) -> None:
    compose = transforms_module.Compose
    original = compose.__call__

    def recording_call(self, img):
        if not any(type(t).__name__.startswith("Random") for t in self.transforms):
            return original(self, img)
        import hashlib

        import torch
        from torch.utils.data import get_worker_info

        state = torch.get_rng_state()
        view = original(self, reference_image())  # the draws the real sample is about to get
        torch.set_rng_state(state)
        worker = get_worker_info()
        with open(_rank_file("augment"), "a") as f:
            f.write(
                f"{'main' if worker is None else f'worker{worker.id}'} "
                f"{hashlib.sha256(view.numpy().tobytes()).hexdigest()[:16]}\n"
            )
        return original(self, img)

    compose.__call__ = recording_call


HOOKS = {
    "torch.utils.data.sampler": _install,
    "torchvision.transforms.transforms": _install_augment_record,
}


class _AfterModules(importlib.abc.MetaPathFinder):
    """Installs each hook right after its module is imported (importing torch here would slow every
    process the tests start, torchrun's own agent included)."""

    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        install = HOOKS.pop(name)  # first: find_spec below comes back here for the same name
        if not HOOKS:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec


if RECORD_DIR:
    os.makedirs(RECORD_DIR, exist_ok=True)
    # modules imported already (ranks forked from a warm process, tests/warm_ranks.py): now
    for name in [name for name in HOOKS if name in sys.modules]:
        HOOKS.pop(name)(sys.modules[name])
    if HOOKS:
        sys.meta_path.insert(0, _AfterModules())
