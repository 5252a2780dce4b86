# shellcheck shell=bash
# NCAR Derecho: HPE Cray EX, PBS Pro, GPU nodes with one 64-core AMD EPYC 7763 (4 NUMA domains),
# 4 NVIDIA A100 40 GB (NVLink) and 4 Slingshot 11 NICs (hsn0..hsn3).
# Sourced by jobs/pbs_mpiexec.pbs and jobs/pbs_torchrun.pbs when SITE=derecho. Every setting keeps
# a value you export yourself (VAR=${VAR-default}); nothing here starts a process.
#
# Sources, read 2026-11 (check them again: sites change):
#   [jobs]   NCAR HPC docs, "Derecho job script examples": docs/pbs/job-scripts/ in github.com/NCAR/HPC-Docs
#            (ncar-hpc-docs.arc.ucar.edu), snapshot of 2026-05-19
#   [queues] NCAR HPC docs, "Job submission queues and charges" (docs/pbs/charging.md) and
#            "Job preemption with PBS" (docs/pbs/preemption.md), same snapshot
#   [hpe]    HPE, "Running NCCL-Based Applications" v1.1 (2024-03), as applied to Derecho by NCAR staff in
#            github.com/benkirk/derecho-pytorch-mpi, profile.d/derecho-nccl-aws-ofi.cfg
#   [guide]  Derecho distributed-PyTorch guide, github.com/negin513/distributed-pytorch-hpc,
#            docs/guide/nccl_tuning.md and docs/guide/derecho_guide.md
#   [pals]   HPE Cray PALS mpiexec --cpu-bind list syntax with core ranges (list:1-8:9-16), as used in
#            ALCF's Aurora guide, docs/aurora/running-jobs-aurora.md in github.com/argonne-lcf/user-guides
#   [torch]  PyTorch, "Distributed communication package", Common environment variables: gloo binds
#            GLOO_SOCKET_IFNAME, an interface name (a comma-separated list), not a prefix as NCCL takes
#
# Job header for Derecho. qsub reads #PBS lines from the job file itself, never from a file it
# sources: copy one block over the #PBS lines of jobs/pbs_*.pbs (drop one '#'), or give the
# options to qsub, whose command line wins over the file's lines.
#   main queue (exclusive GPU nodes, up to 12 h) [jobs] [queues]:
##PBS -A <project>
##PBS -q main
##PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4
##PBS -l job_priority=regular
##PBS -l walltime=02:00:00
##PBS -j oe
#   preempt queue (idle nodes only; preemption is SIGTERM, then SIGKILL 10 minutes later [queues]):
#   05 saves on the SIGTERM, and -r y has PBS rerun the job [queues], under the same id: the same
#   RUN_DIR, where 05 resumes. With -r n (NCAR's example) a preempted job ends for good.
##PBS -A <project>
##PBS -q preempt
##PBS -r y
##PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4
##PBS -l walltime=02:00:00
##PBS -j oe

# ---- Modules [jobs] ----------------------------------------------------------------------------
# cuda must be loaded for GPU jobs, "or nodes may lock up and become unresponsive" [jobs]; conda
# gives `conda activate` for your environment (activate it in the job file's Environment section).
DERECHO_MODULES=${DERECHO_MODULES-ncarenv cuda conda}
if ! type module >/dev/null 2>&1; then
    echo "error: SITE=derecho needs the 'module' command: start the job file as a login shell (#!/bin/bash -l)" >&2
    exit 2
fi
case $- in *u*) site_nounset=1 ;; *) site_nounset=0 ;; esac
set +u  # module (and conda) read variables that may be unset
# shellcheck disable=SC2086  # a list of module names
module load $DERECHO_MODULES
if ((site_nounset)); then set -u; fi

# ---- NCCL over Slingshot [hpe] [guide] ----------------------------------------------------------
# NCCL's bootstrap and socket traffic on the Slingshot interfaces [hpe]; on Ethernet it hangs or crawls [guide].
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME-hsn}
# gloo too (06's placement table, comm_check, CPU runs): on a Slingshot interface, by its full name [torch] [hpe].
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME-hsn0}
# Rings and trees may use different NICs on different nodes: "found to improve performance" on large systems [hpe].
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC-1}
# No InfiniBand on Slingshot: NCCL skips its IB transport [guide].
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE-1}
# libfabric (NCCL's OFI plugin) must not register host memory through CUDA calls: they can deadlock NCCL [hpe].
export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER-1}
# libfabric's default memory-cache monitor (memhooks) deadlocks NCCL; userfaultfd does not [hpe].
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR-userfaultfd}
# Completion-queue size HPE recommends for large jobs (the default is 1024) [hpe].
export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE-131072}
# DERECHO_NCCL_OFI=1 only with an NCCL built with the AWS OFI plugin: pip's torch wheels have none,
# and NCCL then uses TCP sockets, slow across nodes [guide].
if [[ ${DERECHO_NCCL_OFI:-0} == 1 ]]; then
    # Use the plugin, and fail if it cannot load instead of falling back to sockets [hpe].
    export NCCL_NET=${NCCL_NET-AWS Libfabric}
fi

# ---- Rank placement for jobs/pbs_mpiexec.pbs [jobs] [pals] --------------------------------------
# One rank per GPU, each bound to one of the node's 4 NUMA domains, as NCAR advises for 4 ranks per
# GPU node; local rank r uses cuda:r, the pairing of NCAR's example. That example binds each rank to
# the first core of its domain (list:0:16:32:48); a rank's DataLoader workers inherit its binding,
# so here each rank gets its whole domain.
NRANKS_PER_NODE=${NRANKS_PER_NODE-4}
MPIEXEC_BIND=${MPIEXEC_BIND---cpu-bind list:0-15:16-31:32-47:48-63}
