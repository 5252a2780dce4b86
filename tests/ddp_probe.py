r"""Test-only: run a lesson under torchrun with its DDP instrumented from outside the lesson.

    torchrun --standalone --nproc_per_node=2 \
        tests/ddp_probe.py RESULT.json LESSON.py [lesson flags...]

The lessons hold no test code. This worker imports LESSON.py with tests.paths.load_script (its `if
__name__ == "__main__"` does not run), replaces `DDP` in the lesson's namespace by a subclass, and
calls the lesson's main() with the flags. Public APIs only. The subclass, for every model it wraps:
  - records the class names of the model's BatchNorm layers at that moment (04 converts before the
    wrap);
  - registers a DDP communication hook (DDP.register_comm_hook) that counts each gradient bucket,
    then all-reduces it with DDP's default, default_hooks.allreduce_hook.
A global optimizer step hook (torch.optim.optimizer.register_optimizer_step_post_hook)
snapshots the counts at every optimizer step. Rank 0 writes RESULT.json:
    passes_per_step    backward passes that all-reduced gradients, per optimizer step
    buckets_per_step   bucket all-reduces per optimizer step
    passes, buckets    the totals; wrapped: the BatchNorm classes of each wrapped model
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from tests.paths import load_script

counts = {"passes": 0, "buckets": 0, "passes_per_step": [], "buckets_per_step": [], "wrapped": []}
_at_last_step = {"passes": 0, "buckets": 0}


def counting_allreduce_hook(state, bucket):
    """A DDP communication hook: count the bucket (and the
    pass, at its last bucket), then all-reduce it."""
    counts["buckets"] += 1
    counts["passes"] += bucket.is_last()  # one per backward that communicates
    return allreduce_hook(None, bucket)  # None: the default process group; averages over the ranks


def norm_classes(module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__})


class ProbeDDP(DistributedDataParallel):
    def __init__(self, module, *args, **kwargs):
        counts["wrapped"].append(norm_classes(module))
        super().__init__(module, *args, **kwargs)
        self.register_comm_hook(None, counting_allreduce_hook)


def after_step(optimizer, args, kwargs):
    for key in ("passes", "buckets"):
        counts[f"{key}_per_step"].append(counts[key] - _at_last_step[key])
        _at_last_step[key] = counts[key]


def main():
    result_path, lesson, *flags = sys.argv[1:]
    # as when the lesson runs as a script (04 imports a neighbour)
    sys.path.insert(0, str((REPO / lesson).parent))
    module = load_script(lesson, "lesson_under_probe")
    module.DDP = ProbeDDP
    register_optimizer_step_post_hook(after_step)
    sys.argv = [str(REPO / lesson), *flags]
    module.main()
    if os.environ.get("RANK", "0") == "0":
        Path(result_path).write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
