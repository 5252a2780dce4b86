#!/bin/bash
# torchrun on one node: one worker per GPU (or two CPU processes), rendezvous on a free local port.
#
# Edit: GPUS_PER_NODE (processes), TRAIN_ARGS, and your environment setup below.
# Run from the repository root:   bash jobs/torchrun_single_node.sh
# Overridable from the environment: PG_TIMEOUT_S, PYTHON, SCRIPT, TRAIN_ARGS, GPUS_PER_NODE.

set -euo pipefail

# module load cuda python; source .venv/bin/activate
PYTHON=${PYTHON:-python}
SCRIPT=${SCRIPT:-06_multinode/train.py}
# The GPUs this process may use, as torch counts them: CUDA_VISIBLE_DEVICES applies, and a GPU
# split into MIG instances is the one instance CUDA shows (`nvidia-smi -L` lists every instance).
GPUS_PER_NODE=${GPUS_PER_NODE:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
[[ $GPUS_PER_NODE -ge 1 ]] || GPUS_PER_NODE=2  # no GPU: two CPU processes
TRAIN_ARGS=${TRAIN_ARGS:---dataset cifar10 --data-dir data --epochs 30 --output-dir runs/single_node}
# The process-group timeout (the scripts' --timeout-s, 60 s by default: right for local runs). On
# nccl it is also the watchdog's limit, which ends a job whose ranks wait longer: rank 0 writing a
# checkpoint to a parallel file system while the others wait, an ImageFolder scan, --compile.
# A --timeout-s in TRAIN_ARGS comes later and wins; it overrides a --config file's timeout_s.
PG_TIMEOUT_S=${PG_TIMEOUT_S:-600}

# ---- What runs: this repository's scripts take its flags; a script of your own gets TRAIN_ARGS only
# (its argparse would refuse the others).
read -ra train_args <<<"$TRAIN_ARGS"  # a list of words
if [[ $(realpath -m --relative-to=. "$SCRIPT") =~ ^([0-9][0-9]_[a-z_]+|benchmark|debugging)/ ]]; then
    command=("$SCRIPT" --timeout-s "$PG_TIMEOUT_S" "${train_args[@]}")
else
    command=("$SCRIPT" "${train_args[@]}")
fi

# --standalone: a private c10d rendezvous on a free port of this host.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$GPUS_PER_NODE" "${command[@]}"
