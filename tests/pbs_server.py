"""A stand-in for an OpenPBS server, as `qsub` and `qstat -f` on PATH: no PBS server can be
installed here. Each job is a JSON file in the server's folder. What it does is read from OpenPBS's
source (github.com/openpbs/openpbs, cd7ab5ed, 2026-04-10):

- qsub (src/cmds/qsub.c): the command line's options, then the script's `#PBS` lines up to its
  first command. An option on the command line wins over the script's (`if_cmd_line`), so a
  command-line -v replaces the script's whole -v, and the last -v wins; -l merges per resource,
  the command line's value first (src/lib/Libcmds/set_resource.c). Submit_arguments holds the
  command-line arguments (encode_xml_arg_list). -r y/n sets Rerunable (default True).
- a dependency on an array subjob is refused as parse_depend.c refuses it, exit code 2;
- a queue's max_queued per user refuses a further job of that user while one is queued or running
  (src/server/svr_func.c, the generic user's message; qsub exits with pbs_errno 15142 & 255 = 38);
- qstat -f (src/cmds/qstat.c, prt_attr): "Job Id: <id>", then four spaces, "name = value", a line
  past 78 columns continued after a newline and a tab; Submit_arguments decoded and joined with
  spaces (decode_xml_arg_list_str), walltime as HH:MM:SS (encode_time).

Used by tests/test_jobs.py and tests/test_sites.py: PbsServer(folder).bin on PATH, then
run(job_id) gives the environment PBS starts the job's script with.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

SERVER = "pbs01"
QSUB_FLAGS = set("fhIVXz")  # qsub's options without a value (its getopt string)


class PbsServer:
    def __init__(self, folder: Path, first_id: int = 4400, limits: dict | None = None):
        """`limits`: {queue: max jobs queued or running per user}."""
        self.folder = Path(folder)
        self.bin = self.folder / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        (self.folder / "next_id").write_text(str(first_id))
        (self.folder / "limits.json").write_text(json.dumps(limits or {}))
        for command in ("qsub", "qstat"):
            path = self.bin / command
            path.write_text(
                f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" '
                f'"{self.folder}" {command} "$@"\n'
            )
            path.chmod(0o755)

    def job(self, job_id: str) -> dict:
        return json.loads((self.folder / f"{job_id}.json").read_text())

    def jobs(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json") if p.stem != "limits")

    def start(self, job_id: str, **extra: str) -> dict[str, str]:
        """Mark the job running; the environment its script starts with: the variables qsub
        passed (-v, -V), PBS's own, and `extra` (PBS_NODEFILE, PATH)."""
        job = self.job(job_id)
        job["state"] = "R"
        _save(self.folder, job_id, job)
        env = dict(job["variables"])
        env.update(PBS_JOBID=job_id, PBS_ENVIRONMENT="PBS_BATCH", **extra)
        return env

    def end(self, job_id: str) -> None:
        job = self.job(job_id)
        job["state"] = "F"
        _save(self.folder, job_id, job)

    def subjob(self, array_id: str, index: int) -> str:
        """Subjob `index` of an array (create_subjob, src/server/array_func.c): the array's
        attributes but Submit_arguments, which attrs_to_copy leaves out."""
        array = self.job(array_id)
        job_id = array_id.replace("[]", f"[{index}]")
        attributes = {k: v for k, v in array["attributes"].items() if k != "Submit_arguments"}
        attributes.update(array_id=array_id, array_index=str(index))
        _save(self.folder, job_id, {**array, "attributes": attributes})
        return job_id

    def preempt(self, job_id: str) -> bool:
        """A preemption by requeue (the scheduler's preempt_order R): the server reruns a
        rerunnable job under the same id (req_rerun.c, req_rerunjob2: PBSE_NORERUN where
        Rerunable is False, and the next method of the order, such as delete, follows)."""
        job = self.job(job_id)
        rerun = job["attributes"]["Rerunable"] == "True"
        job["state"] = "Q" if rerun else "F"
        _save(self.folder, job_id, job)
        return rerun


def _save(folder: Path, job_id: str, job: dict) -> None:
    (folder / f"{job_id}.json").write_text(json.dumps(job, indent=1))


def _options(words: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    options, rest = [], list(words)
    while rest and re.fullmatch(r"-[A-Za-z].*", rest[0]):
        word = rest.pop(0)
        letter, value = word[1], word[2:]
        if letter in QSUB_FLAGS:
            options.append((letter, None))
        else:
            options.append((letter, value or (rest.pop(0) if rest else "")))
    return options, rest


def _directives(script: Path) -> list[tuple[str, str | None]]:
    """The script's #PBS lines, up to its first command (qsub.c, do_dir)."""
    words = []
    for line in script.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#PBS"):
            words += stripped[4:].split(None, 1)
        elif stripped and not stripped.startswith("#"):
            break
    return _options(words)[0]


def _resources(values: list[str], into: dict[str, str], override: bool) -> None:
    for value in values:
        for item in value.split(","):
            name, _, setting = item.partition("=")
            if override or name not in into:
                into[name] = setting


def qsub(folder: Path, argv: list[str]) -> int:
    given, rest = _options(argv)
    if not rest:
        print("usage: qsub [options] script", file=sys.stderr)
        return 2
    script = Path(rest[0])
    if not script.is_file():
        print(f"qsub: script file:: No such file or directory {rest[0]}", file=sys.stderr)
        return 2
    from_file = _directives(script)
    on_line = {letter for letter, _ in given}
    options = given + [(letter, v) for letter, v in from_file if letter not in on_line]
    resources: dict[str, str] = {}
    _resources([v for letter, v in given if letter == "l"], resources, override=True)
    _resources([v for letter, v in from_file if letter == "l"], resources, override=False)
    last = {letter: value for letter, value in options}  # the last of each option counts
    for value in [v for letter, v in options if letter == "W"]:
        for item in value.split(","):
            if item.startswith("depend=") and re.search(r"\[\d+\]", item):
                print("cannot have dependancy on subjob or range", file=sys.stderr)
                print("qsub: illegal -W value", file=sys.stderr)
                return 2
    queue = last.get("q") or "workq"
    limits = json.loads((folder / "limits.json").read_text())
    user = os.environ.get("USER", "root")
    if queue in limits:
        busy = [
            j
            for j in (json.loads(p.read_text()) for p in folder.glob("*.*.json"))
            if j["attributes"]["queue"] == queue and j["user"] == user and j["state"] in "QR"
        ]
        if len(busy) >= limits[queue]:
            print("qsub: would exceed queue generic's per-user limit", file=sys.stderr)
            return 38
    variables = {}
    if "V" in last:
        variables.update(os.environ)
    for item in filter(None, (last.get("v") or "").split(",")):
        name, _, value = item.partition("=")
        variables[name] = value if _ else os.environ.get(name, "")
    variables.update(PBS_O_WORKDIR=os.getcwd(), PBS_O_QUEUE=queue, PBS_O_HOME="/root")
    attributes = {
        "Job_Name": last.get("N") or script.name,
        "queue": queue,
        "Rerunable": "False" if last.get("r") == "n" else "True",
        "Priority": last.get("p") or "0",
    }
    if "A" in last:
        attributes["Account_Name"] = last["A"]
    for name, setting in sorted(resources.items()):
        if name == "walltime":
            setting = _hms(setting)
        attributes[f"Resource_List.{name}"] = setting
    attributes["Submit_arguments"] = " ".join(argv)
    attributes["Variable_List"] = ",".join(f"{k}={v}" for k, v in variables.items())
    if "W" in last:
        attributes["depend"] = last["W"]
    number = int((folder / "next_id").read_text())
    (folder / "next_id").write_text(str(number + 1))
    job_id = f"{number}[].{SERVER}" if "J" in last else f"{number}.{SERVER}"
    job = dict(attributes=attributes, variables=variables, user=user, state="Q")
    _save(folder, job_id, job)
    print(job_id)
    return 0


def _hms(value: str) -> str:
    seconds = 0
    for part in value.split(":"):
        seconds = seconds * 60 + int(float(part))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def qstat(folder: Path, argv: list[str]) -> int:
    if argv[:1] != ["-f"] or len(argv) != 2:
        print("usage: qstat -f job_id (this stand-in)", file=sys.stderr)
        return 2
    path = folder / f"{argv[1]}.json"
    if not path.exists():
        print(f"qstat: Unknown Job Id {argv[1]}", file=sys.stderr)
        return 153
    attributes = json.loads(path.read_text())["attributes"]
    print(f"Job Id: {argv[1]}")
    for name, value in attributes.items():
        line = f"    {name} = {value}"
        print("\n\t".join([line[:78], *(line[i : i + 77] for i in range(78, len(line), 77))]))
    return 0


if __name__ == "__main__":
    folder, command, *args = sys.argv[1:]
    sys.exit({"qsub": qsub, "qstat": qstat}[command](Path(folder), args))
