"""jobs/: static checks of every job file, the Slurm files on a real two-node Slurm cluster,
the PBS files under bash with PBS's variables and a real mpiexec."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from tests.helpers import PYTHON, REPO, clean_env, kill_group, read_summary, run
from tests.launcher_tools import need_root, need_tools
from tests.slurm_cluster import TOOLS as SLURM_TOOLS, SlurmCluster

JOBS = sorted((REPO / "jobs").glob("*.*"))
SLURM_JOBS = ["slurm_srun.sbatch", "slurm_torchrun.sbatch"]
SMALL = "--max-steps 3 --epochs 1 --batch-size 16"


def test_job_files_exist():
    names = {p.name for p in JOBS}
    assert {"torchrun_single_node.sh", "torchrun_multi_node.sh", *SLURM_JOBS, "pbs_mpiexec.pbs",
            "pbs_torchrun.pbs", "prepare_data.sh"} <= names


@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
def test_job_file_static(job):
    text = job.read_text()
    run(["bash", "-n", job], 30, check=True)
    need_tools("shellcheck")
    result = run(["shellcheck", "-s", "bash", job], 60)
    assert result.returncode == 0, result.stdout
    assert "set -euo pipefail" in text
    assert re.search(r"^# Edit", text, re.M), "header must say what to edit"
    # Directives: exact '#SBATCH --opt' / '#PBS -x', and all of them before the first command
    # (sbatch and qsub stop reading directives there). '##SBATCH' is a disabled line.
    seen_command = False
    for number, line in enumerate(text.splitlines(), 1):
        assert not re.match(r"#\s+(SBATCH|PBS)\s+-", line), f"{job.name}:{number}: '# SBATCH' is ignored: {line}"
        if line.startswith("#SBATCH"):
            assert re.fullmatch(r"#SBATCH --[a-z][a-z-]*(=\S+)?", line), f"{job.name}:{number}: {line}"
            assert not seen_command, f"{job.name}:{number}: directive after the first command"
        if line.startswith("#PBS"):
            assert re.fullmatch(r"#PBS -[A-Za-z] \S+", line), f"{job.name}:{number}: {line}"
            assert not seen_command, f"{job.name}:{number}: directive after the first command"
        if line.strip() and not line.startswith("#"):
            seen_command = True
    # Every script a job file runs exists.
    for script in re.findall(r"SCRIPT=\$\{SCRIPT:-([^}]+)\}", text):
        assert (REPO / script).is_file(), script
    for module in re.findall(r"-m (common\.\w+)", text):
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module


@pytest.mark.parametrize("name", SLURM_JOBS)
def test_slurm_file_settings(name):
    text = (REPO / "jobs" / name).read_text()
    assert "--kill-on-bad-exit=1" in text
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", text, re.M)
    assert re.search(r"^#SBATCH --requeue$", text, re.M)
    assert "scontrol show hostnames" in text
    assert "$((15000 + SLURM_JOB_ID % 15000))" in text  # common.launcher derives the same port
    assert len(re.findall(r"^REQUEUE_EXIT_CODE=", text, re.M)) == 1  # one place to align it


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
        env = clean_env(PYTHON=PYTHON, GPUS_PER_NODE="1", TRAIN_ARGS=f"{SMALL} --output-dir {out / name}")
        job_id = cluster.sbatch(["-o", str(out / f"{name}.out"), *SBATCH_SMALL, f"jobs/{name}"], env, REPO)
        jobs[name] = job_id
    states = {name: cluster.wait(job_id, timeout=240) for name, job_id in jobs.items()}
    print(f"both Slurm jobs done in {time.perf_counter() - start:.1f} s")
    return {name: (jobs[name], states[name], out / name, (out / f"{name}.out")) for name in SLURM_JOBS}


@pytest.mark.parametrize("name,launcher", [("slurm_srun.sbatch", "slurm"), ("slurm_torchrun.sbatch", "torchrun")])
def test_sbatch_job_completes(slurm_jobs, cluster, name, launcher):
    job_id, (state, exit_code), run_dir, log = slurm_jobs[name]
    output = log.read_text() if log.exists() else "(no job output)"
    assert state == "COMPLETED", f"{state} {exit_code}\n{output}\n{cluster.logs()}"
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["replicas_identical"]
    assert summary["launcher"] == launcher and summary["scheduler"] == "slurm"
    assert [(p["rank"], p["local_rank"]) for p in summary["placement"]] == [(0, 0), (1, 0)]  # one per node
    port = 15000 + int(job_id) % 15000
    # First host from scontrol (node1), its NodeAddr as the rendezvous address, port from the job id.
    assert f"first host node1, rendezvous 127.0.0.1:{port}" in output
    # Rank 0's placement table: ranks 0 and 1, each local rank 0 (one per node), on CPU.
    assert re.search(r"^\s+0\s+0\s+\S+\s+cpu\n\s+1\s+0\s+\S+\s+cpu$", output, re.M), output
    assert "launcher " + launcher in output
    if launcher == "slurm":
        assert (summary["master_addr"], summary["master_port"]) == ("127.0.0.1", port)


def test_slurm_detection_batch_shell_vs_job_step(cluster, tmp_path):
    """The batch shell has SLURM_PROCID=0 but is no rank; srun's tasks are ranks 0 and 1."""
    probe = ("import json, os; from common.launcher import launch_info; i = launch_info(os.environ); "
             "print(json.dumps([os.environ.get('SLURM_STEP_ID'), i.launcher, i.rank, i.world_size]))")
    (tmp_path / "probe.sh").write_text(
        f"#!/bin/bash\n{PYTHON} -c \"{probe}\"\nsrun {PYTHON} -c \"{probe}\"\n")
    job = cluster.sbatch(["-N2", "-n2", *SBATCH_SMALL, "-o", str(tmp_path / "out"), str(tmp_path / "probe.sh")],
                         clean_env(), REPO)
    assert cluster.wait(job, 120)[0] == "COMPLETED", (tmp_path / "out").read_text()
    rows = [json.loads(line) for line in (tmp_path / "out").read_text().splitlines() if line.startswith("[")]
    assert rows[0] == [None, "single", 0, 1]  # the batch shell: no SLURM_STEP_ID on this Slurm
    assert sorted(rows[1:]) == [["0", "slurm", 0, 2], ["0", "slurm", 1, 2]]


def test_slurm_requeue_on_exit_code(cluster, tmp_path):
    """A run that exits with REQUEUE_EXIT_CODE is requeued by the job file and runs again."""
    # Behaves as 05 does on preemption: the ranks agree (here: wait until every task of this run
    # has written its line), all exit 75, and a SIGTERM while exiting changes nothing (05's
    # handler only sets a flag). Without the agreement, a task that exits 75 before the other
    # has started makes srun --kill-on-bad-exit terminate it, and srun no longer returns 75.
    script = tmp_path / "preempted_once.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        runs = os.environ["RUNS_FILE"]
        with open(runs, "a") as f:
            f.write(f"{os.environ['SLURM_PROCID']} {restart}\\n")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if open(runs).read().count(f" {restart}\\n") == int(os.environ["SLURM_NTASKS"]):
                break
            time.sleep(0.1)
        sys.exit(75 if restart == "0" else 0)
        """))
    env = clean_env(PYTHON=PYTHON, SCRIPT=str(script), TRAIN_ARGS="", RUNS_FILE=str(tmp_path / "runs"))
    job = cluster.sbatch(["-o", str(tmp_path / "out"), *SBATCH_SMALL, "jobs/slurm_srun.sbatch"], env, REPO)
    deadline, state = time.monotonic() + 240, ("", "")
    while time.monotonic() < deadline and state[0] not in cluster.FINAL_STATES:
        state = cluster.job_state(job)
        if state[0] == "PENDING":
            # Slurm holds a requeued job back for a while (BeginTime); release it now.
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster.env(),
                           capture_output=True, timeout=30)
        time.sleep(1)
    runs = sorted(r for r in (tmp_path / "runs").read_text().splitlines() if r)
    assert runs == ["0 0", "0 1", "1 0", "1 1"], (tmp_path / "out").read_text()
    assert state[0] == "COMPLETED"


# -- PBS: the job files under bash, with PBS's variables and a real mpiexec ------------------------

def pbs_env(tmp_path, job_id, **extra):
    """Two "nodes" in the node file, both this machine: its host name first, then localhost."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\nlocalhost\n")
    return clean_env(PBS_NODEFILE=str(nodefile), PBS_JOBID=job_id, PBS_O_WORKDIR=str(REPO),
                     MPIEXEC="mpiexec.mpich", PYTHON=PYTHON, **extra)


def test_pbs_mpiexec_job(tmp_path):
    need_tools("mpiexec.mpich")
    # MPICH's Hydra takes --ppn but not PALS's --cpu-bind depth: MPIEXEC_BIND is emptied.
    env = pbs_env(tmp_path, "4321.pbs01", NRANKS_PER_NODE="1", MPIEXEC_BIND="",
                  TRAIN_ARGS=f"{SMALL} --output-dir {tmp_path / 'run'}")
    start = time.perf_counter()
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 180, env=env, check=True, cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["scheduler"] == "pbs" and summary["launcher"] == "mpich"
    assert summary["world_size"] == 2 and [p["rank"] for p in summary["placement"]] == [0, 1]
    # Rank 0's address is the node file's first line; the port comes from PBS_JOBID (4321).
    assert (summary["master_addr"], summary["master_port"]) == (socket.gethostname(), 15000 + 4321)
    assert "2 node(s), 2 ranks (1 per node)" in result.stdout
    print(f"PBS mpiexec job: {time.perf_counter() - start:.1f} s")


def test_pbs_torchrun_job(tmp_path):
    need_tools("mpiexec.mpich")
    env = pbs_env(tmp_path, "4322.pbs01", GPUS_PER_NODE="1", TRAIN_ARGS=f"{SMALL} --output-dir {tmp_path / 'run'}")
    start = time.perf_counter()
    result = run(["bash", REPO / "jobs/pbs_torchrun.pbs"], 180, env=env, check=True, cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["scheduler"] == "pbs" and summary["launcher"] == "torchrun"
    assert summary["world_size"] == 2 and [(p["rank"], p["local_rank"]) for p in summary["placement"]] == [(0, 0), (1, 0)]
    assert f"rendezvous {socket.gethostname()}:{15000 + 4322}" in result.stdout
    print(f"PBS torchrun job: {time.perf_counter() - start:.1f} s")


# Stands in for 05 under PBS: `exit N` exits with N at once; `preempted DIR` writes a ready file
# into DIR, then waits and, on SIGTERM, exits with the requeue code (as 05 does once it has saved).
PBS_STAND_IN = textwrap.dedent("""\
    import os, signal, sys, time
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK")
    open(os.path.join(sys.argv[2], f"ready.{rank}"), "w").close()
    time.sleep(120)
    """)


def pbs_requeue_env(tmp_path, job_file, job_id, train_args):
    """PBS variables, the stand-in as SCRIPT, and a `qrerun` that records its arguments (no PBS server here)."""
    (tmp_path / "stand_in.py").write_text(PBS_STAND_IN)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qrerun").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "qrerun.calls"}\n')
    (bin_dir / "qrerun").chmod(0o755)
    per_node = {"NRANKS_PER_NODE": "1", "MPIEXEC_BIND": ""} if "mpiexec" in job_file else {"GPUS_PER_NODE": "1"}
    return pbs_env(tmp_path, job_id, SCRIPT=str(tmp_path / "stand_in.py"), TRAIN_ARGS=train_args,
                   PATH=f"{bin_dir}:{clean_env()['PATH']}", **per_node)


def test_pbs_job_requeues_when_the_ranks_exit_with_the_requeue_code(tmp_path):
    need_tools("mpiexec.mpich")
    env = pbs_requeue_env(tmp_path, "pbs_mpiexec.pbs", "4323.pbs01", "exit 75")
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 60, env=env, check=True, cwd=tmp_path)
    assert "requeueing job 4323.pbs01 (exit code 75, preempted=0)" in result.stdout, result.output
    assert (tmp_path / "qrerun.calls").read_text() == "4323.pbs01\n"
    # Any other failure is the job's exit code, with no requeue.
    other = tmp_path / "other"
    other.mkdir()
    env = pbs_requeue_env(other, "pbs_mpiexec.pbs", "4324.pbs01", "exit 3")
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 60, env=env, cwd=other)
    assert result.returncode == 3 and not (other / "qrerun.calls").exists(), result.output


@pytest.mark.parametrize("job_file", ["pbs_mpiexec.pbs", "pbs_torchrun.pbs"])
def test_pbs_job_requeues_after_sigterm_to_the_whole_job(job_file, tmp_path):
    """As PBS does at the walltime or on preemption: SIGTERM to every process of the job."""
    need_tools("mpiexec.mpich")
    env = pbs_requeue_env(tmp_path, job_file, "4325.pbs01", f"preempted {tmp_path}")
    proc = subprocess.Popen(["bash", REPO / "jobs" / job_file], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("ready.*"))) == 2, "the two ranks never started"
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    assert "requeueing job 4325.pbs01" in out and "preempted=1" in out, out
    assert (tmp_path / "qrerun.calls").read_text() == "4325.pbs01\n"


def test_pbs_job_refuses_to_run_outside_pbs(tmp_path):
    env = clean_env()
    result = run(["bash", REPO / "jobs/pbs_mpiexec.pbs"], 30, env=env, cwd=tmp_path)
    assert result.returncode != 0 and "PBS_O_WORKDIR: not set: run this file with qsub" in result.stderr


def test_torchrun_single_node_job(tmp_path):
    env = clean_env(PYTHON=PYTHON, GPUS_PER_NODE="2", TRAIN_ARGS=f"{SMALL} --output-dir {tmp_path / 'run'}")
    run(["bash", "jobs/torchrun_single_node.sh"], 150, env=env, check=True)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun"


def test_basic_example_runs_unchanged_under_srun(cluster, tmp_path):
    """01_basic_ddp/train.py, as its README says, under plain srun: two tasks on two nodes.

    Rank and world size come from srun; only the address is given, because this test cluster's
    node names do not resolve (on a real cluster the first host of the node list does)."""
    out = tmp_path / "run"
    (tmp_path / "job.sh").write_text(
        f"#!/bin/bash\nexport MASTER_ADDR=127.0.0.1\nsrun {PYTHON} 01_basic_ddp/train.py {SMALL} --output-dir {out}\n")
    job = cluster.sbatch(["-N2", "-n2", *SBATCH_SMALL, "-o", str(tmp_path / "out"), str(tmp_path / "job.sh")],
                         clean_env(), REPO)
    state = cluster.wait(job, 180)
    assert state[0] == "COMPLETED", (tmp_path / "out").read_text()
    summary = read_summary(out)
    assert (summary["launcher"], summary["world_size"], summary["replicas_identical"]) == ("slurm", 2, True)
    assert (tmp_path / "out").read_text().count("launcher ") == 1
