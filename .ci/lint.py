"""Structural rules for the files a user runs or copies, moved here from the test suite: the
Python files of the numbered lessons and their side scripts (0*/), common/, benchmark/,
debugging/, porting/, jobs/, and the Slurm and PBS job files in jobs/.
Each rule protects someone who copies one of them:

  private-torch-api      no torch._x, dist._x, model._x: a private API changes without notice
  common-communicates    no collective in common/, even through another helper: a reader calls a
                         helper like plain code, under `if rank == 0:`, and the job hangs
  common-import-cycle    common/'s modules import each other without a cycle, even through an
                         import inside a function: a copy of common/ is a package a user's code
                         imports, and a cycle breaks the import order of whoever imports it first
  destroy-process-group  a script that starts a process group ends it, right after `del model`:
                         the DDP model holds the group, and gloo's threads otherwise end at
                         interpreter shutdown ("terminate called without an active exception")
  os-exit                no os._exit: it skips atexit handlers and unflushed output
  record-main            @record on main(): else torchrun shows no exception for a failing rank
  set-device-first       torch.cuda.set_device(device) right before the group (unless gloo
                         only): else every rank's collectives use, and fill, GPU 0
  barrier-device-ids     barrier(device_ids=...): else nccl's first barrier ignores set_device and
                         guesses global rank mod the GPUs (torch up to 2.14.1): a wrong GPU, or two
                         ranks on one, where that is not the local rank
                         (and no init_process_group(device_id=...): 01's README says why)
  backend-only-api       a gloo- or nccl-only API under an `if` naming its backend: else it fails
                         as soon as the other backend runs the script
  forked-loader-workers  DataLoader workers in a file that starts a process group, or in common/
                         (the lessons' loaders), started with worker_start_method(...) or another
                         explicit context but "fork": fork() from a rank running gloo's threads can
                         hang a worker
  test-hooks             no DDP_TEST_/DDP_EXAMPLES_ hook: a copy carries no test machinery
  training-catches       no `try` in a lesson's train.py: a failing rank shows torch's report
  gpu-from-launch        torch.device("cuda", launch.gpu), not the local rank: where a site
                         shows each rank only its own GPU, that GPU is cuda:0
  slurm-job-settings     a .sbatch file: the time-limit signal (--signal=USR1@N, N >= 300 s) goes
                         to the ranks early enough to save, and torchrun's shutdown timeout gives
                         its workers that time (at most N - 60 s); --requeue with
                         --open-mode=append, so a requeued run adds to the log; srun with
                         --kill-on-bad-exit=1 (one failed rank ends the step, not the time limit)
                         and --cpus-per-task passed on (Slurm 22.05-23.02 does not)
  job-file-header        a job file (.sh, .sbatch, .pbs in jobs/): `set -euo pipefail`, a header
                         that says what to edit (`# Edit`), directives written exactly (`#SBATCH
                         --opt`, `#PBS -x`: sbatch and qsub ignore `# SBATCH`) and before the first
                         command (they stop reading there), and every SCRIPT and `-m common.x` it
                         names exists
  ci-runs-the-readme     .ci/run runs the README's test command as written, with every tier
                         selected by PYTEST_ADDOPTS right before it and unset right after it (pytest
                         reads it after pytest.ini), then the minimum-torch tier, and ends with the
                         README's style check: CI tests what a user runs
  scheduler-in-one-place a .sbatch or .pbs file runs no scheduler command (scontrol, sacctmgr,
                         qstat, qsub, qrerun...): jobs/scheduler.py reads the scheduler's answers
                         (deadline, preempt mode, version, how the job was submitted) and acts,
                         tested once for all four files; bash copies of it drifted

A line where a rule does not apply says so and why in a comment: `# lint: allow[rule-name] why`.

Usage: python .ci/lint.py [PATH ...]   files or folders; without any, the folders above
       python .ci/lint.py --self-test  each rule on a planted mistake and on its corrected twin
A finding is one line, `path:line: rule-name: message`. Exit status 1 if anything is found (or
the self-test fails), 0 if clean, 2 for bad usage. A plain run does the self-test quietly first,
so that CI's one call shows that every rule can fail, then checks the repository.
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
# tests/paths.py's CODE_DIRS (common/, the numbered lessons, benchmark/, debugging/) and porting/
DEFAULT_PATTERNS = (
    "0*/*.py",
    "common/*.py",
    "benchmark/*.py",
    "debugging/*.py",
    "porting/*.py",
    "jobs/*.py",
    "jobs/*.sh",
    "jobs/*.sbatch",
    "jobs/*.pbs",
    ".ci/run",
)
JOB_FILES = (".sh", ".sbatch", ".pbs")  # read as text: the Python rules see none of them
CI_SCRIPT = ".ci/run"  # read as text too
README_TEST_COMMAND = "pip install -r requirements.txt -r requirements-test.txt && python -m pytest"
README_STYLE_CHECK = "ruff format --check . && ruff check . && python .ci/lint.py"


class File(NamedTuple):
    path: Path
    name: str  # as printed
    text: str
    nodes: list[ast.AST]  # ast.walk of its module, the module first
    starts: list[ast.Call]  # its init_process_group calls (doctor.py only names it: none)


def code_lines(f: File) -> list[str]:
    """Its lines without their comments: a comment may name what the code must not use."""
    return [line.split("#")[0] for line in f.text.splitlines()]


def callee(node: ast.AST) -> str:
    """The name a call calls: `barrier` for dist.barrier(...) and for barrier(...)."""
    func = getattr(node, "func", None)
    return getattr(func, "attr", None) or getattr(func, "id", None) or ""


PRIVATE_API = re.compile(r"(torch|dist|distributed_c10d|c10d|model|ddp)\._[a-z][a-z_]*")


def private_torch_api(files):
    for f in files:
        for number, code in enumerate(code_lines(f), 1):
            if match := PRIVATE_API.search(code):
                yield f, number, f"{match[0]} is private torch API; use a public one"


# The doctor's list (it imports nothing outside the standard library), and point-to-point calls:
# the doctor leaves those out, as rank branches are where they belong, but they communicate.
sys.path.insert(0, str(REPO / "debugging"))
from doctor import COLLECTIVES as DOCTORS_COLLECTIVES  # noqa: E402

COLLECTIVES = DOCTORS_COLLECTIVES | {"send", "recv", "isend", "irecv"}


def _communicates(function: ast.FunctionDef, known: set[str]) -> bool:
    for call in (n for statement in function.body for n in ast.walk(statement)):
        func = getattr(call, "func", None)
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        name = callee(call)
        if name in known or (name in COLLECTIVES and owner in ("dist", "torch.distributed")):
            return True
    return False


def common_communicates(files):
    common = [f for f in files if f.path.parent.name == "common"]
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions = [(f, n) for f in common for n in f.nodes if isinstance(n, kinds)]
    # a function whose docstring says "Collective: ..." communicates; so does one that calls a
    # collective or another such function of common/ (followed to a fixed point)
    names = {n.name for _, n in functions if (ast.get_docstring(n) or "").startswith("Collective")}
    while more := {n.name for _, n in functions if _communicates(n, names)} - names:
        names |= more
    for f, n in functions:
        if n.name in names:
            yield f, n.lineno, f"{n.name}() communicates; call collectives in the script"


def _common_imports(f: File, names: set[str]) -> list[tuple[str, int]]:
    """(module of common/, line) for each import of one, at the top or inside a function:
    `from common.x import ...`, `import common.x`, `from common import x`, relative."""
    found = []
    for node in f.nodes:
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = "." * node.level + (node.module or "")
            modules = [package] + [f"{package}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in (m for m in modules if m.startswith(("common.", "."))):
            found += [
                (part, node.lineno) for part in module.lstrip(".").split(".") if part in names
            ]
    return found


def common_import_cycle(files):
    common = {f.path.stem: f for f in files if f.path.parent.name == "common"}
    imports = {name: _common_imports(f, set(common) - {name}) for name, f in common.items()}
    done, path = set(), []

    def visit(module):  # depth first; the modules along a cycle, or [] where none is reached
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted({name for name, _ in imports[module]}):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(common):
        if cycle := visit(module):
            line = next(n for name, n in imports[cycle[0]] if name == cycle[1])
            yield common[cycle[0]], line, f"an import cycle: {' -> '.join(cycle)}"
            return


def _released(before: list[ast.stmt]) -> bool:
    """`before` ends with a `del` of `model` (`del model, ema` too), then at most
    torch.compiler.reset(): debugging/compile_ddp.py's compiler caches hold the model as well."""
    if before and ast.unparse(before[-1]) == "torch.compiler.reset()":
        before = before[:-1]
    last = before[-1] if before else None
    return isinstance(last, ast.Delete) and "model" in [ast.unparse(t) for t in last.targets]


def destroy_process_group(files):
    for f in (f for f in files if f.starts):
        # a function that holds no DDP `model` needs no del: 04's train() (fit() returns without
        # it), 02's gather_predictions.py (a plain module: nothing is trained)
        wraps = [
            n.lineno
            for n in f.nodes
            if callee(getattr(n, "value", None)) in ("DDP", "DistributedDataParallel")
            and "model" in [ast.unparse(t) for t in getattr(n, "targets", [])]
        ]
        holders = [n for n in f.nodes if isinstance(n, ast.FunctionDef)]
        holders = [h for h in holders if any(h.lineno <= w <= h.end_lineno for w in wraps)]
        destroys = 0
        for node in f.nodes:
            for block in (getattr(node, k, None) for k in ("body", "orelse", "finalbody")):
                for index, statement in enumerate(block if isinstance(block, list) else []):
                    if callee(getattr(statement, "value", None)) != "destroy_process_group":
                        continue
                    destroys += 1
                    held = any(h.lineno <= statement.lineno <= h.end_lineno for h in holders)
                    if held and not _released(block[:index]):
                        yield (
                            f,
                            statement.lineno,
                            "`del model` right before destroy_process_group()",
                        )
        if not destroys:
            yield f, f.starts[0].lineno, "starts a process group, never destroys it"


def os_exit(files):
    for f in files:
        for number, code in enumerate(code_lines(f), 1):
            if re.search(r"\bos\._exit\(", code):
                yield f, number, "os._exit skips atexit handlers and unflushed output"


RECORD = "from torch.distributed.elastic.multiprocessing.errors import record"


def record_main(files):
    for f in (f for f in files if f.starts):
        main = [n for n in f.nodes[0].body if getattr(n, "name", "") == "main"]
        if not main or "record" not in [ast.unparse(d) for d in main[0].decorator_list]:
            yield f, (main or f.starts)[0].lineno, "starts a process group: main() needs @record"
        if RECORD not in f.text:
            yield f, 1, f"starts a process group: `{RECORD}`"


def set_device_first(files):
    for f in files:
        lines = code_lines(f)
        for start in f.starts:
            backend = next((k.value for k in start.keywords if k.arg == "backend"), None)
            backend = start.args[0] if start.args else backend
            # gloo-only scripts, and torch's fake group (benchmark/scale.py), use no GPU
            if isinstance(backend, ast.Constant) and backend.value in ("gloo", "fake"):
                continue
            before = lines[max(0, start.lineno - 4) : start.lineno - 1]
            if not any("torch.cuda.set_device(device)" in line for line in before):
                yield f, start.lineno, "torch.cuda.set_device(device) within the 3 lines before"


def barrier_device_ids(files):
    for f in files:
        for call in (n for n in f.nodes if callee(n) == "barrier"):
            # comm_check's barrier(device, group) helper passes device_ids itself
            first = ast.unparse(call.args[0]) if call.args else ""
            helper = isinstance(call.func, ast.Name) and first == "device"
            if not helper and "device_ids" not in [k.arg for k in call.keywords]:
                yield f, call.lineno, "pass device_ids (None on gloo) to barrier()"
        # 01's README, "Why device_ids and not device_id": the lessons bind no device
        for start in f.starts:
            if "device_id" in [k.arg for k in start.keywords]:
                yield (
                    f,
                    start.lineno,
                    "device_ids on each barrier, not init_process_group(device_id=)",
                )


# From torch 2.14's source (distributed_c10d.py, ProcessGroupNCCL.cpp). ReduceOp.AVG is documented
# as NCCL-only but gloo computes it, and batch_isend_irecv works on both: neither is listed.
BACKEND_ONLY = {
    **dict.fromkeys(("monitored_barrier", "BAND", "BOR", "BXOR", "ProcessGroupGloo"), "gloo"),
    **dict.fromkeys(("ProcessGroupNCCL", "split_group", "PREMUL_SUM", "torch.cuda.nccl"), "nccl"),
}


def _polarity(test: ast.AST, backend: str) -> int:
    """+1 if `test` true means `backend`, -1 if `test` false does, 0 if it tells neither. It names
    a backend with a string "gloo", a name or an attribute (Backend.GLOO, is_nccl_available)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -_polarity(test.operand, backend)
    if isinstance(test, ast.BoolOp):  # `a and b` true: both are; `a or b` false: both are false
        wanted = 1 if isinstance(test.op, ast.And) else -1
        return wanted if wanted in [_polarity(v, backend) for v in test.values] else 0
    if not any(
        (isinstance(n, ast.Constant) and str(n.value).lower() == backend)
        or backend in (getattr(n, "id", None) or getattr(n, "attr", None) or "").lower()
        for n in ast.walk(test)
    ):
        return 0
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return -1 if isinstance(test.ops[0], (ast.NotEq, ast.NotIn, ast.IsNot)) else 1
    return 1  # e.g. dist.is_nccl_available()


def backend_only_api(files):
    def visit(node: ast.AST, guards: frozenset[str]):
        api = None
        if isinstance(node, ast.Attribute):  # torch.cuda.nccl.x: found at its torch.cuda.nccl
            nccl = node.attr == "nccl" and ast.unparse(node) == "torch.cuda.nccl"
            api = "torch.cuda.nccl" if nccl else node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            api = node.id  # from torch.distributed import monitored_barrier
        if api in BACKEND_ONLY:
            if BACKEND_ONLY[api] not in guards:  # one finding per use, not per sub-attribute
                yield node.lineno, f"{api} is {BACKEND_ONLY[api]} only: guard it with an `if`"
        elif isinstance(node, (ast.If, ast.IfExp)):
            yield from visit(node.test, guards)
            signs = {b: _polarity(node.test, b) for b in ("gloo", "nccl")}
            for branch, sign in ((node.body, 1), (node.orelse, -1)):
                more = guards | {b for b, s in signs.items() if s == sign}
                for child in branch if isinstance(branch, list) else [branch]:
                    yield from visit(child, more)
        elif not isinstance(node, (ast.Import, ast.ImportFrom)):  # importing is fine; using not
            for child in ast.iter_child_nodes(node):
                yield from visit(child, guards)

    for f in files:
        if re.search(r"\b(cuda\.nccl|" + "|".join(BACKEND_ONLY) + r")\b", f.text):  # quick look
            yield from ((f, line, message) for line, message in visit(f.nodes[0], frozenset()))


def forked_loader_workers(files):
    # porting/train_ddp.py picks forkserver itself (porting/ imports nothing from common/); a
    # script that starts no process group (porting/train_plain.py) has no gloo threads to copy
    for f in (f for f in files if f.starts or f.path.parent.name == "common"):
        for call in (n for n in f.nodes if callee(n) == "DataLoader"):
            keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
            context = keywords.get("multiprocessing_context", "")
            if "num_workers" in keywords and context in ("", "None", "'fork'", '"fork"'):
                yield f, call.lineno, "pass multiprocessing_context=worker_start_method(...)"


def gpu_from_launch(files):
    for f in files:
        for node in f.nodes:
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "torch.device"
                and len(node.args) == 2
                and isinstance(node.args[1], ast.Attribute)
                and node.args[1].attr == "local_rank"
            ):
                yield f, node.lineno, 'torch.device("cuda", ....local_rank): use launch.gpu'


def test_hooks(files):
    for f in files:
        for number, line in enumerate(f.text.splitlines(), 1):
            if "DDP_TEST_" in line or "DDP_EXAMPLES_" in line:
                yield f, number, "a test hook in an example a user copies"


def training_catches(files):
    # a lesson's train.py; its side scripts (05's checkpoint.py) may catch what they expect
    for f in (f for f in files if f.path.name == "train.py" and f.path.parent.name[:1] == "0"):
        for node in f.nodes:
            if isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                yield f, node.lineno, "a lesson's train.py catches no exception"


def _first_line(f: File, pattern: str) -> int:
    """The number of the first line that matches `pattern`, else 1."""
    lines = f.text.splitlines()
    return next((n for n, line in enumerate(lines, 1) if re.search(pattern, line)), 1)


def job_file_header(files):
    for f in (f for f in files if f.path.suffix in JOB_FILES):
        if "set -euo pipefail" not in f.text:
            yield f, 1, "set -euo pipefail"
        if not re.search(r"^# Edit", f.text, re.M):
            yield f, 1, "a header that says what to edit: `# Edit ...`"
        command = False  # the first command seen
        for number, line in enumerate(f.text.splitlines(), 1):
            if re.match(r"#\s+(SBATCH|PBS)\s+-", line):
                yield f, number, "`# SBATCH` / `# PBS` is a comment: write `#SBATCH` / `#PBS`"
            exact = {
                "#SBATCH": (r"#SBATCH --[a-z][a-z-]*(=\S+)?", "#SBATCH --option=value"),
                "#PBS": (r"#PBS -[A-Za-z] \S+", "#PBS -x value"),
            }
            for prefix, (form, example) in exact.items():
                if line.startswith(prefix) and not re.fullmatch(form, line):
                    yield f, number, f"write a directive as `{example}`"
                if line.startswith(prefix) and command:
                    yield f, number, "a directive after the first command is not read"
            command = command or bool(line.strip() and not line.startswith("#"))
        for script in re.findall(r"SCRIPT=\$\{SCRIPT:-([^}]+)\}", f.text):
            if not (REPO / script).is_file():
                yield f, _first_line(f, "SCRIPT="), f"no such script: {script}"
        for module in re.findall(r"-m (common\.\w+)", f.text):
            if not (REPO / (module.replace(".", "/") + ".py")).is_file():
                yield f, _first_line(f, module), f"no such module: {module}"


def slurm_job_settings(files):
    for f in (f for f in files if f.path.suffix == ".sbatch"):
        code = "\n".join(code_lines(f))
        signal = re.search(r"^#SBATCH --signal=USR1@(\d+)$", f.text, re.M)
        lead = int(signal[1]) if signal else 0
        if lead < 300:
            yield f, _first_line(f, "^#SBATCH"), "#SBATCH --signal=USR1@N, N >= 300: time to save"
        shutdown = re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)", code)
        if "torch.distributed.run" in code and (not shutdown or int(shutdown[1]) > lead - 60):
            yield (
                f,
                _first_line(f, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=|torch.distributed.run"),
                "torchrun's workers get TORCH_ELASTIC_SHUTDOWN_TIMEOUT, at most the signal's lead "
                "minus 60 s, to save in",
            )
        for option in ("--requeue", "--open-mode=append"):
            if not re.search(rf"^#SBATCH {option}$", f.text, re.M):
                yield f, _first_line(f, "^#SBATCH"), f"#SBATCH {option}: a preempted run requeues"
        for number, line in enumerate(code_lines(f), 1):
            if line.startswith("srun ") and not (
                "--kill-on-bad-exit=1" in line
                and '--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in line
            ):
                yield (
                    f,
                    number,
                    'srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"',
                )


def ci_runs_the_readme(files):
    for f in (f for f in files if f.path.as_posix().endswith(CI_SCRIPT)):
        readme = (f.path.parents[1] / "README.md").read_text()
        commands = [
            (number, " ".join(line.split()))
            for number, line in enumerate(f.text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        texts = [text for _, text in commands]
        for command in (README_TEST_COMMAND, README_STYLE_CHECK):
            if command not in readme:
                yield f, 1, f"the README no longer shows `{command}`"
        if README_TEST_COMMAND not in texts:
            yield f, 1, f"run the README's test command as written: `{README_TEST_COMMAND}`"
            continue
        at = texts.index(README_TEST_COMMAND)
        line = commands[at][0]
        if texts[at - 1] != "export PYTEST_ADDOPTS='-m \"\"'" or texts[at + 1 : at + 2] != [
            "unset PYTEST_ADDOPTS"
        ]:
            yield f, line, "PYTEST_ADDOPTS='-m \"\"' right before it, unset right after it"
        if not any(t.endswith("python -m pytest -m min_torch") for t in texts[at:]):
            yield f, line, "then the minimum-torch tier: `python -m pytest -m min_torch`"
        if texts[-1] != README_STYLE_CHECK:
            yield f, commands[-1][0], f"end with the README's style check: `{README_STYLE_CHECK}`"


def scheduler_in_one_place(files):
    for f in (f for f in files if f.path.suffix in (".sbatch", ".pbs")):
        for number, line in enumerate(code_lines(f), 1):
            if found := re.search(r"\b(scontrol|sacctmgr|squeue|sinfo|qstat|qsub|qrerun)\b", line):
                yield (
                    f,
                    number,
                    f"{found[1]} in a job file: jobs/scheduler.py reads and asks the scheduler",
                )


RULES = [
    *(private_torch_api, common_communicates, common_import_cycle, destroy_process_group),
    *(os_exit, record_main),
    *(set_device_first, barrier_device_ids, backend_only_api, forked_loader_workers),
    *(test_hooks, training_catches, gpu_from_launch),
]
JOB_RULES = [job_file_header, slurm_job_settings, ci_runs_the_readme, scheduler_in_one_place]


def rule_name(rule) -> str:
    return rule.__name__.replace("_", "-")


def lint(paths: list[Path], rules=RULES + JOB_RULES) -> list[str]:
    files, jobs, found = [], [], []
    for path in paths:
        name = str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)
        text = path.read_text()
        if path.suffix in JOB_FILES or path.as_posix().endswith(CI_SCRIPT):
            jobs.append(File(path, name, text, [], []))
            continue
        try:
            nodes = list(ast.walk(ast.parse(text, name)))
        except SyntaxError as error:
            found.append(f"{name}:{error.lineno}: syntax: {error.msg}")
            continue
        starts = [n for n in nodes if callee(n).endswith("init_process_group")]
        files.append(File(path, name, text, nodes, starts))
    for rule in rules:
        checked, name = jobs if rule in JOB_RULES else files, rule_name(rule)
        found += [
            f"{f.name}:{line}: {name}: {say}"
            for f, line, say in rule(checked)
            if not allowed(f, line, name)
        ]
    return found


def allowed(f: File, line: int, name: str) -> bool:
    """The flagged line says `# lint: allow[name] why`."""
    lines = f.text.splitlines()
    return 0 < line <= len(lines) and f"# lint: allow[{name}]" in lines[line - 1]


# Each rule's planted mistake and its corrected twin, in folders that mirror the repository's:
# `--- rule file`, then the file's lines; a line ending in `#-` is in the mistake only, one ending
# in `#+` in the twin only. A file without either shows an exemption: the rule passes it in both.
PLANTED = """
--- private-torch-api 01_a/a.py
store = dist.distributed_c10d._get_default_store()  #-
store = dist.TCPStore(host, port)  # not dist._get_default_store(): a comment may name it  #+
--- common-communicates common/a.py
def inner(t):
    dist.all_reduce(t)  #-
    t.sum()  #+
def outer(t):
    inner(t)
--- common-import-cycle common/a.py
from common.b import helper
--- common-import-cycle common/b.py
def helper():
    from common.a import other  #-
    return 1
--- job-file-header jobs/a.sh
#!/bin/bash
# Edit: NNODES.
#SBATCH --nodes=2
set -euo pipefail
# SBATCH --time=1:00:00  #-
#SBATCH --gpus-per-node 4  #-
SCRIPT=${SCRIPT:-01_basic_ddp/missing.py}  #-
SCRIPT=${SCRIPT:-01_basic_ddp/train.py}  #+
python -m torch.distributed.run "$SCRIPT"
#PBS -l walltime=01:00:00  #-
--- destroy-process-group 01_a/train.py
def main():
    dist.init_process_group("gloo")
    model = DDP(model)
    del model  #+
    dist.destroy_process_group()
def end(model):  # holds no DDP model: needs no del
    dist.destroy_process_group()
--- os-exit debugging/a.py
os._exit(0)  #-
sys.exit(0)  # not os._exit(0)  #+
--- os-exit debugging/b.py
os._exit(0)  # lint: allow[os-exit] a forked child: not its parent's atexit handlers
--- forked-loader-workers 03_a/a.py
dist.init_process_group("gloo")
d = DataLoader(s, num_workers=n, multiprocessing_context="fork")  #-
d = DataLoader(s, num_workers=n, multiprocessing_context=context)  #+
--- record-main benchmark/a.py
from torch.distributed.elastic.multiprocessing.errors import record
@record  #+
def main():
    dist.init_process_group("gloo")
--- record-main debugging/doctor.py
NAME = "init_process_group"
--- set-device-first 01_a/a.py
torch.cuda.set_device(device)  #+
# a comment between
dist.init_process_group(backend)
dist.init_process_group("gloo")  # gloo only: no GPU
--- barrier-device-ids 06_a/a.py
dist.barrier()  #-
dist.barrier(device_ids=None)  #+
barrier(device, group)
--- barrier-device-ids 01_a/a.py
dist.init_process_group(backend, device_id=device)  #-
dist.init_process_group(backend)  #+
--- backend-only-api 02_a/a.py
from torch.distributed import monitored_barrier
if backend == "gloo" or fast:  #-
if backend == "gloo":  #+
    monitored_barrier()
--- forked-loader-workers common/a.py
d = DataLoader(s, num_workers=n)  #-
d = DataLoader(s, num_workers=n, multiprocessing_context=worker_start_method(n))  #+
--- forked-loader-workers porting/a.py
d = DataLoader(s, num_workers=n)
--- gpu-from-launch 03_a/a.py
device = torch.device("cuda", launch.local_rank)  #-
device = torch.device("cuda", launch.gpu)  #+
--- test-hooks 07_a/a.py
os.environ.get("DDP_TEST_FAIL")  #-
os.environ.get("RANK")  #+
--- training-catches 08_a/train.py
try:  #-
    main()  #-
except Exception:  #-
    pass  #-
main()  #+
--- training-catches 08_a/side.py
try:
    main()
except Exception:
    pass
--- slurm-job-settings jobs/a.sbatch
#SBATCH --signal=USR1@120  #-
#SBATCH --signal=USR1@300  #+
#SBATCH --open-mode=append
#SBATCH --requeue
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
srun --kill-on-bad-exit=1 \  #-
srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \  #+
    python -m torch.distributed.run train.py
--- ci-runs-the-readme README.md
pip install -r requirements.txt -r requirements-test.txt && python -m pytest
ruff format --check . && ruff check . && python .ci/lint.py
--- ci-runs-the-readme .ci/run
set -euo pipefail
export PYTEST_ADDOPTS='-m ""'
pip install -r requirements.txt -r requirements-test.txt && python -m pytest
unset PYTEST_ADDOPTS  #+
PATH="$venv/bin:$PATH" python -m pytest -m min_torch
ruff format --check . && ruff check . && python .ci/lint.py
--- scheduler-in-one-place jobs/a.sbatch
# scontrol show job tells the preempt time (a comment)
[[ $(scontrol show job "$SLURM_JOB_ID") =~ PreemptTime=[0-9] ]] && requeue=1  #-
exec "$PYTHON" jobs/scheduler.py end "$status" "$signalled"  #+
"""


def self_test() -> list[str]:
    """What went wrong: a rule that misses its planted mistake or flags its corrected twin."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in PLANTED.split("\n--- ")[1:]:
            header, *lines = part.splitlines()
            rule, name = header.split()
            for twin, other in (("-", "+"), ("+", "-")):
                kept = [line for line in lines if not line.endswith(f"  #{other}")]
                path = Path(tmp, rule, twin, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("\n".join(line.removesuffix(f"  #{twin}") for line in kept))
        for rule, name in ((rule, rule_name(rule)) for rule in RULES + JOB_RULES):
            mistake, twin = (
                sorted(
                    p
                    for p in Path(tmp, name, t).rglob("*")
                    if p.suffix in (".py", *JOB_FILES) or p.as_posix().endswith(CI_SCRIPT)
                )
                for t in "-+"
            )
            if not [x for x in lint(mistake, [rule]) if f": {name}: " in x]:
                failures.append(f"{name}: did not find its planted mistake")
            failures += [f"{name}: flagged its corrected twin: {x}" for x in lint(twin, [rule])]
    return failures


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    if argv == ["--self-test"]:
        failures = self_test()
        print(
            "\n".join(failures) or f"self-test: each of the {len(RULES + JOB_RULES)} rules can fail"
        )
        return 1 if failures else 0
    if bad := [a for a in argv if a.startswith("-") or not Path(a).exists()]:
        print(f"lint.py: not a file or folder: {' '.join(bad)}\n\n{__doc__}", file=sys.stderr)
        return 2
    failures = [] if argv else self_test()
    kinds = ("*.py", *(f"*{suffix}" for suffix in JOB_FILES))
    roots = [(Path(a), k) for a in argv for k in kinds] or [(REPO, p) for p in DEFAULT_PATTERNS]
    paths = [p for r, glob in roots for p in (sorted(r.glob(glob)) if r.is_dir() else [r])]
    paths = list(dict.fromkeys(paths))  # a file named on the command line: once
    if not paths:
        print(f"lint.py: no Python or job file in {' '.join(argv)}", file=sys.stderr)
        return 2
    found = lint([p.resolve() for p in paths])
    for line in [f"self-test: {failure}" for failure in failures] + found:
        print(line)
    seconds = time.perf_counter() - started
    print(f"lint.py: {len(paths)} files, {len(found)} findings, {seconds:.2f}s", file=sys.stderr)
    return 1 if found or failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
