"""jobs/: static checks of every job file, the Slurm files on a real two-node Slurm cluster,
the PBS files under bash with PBS's variables and a real mpiexec."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections import Counter

import pytest

from tests.launcher_tools import need_root, need_tools, openmpi_env
from tests.pbs_server import PbsServer
from tests.paths import PYTHON, REPO
from tests.processes import (
    short_run,
    clean_env,
    finish,
    free_port,
    kill_group,
    run,
    torchrun,
    wait_all,
)
from tests.processes import start as start_guarded
from tests.results import differing_tensors, load_model, read_summary, repeated_lines
from tests.slurm_cluster import TOOLS as SLURM_TOOLS
from tests.slurm_cluster import SlurmCluster
from tests.torch_versions import skip_below_torch

JOBS = sorted(p for p in (REPO / "jobs").glob("*.*") if p.suffix in (".sh", ".sbatch", ".pbs"))
SLURM_JOBS = ["slurm_srun.sbatch", "slurm_torchrun.sbatch"]
SMALL = " ".join(short_run())


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_file_static(job):
    run(["bash", "-n", job], 30, check=True)
    need_tools("shellcheck")
    result = run(["shellcheck", "-s", "bash", job], 60)
    assert result.returncode == 0, result.stdout
    # its header, directives and the scripts it names: .ci/lint.py, job-file-header


# -- a real two-node Slurm cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    need_root("a test Slurm cluster (slurmd)")
    need_tools(*SLURM_TOOLS)
    start = time.perf_counter()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        print(f"Slurm cluster up in {time.perf_counter() - start:.1f} s")
        yield c  # stopped by the context manager, also when a test failed


# One CPU per node and task: the test nodes advertise 2, so two jobs run side by side.
SBATCH_SMALL = ["--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0"]


@pytest.fixture(scope="module")
def slurm_jobs(cluster, tmp_path_factory):
    """Submit both job files at once (they fit side by side), wait for both."""
    out = tmp_path_factory.mktemp("slurm_jobs")
    start, jobs = time.perf_counter(), {}
    for name in SLURM_JOBS:
        env = clean_env(
            PYTHON=PYTHON,
            GPUS_PER_NODE="1",
            SCRIPT="06_multinode/train.py",
            TRAIN_ARGS=SMALL,
            RUN_DIR=str(out / name),
        )
        job_id = cluster.sbatch(
            ["-o", str(out / f"{name}.out"), *SBATCH_SMALL, f"jobs/{name}"], env, REPO
        )
        jobs[name] = job_id
    states = {name: cluster.wait(job_id, timeout=240) for name, job_id in jobs.items()}
    print(f"both Slurm jobs done in {time.perf_counter() - start:.1f} s")
    return {
        name: (jobs[name], states[name], out / name, (out / f"{name}.out")) for name in SLURM_JOBS
    }


@pytest.mark.parametrize(
    "name,launcher", [("slurm_srun.sbatch", "slurm"), ("slurm_torchrun.sbatch", "torchrun")]
)
def test_sbatch_job_completes(slurm_jobs, cluster, name, launcher):
    if name == "slurm_torchrun.sbatch":
        skip_below_torch("2.10", "torchrun's --signals-to-handle, which the job file passes")
    job_id, (state, exit_code), run_dir, log = slurm_jobs[name]
    output = log.read_text() if log.exists() else "(no job output)"
    assert state == "COMPLETED", f"{state} {exit_code}\n{output}\n{cluster.logs()}"
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["replicas_identical"]
    assert summary["launcher"] == launcher and summary["scheduler"] == "slurm"
    # one per node
    assert [(p["rank"], p["local_rank"]) for p in summary["placement"]] == [(0, 0), (1, 0)]
    port = 15000 + int(job_id) % 15000
    # The first host's NodeAddr (node1's own address, a host of its own) as the rendezvous
    # address (jobs/scheduler.py asks scontrol), port from the job id.
    node1 = cluster.address["node1"]
    assert f"(node[1-2]), rendezvous {node1}:{port}, run dir" in output
    # Rank 0's placement table: ranks 0 and 1, each local rank 0 (one per node), on CPU.
    assert re.search(
        r"^\s+0\s+0\s+\S+\s+cpu\s+unset\n\s+1\s+0\s+\S+\s+cpu\s+unset$", output, re.M
    ), output
    assert "launcher " + launcher in output
    if launcher == "slurm":
        assert (summary["master_addr"], summary["master_port"]) == (node1, port)
    # each rank on a host of its own
    assert sorted(p["host"] for p in summary["placement"]) == ["node1", "node2"], summary


def test_slurm_detection_batch_shell_vs_job_step(cluster, tmp_path):
    """The batch shell has SLURM_PROCID=0 but is no rank; srun's tasks are ranks 0 and 1."""
    probe = (
        "import json, os; from common.launcher import launch_info; i = launch_info(os.environ); "
        "print(json.dumps([os.environ.get('SLURM_STEP_ID'), i.launcher, i.rank, i.world_size]))"
    )
    (tmp_path / "probe.sh").write_text(
        f'#!/bin/bash\n{PYTHON} -c "{probe}"\nsrun {PYTHON} -c "{probe}"\n'
    )
    job = cluster.sbatch(
        ["-N2", "-n2", *SBATCH_SMALL, "-o", str(tmp_path / "out"), str(tmp_path / "probe.sh")],
        clean_env(),
        REPO,
    )
    assert cluster.wait(job, 120)[0] == "COMPLETED", (tmp_path / "out").read_text()
    rows = [
        json.loads(line)
        for line in (tmp_path / "out").read_text().splitlines()
        if line.startswith("[")
    ]
    assert rows[0] == [None, "single", 0, 1]  # the batch shell: no SLURM_STEP_ID on this Slurm
    assert sorted(rows[1:]) == [["0", "slurm", 0, 2], ["0", "slurm", 1, 2]]


# -- the launcher matrix: every MPI plugin of this Slurm, and mpiexec inside an allocation ---------
MPI_PLUGINS = ("none", "pmi2", "pmix", "cray_shasta")  # `srun --mpi=list` on the test cluster
DISTRIBUTIONS = ("block", "cyclic")
# the variable each plugin adds (Debian's Slurm 22.05), and that the cell's tasks must show
PLUGIN_VARIABLE = {
    "none": None,
    "pmi2": "PMI_RANK",
    "pmix": "PMIX_RANK",
    "cray_shasta": "PALS_RANKID",
}
# where each MPI says rank, local rank, world size and local world size
MPI_SAYS = {
    "mpich": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    "openmpi": tuple(f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "LOCAL_RANK", "SIZE", "LOCAL_SIZE")),
}


def cluster_openmpi_env(**extra: str) -> dict[str, str]:
    """Open MPI as root, over the nodes' own network (eth0: each node's only interface but lo)."""
    env = openmpi_env(**extra)
    env.update(OMPI_MCA_oob_tcp_if_include="eth0", OMPI_MCA_btl_tcp_if_include="eth0")
    return env


def sbatch_script(cluster, tmp_path, lines, sbatch_args, env, timeout) -> str:
    """`lines` as a job script of its own, submitted with `sbatch_args`; its output, once the job
    has COMPLETED (any other end fails the test, with the job's output and the daemons' logs)."""
    (tmp_path / "job.sh").write_text("#!/bin/bash\nset -euo pipefail\n" + "\n".join(lines) + "\n")
    job_file, log = str(tmp_path / "job.sh"), str(tmp_path / "out")
    job = cluster.sbatch([*sbatch_args, "-o", log, job_file], env, REPO)
    state = cluster.wait(job, timeout)
    output = (tmp_path / "out").read_text()
    assert state[0] == "COMPLETED", f"{state}\n{output[-3000:]}\n{cluster.logs()}"
    return output


@pytest.fixture(scope="module")
def launcher_matrix(cluster, tmp_path_factory):
    """One job of 2 nodes x 2 tasks: tests/launch_probe.py under srun with every MPI plugin and
    both distributions, then under MPICH's and Open MPI's mpiexec, which start their daemons with
    srun. {cell: [each process's {"detected": [...], "env": {...}}]}."""
    need_tools("mpiexec.mpich", "mpirun")
    root = tmp_path_factory.mktemp("matrix")
    probe = f"{PYTHON} tests/launch_probe.py"
    lines = ["#!/bin/bash", "set -euo pipefail"]
    for mpi in MPI_PLUGINS:
        for distribution in DISTRIBUTIONS:
            lines.append(
                f"srun --mpi={mpi} -m {distribution} -N2 --ntasks-per-node=2 --cpus-per-task=1 "
                f"{probe} srun/{mpi}/{distribution}"
            )
    lines.append(f"timeout 60 mpiexec.mpich -n 4 -ppn 2 {probe} mpiexec/mpich")
    lines.append(f"timeout 60 mpirun -n 4 --map-by ppr:2:node {probe} mpiexec/openmpi")
    (root / "job.sh").write_text("\n".join(lines) + "\n")
    args = ["-N2", "--ntasks-per-node=2", "--cpus-per-task=1", "-o", str(root / "out")]
    job = cluster.sbatch([*args, str(root / "job.sh")], cluster_openmpi_env(), REPO)
    state = cluster.wait(job, 180)
    output = (root / "out").read_text()
    assert state[0] == "COMPLETED", f"{state}\n{output}\n{cluster.logs()}"
    cells = {}
    for line in output.splitlines():
        if line.startswith("probe "):
            _, cell, row = line.split(" ", 2)
            cells.setdefault(cell, []).append(json.loads(row))
    return cells


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("mpi", MPI_PLUGINS)
def test_srun_tasks_are_read_as_slurm_places_them(launcher_matrix, mpi, distribution):
    """Whatever the plugin exports beside Slurm's own variables, each task's (rank, local rank,
    world size, local world size) is what Slurm says: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS
    and the count of the step's tasks on its node. Before, pmi2's PMI_RANK made a task MPICH's,
    local rank 0 of 1 (GPU 0 for every rank of a node); pmix's gave a local world of 1."""
    tasks = launcher_matrix[f"srun/{mpi}/{distribution}"]
    on_node = Counter(task["env"]["SLURM_NODEID"] for task in tasks)
    assert sorted(task["detected"] for task in tasks) == sorted(
        ["slurm", *(int(task["env"][n]) for n in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))]
        + [on_node[task["env"]["SLURM_NODEID"]]]
        for task in tasks
    )
    # the cell is what it says: the plugin's own variable is there, and ranks 0 and 1 share a node
    # under block distribution, not under cyclic
    assert all((PLUGIN_VARIABLE[mpi] in task["env"]) == (mpi != "none") for task in tasks)
    node_of = {task["detected"][1]: task["env"]["SLURM_NODEID"] for task in tasks}
    assert (node_of[0] == node_of[1]) == (distribution == "block") and len(on_node) == 2


@pytest.mark.parametrize("mpi", MPI_SAYS)
def test_mpiexec_inside_a_slurm_job_is_read_from_the_mpi(launcher_matrix, mpi):
    """mpiexec inside an allocation starts its daemons with srun, so its ranks carry a srun step's
    SLURM_PROCID: the daemon's, not theirs (checked). Their numbers come from the MPI."""
    ranks = launcher_matrix[f"mpiexec/{mpi}"]
    assert sorted(rank["detected"] for rank in ranks) == sorted(
        [mpi, *(int(rank["env"][name]) for name in MPI_SAYS[mpi])] for rank in ranks
    )
    assert sorted(rank["detected"][1] for rank in ranks) == [0, 1, 2, 3]
    assert {tuple(rank["detected"][3:]) for rank in ranks} == {(4, 2)}
    assert any(rank["env"]["SLURM_PROCID"] != str(rank["detected"][1]) for rank in ranks)
    # Two hosts, and every rank meets at one rendezvous: rank 0's host (no MASTER_ADDR given).
    # Before, Open MPI's ranks on node2 inherited its daemon step's node list and met at node2.
    hosts = {rank["detected"][1]: rank["host"] for rank in ranks}
    assert sorted(set(hosts.values())) == ["node1", "node2"]
    assert {rank["rendezvous"].split(":")[0] for rank in ranks} == {hosts[0]}, ranks
    assert len({rank["rendezvous"] for rank in ranks}) == 1


def test_srun_tasks_meet_at_their_steps_first_node(launcher_matrix):
    for cell, tasks in launcher_matrix.items():
        if cell.startswith("srun/"):
            host_of_rank_0 = next(t["host"] for t in tasks if t["detected"][1] == 0)
            assert {t["rendezvous"].split(":")[0] for t in tasks} == {host_of_rank_0}, cell


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_06_trains_under_mpiexec_inside_an_allocation_across_both_hosts(cluster, tmp_path, mpi):
    """mpirun (Open MPI) or mpiexec (MPICH) in an sbatch job over both nodes, one rank each, with
    no MASTER_ADDR: 06 trains, its ranks on two hosts, identical replicas."""
    need_tools("mpiexec.mpich", "mpirun")
    launch = {
        "openmpi": "mpirun -n 2 --map-by ppr:1:node",
        "mpich": "mpiexec.mpich -n 2 -ppn 1",
    }[mpi]
    out = tmp_path / "run"
    sbatch_script(
        cluster,
        tmp_path,
        [f"timeout 150 {launch} {PYTHON} 06_multinode/train.py {SMALL} --output-dir {out}"],
        ["-N2", "--ntasks-per-node=1", "--cpus-per-task=1"],
        cluster_openmpi_env(),
        200,
    )
    summary = read_summary(out)
    assert (summary["launcher"], summary["world_size"], summary["replicas_identical"]) == (
        mpi,
        2,
        True,
    )
    assert [p["host"] for p in summary["placement"]] == ["node1", "node2"]
    assert summary["master_addr"] == "node1"


def test_01_trains_under_srun_with_the_pmi2_plugin(cluster, tmp_path):
    """Sites with MpiDefault=pmi2 (and Intel MPI users told to add --mpi=pmi2): 01 on 2 nodes x 2
    tasks trains with identical replicas, each rank on the local rank Slurm gave it."""
    sbatch_script(
        cluster,
        tmp_path,
        [
            f"srun --mpi=pmi2 -N2 --ntasks-per-node=2 --cpus-per-task=1 {PYTHON} "
            f"01_basic_ddp/train.py {SMALL} --log-every 1000 --output-dir {tmp_path / '01'}"
        ],
        ["-N2", "--ntasks-per-node=2", "--cpus-per-task=1"],
        clean_env(),
        240,
    )
    basic = read_summary(tmp_path / "01")
    assert (basic["world_size"], basic["launcher"], basic["replicas_identical"]) == (
        4,
        "slurm",
        True,
    )


# -- preemption and requeue: 05_checkpointing/preempt.py
# under each job file, on the two-node cluster --

# Long enough (8 epochs of 45 steps) to be stopped mid-run; a checkpoint every 20 steps.
PREEMPT_ARGS = " ".join(short_run(max_steps=None, epochs=8, save_every_steps=20, log_every=1000))
SLURM_DELIVERIES = ("signal", "requeue")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same training on 2 ranks, never
    stopped (OMP_NUM_THREADS=1 in both, as in the jobs)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    torchrun(
        "05_checkpointing/train.py",
        *PREEMPT_ARGS.split(),
        "--output-dir",
        out,
        nproc=2,
        timeout=300,
    )
    return load_model(out)


def delivery_command(name: str, delivery: str, job_id: str) -> list[str]:
    """How Slurm delivers each: the file's own --signal (to the job steps, as before the time
    limit), an operator's requeue (SIGTERM to the whole job; Slurm requeues it itself)."""
    if delivery == "signal":
        sig = re.search(
            r"^#SBATCH --signal=(\w+)@\d+$", (REPO / "jobs" / name).read_text(), re.M
        ).group(1)
        return ["scancel", f"--signal={sig}", job_id]
    return {"requeue": ["scontrol", "requeue", job_id]}[delivery]


@pytest.fixture(scope="module")
def preempted_jobs(cluster, tmp_path_factory):
    """Each job file x each delivery, submitted together (the cluster
    runs two at a time); each one gets its delivery once its first
    checkpoint exists, and is released as soon as it is requeued."""
    root = tmp_path_factory.mktemp("preempted")
    jobs = {}
    for name in SLURM_JOBS:
        for delivery in SLURM_DELIVERIES:
            run_dir = root / f"{name}-{delivery}"
            env = clean_env(
                PYTHON=PYTHON, GPUS_PER_NODE="1", RUN_DIR=str(run_dir), TRAIN_ARGS=PREEMPT_ARGS
            )
            log = root / f"{name}-{delivery}.out"
            job_id = cluster.sbatch(["-o", str(log), *SBATCH_SMALL, f"jobs/{name}"], env, REPO)
            jobs[(name, delivery)] = {
                "job": job_id,
                "run_dir": run_dir,
                "log": log,
                "delivered": False,
            }
    deadline = time.monotonic() + 900
    running = dict(jobs)
    while running and time.monotonic() < deadline:
        for key, job in list(running.items()):
            if not job["delivered"] and (job["run_dir"] / "checkpoints" / "latest").exists():
                subprocess.run(
                    delivery_command(*key, job["job"]),
                    env=cluster.env(),
                    check=True,
                    timeout=30,
                    capture_output=True,
                )
                job["delivered"] = True
            state = cluster.job_state(job["job"])
            if state[0] == "PENDING" and job["delivered"] and not job.get("released"):
                # Slurm holds a requeued job back for a while (BeginTime); bring that forward, once,
                # but not to "now": a slurmd refuses to launch a job whose credential is not newer
                # (in whole seconds) than its kill of the previous run ("Job N already killed, do
                # not launch batch job", and the job fails), which the hold is there to prevent.
                subprocess.run(
                    ["scontrol", "update", f"JobId={job['job']}", "StartTime=now+5"],
                    env=cluster.env(),
                    capture_output=True,
                    timeout=30,
                )
                job["released"] = True
            if state[0] in cluster.FINAL_STATES:
                job["state"] = state
                shown = subprocess.run(
                    ["scontrol", "show", "job", job["job"]],
                    env=cluster.env(),
                    text=True,
                    capture_output=True,
                    timeout=30,
                ).stdout
                job["restarts"] = int(re.search(r"Restarts=(\d+)", shown).group(1))
                del running[key]
        time.sleep(0.5)
    assert not running, f"jobs still running after 900 s: {sorted(running)}"
    return jobs


def stop_and_resume_steps(log: str) -> tuple[int | None, int]:
    """(the step a signal's save happened at, or None; the step the requeued run resumed from)."""
    saved = re.search(r"^SIG\w+: checkpoint at step (\d+) saved; exiting with code 75", log, re.M)
    resumed = re.findall(r"^resumed from \S+ckpt-(\d+)\.pt: step (\d+)", log, re.M)
    assert len(resumed) == 1 and int(resumed[0][0]) == int(resumed[0][1]), log[-3000:]
    return (int(saved.group(1)) if saved else None), int(resumed[0][1])


@pytest.mark.parametrize("name", SLURM_JOBS)
@pytest.mark.parametrize("delivery", SLURM_DELIVERIES)
def test_preempted_job_requeues_once_and_resumes_bitwise(
    preempted_jobs, uninterrupted, cluster, name, delivery
):
    if name == "slurm_torchrun.sbatch":
        skip_below_torch("2.10", "torchrun's --signals-to-handle, which the job file passes")
    job = preempted_jobs[(name, delivery)]
    log = job["log"].read_text()
    assert job["state"][0] == "COMPLETED", f"{job['state']}\n{log[-3000:]}\n{cluster.logs()}"
    # appended log
    assert job["restarts"] == 1 and "(restart 0)" in log and "(restart 1)" in log, log[-3000:]
    saved_at, resumed_from = stop_and_resume_steps(log)
    print(
        f"{name} {delivery}: saved on the signal at step {saved_at}, resumed from step "
        f"{resumed_from}, "
        f"restarts {job['restarts']}"
    )
    if delivery == "signal":
        # Every rank saved at the next step boundary after
        # the signal, and the job resumed right there.
        sig = delivery_command(name, delivery, "")[1].split("=")[1]
        assert f"SIG{sig}: checkpoint at step {resumed_from} saved" in log, log[-3000:]
        assert saved_at == resumed_from
    assert differing_tensors(load_model(job["run_dir"]), uninterrupted) == []


@pytest.mark.parametrize("crash", ["at-step-2", "bad-input-after-a-requeue"])
def test_crashed_job_is_not_requeued(cluster, tmp_path, crash):
    """A crash is not a preemption: the job fails and is not requeued. At step 2 (injected); or
    at once, on bad input (exit 2, before any process group), in a run folder where an earlier
    run's save left checkpoints/REQUEUE: before, the job file found that note and requeued the
    crash until MAX_RESTARTS (preempt.py deletes it only once it resumes)."""
    if crash == "at-step-2":
        failure = dict(
            TRAIN_ARGS=SMALL,
            PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
            DDP_TEST_FAIL_AT_STEP="2",
            DDP_TEST_FAIL_RANK="1",
        )
        said = "injected failure"
    else:
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / "REQUEUE").write_text("SIGUSR1 at step 12\n")
        failure, said = dict(TRAIN_ARGS=f"{SMALL} --local-batch-size 0"), "error: "
    env = clean_env(PYTHON=PYTHON, RUN_DIR=str(tmp_path / "run"), **failure)
    job = cluster.sbatch(
        ["-o", str(tmp_path / "out"), *SBATCH_SMALL, "jobs/slurm_srun.sbatch"], env, REPO
    )
    state = cluster.wait(job, 180)
    time.sleep(2)  # a requeue would show as PENDING right after
    log = (tmp_path / "out").read_text()
    assert state[0] == "FAILED" and said in log and "requeueing" not in log, log[-3000:]
    assert cluster.job_state(job)[0] == "FAILED" and restarts(cluster, job) == 0


def restarts(cluster, job_id: str) -> int:
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id],
        env=cluster.env(),
        text=True,
        capture_output=True,
        timeout=30,
    ).stdout
    return int(re.search(r"Restarts=(\d+)", shown).group(1))


def submit_preempt_job(cluster, tmp_path, name, train_args=PREEMPT_ARGS, sbatch=(), **extra):
    """05's preempt.py under job file `name`, on one CPU a node, with `sbatch`'s options too;
    returns (job id, run dir, log) once its first checkpoint exists."""
    run_dir, log = tmp_path / "run", tmp_path / "out"
    env = clean_env(
        PYTHON=PYTHON, GPUS_PER_NODE="1", RUN_DIR=str(run_dir), TRAIN_ARGS=train_args, **extra
    )
    job = cluster.sbatch(["-o", str(log), *SBATCH_SMALL, *sbatch, f"jobs/{name}"], env, REPO)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and cluster.job_state(job)[0] in (
            "PENDING",
            "RUNNING",
        ), log.read_text() if log.exists() else cluster.logs()
        time.sleep(0.2)
    return job, run_dir, log


def wait_through_a_requeue(cluster, job: str, timeout: float) -> None:
    """Wait until the job ends, bringing a requeued run's start forward once, as preempted_jobs
    does (to now+5, not to now)."""
    deadline, released = time.monotonic() + timeout, False
    while cluster.job_state(job)[0] not in cluster.FINAL_STATES and time.monotonic() < deadline:
        if cluster.job_state(job)[0] == "PENDING" and not released:
            subprocess.run(
                ["scontrol", "update", f"JobId={job}", "StartTime=now+5"],
                env=cluster.env(),
                capture_output=True,
                timeout=30,
            )
            released = True
        time.sleep(0.5)


@pytest.mark.parametrize("name", SLURM_JOBS)
def test_scancel_ends_the_job_for_good(cluster, tmp_path, name):
    """`scancel JOBID` of a running job: CANCELLED, never requeued. Slurm sends SIGTERM to the
    batch shell as well as to the steps (slurmd's _rpc_terminate_job); before, the job file took
    it for a preemption, requeued, and the job ran to COMPLETED."""
    if name == "slurm_torchrun.sbatch":
        skip_below_torch("2.10", "torchrun's --signals-to-handle, which the job file passes")
    job, run_dir, log = submit_preempt_job(cluster, tmp_path, name)
    subprocess.run(["scancel", job], env=cluster.env(), check=True, timeout=30)
    state = cluster.wait(job, 120)
    time.sleep(2)  # a requeue would show as PENDING right after
    output = log.read_text()
    assert state[0] == "CANCELLED" and cluster.job_state(job)[0] == "CANCELLED", output[-3000:]
    assert restarts(cluster, job) == 0 and "requeueing" not in output, output[-3000:]
    assert "SIGTERM to the batch shell" in output


def preempted_and_resumed(
    cluster, tmp_path, name, uninterrupted, qos=(), urgent=("-p", "urgent")
) -> str:
    """A real preemption: an urgent job (the higher-tier partition, or `urgent`'s options; every
    CPU of both nodes) preempts the running one (submitted with `qos`), whose ranks save on the
    SIGTERM. Asserts it was requeued once, resumed from that save and ended as the
    uninterrupted run; returns its log."""
    # 20 ms a sample (tests/inject) until the save: some 2 minutes of training, so that the
    # preemption, which Slurm starts seconds after the urgent job's submission (more on a loaded
    # machine), comes mid-run; the requeued run goes at full speed. A time format of the user's
    # own: before, the job files then took the job for not preempted.
    slow_flag = tmp_path / "slow"
    slow_flag.touch()
    slow = dict(
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
        DDP_TEST_SLOW_SAMPLE_S="0.02",
        DDP_TEST_SLOW_WHILE=str(slow_flag),
        SLURM_TIME_FORMAT="%a %T",
    )
    job, run_dir, log = submit_preempt_job(cluster, tmp_path, name, sbatch=qos, **slow)
    urgent = cluster.sbatch(
        [*urgent, "-N2", "--ntasks-per-node=2", "--cpus-per-task=1"]
        + ["-o", str(tmp_path / "urgent.out"), "--wrap", "sleep 1"],
        clean_env(),
        REPO,
    )
    deadline = time.monotonic() + 150
    while "SIGTERM: checkpoint at step" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    slow_flag.unlink()
    wait_through_a_requeue(cluster, job, 300)
    output = log.read_text()
    assert cluster.job_state(job)[0] == "COMPLETED", output[-3000:]
    assert cluster.job_state(urgent)[0] == "COMPLETED"
    assert restarts(cluster, job) == 1, output[-3000:]
    saved_at, resumed_from = stop_and_resume_steps(output)
    assert (
        f"SIGTERM: checkpoint at step {resumed_from} saved" in output and saved_at == resumed_from
    )
    assert differing_tensors(load_model(run_dir), uninterrupted) == []
    return output


@pytest.mark.parametrize("name", SLURM_JOBS)
def test_preemption_saves_requeues_and_resumes_bitwise(cluster, uninterrupted, tmp_path, name):
    """Slurm sends SIGTERM to the job's steps, not to its batch shell, and shows a PreemptTime;
    the ranks save, and the job file requeues: Slurm 22.05 does not requeue a job that ends
    within its GraceTime itself (seen here). The job's mode is its partition's own (REQUEUE);
    tests/test_job_decisions.py holds the other modes and versions."""
    if name == "slurm_torchrun.sbatch":
        skip_below_torch("2.10", "torchrun's --signals-to-handle, which the job file passes")
    output = preempted_and_resumed(cluster, tmp_path, name, uninterrupted)
    said = r"preempted, preempt mode REQUEUE \(the partition's\)$"
    assert re.search(
        rf"^requeueing job \d+ \(exit code \d+; SIGTERM at step \d+\): {said}", output, re.M
    ), output[-3000:]


@pytest.fixture(scope="module")
def gang_cluster(tmp_path_factory):
    """A second cluster whose PreemptMode is GANG,REQUEUE, and a "debug" partition without a
    mode of its own, which shows the cluster's."""
    need_root("a test Slurm cluster (slurmd)")
    need_tools(*SLURM_TOOLS)
    root = tmp_path_factory.mktemp("slurm_gang")
    with SlurmCluster(root, cluster_mode="GANG,REQUEUE", partition_mode="") as c:
        yield c


def test_a_combined_preempt_mode_requeues_and_resumes_bitwise(
    gang_cluster, uninterrupted, tmp_path
):
    """`scontrol show partition` prints PreemptMode=GANG,REQUEUE, which the old job files'
    `=~ PreemptMode=REQUEUE` missed. Slurm 22.05, under GANG, signals the batch shell too and
    requeues the job itself (05's README says so): the job file requeues nothing, and the job
    resumes from its save and ends as the uninterrupted run."""
    output = preempted_and_resumed(gang_cluster, tmp_path, "slurm_srun.sbatch", uninterrupted)
    assert "SIGTERM to the batch shell" in output, output[-3000:]
    assert "requeueing job" not in output, output[-3000:]


@pytest.fixture(scope="module")
def qos_cluster(tmp_path_factory):
    """A third cluster, with accounting (slurmdbd on a MariaDB of its own) and
    PreemptType=preempt/qos: the QOS "scavenger" (PreemptMode=requeue), which "urgent" preempts.
    The partition's mode and the cluster's (REQUEUE) play no part."""
    need_root("a test Slurm cluster (slurmd)")
    need_tools(*SLURM_TOOLS, "slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db")
    root = tmp_path_factory.mktemp("slurm_qos")
    with SlurmCluster(root, partition_mode="CANCEL", qos_preemption=True) as c:
        yield c


def test_a_qos_preempt_mode_requeues_and_resumes_bitwise(qos_cluster, uninterrupted, tmp_path):
    """Under preempt/qos the job's mode is its QOS's: requeue, while its partition shows CANCEL,
    which the old job files read (and so never requeued)."""
    output = preempted_and_resumed(
        qos_cluster,
        tmp_path,
        "slurm_srun.sbatch",
        uninterrupted,
        qos=["--qos=scavenger"],
        urgent=["--qos=urgent"],
    )
    said = r"preempted, preempt mode REQUEUE \(the QOS's\)$"
    assert re.search(
        rf"^requeueing job \d+ \(exit code \d+; SIGTERM at step \d+\): {said}", output, re.M
    ), output[-3000:]


def test_time_limit_signal_with_loader_workers_under_srun_requeues_bitwise(
    cluster, uninterrupted, tmp_path
):
    """The file's --signal (SIGUSR1 to every process of the step: proctrack/linuxproc, as
    proctrack/pgid, or cgroup with SignalChildrenProcesses) with two loader workers a rank on a
    data-bound pipeline (5 ms a sample): the ranks save, the job requeues and ends as the
    uninterrupted run. Before, the signal ended the workers and the ranks failed unsaved."""
    slow = dict(PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}", DDP_TEST_SLOW_SAMPLE_S="0.005")
    args = f"{PREEMPT_ARGS} --num-workers 2"
    job, run_dir, log = submit_preempt_job(cluster, tmp_path, "slurm_srun.sbatch", args, **slow)
    subprocess.run(
        delivery_command("slurm_srun.sbatch", "signal", job),
        env=cluster.env(),
        check=True,
        timeout=30,
    )
    wait_through_a_requeue(cluster, job, 300)
    output = log.read_text()
    assert cluster.job_state(job)[0] == "COMPLETED" and restarts(cluster, job) == 1, output[-3000:]
    saved_at, resumed_from = stop_and_resume_steps(output)
    assert (
        f"SIGUSR1: checkpoint at step {resumed_from} saved" in output and saved_at == resumed_from
    )
    assert "exited unexpectedly" not in output
    assert differing_tensors(load_model(run_dir), uninterrupted) == []


def test_two_srun_steps_of_one_job_train_side_by_side(cluster, tmp_path):
    """`srun ... &` twice in one allocation, the sweep pattern: each step meets at its own port
    (common/launcher.py adds the step id). Before, both took the job's port: the second step's
    rank 0 failed with EADDRINUSE and its other rank joined the first step's store."""
    steps = [
        f"srun --exact -N2 -n2 --cpus-per-task=1 {PYTHON} 06_multinode/train.py {SMALL} "
        f"--output-dir {tmp_path / step} &"
        for step in ("a", "b")
    ]
    sbatch_script(
        cluster,
        tmp_path,
        [*steps, "wait %1 && wait %2"],
        ["-N2", "--ntasks-per-node=2", "--cpus-per-task=1"],
        clean_env(),
        240,
    )
    summaries = [read_summary(tmp_path / step) for step in ("a", "b")]
    assert [(s["world_size"], s["replicas_identical"]) for s in summaries] == [(2, True)] * 2
    assert summaries[0]["master_port"] != summaries[1]["master_port"]
    for summary in summaries:
        assert sorted(p["host"] for p in summary["placement"]) == ["node1", "node2"]


def test_requeues_stop_at_max_restarts(cluster, tmp_path):
    env = clean_env(
        PYTHON=PYTHON, RUN_DIR=str(tmp_path / "run"), TRAIN_ARGS=PREEMPT_ARGS, MAX_RESTARTS="0"
    )
    job = cluster.sbatch(
        ["-o", str(tmp_path / "out"), *SBATCH_SMALL, "jobs/slurm_srun.sbatch"], env, REPO
    )
    deadline = time.monotonic() + 180
    while (
        not (tmp_path / "run" / "checkpoints" / "latest").exists() and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    subprocess.run(
        delivery_command("slurm_srun.sbatch", "signal", job),
        env=cluster.env(),
        check=True,
        timeout=30,
    )
    state = cluster.wait(job, 180)
    log = (tmp_path / "out").read_text()
    assert state[0] == "FAILED", log[-3000:]
    assert "not requeueing job" in log and "MAX_RESTARTS=0" in log and "(restart 1)" not in log, (
        log[-3000:]
    )
    # the save happened; only the requeue is refused
    assert (tmp_path / "run" / "checkpoints" / "REQUEUE").exists()


# -- PBS: the job files under bash, with PBS's variables and a real mpiexec ------------------------


def pbs_env(tmp_path, job_file, *qsub_args, first_id=4321, **extra):
    """Submit jobs/<job_file> to the PBS stand-in (tests/pbs_server.py: no PBS server here) with
    `qsub_args`; return the server, the job id and the environment PBS starts the job with: the
    submission's variables, two "nodes" in the node file (this machine: its host name first, then
    localhost), MPICH's mpiexec, this interpreter and `extra`."""
    server = PbsServer(tmp_path / "pbs", first_id=first_id)
    env = clean_env(PATH=f"{server.bin}:{clean_env()['PATH']}")
    submitted = run([server.bin / "qsub", *qsub_args, f"jobs/{job_file}"], 30, env=env, check=True)
    job_id = submitted.stdout.strip()
    return server, job_id, started(server, job_id, tmp_path, **extra)


def started(server, job_id, tmp_path, **extra):
    """The environment PBS starts `job_id`'s script with (see pbs_env)."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\nlocalhost\n")
    env = clean_env(MPIEXEC="mpiexec.mpich", PYTHON=PYTHON)
    env.update(server.start(job_id, PBS_NODEFILE=str(nodefile)), **extra)
    env["PATH"] = f"{server.bin}:{clean_env()['PATH']}"
    return env


GLOO_LOOPBACK_WARNING = "so gloo listens on loopback, where other hosts cannot connect"
HOST_RESOLVES_TO_LOOPBACK = socket.gethostbyname(socket.gethostname()).startswith("127.")


@pytest.mark.scheduler
def test_pbs_mpiexec_job(tmp_path):
    need_tools("mpiexec.mpich")
    # MPICH's Hydra takes --ppn but not PALS's --cpu-bind depth: MPIEXEC_BIND is emptied.
    _, _, env = pbs_env(
        tmp_path,
        "pbs_mpiexec.pbs",
        NRANKS_PER_NODE="1",
        MPIEXEC_BIND="",
        SCRIPT="06_multinode/train.py",
        DEADLINE_ARGS="",
        TRAIN_ARGS=SMALL,
        RUN_DIR=str(tmp_path / "run"),
    )
    start = time.perf_counter()
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 180, env=env, check=True, cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["scheduler"] == "pbs" and summary["launcher"] == "mpich"
    assert summary["world_size"] == 2 and [p["rank"] for p in summary["placement"]] == [0, 1]
    # Rank 0's address is the node file's first line; the port comes from PBS_JOBID (4321).
    assert (summary["master_addr"], summary["master_port"]) == (socket.gethostname(), 15000 + 4321)
    assert "2 node(s), 2 ranks (1 per node)" in result.stdout
    # 06 warns before its gloo group where this host's name resolves to loopback (here, as a rule)
    # and GLOO_SOCKET_IFNAME is unset (test_pbs_torchrun_job sets it: no warning there)
    assert (GLOO_LOOPBACK_WARNING in result.stderr) == HOST_RESOLVES_TO_LOOPBACK, result.output
    print(f"PBS mpiexec job: {time.perf_counter() - start:.1f} s")


@pytest.mark.scheduler
def test_pbs_torchrun_job(tmp_path):
    need_tools("mpiexec.mpich")
    _, _, env = pbs_env(
        tmp_path,
        "pbs_torchrun.pbs",
        first_id=4322,
        GLOO_SOCKET_IFNAME="lo",
        GPUS_PER_NODE="1",
        SCRIPT="06_multinode/train.py",
        DEADLINE_ARGS="",
        TRAIN_ARGS=SMALL,
        RUN_DIR=str(tmp_path / "run"),
    )
    start = time.perf_counter()
    result = run(["bash", REPO / "jobs/pbs_torchrun.pbs"], 180, env=env, check=True, cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["scheduler"] == "pbs" and summary["launcher"] == "torchrun"
    assert summary["world_size"] == 2 and [
        (p["rank"], p["local_rank"]) for p in summary["placement"]
    ] == [(0, 0), (1, 0)]
    assert f"rendezvous {socket.gethostname()}:{15000 + 4322}" in result.stdout
    assert GLOO_LOOPBACK_WARNING not in result.output
    print(f"PBS torchrun job: {time.perf_counter() - start:.1f} s")


def pbs_chain_env(tmp_path, job_file, first_id, *qsub_args, **extra):
    """pbs_env for 05 on two ranks, one a "node": (server, job id, environment)."""
    per_node = (
        {"NRANKS_PER_NODE": "1", "MPIEXEC_BIND": ""}
        if "mpiexec" in job_file
        else {"GPUS_PER_NODE": "1"}
    )
    extra = dict(RUN_DIR=str(tmp_path / "run"), TRAIN_ARGS=PREEMPT_ARGS, **per_node, **extra)
    return pbs_env(tmp_path, job_file, *qsub_args, first_id=first_id, **extra)


@pytest.mark.scheduler
@pytest.mark.parametrize("job_file", ["pbs_mpiexec.pbs", "pbs_torchrun.pbs"])
def test_pbs_deadline_saves_resubmits_and_the_next_job_resumes_bitwise(
    job_file, uninterrupted, tmp_path
):
    """PBS warns no one before the wall time: 05's --time-limit-s (the job's walltime, read with
    qstat -f, less SAVE_MARGIN_S) stops it, and jobs/scheduler.py submits the job again as it
    was submitted (tests/test_job_decisions.py holds which options), to start after this one;
    that job resumes in the same RUN_DIR and ends as the uninterrupted run."""
    need_tools("mpiexec.mpich")
    # A deadline 1 s after the start: reached before the first step ends however fast the machine
    # (the whole run takes 3.8 s on 2 cores: with 4 s it sometimes ended before the deadline).
    qsub = ["-A", "proj7", "-q", "prod", "-l", "walltime=00:00:06", "-l", "filesystems=home:eagle"]
    server, first_id, env = pbs_chain_env(tmp_path, job_file, 4323, *qsub, SAVE_MARGIN_S="5")
    first = run(["bash", REPO / "jobs" / job_file], 180, env=env, check=True, cwd=tmp_path)
    saved_at = int(
        re.search(r"^time limit: checkpoint at step (\d+) saved", first.stdout, re.M).group(1)
    )
    assert server.jobs() == [first_id, "4324.pbs01"], first.output[-3000:]
    before, after = server.job(first_id), server.job("4324.pbs01")
    kept = ("Account_Name", "queue", "Resource_List.walltime", "Resource_List.filesystems")
    assert {k: after["attributes"][k] for k in kept} == {k: before["attributes"][k] for k in kept}
    assert after["attributes"]["depend"] == f"depend=afterany:{first_id}"
    assert after["variables"]["RESTART_COUNT"] == "1"
    # The next job: PBS's variables for it, no rendezvous of the first job's (the second derives
    # its own), and no deadline: it runs to the end.
    env = started(server, "4324.pbs01", tmp_path, DEADLINE_ARGS="", NRANKS_PER_NODE="1")
    env.update(MPIEXEC_BIND="", GPUS_PER_NODE="1", TRAIN_ARGS=PREEMPT_ARGS)
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env
    second = run(["bash", REPO / "jobs" / job_file], 300, env=env, check=True, cwd=tmp_path)
    assert f"rendezvous {socket.gethostname()}:{15000 + 4324}" in second.stdout, second.stdout
    assert re.search(rf"^resumed from \S+: step {saved_at}, ", second.stdout, re.M), second.output[
        -3000:
    ]
    # finished: no more resubmission
    assert len(server.jobs()) == 2
    print(
        f"{job_file}: deadline save at step {saved_at}, resumed from step {saved_at}, restart "
        "count 1"
    )
    assert differing_tensors(load_model(tmp_path / "run"), uninterrupted) == []


@pytest.mark.scheduler
def test_pbs_sigterm_to_the_whole_job_saves_and_is_not_resubmitted(tmp_path):
    """As PBS does on `qdel`, at the wall time or on a preemption: SIGTERM to every process of the
    job. 05 saves at the next step boundary (within kill_delay); the job file does not resubmit
    (before, it did: a qdel was undone, up to MAX_RESTARTS times). A preempted rerunnable job PBS
    reruns under the same id (tests/test_job_decisions.py), and the rerun resumes."""
    need_tools("mpiexec.mpich")
    server, job_id, env = pbs_chain_env(tmp_path, "pbs_mpiexec.pbs", 4325)
    proc = start_guarded(
        ["bash", REPO / "jobs" / "pbs_mpiexec.pbs"],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while (
            not (tmp_path / "run" / "checkpoints" / "latest").exists()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = finish(proc, 60, "pbs_mpiexec.pbs after SIGTERM to every process")
    finally:
        kill_group(proc)
    saved = re.search(r"^SIGTERM: checkpoint at step (\d+) saved", out, re.M)
    assert saved, out[-3000:]
    assert "this job ends here, not resubmitted" in out and server.jobs() == [job_id]
    assert server.preempt(job_id)  # rerunnable: PBS queues it again, under its id
    rerun = run(["bash", REPO / "jobs" / "pbs_mpiexec.pbs"], 300, env=env, cwd=tmp_path)
    assert re.search(rf"^resumed from \S+: step {saved[1]}, ", rerun.stdout, re.M), rerun.output[
        -3000:
    ]


@pytest.mark.scheduler
def test_pbs_crash_is_not_resubmitted_and_restarts_are_capped(tmp_path):
    need_tools("mpiexec.mpich")
    crash = tmp_path / "crash"
    crash.mkdir()
    server, job_id, env = pbs_chain_env(
        crash,
        "pbs_mpiexec.pbs",
        4326,
        PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}",
        DDP_TEST_FAIL_AT_STEP="2",
        DDP_TEST_FAIL_RANK="1",
    )
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 120, env=env, cwd=crash)
    assert result.returncode != 0 and "injected failure" in result.output, result.output[-3000:]
    assert server.jobs() == [job_id]
    # Bad input (exit 2, before any process group) where an earlier job's deadline save left
    # checkpoints/REQUEUE: before, the file found that note and resubmitted the crash.
    stale = tmp_path / "stale"
    (stale / "run" / "checkpoints").mkdir(parents=True)
    (stale / "run" / "checkpoints" / "REQUEUE").write_text("time limit at step 12\n")
    server, job_id, env = pbs_chain_env(stale, "pbs_mpiexec.pbs", 4328)
    env["TRAIN_ARGS"] += " --local-batch-size 0"
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 120, env=env, cwd=stale)
    assert result.returncode != 0 and "error: " in result.output, result.output[-3000:]
    assert server.jobs() == [job_id]
    capped = tmp_path / "capped"
    capped.mkdir()
    server, job_id, env = pbs_chain_env(
        capped,
        "pbs_mpiexec.pbs",
        4327,
        "-l",
        "walltime=00:00:06",
        SAVE_MARGIN_S="5",
        RESTART_COUNT="5",
        MAX_RESTARTS="5",
    )
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 180, env=env, cwd=capped)
    assert (
        result.returncode == 1 and "not resubmitting: restarted 5 times already" in result.stdout
    ), result.output
    assert server.jobs() == [job_id]


def test_pbs_job_refuses_to_run_outside_pbs(tmp_path):
    env = clean_env()
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 30, env=env, cwd=tmp_path)
    assert (
        result.returncode != 0
        and "PBS_O_WORKDIR: not set: run this file with qsub" in result.stderr
    )


@pytest.mark.launchers
def test_torchrun_single_node_job_counts_the_gpus_torch_sees(tmp_path):
    """The GPU count is torch's (CUDA_VISIBLE_DEVICES and MIG as CUDA shows them), not the lines
    of `nvidia-smi -L`, which lists every MIG instance and ignores the mask. Here a stand-in
    nvidia-smi lists three, torch sees none: two CPU processes (before: three)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text(
        '#!/bin/sh\nfor i in 0 1 2; do echo "GPU $i: NVIDIA A100 (UUID: GPU-$i)"; done\n'
    )
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    env = clean_env(PYTHON=PYTHON, TRAIN_ARGS=f"{SMALL} --output-dir {tmp_path / 'run'}")
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    env.pop("GPUS_PER_NODE", None)
    run(["bash", "jobs/torchrun_single_node.sh"], 150, env=env, check=True)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun"


def test_basic_example_runs_unchanged_under_srun(cluster, tmp_path):
    """01_basic_ddp/train.py, as its README says, under plain srun: two tasks on two nodes.

    Rank, world size and rendezvous (the step's first node, by name) come from srun."""
    out = tmp_path / "run"
    (tmp_path / "job.sh").write_text(
        f"#!/bin/bash\nsrun {PYTHON} 01_basic_ddp/train.py {SMALL} --output-dir {out}\n"
    )
    job = cluster.sbatch(
        ["-N2", "-n2", *SBATCH_SMALL, "-o", str(tmp_path / "out"), str(tmp_path / "job.sh")],
        clean_env(),
        REPO,
    )
    state = cluster.wait(job, 180)
    assert state[0] == "COMPLETED", (tmp_path / "out").read_text()
    summary = read_summary(out)
    assert (summary["launcher"], summary["world_size"], summary["replicas_identical"]) == (
        "slurm",
        2,
        True,
    )
    assert repeated_lines((tmp_path / "out").read_text()) == []  # rank 0 printed


def test_torchrun_multi_node_job_on_two_hosts(cluster, tmp_path):
    """jobs/torchrun_multi_node.sh started on each of the test cluster's two hosts (their own
    names and addresses, not through Slurm), meeting at RDZV_HOST=node1 by name: 06 trains, one
    rank a host, identical replicas."""
    out = tmp_path / "run"
    env = clean_env(
        PYTHON=PYTHON,
        NNODES="2",
        GPUS_PER_NODE="1",
        RDZV_HOST="node1",
        RDZV_PORT=str(free_port()),
        RDZV_ID=f"two-hosts-{os.getpid()}",
        TRAIN_ARGS=f"{SMALL} --output-dir {out}",
    )
    with contextlib.ExitStack() as logs:
        procs = [
            start_guarded(
                cluster.on_node(node, ["bash", "jobs/torchrun_multi_node.sh"]),
                env=env,
                stdout=logs.enter_context(open(tmp_path / f"{node}.log", "w")),
                stderr=subprocess.STDOUT,
            )
            for node in ("node1", "node2")
        ]
        wait_all(procs, 180, tmp_path, "torchrun on two hosts")
    summary = read_summary(out)
    assert (summary["launcher"], summary["world_size"], summary["replicas_identical"]) == (
        "torchrun",
        2,
        True,
    )
    assert sorted(p["host"] for p in summary["placement"]) == ["node1", "node2"]


# -- a script of the user's own, ported for torchrun, under every scheduler job file ---------------
USER_SCRIPT = "tests/user_scripts/torchrun_style.py"


def user_script_ranks(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("name", SLURM_JOBS)
def test_a_torchrun_style_script_of_ones_own_runs_under_the_slurm_job_files(
    cluster, tmp_path, name
):
    """SCRIPT=my_train.py with its own argparse and env://, on two hosts: the job file gives it
    TRAIN_ARGS only (before: `unrecognized arguments: --timeout-s 600 --output-dir ...`) and,
    under srun, torchrun's variables through jobs/torchrun_env.py."""
    if name == "slurm_torchrun.sbatch":
        skip_below_torch("2.10", "torchrun's --signals-to-handle, which the job file passes")
    out, log = tmp_path / "out", tmp_path / "log"
    env = clean_env(
        PYTHON=PYTHON,
        GPUS_PER_NODE="1",
        SCRIPT=USER_SCRIPT,
        TRAIN_ARGS=f"--steps 3 --out {out}",
        RUN_DIR=str(tmp_path / "run"),
    )
    job = cluster.sbatch(["-o", str(log), *SBATCH_SMALL, f"jobs/{name}"], env, REPO)
    state = cluster.wait(job, 180)
    assert state[0] == "COMPLETED", log.read_text()[-3000:]
    ranks = user_script_ranks(out)
    assert [
        (r["rank"], r["local_rank"], r["world_size"], r["local_world_size"]) for r in ranks
    ] == [
        (0, 0, 2, 1),
        (1, 0, 2, 1),
    ]
    assert sorted(r["host"] for r in ranks) == ["node1", "node2"]
    assert all(r["replicas_identical"] for r in ranks)


@pytest.mark.scheduler
@pytest.mark.parametrize("job_file", ["pbs_mpiexec.pbs", "pbs_torchrun.pbs"])
def test_a_torchrun_style_script_of_ones_own_runs_under_the_pbs_job_files(tmp_path, job_file):
    need_tools("mpiexec.mpich")
    per_node = (
        {"NRANKS_PER_NODE": "1", "MPIEXEC_BIND": ""}
        if "mpiexec" in job_file
        else {"GPUS_PER_NODE": "1"}
    )
    _, _, env = pbs_env(
        tmp_path,
        job_file,
        first_id=4331,
        SCRIPT=USER_SCRIPT,
        TRAIN_ARGS=f"--steps 3 --out {tmp_path / 'out'}",
        RUN_DIR=str(tmp_path / "run"),
        GLOO_SOCKET_IFNAME="lo",
        **per_node,
    )
    run(["bash", REPO / "jobs" / job_file], 180, env=env, check=True, cwd=tmp_path)
    ranks = user_script_ranks(tmp_path / "out")
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(r["replicas_identical"] for r in ranks)


@pytest.mark.launchers
def test_torchrun_env_refuses_a_missing_script_name():
    result = run([PYTHON, "jobs/torchrun_env.py"], 60)
    assert result.returncode == 2 and result.stderr.startswith("error: usage:")


def test_torchrun_env_gives_a_rank_bound_to_its_own_gpu_local_rank_0():
    """srun --gpus-per-task=1 (or a site's affinity script) leaves each rank one GPU: LOCAL_RANK
    is 0, as torchrun's --virtual-local-rank sets it. Before, task 3 got LOCAL_RANK=3 and
    `torch.cuda.set_device(3)` failed with "invalid device ordinal". Seeing every GPU, or no
    variable saying, it keeps its local rank; two GPUs for four ranks is refused."""
    task = dict(SLURM_JOB_ID="61", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="3")
    task.update(SLURM_NODEID="0", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4")
    task.update(SLURM_STEP_NODELIST="n1", SLURM_JOB_NODELIST="n1", SLURM_STEP_TASKS_PER_NODE="4")
    show = "import os; print(os.environ['LOCAL_RANK'], os.environ['RANK'])"
    local_rank = {}
    for visible in ("3", "0,1,2,3", None, "", "0,1"):
        env = clean_env(**task)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        result = run([PYTHON, "jobs/torchrun_env.py", "-c", show], 60, env=env)
        local_rank[visible] = (result.returncode, result.stdout.strip() or result.stderr.strip())
    assert local_rank == {
        "3": (0, "0 3"),
        "0,1,2,3": (0, "3 3"),
        None: (0, "3 3"),
        "": (0, "3 3"),
        "0,1": (
            2,
            "error: 4 ranks on this node but 2 GPUs visible to rank 3 "
            "(CUDA_VISIBLE_DEVICES=0,1): one rank per GPU, seeing all or its own",
        ),
    }
