# shellcheck shell=bash
# ALCF Polaris: HPE Apollo 6500 Gen 10+, PBS Pro, nodes with one 32-core AMD EPYC Milan 7543P
# (64 hardware threads, 4 NUMA domains), 4 NVIDIA A100 (NVLink) and two Slingshot 11 adapters.
# Sourced by jobs/pbs_mpiexec.pbs and jobs/pbs_torchrun.pbs when SITE=polaris. Every setting keeps
# a value you export yourself (VAR=${VAR-default}); nothing here starts a process.
#
# Sources, read 2026-11 from github.com/argonne-lcf/user-guides (docs.alcf.anl.gov), snapshot of
# 2026-08-19 (check them again: sites change):
#   [node]   "Polaris" (machine overview, device affinity table), docs/polaris/index.md
#   [queues] "Running Jobs on Polaris", docs/polaris/running-jobs/index.md
#   [qsub]   "Job Scheduling and Execution", docs/running-jobs/index.md and example-job-scripts.md
#   [gpus]   "Using GPUs on Polaris Compute Nodes", docs/polaris/running-jobs/using-gpus.md
#   [torch]  "PyTorch on Polaris", docs/polaris/data-science/frameworks/pytorch.md
#   [nccl]   "NCCL", docs/polaris/applications-and-libraries/libraries/nccl.md
#   [pals]   PALS mpiexec --cpu-bind list syntax with core ranges (list:1-8:9-16), docs/aurora/running-jobs-aurora.md
#   [env]    NVIDIA, "NCCL Environment Variables" (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)
#
# Job header for Polaris. qsub reads #PBS lines from the job file itself, never from a file it
# sources: copy one block over the #PBS lines of jobs/pbs_*.pbs (drop one '#'), or give the
# options to qsub, whose command line wins over the file's lines. -A, walltime and filesystems are
# mandatory [qsub]; list every file system the job reads or writes. prod takes 10 nodes or more:
# smaller jobs go to debug, debug-scaling or preemptable [queues]. 05 saves before the job's own
# walltime, which the job file reads from PBS. debug-scaling allows one job per user [queues]: a
# run there cannot submit its next part while it runs (the log says how to submit it by hand).
#   debug: 1-2 nodes, up to 1 h [queues]:
##PBS -A <project>
##PBS -q debug
##PBS -l select=2:system=polaris
##PBS -l place=scatter
##PBS -l walltime=01:00:00
##PBS -l filesystems=home:eagle
##PBS -j oe
#   debug-scaling: 1-10 nodes, up to 1 h, one job per user [queues]:
##PBS -A <project>
##PBS -q debug-scaling
##PBS -l select=8:system=polaris
##PBS -l place=scatter
##PBS -l walltime=01:00:00
##PBS -l filesystems=home:eagle
##PBS -j oe
#   prod, a routing queue: 10-496 nodes (10-24 nodes: up to 3 h) [queues]:
##PBS -A <project>
##PBS -q prod
##PBS -l select=10:system=polaris
##PBS -l place=scatter
##PBS -l walltime=02:00:00
##PBS -l filesystems=home:eagle
##PBS -j oe
#   preemptable: 1-10 nodes, up to 72 h; a job there "may be preempted (killed without any
#   warning)" for the demand queue, and -r y has PBS rerun it [queues]. The rerun keeps the job id,
#   hence RUN_DIR, and 05 resumes there from its last checkpoint.
##PBS -A <project>
##PBS -q preemptable
##PBS -r y
##PBS -l select=4:system=polaris
##PBS -l place=scatter
##PBS -l walltime=02:00:00
##PBS -l filesystems=home:eagle
##PBS -j oe

# ---- Modules: ALCF's PyTorch, in its conda module [torch] -----------------------------------------
POLARIS_MODULES=${POLARIS_MODULES-conda}
if ! type module >/dev/null 2>&1; then
    echo "error: SITE=polaris needs the 'module' command: start the job file as a login shell (#!/bin/bash -l)" >&2
    exit 2
fi
# The NCCL settings that ALCF's conda module exports itself [nccl]: yours, kept through it.
POLARIS_MODULE_NCCL=(NCCL_NET_GDR_LEVEL NCCL_CROSS_NIC NCCL_COLLNET_ENABLE NCCL_NET)
declare -A polaris_yours=()
for name in "${POLARIS_MODULE_NCCL[@]}"; do
    if [[ -v $name ]]; then polaris_yours[$name]=${!name}; fi
done
case $- in *u*) site_nounset=1 ;; *) site_nounset=0 ;; esac
set +u  # module and conda read variables that may be unset
module use /soft/modulefiles
# shellcheck disable=SC2086  # a list of module names
module load $POLARIS_MODULES
conda activate ${POLARIS_CONDA_ENV:+"$POLARIS_CONDA_ENV"}  # ALCF's base environment unless you name yours
if ((site_nounset)); then set -u; fi
for name in "${POLARIS_MODULE_NCCL[@]}"; do
    if [[ -v polaris_yours[$name] ]]; then
        # A value you exported wins over the module's [nccl].
        export "$name=${polaris_yours[$name]}"
    elif [[ ${POLARIS_NCCL_OFI:-1} != 1 ]]; then
        unset "$name"  # switched off: ALCF's page says to unset what the module set [nccl]
    fi
done

# ---- NCCL over Slingshot: ALCF's tested settings [nccl] --------------------------------------------
# ALCF measured 2-3x faster communication for some workloads with the AWS OFI plugin; for some
# applications (Megatron-DeepSpeed) it hangs or times out instead: then set POLARIS_NCCL_OFI=0 [nccl].
if [[ ${POLARIS_NCCL_OFI:-1} == 1 ]]; then
    # GPUDirect RDMA when the GPU and the NIC share a NUMA node [nccl] [env].
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL-PHB}
    # Rings and trees may use different NICs on different nodes [nccl] [env].
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC-1}
    # NCCL's CollNet algorithms, part of ALCF's tested set [nccl].
    export NCCL_COLLNET_ENABLE=${NCCL_COLLNET_ENABLE-1}
    # Use the AWS OFI (libfabric) plugin, and fail if it cannot load, instead of TCP sockets [nccl].
    export NCCL_NET=${NCCL_NET-AWS Libfabric}
    # Where the plugin and the hwloc it needs live (versioned paths: check them) [nccl].
    export LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib/${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # libfabric must not register host memory through CUDA calls: they can deadlock NCCL [nccl].
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER-1}
    # userfaultfd, not the default memory-cache monitor, which deadlocks NCCL [nccl].
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR-userfaultfd}
    # A larger completion queue than libfabric's default, for large jobs [nccl].
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE-131072}
fi

# ---- Rank placement for jobs/pbs_mpiexec.pbs [node] [pals] ---------------------------------------
# One rank per GPU; local rank r uses cuda:r and runs on the NUMA domain nearest to it, cores and
# their hardware threads: GPU 0 with 24-31,56-63, GPU 1 with 16-23,48-55, GPU 2 with 8-15,40-47,
# GPU 3 with 0-7,32-39 [node] (ALCF's own script gets the same pairing from --cpu-bind depth -d 8
# and GPUs in reverse order [gpus]).
NRANKS_PER_NODE=${NRANKS_PER_NODE-4}
MPIEXEC_BIND=${MPIEXEC_BIND---cpu-bind list:24-31,56-63:16-23,48-55:8-15,40-47:0-7,32-39}
