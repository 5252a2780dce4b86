# shellcheck shell=bash
# NERSC Perlmutter: HPE Cray EX, Slurm, GPU nodes with one AMD EPYC 7763 (Slurm counts 128 CPUs:
# 4 tasks x 32 in NERSC's example), 4 NVIDIA A100 and Slingshot 11.
# Sourced by jobs/slurm_srun.sbatch and jobs/slurm_torchrun.sbatch when SITE=perlmutter. Every
# setting keeps a value you export yourself (VAR=${VAR-default}); nothing here starts a process.
#
# Sources, read 2026-11 from docs.nersc.gov (check them again: sites change):
#   [launch] "Launchers" (machinelearning/launchers): a GPU job is -C gpu, --gpus-per-node=4,
#            --ntasks-per-node=4 with --cpus-per-task=32 for one task per GPU, MASTER_ADDR from
#            `scontrol show hostnames`; NERSC's container example adds the nccl-plugin module
#   [queues] "Queues and Charges" (jobs/policy): most jobs go to the regular QOS; debug is the default
#   [nodes]  "Node Types at NERSC" (beginner-guide): 1 AMD EPYC 7763 and 4 A100 per GPU node
#   [check]  not verified against a NERSC page here: check it (`module avail pytorch`)
#
# Job header for Perlmutter. sbatch reads #SBATCH lines from the job file itself, never from a
# file it sources: replace the job file's resource lines with a block (drop one '#'; keep its
# --signal, --requeue and --open-mode lines), or give the options to sbatch, whose command line
# wins over the file's lines.
#   jobs/slurm_srun.sbatch, one task per GPU [launch] [queues]:
##SBATCH --account=<project>
##SBATCH --constraint=gpu
##SBATCH --qos=regular
##SBATCH --nodes=2
##SBATCH --ntasks-per-node=4
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=32
##SBATCH --time=02:00:00
#   jobs/slurm_torchrun.sbatch, one task (torchrun) per node with all of its 128 CPUs [launch] [nodes]:
##SBATCH --account=<project>
##SBATCH --constraint=gpu
##SBATCH --qos=regular
##SBATCH --nodes=2
##SBATCH --ntasks-per-node=1
##SBATCH --gpus-per-node=4
##SBATCH --cpus-per-task=128
##SBATCH --time=02:00:00

# ---- Modules: NERSC's PyTorch [check] ---------------------------------------------------------
PERLMUTTER_MODULES=${PERLMUTTER_MODULES-pytorch}
if ! type module >/dev/null 2>&1; then
    echo "error: SITE=perlmutter needs the 'module' command: start the job file as a login shell (#!/bin/bash -l)" >&2
    exit 2
fi
case $- in *u*) site_nounset=1 ;; *) site_nounset=0 ;; esac
set +u  # module reads variables that may be unset
# shellcheck disable=SC2086  # a list of module names
module load $PERLMUTTER_MODULES
if ((site_nounset)); then set -u; fi

# ---- NCCL: nothing set here [launch] ------------------------------------------------------------
# NERSC's page sets no NCCL variable; it gets NCCL's Slingshot (OFI) plugin from a module (nccl-plugin
# in its container example). Check which network NCCL uses: with NCCL_DEBUG=INFO, NCCL's line
# "Using network ..." names it: "AWS Libfabric" is the plugin, "Socket" is TCP (slow across nodes).

# ---- Rank placement [launch] ----------------------------------------------------------------------
# Every task sees the node's 4 GPUs (--gpus-per-node, no --gpus-per-task); local rank r uses cuda:r.
# The job files pass --cpus-per-task on to srun themselves (Slurm 22.05-23.02 does not).
GPUS_PER_NODE=${GPUS_PER_NODE-4}
