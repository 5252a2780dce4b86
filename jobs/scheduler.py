"""The job files' decisions, read from the scheduler itself: a run's deadline, and at its end
whether to requeue (Slurm) or resubmit (PBS), with which options. Standard library only, no
torch: it runs with the site's Python in well under a second.

    settings=$(python jobs/scheduler.py start); eval "$settings"     # at a job's start
    python jobs/scheduler.py end STATUS SIGNALLED      # at its end; exits with the job's exit code

`start` deletes an earlier run's note (05's preempt.py writes REQUEUE in its checkpoint folder)
and prints shell assignments: rdzv_host and rdzv_port, where rank 0 listens (MASTER_ADDR and
MASTER_PORT where set; else the first node, Slurm's NodeAddr for it, and common/launcher.py's
port), and under PBS time_limit_s, the seconds the run has before it must stop and save: the
job's own walltime (`qstat -f`) less SAVE_MARGIN_S. `end` reads the note this run wrote:

- "SIGUSR1 at ..." (Slurm's warning before the time limit): `scontrol requeue`.
- "SIGTERM at ..." under Slurm, the job preempted (PreemptTime set) where its preempt mode requeues:
  `scontrol requeue` before Slurm 24.05; from 24.05 on Slurm requeues a job that ends within its
  grace time itself, and a requeue of its own would leave the job's grace-preempt flag set.
- "time limit at ..." (the deadline): Slurm requeues; PBS submits the job again, as it was
  submitted (`Submit_arguments`), to start after this one (`-W depend=afterany:<this job>`).
- none, or SIGNALLED=1 (SIGTERM to the batch shell: a cancel, the wall time, a preemption that
  PBS reruns itself, an operator's requeue): nothing; the job ends with STATUS.

A job restarted MAX_RESTARTS times is not restarted again. Every input is the environment the
job files set: RUN_DIR, TRAIN_ARGS, SAVE_MARGIN_S, MAX_RESTARTS, RESTART_COUNT (PBS).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common.launcher import expand_hostlist, master_port  # noqa: E402


class JobError(Exception):
    """One line for the job's log: what the scheduler said, and what to do."""


# ---- the note ------------------------------------------------------------------------------
def note_path(env: dict) -> Path:
    """Where 05's preempt.py writes REQUEUE: its checkpoint folder, <RUN_DIR>/checkpoints unless
    TRAIN_ARGS (or its --config file) names another with --checkpoint-dir."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--checkpoint-dir", "--checkpoint_dir")
    parser.add_argument("--config")
    args, _ = parser.parse_known_args(shlex.split(env.get("TRAIN_ARGS", "")))
    folder = args.checkpoint_dir
    if folder is None and args.config:
        folder = _yaml_value(Path(args.config), "checkpoint_dir")
    return Path(folder or Path(env["RUN_DIR"]) / "checkpoints") / "REQUEUE"


def _yaml_value(path: Path, key: str) -> str | None:
    try:
        import yaml

        values = yaml.safe_load(path.read_text()) or {}
    except (ImportError, OSError, ValueError):
        return None  # the training script reports a config it cannot read
    value = values.get(key) if isinstance(values, dict) else None
    return str(value) if value else None


def read_note(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# ---- Slurm ---------------------------------------------------------------------------------
def slurm_fields(text: str) -> dict[str, str]:
    """`scontrol show job` or `show partition` output: Key=Value words, one record."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][\w/:.]*)=(\S*)", text))


def slurm_config(text: str) -> dict[str, str]:
    """`scontrol show config`: one `Key = Value` a line."""
    return dict(re.findall(r"^(\S+)\s+=\s+(.*?)\s*$", text, re.M))


def slurm_version(text: str) -> tuple[int, int]:
    """`scontrol --version`: 'slurm 22.05.8' -> (22, 5)."""
    m = re.search(r"(\d+)\.(\d+)", text)
    if not m:
        raise JobError(f"scontrol --version printed {text.strip()!r}: no version")
    return int(m[1]), int(m[2])


def requeues(mode: str) -> bool:
    """Whether a preempt mode as Slurm prints it ('REQUEUE', 'GANG,REQUEUE', 'WITHIN,REQUEUE',
    'PRIORITY,REQUEUE'; sacctmgr in lower case) requeues a preempted job."""
    return "REQUEUE" in mode.upper().split(",")


def preempt_mode(config: dict, partition: dict, qos_mode: str) -> tuple[str, str]:
    """The job's preempt mode as Slurm resolves it, and whose it is (slurm_job_preempt_mode and
    the preempt plugins, 22.05 to 25.05): under PreemptType=preempt/qos the QOS's unless it has
    none (sacctmgr prints 'cluster'), then the cluster's PreemptMode; under
    preempt/partition_prio the partition's, which `scontrol show partition` prints with the
    cluster's in its place where the partition sets none. Otherwise nothing is preempted."""
    kind = config.get("PreemptType", "")
    if kind == "preempt/qos":
        if qos_mode and qos_mode.lower() not in ("cluster", "off"):
            return qos_mode.upper(), "the QOS's"
        return config.get("PreemptMode", "OFF"), "the cluster's"
    if kind == "preempt/partition_prio":
        return partition.get("PreemptMode", "OFF"), "the partition's"
    return "OFF", f"PreemptType={kind or 'none'}"


def slurm_decision(
    note: str, job: dict, mode: tuple[str, str], version: tuple, env: dict
) -> tuple[str, str]:
    """('requeue' | 'slurm' | 'end' | 'capped', why): from the note, the job's `scontrol show
    job` fields, its preempt mode and whose it is (preempt_mode) and Slurm's version."""
    restarts, most = int(env.get("SLURM_RESTART_COUNT") or 0), int(env.get("MAX_RESTARTS", 5))
    if note.startswith(("SIGUSR1 at ", "time limit at ")):
        why = "the time limit"
    elif note.startswith("SIGTERM at "):
        if job.get("PreemptTime", "None") in ("None", "Unknown", ""):
            return "end", "SIGTERM, but not a preemption: not requeued"
        said = f"preempted, preempt mode {mode[0]} ({mode[1]})"
        if not requeues(mode[0]):
            return "end", f"{said}: not requeued"
        if version >= (24, 5):
            # proc_req.c, _slurm_rpc_complete_batch_script: GRACE_PREEMPT, from 24.05.0
            return "slurm", f"{said}: Slurm {version[0]}.{version[1]:02d} requeues it"
        why = said
    else:
        return "end", ""
    if restarts >= most:
        return "capped", f"restarted {restarts} times already (MAX_RESTARTS={most})"
    return "requeue", why


def slurm_end(env: dict, note: str, status: int) -> int:
    job_id = env["SLURM_JOB_ID"]
    job = slurm_fields(_run(["scontrol", "show", "job", job_id], env))
    mode = ("", "")
    if note.startswith("SIGTERM at "):
        config = slurm_config(_run(["scontrol", "show", "config"], env))
        partition = {}
        if config.get("PreemptType") == "preempt/partition_prio":
            # -a: a hidden partition is shown too
            name = job.get("Partition", "").split(",")[0]
            partition = slurm_fields(_run(["scontrol", "-a", "show", "partition", name], env))
        qos_mode = ""
        if config.get("PreemptType") == "preempt/qos" and job.get("QOS"):
            qos = ["sacctmgr", "-nP", "show", "qos", job["QOS"], "format=preemptmode"]
            qos_mode = _run(qos, env).strip()
        mode = preempt_mode(config, partition, qos_mode)
    version = slurm_version(_run(["scontrol", "--version"], env))
    action, why = slurm_decision(note, job, mode, version, env)
    if action == "requeue":
        print(f"requeueing job {job_id} (exit code {status}; {note}): {why}", flush=True)
        _run(["scontrol", "requeue", job_id], env)
        return 0
    if action == "capped":
        print(f"not requeueing job {job_id}: {why}", flush=True)
        return 1
    if why:
        print(f"job {job_id} ({note}): {why}", flush=True)
    return 0 if action == "slurm" else -1


# ---- PBS -----------------------------------------------------------------------------------
def qstat_fields(text: str) -> dict[str, str]:
    """`qstat -f`: `    name = value` a line, a long value continued after a newline and a tab
    (OpenPBS src/cmds/qstat.c, prt_attr)."""
    joined = text.replace("\n\t", "")
    return dict(re.findall(r"^ {4}(\S+) = (.*)$", joined, re.M))


def walltime_s(value: str) -> int:
    """PBS walltime '[[HH:]MM:]SS' in seconds."""
    if not re.fullmatch(r"\d+(:\d+){0,2}", value):
        raise JobError(f"walltime {value!r} is not [[HH:]MM:]SS")
    seconds = 0
    for part in value.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def pbs_deadline_s(job: dict, env: dict) -> int:
    """The seconds a run has before it stops and saves: walltime less SAVE_MARGIN_S."""
    if "Resource_List.walltime" not in job:
        raise JobError(f"qstat -f {env['PBS_JOBID']} shows no Resource_List.walltime")
    walltime, margin = walltime_s(job["Resource_List.walltime"]), int(env.get("SAVE_MARGIN_S", 300))
    if walltime <= margin:
        raise JobError(
            f"walltime {walltime} s leaves no time before SAVE_MARGIN_S={margin} s: "
            "ask for more walltime, or a smaller SAVE_MARGIN_S"
        )
    return walltime - margin


# what a job file hands on to the next job: set anew, whatever this job's -v said
HANDED_ON = ("RUN_DIR", "RESTART_COUNT")
# qsub's options without a value (OpenPBS src/cmds/qsub.c, its getopt string)
QSUB_FLAGS = set("fhIVXz")


def submitted_options(arguments: str) -> tuple[list[tuple[str, str | None]], list[str]]:
    """qsub's options and its script (or `-- command`) from `qstat -f`'s Submit_arguments, which
    joins qsub's arguments with spaces, unquoted (qstat.c, decode_xml_arg_list_str): a value's
    words run up to the next option, and the last word is the script."""
    words = arguments.split()
    if "--" in words:
        words, command = words[: words.index("--")], words[words.index("--") :]
    else:
        words, command = words[:-1], words[-1:]
    options: list[tuple[str, str | None]] = []
    for word in words:
        option = re.fullmatch(r"-([A-Za-z])(.*)", word)
        if option:
            letter, rest = option[1], option[2]
            options.append((letter, None if letter in QSUB_FLAGS else rest))
        elif options and options[-1][1] is not None:
            letter, value = options[-1]
            options[-1] = (letter, f"{value} {word}" if value else word)
        else:
            raise JobError(f"Submit_arguments {arguments!r}: {word!r} is no qsub option")
    return options, command


def resubmission(job: dict, env: dict) -> list[str]:
    """qsub's arguments for the next job: this job's own submission (its Submit_arguments: the
    options and the file as given to qsub; qsub reads the file's #PBS lines again), after this
    one (-W depend=afterany), with RUN_DIR and the restart count added to its -v."""
    job_id = env["PBS_JOBID"]
    if re.match(r"\d+\[\d+\]", job_id):
        raise JobError(
            f'{job_id} is an array subjob, which qsub cannot make a job depend on ("cannot have '
            'dependancy on subjob or range"): not resubmitted. Submit the next part yourself '
            "once the array has ended"
        )
    if "Submit_arguments" not in job:
        raise JobError(f"qstat -f {job_id} shows no Submit_arguments: not resubmitted")
    options, command = submitted_options(job["Submit_arguments"])
    # qsub takes the last -v alone (qsub.c: `case 'v'` replaces v_value)
    given = [value for letter, value in options if letter == "v"][-1:]
    variables = [v for v in ",".join(given).split(",") if v and v.split("=")[0] not in HANDED_ON]
    restarts = int(env.get("RESTART_COUNT") or 0) + 1
    variables += [f"RUN_DIR={env['RUN_DIR']}", f"RESTART_COUNT={restarts}"]
    args = []
    for letter, value in options:
        if letter == "W":
            value = ",".join(w for w in (value or "").split(",") if not w.startswith("depend="))
        if letter == "v" or (letter == "W" and not value):
            continue
        args += [f"-{letter}"] + ([] if value is None else [value])
    return [*args, "-v", ",".join(variables), "-W", f"depend=afterany:{job_id}", *command]


def pbs_end(env: dict, note: str, status: int) -> int:
    if not note.startswith("time limit at "):
        return -1
    job_id = env["PBS_JOBID"]
    restarts, most = int(env.get("RESTART_COUNT") or 0), int(env.get("MAX_RESTARTS", 5))
    if restarts >= most:
        print(f"not resubmitting: restarted {restarts} times already (MAX_RESTARTS={most})")
        return 1
    job = qstat_fields(_run(["qstat", "-f", job_id], env))
    args = resubmission(job, env)
    print(f"resubmitting after job {job_id} (exit code {status}; {note}): qsub {shlex.join(args)}")
    done = subprocess.run(["qsub", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        said = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise JobError(
            f"qsub refused the next job ({said}). The checkpoint is saved: once this job has "
            f"ended, submit it yourself with RESTART_COUNT={restarts + 1}: qsub {shlex.join(args)}"
        )
    print(f"next job: {done.stdout.strip()}", flush=True)
    return 0


# ---- both ----------------------------------------------------------------------------------
def _run(command: list[str], env: dict) -> str:
    """A scheduler command's output, its times in one format whatever the user's
    SLURM_TIME_FORMAT."""
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**env, "SLURM_TIME_FORMAT": "standard"},
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JobError(f"{shlex.join(command)}: {exc}") from None
    if done.returncode != 0:
        said = " ".join(done.stderr.split())
        raise JobError(f"{shlex.join(command)} failed (exit {done.returncode}): {said}")
    return done.stdout


def start(env: dict) -> dict[str, str | int]:
    """The settings a job file needs at its start (see the top of this file)."""
    note_path(env).unlink(missing_ok=True)  # an earlier run's note must not requeue this run's end
    settings: dict[str, str | int] = {}
    if env.get("SLURM_JOB_ID"):
        first = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        # NodeAddr: the address Slurm itself reaches the node at (usually its name)
        try:
            address = slurm_fields(_run(["scontrol", "show", "node", first], env))["NodeAddr"]
        except (JobError, KeyError):
            address = first
        settings["rdzv_host"] = env.get("MASTER_ADDR") or address
        settings["rdzv_port"] = master_port(env, "slurm")
    else:
        job = qstat_fields(_run(["qstat", "-f", env["PBS_JOBID"]], env))
        first = Path(env["PBS_NODEFILE"]).read_text().split()[0]
        settings["rdzv_host"] = env.get("MASTER_ADDR") or first
        settings["rdzv_port"] = master_port(env, "pbs")
        if "DEADLINE_ARGS" not in env:  # set (even empty): the job file needs no deadline
            settings["time_limit_s"] = pbs_deadline_s(job, env)
    return settings


def end(env: dict, status: int, signalled: bool) -> int:
    note = read_note(note_path(env))
    if signalled or not note:  # no note: the run finished, or failed
        return status
    decided = (slurm_end if env.get("SLURM_JOB_ID") else pbs_end)(env, note, status)
    return status if decided < 0 else decided


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    try:
        if argv[:1] == ["start"] and len(argv) == 1:
            for name, value in start(env).items():
                print(f"{name}={shlex.quote(str(value))}")
            return 0
        if argv[:1] == ["end"] and len(argv) == 3:
            return end(env, int(argv[1]), argv[2] == "1")
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("error: usage: scheduler.py start | end STATUS SIGNALLED", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
