"""jobs/sites/: the site files (Derecho, Polaris, Perlmutter) and the job files that source them.

No PBS, Lmod or GPU here: the site files are sourced in bash with `module` and `conda` replaced by
recording stubs, and the job files run under bash with `mpiexec`, `srun` and `scontrol` stubs that
record what they were given. What is checked is what the files do with it: the variables exported,
the modules loaded, the flags that reach the launcher, and the header blocks each site needs.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.launcher_tools import (
    PBS_JOBS,
    SITE_JOBS,
    SLURM_JOBS,
    need_tools,
    site_env,
    source_site,
    stub_bin,
)
from tests.paths import REPO
from tests.pbs_server import PbsServer
from tests.processes import read_env, run

SITES_DIR = REPO / "jobs" / "sites"
SITE_FILES = sorted(SITES_DIR.glob("*.sh"))
# The same directive forms tests/test_jobs.py requires of the job files.
PBS_LINE = re.compile(r"#PBS -[A-Za-z] \S+")
SBATCH_LINE = re.compile(r"#SBATCH --[a-z][a-z-]*(=\S+)?")


@pytest.mark.parametrize("path", SITE_FILES, ids=lambda p: p.name)
def test_site_file_static(path):
    run(["bash", "-n", path], 30, check=True)
    need_tools("shellcheck")
    result = run(["shellcheck", "-s", "bash", path], 60)
    assert result.returncode == 0, result.stdout
    # Each setting says why and where from: every export follows a comment naming a source, a [tag]
    # the file's Sources list defines.
    text = path.read_text()
    defined = set(re.findall(r"^#   (\[\w+\])", text, re.M))
    lines = text.splitlines()
    exports = [i for i, line in enumerate(lines) if line.strip().startswith("export ")]
    assert exports or path.stem == "perlmutter"
    for i in exports:
        above = lines[i - 1].strip()
        assert above.startswith("#"), f"{path.name}:{i + 1}: no reason above: {lines[i]}"
        tags = set(re.findall(r"\[\w+\]", above))
        assert tags and tags <= defined, f"{path.name}:{i + 1}: sources {tags}, defined {defined}"

    for name in PBS_JOBS + SLURM_JOBS:
        text = (REPO / "jobs" / name).read_text()
        assert text.startswith("#!/bin/bash -l\n") and 'source "jobs/sites/$SITE.sh"' in text, name


# -- sourcing a site file --------------------------------------------------------------------------


def test_polaris_loads_alcfs_conda_module_and_activates_it(tmp_path):
    assert source_site("polaris", tmp_path)[2] == [
        "module use /soft/modulefiles",
        "module load conda",
        "conda activate",
    ]


def test_your_own_values_and_the_switches_win(tmp_path):
    """A variable exported before keeps its value; the
    switches change what is exported or loaded."""
    for sub in "abcd":
        (tmp_path / sub).mkdir()
    exported, placement, calls = source_site(
        "derecho",
        tmp_path / "a",
        NCCL_SOCKET_IFNAME="hsn0",
        MPIEXEC_BIND="",
        DERECHO_NCCL_OFI="1",
        DERECHO_MODULES="cuda",
    )
    assert "NCCL_SOCKET_IFNAME" not in exported  # unchanged: the value given
    assert (
        exported["NCCL_NET"] == "AWS Libfabric"
        and placement["MPIEXEC_BIND"] == ""
        and calls == ["module load cuda"]
    )
    exported, _, calls = source_site(
        "polaris", tmp_path / "b", POLARIS_NCCL_OFI="0", POLARIS_CONDA_ENV="myenv"
    )
    assert exported == {} and calls[-1] == "conda activate myenv"
    exported, _, calls = source_site(
        "polaris", tmp_path / "c", LD_LIBRARY_PATH="/mine", POLARIS_MODULES="conda/2025"
    )
    assert exported["LD_LIBRARY_PATH"].endswith(":/mine") and "module load conda/2025" in calls
    _, _, calls = source_site("perlmutter", tmp_path / "d", PERLMUTTER_MODULES="pytorch/2.9 nccl")
    assert calls == ["module load pytorch/2.9 nccl"]


def test_polaris_switch_off_unsets_the_nccl_settings_alcfs_module_exports(tmp_path):
    """ALCF's conda module exports four NCCL settings itself; ALCF's page says to unset them to turn
    them off. POLARIS_NCCL_OFI=0 does, and keeps a value you exported before (NCCL_NET here).
    Before, the switch only left out the file's own exports, and the module's stayed on."""
    alcf = dict(NCCL_NET_GDR_LEVEL="PHB", NCCL_CROSS_NIC="1", NCCL_COLLNET_ENABLE="1")
    alcf["NCCL_NET"] = "AWS Libfabric"
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    source_site("polaris", tmp_path / "off", alcf, POLARIS_NCCL_OFI="0", NCCL_NET="Socket")
    after = {k: v for k, v in read_env(tmp_path / "off" / "after").items() if k.startswith("NCCL_")}
    assert after == {"NCCL_NET": "Socket"}
    # control: switched on (the default), the module's values are there
    source_site("polaris", tmp_path / "on", alcf)
    assert alcf.items() <= read_env(tmp_path / "on" / "after").items()


# -- the job files with SITE=..., under stubs of the launchers ------------------------------------


def launcher_stubs(tmp_path: Path) -> Path:
    """mpiexec and srun record their arguments and environment; scontrol answers as Slurm would."""
    bin_dir = stub_bin(tmp_path)
    for name in ("mpiexec", "srun"):
        (bin_dir / name).write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/{name}.args"\n'
            f'env > "{tmp_path}/{name}.env"\n'
        )
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$1 $2" in\n  "show hostnames") echo node1 ;;\n'
        '  "show node") echo "NodeName=node1 NodeAddr=10.1.2.3 State=IDLE" ;;\nesac\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


def run_job(name: str, tmp_path: Path, site: str | None, with_module: bool = True):
    """Run jobs/<name> under bash as its scheduler would start
    it; return (result, launcher argv, launcher env)."""
    bin_dir = launcher_stubs(tmp_path)
    env = site_env(tmp_path, with_module=False, RUN_DIR=str(tmp_path / "run"), PYTHON="python")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if not with_module:
        (bin_dir / "module").unlink()
    if site is not None:
        env["SITE"] = site
    if name.startswith("pbs"):
        # submitted to the PBS stand-in, which answers the job file's qstat -f
        server = PbsServer(tmp_path / "pbs", first_id=4400)
        run([server.bin / "qsub", REPO / "jobs" / name], 30, env=env, check=True)
        (tmp_path / "nodefile").write_text(f"{socket.gethostname()}\nlocalhost\n")
        env.update(server.start("4400.pbs01", PBS_NODEFILE=str(tmp_path / "nodefile")))
        env.update(MPIEXEC=str(bin_dir / "mpiexec"), PATH=f"{server.bin}:{env['PATH']}")
        launcher = "mpiexec"
    else:
        env.update(
            SLURM_JOB_ID="4400",
            SLURM_JOB_NODELIST="node1",
            SLURM_JOB_NUM_NODES="1",
            SLURM_CPUS_PER_TASK="32",
        )
        launcher = "srun"
    result = run(["bash", REPO / "jobs" / name], 60, env=env)
    args_file, env_file = tmp_path / f"{launcher}.args", tmp_path / f"{launcher}.env"
    argv = args_file.read_text().splitlines() if args_file.exists() else None
    launcher_env = (
        dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
        if env_file.exists()
        else None
    )
    return result, argv, launcher_env


@pytest.mark.parametrize(
    "site,name", [(s, n) for s, jobs in sorted(SITE_JOBS.items()) for n in jobs]
)
def test_job_file_sources_its_site_and_the_launcher_gets_it(site, name, tmp_path):
    """What the site file exports and loads when sourced alone (source_site; jobs/sites/README.md's
    table: tests/test_readme_text.py) is what the job file gives its launcher."""
    (tmp_path / "alone").mkdir()
    exported, placement, site_calls = source_site(site, tmp_path / "alone")
    result, argv, env = run_job(name, tmp_path, site)
    assert result.returncode == 0, result.output
    # the NCCL variables reach the ranks
    assert {k: env.get(k) for k in exported} == exported
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == site_calls, calls
    if name == "pbs_mpiexec.pbs":
        bind = placement["MPIEXEC_BIND"].split()
        assert argv[argv.index("--ppn") + 2 : argv.index("--ppn") + 2 + len(bind)] == bind, argv
    if name.startswith("slurm"):
        assert "--cpus-per-task=32" in argv, argv
    if name == "slurm_torchrun.sbatch":
        assert "--nproc_per_node=4" in argv, argv


@pytest.mark.parametrize("name", PBS_JOBS + SLURM_JOBS)
def test_job_file_without_site_loads_nothing(name, tmp_path):
    """Negative control: without SITE the job file loads no module and exports no NCCL variable."""
    result, argv, env = run_job(name, tmp_path, None)
    assert result.returncode == 0, result.output
    assert not (tmp_path / "calls").exists()
    assert not any(k.startswith(("NCCL_", "FI_")) for k in env)
    if name == "pbs_mpiexec.pbs":
        assert argv[argv.index("--ppn") + 2 : argv.index("--ppn") + 5] == [
            "--depth=8",
            "--cpu-bind",
            "depth",
        ]


def recording_python(tmp_path: Path) -> Path:
    """A `python` that appends its arguments, one call a line, to <tmp_path>/python.calls."""
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/python.calls"\n')
    stub.chmod(0o755)
    return stub


@pytest.mark.parametrize("name", PBS_JOBS + SLURM_JOBS + ["torchrun_multi_node.sh"])
def test_job_files_pass_a_process_group_timeout_fit_for_a_cluster(name, tmp_path):
    """On nccl the process-group timeout is also the watchdog's limit: the lessons' 60 s can end a
    healthy job (a checkpoint write while the others wait, --compile). The job files pass 600 s,
    before TRAIN_ARGS, whose own --timeout-s wins: the last flag counts (the config's argparse)."""
    if name.startswith("torchrun"):
        env = site_env(tmp_path, with_module=False, NNODES="2", RDZV_HOST="node1")
        env.update(PYTHON=str(recording_python(tmp_path)), TRAIN_ARGS="--epochs 3")
        result = run(["bash", REPO / "jobs" / name], 60, env=env)
        argv = (tmp_path / "python.calls").read_text().split()
    else:
        result, argv, _ = run_job(name, tmp_path, None)
    assert result.returncode == 0, result.output
    at = argv.index("--timeout-s")
    assert argv[at + 1] == "600" and "--epochs" in argv[at + 2 :], argv
    from common.config import TrainConfig, parse_config

    assert parse_config(TrainConfig, ["--timeout-s", "600", "--timeout-s", "5"]).timeout_s == 5


@pytest.mark.parametrize("name", ["pbs_mpiexec.pbs", "slurm_srun.sbatch"])
def test_unknown_site_or_no_module_command_stops_the_job_before_launch(name, tmp_path):
    (tmp_path / "unknown").mkdir()
    result, argv, _ = run_job(name, tmp_path / "unknown", "nowhere")
    assert result.returncode == 2 and argv is None, result.output
    assert result.stderr.strip().splitlines() == [
        "error: SITE=nowhere: no jobs/sites/nowhere.sh (sites: derecho.sh perlmutter.sh polaris.sh)"
    ]
    site = "derecho" if name.startswith("pbs") else "perlmutter"
    (tmp_path / "login").mkdir()
    result, argv, _ = run_job(name, tmp_path / "login", site, with_module=False)
    assert result.returncode == 2 and argv is None and "#!/bin/bash -l" in result.stderr, (
        result.output
    )


# -- the header blocks each site file offers ------------------------------------------------------


def header_blocks(text: str) -> list[list[str]]:
    """Runs of disabled directives (##PBS / ##SBATCH
    lines), one '#' dropped: as the user copies them."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith(("##PBS ", "##SBATCH ")):
            current.append(line[1:])
        elif current:
            blocks.append(current)
            current = []
    return blocks


def options(block: list[str]) -> list[tuple[str, str]]:
    """('-q', 'main'), ('select', '2:ncpus=...'), ('--nodes', '2'), ..."""
    result = []
    for line in block:
        flag, _, value = line.split(" ", 1)[1].partition(" ")
        if flag == "-l":
            result.append(tuple(value.split("=", 1)))
        elif flag.startswith("--"):
            name, _, arg = flag.partition("=")
            result.append((name, arg))
        else:
            result.append((flag, value))
    return result


def seconds(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


POLARIS_QUEUES = {
    "debug": (1, 2, 1),
    "debug-scaling": (1, 10, 1),
    "prod": (10, 496, 24),
    "preemptable": (1, 10, 72),
}


def header_problems(site: str, block: list[str]) -> list[str]:
    """What is wrong with one header block for `site` (empty: nothing)."""
    problems = [
        f"not a directive: {line}"
        for line in block
        if not (PBS_LINE.fullmatch(line) or SBATCH_LINE.fullmatch(line))
    ]
    opts = dict(options(block))
    if site in ("derecho", "polaris"):
        for key in ("-A", "-q", "select", "walltime"):
            if key not in opts:
                problems.append(f"no {key}")
        if problems:
            return problems
    if site == "derecho":
        if not re.fullmatch(r"\d+:ncpus=64:mpiprocs=4:ngpus=4", opts["select"]):
            problems.append(f"select {opts['select']}")
        if opts["-q"] not in ("main", "preempt") or seconds(opts["walltime"]) > 12 * 3600:
            problems.append(f"queue {opts['-q']} for {opts['walltime']}")
        if opts["-q"] == "preempt" and opts.get("-r") != "y":
            problems.append("preempt without -r y: PBS would not rerun a preempted job")
    if site == "polaris":
        m = re.fullmatch(r"(\d+):system=polaris", opts["select"])
        if not m or "filesystems" not in opts or opts.get("place") != "scatter":
            problems.append(f"select {opts['select']}, filesystems, place=scatter")
        elif opts["-q"] not in POLARIS_QUEUES:
            problems.append(f"queue {opts['-q']}")
        else:
            low, high, hours = POLARIS_QUEUES[opts["-q"]]
            if not low <= int(m.group(1)) <= high or seconds(opts["walltime"]) > hours * 3600:
                problems.append(f"{m.group(1)} nodes for {opts['walltime']} in {opts['-q']}")
    if site == "perlmutter":
        if (
            opts.get("--constraint") != "gpu"
            or opts.get("--gpus-per-node") != "4"
            or "--qos" not in opts
        ):
            problems.append("not -C gpu --gpus-per-node=4 with a --qos")
        tasks, cpus = int(opts.get("--ntasks-per-node", 0)), int(opts.get("--cpus-per-task", 0))
        if tasks * cpus != 128:
            problems.append(f"{tasks} tasks x {cpus} CPUs per node")
    return problems


@pytest.mark.parametrize("path", SITE_FILES, ids=lambda p: p.name)
def test_site_header_blocks_fit_the_site(path):
    blocks = header_blocks(path.read_text())
    assert blocks
    for block in blocks:
        assert header_problems(path.stem, block) == [], block
    opts = [dict(options(b)) for b in blocks]
    if path.stem == "derecho":
        assert opts[0]["-q"] == "main"
    if path.stem == "polaris":
        assert {o["-q"] for o in opts} == set(POLARIS_QUEUES)
    if path.stem == "perlmutter":
        # slurm_torchrun, slurm_srun
        assert sorted(o["--ntasks-per-node"] for o in opts) == ["1", "4"]

    # Negative controls: blocks that break one rule each.
    polaris = [
        "#PBS -A p",
        "#PBS -q prod",
        "#PBS -l select=2:system=polaris",
        "#PBS -l place=scatter",
        "#PBS -l walltime=02:00:00",
        "#PBS -l filesystems=home:eagle",
    ]
    assert header_problems("polaris", polaris) == ["2 nodes for 02:00:00 in prod"]
    debug = [line.replace("prod", "debug") for line in polaris]
    # debug: 1 h at most
    assert header_problems("polaris", debug) == ["2 nodes for 02:00:00 in debug"]
    derecho = [
        "#PBS -A p",
        "#PBS -q main",
        "#PBS -l select=2:ncpus=64:mpiprocs=4",
        "#PBS -l walltime=02:00:00",
    ]
    assert header_problems("derecho", derecho) == ["select 2:ncpus=64:mpiprocs=4"]
    preempt = [line.replace("main", "preempt") for line in derecho[:2]] + [
        "#PBS -l select=2:ncpus=64:mpiprocs=4:ngpus=4",
        "#PBS -l walltime=02:00:00",
    ]
    assert header_problems("derecho", [*preempt, "#PBS -r n"]) == [
        "preempt without -r y: PBS would not rerun a preempted job"
    ]
    assert header_problems("derecho", [*preempt, "#PBS -r y"]) == []
    perlmutter = [
        "#SBATCH --qos=regular",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --cpus-per-task=32",
    ]
    assert header_problems("perlmutter", perlmutter) == [
        "not -C gpu --gpus-per-node=4 with a --qos"
    ]
    assert header_problems("perlmutter", [*perlmutter, "#SBATCH --constraint=gpu"]) == []


# -- srun passes --cpus-per-task on
# -----------------------------------------------------------------
