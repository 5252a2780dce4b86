"""Test-only: run benchmark/train.py's training with its knob checks (perf.check_knobs)
left out, to show what torch itself does with a combination the script refuses.

    torchrun --standalone --nproc_per_node=2 tests/perf_unchecked.py [benchmark/train.py flags...]

Everything else is the script's own: its config class (minus
validate), its train() and the launcher detection its main() uses.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `common`, and `perf` as benchmark/train.py imports it
sys.path[:0] = [str(REPO), str(REPO / "benchmark")]

from common.config import load_config  # noqa: E402
from common.launcher import detect_launcher  # noqa: E402
from tests.paths import load_script

train_script = load_script("benchmark/train.py", "benchmark_train")


class UncheckedConfig(train_script.PerfConfig):
    def validate(self):  # no check_knobs: the settings reach torch as given
        pass


if __name__ == "__main__":
    train_script.train(load_config(UncheckedConfig), detect_launcher())
