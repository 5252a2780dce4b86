"""The job files' decisions at a job's start and end (jobs/scheduler.py): the deadline, and whether
to requeue (Slurm) or submit the next job (PBS), with which options.

Each case runs a real job file under bash. The ranks are a stand-in `srun` or `mpiexec` that
leaves the note 05's preempt.py leaves (its save is proven by tests/test_jobs.py). What answers
is a stand-in of what cannot run here, written from the real tool's source:
- PBS: tests/pbs_server.py (OpenPBS's qsub and qstat, no PBS server here);
- Slurm >= 23: `scontrol` and `sacctmgr` printing what Slurm prints (the test cluster is Slurm
  22.05 without slurmdbd, so no QOS exists, and root sees hidden partitions). The formats, from
  SchedMD/slurm (22.05.8, 24.05.8, master 284c3b95): job_info.c (PreemptTime=None, the time in
  SLURM_TIME_FORMAT), partition_info.c (a partition without its own mode prints the cluster's),
  config_info.c ("Key = Value"), sacctmgr's qos_functions.c (lower case, 'cluster' where unset),
  proc_args.c ("slurm 24.05.8").
A real grace-time preemption on the real cluster is in tests/test_jobs.py.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.launcher_tools import site_env
from tests.paths import PYTHON, REPO
from tests.pbs_server import PbsServer
from tests.processes import run

# -- Slurm -----------------------------------------------------------------------------------------

SLURM_STANDIN = r'''#!{python}
"""scontrol and sacctmgr as Slurm prints them, from {answers}; each call appended to calls."""
import json, os, sys, time
answers = json.load(open("{answers}"))
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
open("{calls}", "a").write(" ".join([name, *args]) + "\n")
fmt = os.environ.get("SLURM_TIME_FORMAT", "standard")
preempted = time.strftime("%Y-%m-%dT%H:%M:%S" if fmt in ("", "standard") else fmt)
if name == "sacctmgr":
    print(answers["qos_mode"].lower())
elif args == ["--version"]:
    print("slurm " + answers["version"])
elif args[:2] == ["show", "job"]:
    when = preempted if answers["preempted"] else "None"
    print(f"JobId={{args[2]}} JobName=ddp-srun\n   Priority=1 Nice=0 Account=p QOS=scavenger\n"
          f"   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
          f"   PreemptEligibleTime=2026-12-08T01:00:00 PreemptTime={{when}}\n"
          f"   Partition=debug AllocNode:Sid=login1:4242")
elif "partition" in args:
    if answers["hidden"] and "-a" not in args:
        sys.exit("Partition debug not found")
    hidden = "YES" if answers["hidden"] else "NO"
    print(f"PartitionName=debug\n   AllowGroups=ALL Hidden={{hidden}}\n"
          f"   PriorityTier=1 PreemptMode={{answers['partition_mode']}}")
elif args[:2] == ["show", "config"]:
    print(f"PreemptMode             = {{answers['cluster_mode']}}\n"
          f"PreemptType             = {{answers['preempt_type']}}")
elif args[:2] == ["show", "node"]:
    print("NodeName=node1 Arch=x86_64\n   NodeAddr=10.1.2.3 NodeHostName=node1")
'''


def slurm_job(tmp_path: Path, note: str, **answers) -> tuple[str, list[str]]:
    """jobs/slurm_srun.sbatch whose step leaves `note`, under scontrol and sacctmgr answering
    `answers`; its log and the scheduler calls it made."""
    answers = {
        "version": "22.05.8",
        "preempt_type": "preempt/partition_prio",
        "cluster_mode": "REQUEUE",
        "partition_mode": "REQUEUE",
        "qos_mode": "cluster",
        "preempted": True,
        "hidden": False,
        **answers,
    }
    time_format = answers.pop("time_format", None)
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    standin = SLURM_STANDIN.format(
        python=PYTHON, answers=tmp_path / "answers.json", calls=tmp_path / "calls"
    )
    for name in ("scontrol", "sacctmgr"):
        (bin_dir / name).write_text(standin)
        (bin_dir / name).chmod(0o755)
    # the ranks: they save and leave preempt.py's note, as 05 does on the signal
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\nmkdir -p "{run_dir}/checkpoints"\necho "{note}" > '
        f'"{run_dir}/checkpoints/REQUEUE"\nexit 75\n'
    )
    (bin_dir / "srun").chmod(0o755)
    env = site_env(tmp_path, with_module=False, RUN_DIR=str(run_dir), PYTHON=PYTHON)
    env.update(SLURM_JOB_ID="4400", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if time_format:
        env["SLURM_TIME_FORMAT"] = time_format
    result = run(["bash", REPO / "jobs" / "slurm_srun.sbatch"], 60, env=env)
    calls = (tmp_path / "calls").read_text().splitlines()
    return result, calls


REQUEUED = "scontrol requeue 4400"


@pytest.mark.parametrize(
    "case,answers,requeued,said",
    [
        (  # today's test cluster: the partition's own mode
            "partition REQUEUE",
            {},
            True,
            "preempted, preempt mode REQUEUE (the partition's)",
        ),
        (  # a partition without its own mode prints the cluster's, combined (partition_info.c)
            "cluster GANG,REQUEUE",
            {"cluster_mode": "GANG,REQUEUE", "partition_mode": "GANG,REQUEUE"},
            True,
            "preempted, preempt mode GANG,REQUEUE (the partition's)",
        ),
        (  # preempt/qos: the QOS's mode, whatever the partition shows
            "QOS requeue",
            {
                "preempt_type": "preempt/qos",
                "cluster_mode": "CANCEL",
                "partition_mode": "CANCEL",
                "qos_mode": "requeue",
            },
            True,
            "preempted, preempt mode REQUEUE (the QOS's)",
        ),
        (
            "QOS cancel",
            {"preempt_type": "preempt/qos", "qos_mode": "cancel"},
            False,
            "preempted, preempt mode CANCEL (the QOS's): not requeued",
        ),
        (  # a QOS without its own mode: the cluster's
            "QOS cluster",
            {
                "preempt_type": "preempt/qos",
                "cluster_mode": "WITHIN,REQUEUE",
                "partition_mode": "OFF",
            },
            True,
            "preempted, preempt mode WITHIN,REQUEUE (the cluster's)",
        ),
        (  # scontrol hides a hidden partition from users without -a
            "hidden partition",
            {"hidden": True},
            True,
            "preempted, preempt mode REQUEUE (the partition's)",
        ),
        (  # the user's own time format: PreemptTime=Tue 01:02:03
            "SLURM_TIME_FORMAT",
            {"time_format": "%a %T"},
            True,
            "preempted, preempt mode REQUEUE (the partition's)",
        ),
        (  # 24.05 requeues a job ending in its grace time itself (proc_req.c, GRACE_PREEMPT);
            # a requeue of the job's own would leave that flag set for the next run's end
            "Slurm 24.05",
            {"version": "24.05.8"},
            False,
            "Slurm 24.05 requeues it",
        ),
        ("not preempted", {"preempted": False}, False, "SIGTERM, but not a preemption"),
    ],
)
def test_a_preempted_slurm_job_is_requeued_where_its_preempt_mode_says(
    case, answers, requeued, said, tmp_path
):
    """Before, the job files requeued where `scontrol show partition` began with
    PreemptMode=REQUEUE and PreemptTime began with a digit: wrong for a combined mode, a QOS's
    mode, a hidden partition, a time format of the user's own, and on Slurm 24.05 or later."""
    result, calls = slurm_job(tmp_path, "SIGTERM at step 7", **answers)
    assert result.returncode == (0 if requeued or case == "Slurm 24.05" else 75), result.output
    assert (REQUEUED in calls) == requeued, (calls, result.output)
    assert said in result.stdout, result.output
    if requeued:
        assert "requeueing job 4400 (exit code 75; SIGTERM at step 7): " in result.stdout


def test_the_time_limit_note_requeues_and_a_capped_job_does_not(tmp_path):
    (tmp_path / "a").mkdir()
    result, calls = slurm_job(tmp_path / "a", "SIGUSR1 at step 3")
    assert (
        REQUEUED in calls and "(exit code 75; SIGUSR1 at step 3): the time limit" in result.stdout
    )
    (tmp_path / "b").mkdir()
    result, calls = slurm_job(tmp_path / "b", "SIGUSR1 at step 3", version="24.05.8")
    assert REQUEUED in calls  # a time-limit save is the job file's to requeue on any version


# -- PBS -------------------------------------------------------------------------------------------


def with_header(tmp_path: Path, job_file: str, block: list[str], name: str = "") -> Path:
    """A copy of jobs/<job_file> whose #PBS lines are `block`, as a site's README says to make."""
    lines = (REPO / "jobs" / job_file).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("#PBS "))
    rest = [line for line in lines[first:] if not line.startswith(("#PBS ", "##PBS "))]
    copy = tmp_path / (name or job_file)
    copy.write_text("\n".join(lines[:first] + block + rest) + "\n")
    return copy


def site_block(site: str, queue: str) -> list[str]:
    """The header block jobs/sites/<site>.sh offers for `queue`, its '#' dropped."""
    text = (REPO / "jobs" / "sites" / f"{site}.sh").read_text()
    blocks = re.findall(r"((?:^##PBS .*\n)+)", text, re.M)
    [block] = [b for b in blocks if f"##PBS -q {queue}\n" in b]
    return [line[1:].replace("<project>", "proj7") for line in block.splitlines()]


def pbs_job(
    tmp_path: Path,
    job_file: Path,
    *qsub_args: str,
    note: str | None = "time limit at step 5",
    note_folder: Path | None = None,
    subjob: int | None = None,
    limits: dict | None = None,
    **extra: str,
):
    """Submit `job_file` to the stand-in server with `qsub_args` (from the repository's root, as
    its README says), start it (or its array's subjob `subjob`) with a stand-in mpiexec that
    leaves `note` in `note_folder` (the ranks' save at the deadline; RUN_DIR/checkpoints by
    default), and return (server, job id, the job's result, mpiexec's arguments)."""
    server = PbsServer(tmp_path / "pbs", first_id=4400, limits=limits)
    submit_env = site_env(tmp_path, with_module=False)
    submit_env["PATH"] = f"{server.bin}:{submit_env['PATH']}"
    submitted = run([server.bin / "qsub", *qsub_args, job_file], 30, env=submit_env)
    assert submitted.returncode == 0, submitted.output
    job_id = submitted.stdout.strip()
    if subjob is not None:
        job_id = server.subjob(job_id, subjob)
    run_dir, args = tmp_path / "run", tmp_path / "mpiexec.args"
    mpiexec, folder = tmp_path / "mpiexec", note_folder or run_dir / "checkpoints"
    save = f'mkdir -p "{folder}"\necho "{note}" > "{folder}/REQUEUE"\n' if note else ""
    mpiexec.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{args}"\n{save}exit 75\n')
    mpiexec.chmod(0o755)
    (tmp_path / "nodefile").write_text(f"{socket.gethostname()}\n")
    env = site_env(tmp_path, PYTHON=PYTHON, RUN_DIR=str(run_dir), **extra)
    env.update(server.start(job_id, PBS_NODEFILE=str(tmp_path / "nodefile")))
    env.update(MPIEXEC=str(mpiexec), PATH=f"{server.bin}:{env['PATH']}")
    result = run(["bash", job_file], 60, env=env, cwd=REPO)
    return server, job_id, result, args.read_text().splitlines() if args.exists() else []


def test_polaris_debug_queue_saves_before_its_own_walltime(tmp_path):
    """jobs/sites/README.md's `qsub -v SITE=polaris` on the debug block (walltime 01:00:00): the
    ranks stop 300 s before the job's walltime, read from PBS. Before, the block's
    `#PBS -v WALLTIME_S=3600` was replaced by the command line's -v (qsub.c, `case 'v'`): 6900 s,
    past the wall time, and the run was killed unsaved."""
    job_file = with_header(tmp_path, "pbs_mpiexec.pbs", site_block("polaris", "debug"))
    server, job_id, result, argv = pbs_job(tmp_path, job_file, "-v", "SITE=polaris", note=None)
    assert server.job(job_id)["attributes"]["Resource_List.walltime"] == "01:00:00"
    at = argv.index("--time-limit-s")
    assert argv[at + 1] == "3300", (argv, result.output)


def test_a_resubmitted_derecho_job_keeps_priority_account_queue_and_options(tmp_path):
    """The next job is this one as it was submitted: the command line's -l job_priority (over
    the block's regular), -A, -q, -v, and the copy of the file that was submitted. Before, the
    job files rebuilt the options from a list of resources and dropped job_priority (economy
    became regular), -N, -j and -v, and resubmitted jobs/pbs_mpiexec.pbs, not the edited copy."""
    job_file = with_header(tmp_path, "pbs_mpiexec.pbs", site_block("derecho", "main"), "mine.pbs")
    qsub = ["-l", "job_priority=economy", "-l", "walltime=00:00:06", "-N", "long run"]
    qsub += ["-v", "SITE=derecho,TRAIN_ARGS=--epochs 30 --lr 0.1"]
    server, first, result, _ = pbs_job(tmp_path, job_file, *qsub, SAVE_MARGIN_S="5")
    assert result.returncode == 0, result.output
    assert server.jobs() == [first, "4401.pbs01"], result.output
    before, after = server.job(first), server.job("4401.pbs01")
    kept = ("Account_Name", "queue", "Job_Name", "Resource_List.job_priority")
    kept += ("Resource_List.walltime", "Resource_List.select")
    assert {k: after["attributes"][k] for k in kept} == {k: before["attributes"][k] for k in kept}
    assert after["attributes"]["Resource_List.job_priority"] == "economy"
    assert after["attributes"]["depend"] == f"depend=afterany:{first}"
    assert after["attributes"]["Submit_arguments"].endswith(str(job_file))
    assert after["variables"]["TRAIN_ARGS"] == "--epochs 30 --lr 0.1"
    assert after["variables"]["SITE"] == "derecho"
    assert after["variables"]["RUN_DIR"] == str(tmp_path / "run")
    assert after["variables"]["RESTART_COUNT"] == "1"


def test_derechos_preempt_queue_block_has_pbs_rerun_a_preempted_job(tmp_path):
    """On the preempt queue the ranks save on the SIGTERM and the job file ends; the job goes on
    only if PBS reruns it, which it does for a rerunnable job (req_rerun.c). Before, the block
    said -r n: the preempted run stopped for good."""
    job_file = with_header(tmp_path, "pbs_mpiexec.pbs", site_block("derecho", "preempt"))
    server, job_id, result, _ = pbs_job(tmp_path, job_file, "-v", "SITE=derecho", note=None)
    assert server.job(job_id)["attributes"]["Rerunable"] == "True"
    assert server.preempt(job_id)
    # the control: -r n on the command line wins over the block, and PBS does not rerun
    (tmp_path / "n").mkdir()
    server, job_id, _, _ = pbs_job(tmp_path / "n", job_file, "-r", "n", note=None)
    assert not server.preempt(job_id)


def test_a_queue_of_one_job_per_user_refuses_the_next_job_in_one_clear_line(tmp_path):
    """Polaris debug-scaling: one job per user, so qsub refuses the next part while this one
    runs. Before, `set -e` ended the job on qsub's refusal with no word of what to do."""
    job_file = with_header(tmp_path, "pbs_mpiexec.pbs", site_block("polaris", "debug-scaling"))
    server, job_id, result, _ = pbs_job(
        tmp_path,
        job_file,
        "-l",
        "walltime=00:00:06",
        limits={"debug-scaling": 1},
        SAVE_MARGIN_S="5",
    )
    assert result.returncode == 1 and server.jobs() == [job_id], result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        "error: qsub refused the next job (qsub: would exceed queue generic's per-user limit). "
        "The checkpoint is saved: once this job has ended, submit it yourself with "
        "RESTART_COUNT=1: qsub -l walltime=00:00:06 -v "
    ), line


def test_an_array_subjob_is_not_resubmitted_and_says_so(tmp_path):
    """qsub refuses a dependency on a subjob (parse_depend.c). Before, the job file's qsub failed
    under `set -e` ("qsub: illegal -W value"); now one line says why and what to do."""
    job_file = REPO / "jobs" / "pbs_mpiexec.pbs"
    qsub = ["-J", "1-4", "-l", "walltime=00:00:06"]
    server, job_id, result, _ = pbs_job(tmp_path, job_file, *qsub, subjob=3, SAVE_MARGIN_S="5")
    assert result.returncode == 1 and server.jobs() == ["4400[3].pbs01", "4400[].pbs01"]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: 4400[3].pbs01 is an array subjob"), result.output


@pytest.mark.parametrize("spelling", ["--checkpoint-dir {}", "--checkpoint_dir={}", "--config {}"])
def test_a_checkpoint_dir_of_ones_own_is_where_the_note_is_read(spelling, tmp_path):
    """05's --checkpoint-dir (or a --config file's checkpoint_dir) moves REQUEUE: a deadline save
    there resubmits. Before, the job files looked in $RUN_DIR/checkpoints alone."""
    folder = tmp_path / "elsewhere"
    config = tmp_path / "run.yaml"
    config.write_text(f"checkpoint_dir: {folder}\n")
    argument = spelling.format(config if "config" in spelling else folder)
    server, first, result, _ = pbs_job(
        tmp_path,
        REPO / "jobs" / "pbs_mpiexec.pbs",
        "-l",
        "walltime=00:00:06",
        note_folder=folder,
        SAVE_MARGIN_S="5",
        TRAIN_ARGS=f"--epochs 3 {argument}",
    )
    assert result.returncode == 0 and len(server.jobs()) == 2, result.output


def test_a_walltime_within_the_save_margin_stops_the_job_before_launch(tmp_path):
    """One line at the start, before any rank runs: no deadline could be kept."""
    server, job_id, result, argv = pbs_job(
        tmp_path, REPO / "jobs" / "pbs_mpiexec.pbs", "-l", "walltime=00:04:00", note=None
    )
    assert result.returncode == 1 and argv == [], result.output
    assert result.stderr.strip().splitlines()[0] == (
        "error: walltime 240 s leaves no time before SAVE_MARGIN_S=300 s: ask for more "
        "walltime, or a smaller SAVE_MARGIN_S"
    )
