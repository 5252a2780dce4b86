r"""Run a training script at the GPU's own pace: every DataLoader yields its first batch, already
on the device, as many times as it has batches. No loader worker runs and nothing is copied to
the GPU, so a step takes what the model's work takes, whatever the script's input pipeline.
benchmark/gpu_check.py runs imagenet/main.py and benchmark/train.py this way, alike.

    python benchmark/gpu_pace.py SCRIPT [ARGS...]

The script is imported as a module (its folder on the path of this process and of the processes
it spawns) and its main() is called with ARGS. Processes started by torch.multiprocessing.spawn
import this file first, so their loaders yield device batches too.
"""

import importlib
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _device_batches(loader: DataLoader):
    """The loader's first batch, made in this process and moved to the current GPU (the CPU
    where there is none), len(loader) times."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    indices = next(iter(loader.batch_sampler))
    batch = _to_device(loader.collate_fn([loader.dataset[i] for i in indices]), device)
    for _ in range(len(loader)):
        yield batch


DataLoader.__iter__ = _device_batches


def main() -> int:
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_file():
        print("error: usage: gpu_pace.py SCRIPT [ARGS...], SCRIPT a Python file", file=sys.stderr)
        return 2
    script = Path(sys.argv[1]).resolve()
    # spawned workers unpickle the script's functions by module name: they need its folder too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(script.parent), os.environ.get("PYTHONPATH")])
    )
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *sys.argv[2:]]
    module = importlib.import_module(script.stem)
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
