"""Stress check, run by hand (not in the default suite): preempted Slurm jobs requeue and finish.

Submits a job file with 05 on the two-node test cluster (tests/slurm_cluster.py), sends the job
steps the file's --signal (as Slurm does before the time limit) once the first checkpoint exists,
lets the requeued job start again and waits for the end. Two jobs at a time, --runs in all; busy
processes on every core (--load) make races likelier, as on a loaded CI machine. Each run's final
state, restarts and the step's exit as the job file logged it ("requeueing job N (exit code ...")
are counted; for a run that did not end COMPLETED after one requeue, the tail of its log and of
the Slurm daemons' logs are printed.

    python tests/stress_preempt.py --runs 20 --load 2
    python tests/stress_preempt.py --job slurm_srun.sbatch --runs 10

Exit code 0 when every run ended COMPLETED after exactly one requeue, else 1.
"""

import argparse
import collections
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.processes import clean_env
from tests.slurm_cluster import SlurmCluster  # noqa: E402

TRAIN_ARGS = "--epochs 3 --local-batch-size 16 --save-every-steps 20 --log-every 1000"
SBATCH = ["--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0"]


def busy():
    while True:
        pass


def submit(cluster, job_file, root, index):
    run_dir, log = root / f"run{index}", root / f"run{index}.out"
    env = clean_env(
        PYTHON=sys.executable, GPUS_PER_NODE="1", RUN_DIR=str(run_dir), TRAIN_ARGS=TRAIN_ARGS
    )
    job = cluster.sbatch(["-o", str(log), *SBATCH, f"jobs/{job_file}"], env, REPO)
    return {"job": job, "run_dir": run_dir, "log": log, "signalled": False, "released": False}


def scontrol(cluster, *args):
    return subprocess.run(
        ["scontrol", *args], env=cluster.env(), capture_output=True, text=True, timeout=30
    ).stdout


def drive(cluster, run, signal_name):
    """One poll: signal once the first checkpoint exists, release the requeued job once; the
    final (state, restarts), or None while it runs."""
    if not run["signalled"] and (run["run_dir"] / "checkpoints" / "latest").exists():
        subprocess.run(
            ["scancel", f"--signal={signal_name}", run["job"]],
            env=cluster.env(),
            capture_output=True,
            timeout=30,
        )
        run["signalled"] = True
    state, _ = cluster.job_state(run["job"])
    if state == "PENDING" and run["signalled"] and not run["released"]:
        # as tests/test_jobs.py does: after the hold, not "now" (slurmd refuses a credential that
        # is not newer than its kill of the previous run)
        scontrol(cluster, "update", f"JobId={run['job']}", "StartTime=now+5")
        run["released"] = True
    if state in cluster.FINAL_STATES:
        shown = scontrol(cluster, "show", "job", run["job"])
        return state, int(re.search(r"Restarts=(\d+)", shown).group(1))
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", default="slurm_torchrun.sbatch")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the jobs")
    parser.add_argument("--timeout-s", type=float, default=600, help="per run")
    args = parser.parse_args()
    signal_name = re.search(
        r"^#SBATCH --signal=(\w+)@\d+$", (REPO / "jobs" / args.job).read_text(), re.M
    ).group(1)
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    outcomes, step_exits, bad = collections.Counter(), collections.Counter(), 0
    try:
        with tempfile.TemporaryDirectory() as tmp, SlurmCluster(Path(tmp) / "slurm") as cluster:
            root = Path(tmp)
            pending, running, index = list(range(args.runs)), {}, 0
            while pending or running:
                while pending and len(running) < 2:
                    index = pending.pop(0)
                    running[index] = submit(cluster, args.job, root, index)
                    running[index]["start"] = time.monotonic()
                time.sleep(0.5)
                for i, run in list(running.items()):
                    final = drive(cluster, run, signal_name)
                    if final is None and time.monotonic() - run["start"] > args.timeout_s:
                        subprocess.run(["scancel", run["job"]], env=cluster.env(), timeout=30)
                        final = ("TIMEOUT (stress)", -1)
                    if final is None:
                        continue
                    del running[i]
                    log = run["log"].read_text(errors="replace") if run["log"].exists() else ""
                    exits = re.findall(r"^requeueing job \d+ \(exit code (\d+)", log, re.M)
                    step_exits.update(exits)
                    forced = "Force Terminated" in log
                    outcomes[(final[0], final[1], forced)] += 1
                    print(
                        f"run {i}: {final[0]}, restarts {final[1]}, step exit {exits}, "
                        f"force terminated: {forced}",
                        flush=True,
                    )
                    if final != ("COMPLETED", 1):
                        bad += 1
                        print(f"--- run {i} log\n{log[-4000:]}\n--- daemons\n{cluster.logs()}")
    finally:
        for hog in hogs:
            hog.kill()
    print(f"\n{args.runs} runs of {args.job}, load {args.load}")
    for (state, restarts, forced), count in sorted(outcomes.items()):
        print(f"  {count:3d} x {state}, restarts {restarts}, force terminated: {forced}")
    print(f"  the step's exit code when the job file requeued: {dict(step_exits)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
