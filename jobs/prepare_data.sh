#!/bin/bash
# Data preparation on a LOGIN node (compute nodes are often offline): download once into the
# shared data folder that the training jobs read (--data-dir data).
#
# Edit: DATASETS (cifar10 mnist fashion_mnist), DATA_DIR (a shared file system), environment setup.
# Run from the repository root on a login node:   bash jobs/prepare_data.sh
# Overridable from the environment: PYTHON, DATASETS, DATA_DIR.

set -euo pipefail

# module load python; source .venv/bin/activate
PYTHON=${PYTHON:-python}
DATASETS=${DATASETS:-cifar10}
DATA_DIR=${DATA_DIR:-data}

for dataset in $DATASETS; do
    "$PYTHON" -m common.prepare --dataset "$dataset" --data-dir "$DATA_DIR"
done
