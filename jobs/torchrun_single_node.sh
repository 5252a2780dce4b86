#!/bin/bash
# torchrun on one node: one worker per GPU (or N CPU processes), rendezvous on a free local port.
#
# Edit: GPUS_PER_NODE (processes), TRAIN_ARGS, and your environment setup below.
# Run from the repository root:   bash jobs/torchrun_single_node.sh
# Overridable from the environment: PYTHON, SCRIPT, TRAIN_ARGS, GPUS_PER_NODE.

set -euo pipefail

# module load cuda python; source .venv/bin/activate
PYTHON=${PYTHON:-python}
SCRIPT=${SCRIPT:-06_multinode/train.py}
GPUS_PER_NODE=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
[[ $GPUS_PER_NODE -ge 1 ]] || GPUS_PER_NODE=2  # no GPU: two CPU processes
TRAIN_ARGS=${TRAIN_ARGS:---dataset cifar10 --data-dir data --epochs 30 --output-dir runs/single_node}

# --standalone: a private c10d rendezvous on a free port of this host.
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of words
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$GPUS_PER_NODE" "$SCRIPT" $TRAIN_ARGS
