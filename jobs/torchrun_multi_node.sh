#!/bin/bash
# torchrun on several nodes, under any scheduler or none: run this same file on EVERY node.
# The nodes meet at a c10d rendezvous on the first host (RDZV_HOST); rank 0 lives there.
#
# Edit / set on every node:
#   NNODES          number of nodes (all must start this file)
#   GPUS_PER_NODE   workers per node
#   RDZV_HOST       address of the first node, reachable from all of them (not localhost)
#   RDZV_PORT       a free TCP port on that node (same on every node)
#   RDZV_ID         any string, the same on every node and new for every run (e.g. the job id)
#   LOCAL_ADDR      optional: this node's address on the training network (when the host name
#                   resolves to the wrong interface); IS_HOST=1 on the first node, 0 elsewhere,
#                   when torchrun cannot tell which node is RDZV_HOST (containers, namespaces)
# Run:   NNODES=2 RDZV_HOST=10.0.0.1 bash jobs/torchrun_multi_node.sh      # on each node
# Overridable from the environment: PG_TIMEOUT_S, PYTHON, SCRIPT, TRAIN_ARGS.

set -euo pipefail

# module load cuda python; source .venv/bin/activate
PYTHON=${PYTHON:-python}
SCRIPT=${SCRIPT:-06_multinode/train.py}
NNODES=${NNODES:?set NNODES to the number of nodes}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
RDZV_HOST=${RDZV_HOST:?set RDZV_HOST to the first node address}
RDZV_PORT=${RDZV_PORT:-29400}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-${PBS_JOBID:-ddp}}}
TRAIN_ARGS=${TRAIN_ARGS:---dataset cifar10 --data-dir data --epochs 30 --output-dir runs/multi_node}
# The process-group timeout (the scripts' --timeout-s, 60 s by default: right for local runs). On
# nccl it is also the watchdog's limit, which ends a job whose ranks wait longer: rank 0 writing a
# checkpoint to a parallel file system while the others wait, an ImageFolder scan, --compile.
# A --timeout-s in TRAIN_ARGS comes later and wins; it overrides a --config file's timeout_s.
PG_TIMEOUT_S=${PG_TIMEOUT_S:-600}

extra=()
[[ -n ${LOCAL_ADDR:-} ]] && extra+=("--local_addr=$LOCAL_ADDR")
[[ -n ${IS_HOST:-} ]] && extra+=("--rdzv_conf=is_host=$IS_HOST")
echo "$(hostname): joining $NNODES node(s) x $GPUS_PER_NODE at $RDZV_HOST:$RDZV_PORT (id $RDZV_ID)"

# ---- What runs: this repository's scripts take its flags; a script of your own gets TRAIN_ARGS only
# (its argparse would refuse the others).
read -ra train_args <<<"$TRAIN_ARGS"  # a list of words
if [[ $(realpath -m --relative-to=. "$SCRIPT") =~ ^([0-9][0-9]_[a-z_]+|benchmark|debugging)/ ]]; then
    command=("$SCRIPT" --timeout-s "$PG_TIMEOUT_S" "${train_args[@]}")
else
    command=("$SCRIPT" "${train_args[@]}")
fi

exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv_id="$RDZV_ID" \
    "${extra[@]}" "${command[@]}"
