"""Launcher detection and host-list parsing, table-driven with plain environment dicts."""

import os
import socket
import sys

import pytest

from common.errors import LauncherError
from common.launcher import (
    DEFAULT_PORT,
    PORT_BASE,
    PORT_SPAN,
    STRIDE,
    choose_backend,
    expand_hostlist,
    free_port,
    hostfile_hosts,
    launch_info,
    master_port,
)
from tests.launcher_tools import kubernetes_pod_env
from tests.paths import PYTHON, REPO
from tests.processes import clean_env, finish, node_of, run, start
from tests.results import read_summary


def pals_rank(rank: int, local_rank: int, world: int, local_world: int) -> dict[str, str]:
    """What HPE PALS' mpiexec gives a rank (no public source; ALCF's Polaris guide documents
    PMI_LOCAL_RANK and PMI_LOCAL_SIZE, HPE's Slurm commit 0dbdbf9399 names PALS' variables)."""
    numbers = dict(PALS_RANKID=rank, PALS_LOCAL_RANKID=local_rank, PALS_NODEID=rank // local_world)
    numbers.update(PMI_RANK=rank, PMI_SIZE=world, PMI_LOCAL_RANK=local_rank)
    numbers.update(PMI_LOCAL_SIZE=local_world, PALS_LOCAL_SIZE=local_world)
    return {name: str(value) for name, value in numbers.items()}


# (id, environment, expected (launcher, rank, local_rank,
# world_size, local_world_size, master_addr))
CASES = [
    ("single", {}, ("single", 0, 0, 1, 1, "127.0.0.1")),
    (
        "all four set by hand win, whatever else is set",
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "PMI_RANK": "7",
            "MASTER_ADDR": "node0",
        },
        ("env", 1, 1, 4, 2, "node0"),
    ),
    (
        "intel mpi",
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
            "I_MPI_ROOT": "/opt/intel/mpi",
        },
        ("intel-mpi", 1, 1, 2, 2, "127.0.0.1"),
    ),
    (
        "pals under PBS",
        {**pals_rank(6, 2, 8, 4), "PBS_JOBID": "4321.pbs01", "MASTER_ADDR": "x3001c0s13b0n0"},
        ("pals", 6, 2, 8, 4, "x3001c0s13b0n0"),
    ),
    (
        "slurm srun, step task count preferred",
        {
            "SLURM_JOB_ID": "123",
            "SLURM_STEP_ID": "1",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "8",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": "n[3,5]",
            "SLURM_JOB_NODELIST": "n[1-5]",
        },
        ("slurm", 1, 0, 2, 1, "n3"),
    ),
    ("pbs job without mpiexec", {"PBS_JOBID": "99.server"}, ("single", 0, 0, 1, 1, "127.0.0.1")),
    (
        "mp.spawn keeps MASTER_ADDR",
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
        ("single", 0, 0, 1, 1, "127.0.0.1"),
    ),
]


@pytest.mark.parametrize("env,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_launch_info(env, expected):
    info = launch_info(env)
    assert (
        info.launcher,
        info.rank,
        info.local_rank,
        info.world_size,
        info.local_world_size,
        info.master_addr,
    ) == expected


def openmpi_rank(rank: int, local_rank: int, world: int, local_world: int) -> dict[str, str]:
    numbers = dict(RANK=rank, LOCAL_RANK=local_rank, SIZE=world, LOCAL_SIZE=local_world)
    return {f"OMPI_COMM_WORLD_{name}": str(value) for name, value in numbers.items()}


def test_multi_host_mpi_outside_a_scheduler_needs_master_addr():
    """mpiexec with a host file, jsrun's OMPI_* variables, Open MPI under SGE: no Slurm or PBS job
    names rank 0's host. Before, every host met silently at its own 127.0.0.1:29500."""
    for env in (
        openmpi_rank(5, 1, 8, 4),
        {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    ):
        with pytest.raises(LauncherError, match="export MASTER_ADDR=<rank 0's host>"):
            launch_info(env)
        assert launch_info({**env, "MASTER_ADDR": "node0"}).master_addr == "node0"
    # one host: loopback is right
    assert launch_info(openmpi_rank(5, 1, 8, 8)).master_addr == "127.0.0.1"


def test_pbs_master_is_first_line_of_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1001c0s0b0n0\nx1001c0s0b0n0\nx1002c0s0b0n0\n")
    env = {"PBS_JOBID": "4321.pbs01", "PBS_NODEFILE": str(nodefile), **pals_rank(0, 0, 4, 2)}
    info = launch_info(env)
    assert (info.launcher, info.scheduler, info.master_addr) == ("pals", "pbs", "x1001c0s0b0n0")
    assert info.master_port == PORT_BASE + 4321 % PORT_SPAN


def test_unreadable_or_empty_nodefile_is_an_error(tmp_path):
    ranks = pals_rank(0, 0, 4, 2)
    with pytest.raises(LauncherError, match="PBS_NODEFILE"):
        launch_info({"PBS_JOBID": "1", "PBS_NODEFILE": str(tmp_path / "missing"), **ranks})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(LauncherError, match="is empty"):
        launch_info({"PBS_JOBID": "1", "PBS_NODEFILE": str(tmp_path / "empty"), **ranks})


@pytest.mark.parametrize(
    "env,port",
    [
        ({}, DEFAULT_PORT),
        ({"MASTER_PORT": "12345"}, 12345),
        ({"SLURM_JOB_ID": "123456"}, PORT_BASE + 123456 % PORT_SPAN),
        ({"SLURM_JOB_ID": "77_3"}, PORT_BASE + 77),  # array job
        ({"PBS_JOBID": "8812.pbs-server"}, PORT_BASE + 8812),
        # array subjob
        ({"PBS_JOBID": "8812[3].pbs-server"}, PORT_BASE + (8812 + 3 * STRIDE) % PORT_SPAN),
        ({"PBS_JOBID": "8812[].pbs-server"}, PORT_BASE + 8812),  # the array job itself
    ],
)
def test_master_port(env, port):
    assert master_port(env) == port


def test_jobs_on_one_node_get_different_ports():
    assert master_port({"SLURM_JOB_ID": "1001"}) != master_port({"SLURM_JOB_ID": "1002"})
    assert all(
        1024 < master_port({"SLURM_JOB_ID": str(j)}) < 32768 for j in (0, 14999, 15000, 10**9 + 7)
    )
    # Any PORT_SPAN consecutive job ids get PORT_SPAN different ports ...
    assert (
        len({master_port({"SLURM_JOB_ID": str(j)}) for j in range(123_456, 123_456 + PORT_SPAN)})
        == PORT_SPAN
    )
    # ... but ids PORT_SPAN apart share one (a job still
    # running after PORT_SPAN more were submitted):
    # the second fails at start with "address already in use" (tests/test_forum_errors.py).
    assert master_port({"SLURM_JOB_ID": "1234"}) == master_port({"SLURM_JOB_ID": "16234"})


def test_pbs_array_subjobs_get_different_ports():
    """All subjobs of an array differ (they used to share the array's port), and the first
    200 stay clear of the 70 jobs submitted right after the array (ids that follow it)."""
    for job in (1234, 77_777, 14_999):
        subjobs = [master_port({"PBS_JOBID": f"{job}[{i}].pbs01"}) for i in range(PORT_SPAN)]
        assert len(set(subjobs)) == PORT_SPAN
        assert subjobs[0] == master_port({"PBS_JOBID": f"{job}.pbs01"})
        following = {master_port({"PBS_JOBID": f"{job + d}.pbs01"}) for d in range(1, 71)}
        assert not following & set(subjobs[:200])


@pytest.mark.parametrize(
    "variable,ids",
    [
        ("SLURM_JOB_ID", ["1234", "16234", "987654321"]),
        (
            "PBS_JOBID",
            ["1234.pbs01", "1234[0].pbs01", "1234[5].pbs01", "99[14999].server", "8812[]"],
        ),
    ],
)
def test_the_port_comes_from_the_job_id_and_an_array_index(variable, ids):
    """The job files take it from here too (jobs/scheduler.py start)."""
    ports = [master_port({variable: job_id}) for job_id in ids]
    # 1234 and 16234 share; so do 1234, 1234[0]
    assert ports[0] == ports[1] and len(set(ports)) == len(ports) - 1


@pytest.mark.parametrize(
    "env,message",
    [
        ({"WORLD_SIZE": "2"}, "rank is not set"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "outside the world size"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "outside the world size"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "at least 1"),
        (
            {
                "TORCHELASTIC_RUN_ID": "x",
                "RANK": "0",
                "LOCAL_RANK": "2",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2",
            },
            "local rank 2",
        ),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "rank is not set"),
        ({"PMI_SIZE": "2", "PMI_RANK": "2", "MPI_LOCALNRANKS": "2"}, "outside the world size"),
        # a rank from no launcher the rule knows is never taken for a process alone
        ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "^PMI_RANK is set, but by no launcher"),
        ({"PMIX_RANK": "1"}, "^PMIX_RANK is set, but by no launcher"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
        ({"MASTER_PORT": "http"}, "not an integer"),
    ],
)
def test_inconsistent_environment_is_a_clear_error(env, message):
    with pytest.raises(LauncherError, match=message):
        launch_info(env)


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("gpu[001-004,010],login2", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "login2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("a[1-2],b[3],c", ["a1", "a2", "b3", "c"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x3001c0s13b0n0", ["x3001c0s13b0n0"]),
        ("node-[09-11].cluster", ["node-09.cluster", "node-10.cluster", "node-11.cluster"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "gpu[1-2",
        "gpu1-2]",
        "gpu[]",
        "gpu[a-b]",
        "gpu[3-1]",
        "a,,b",
        "gpu[1-2,]",
        "gpu[[1]]",
        ",",
    ],
)
def test_malformed_hostlist_is_an_error(bad):
    with pytest.raises(LauncherError):
        expand_hostlist(bad)


# --- which GPU is this rank's
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "visible,gpus",
    [
        # per-rank binding (srun --gpus-per-task=1, site scripts): each rank sees only its own
        (1, [0, 0, 0, 0]),
        (4, [0, 1, 2, 3]),  # every rank sees the node's 4 GPUs: index by local rank
        (8, [0, 1, 2, 3]),  # more GPUs than local ranks: the first four
        (0, [0, 0, 0, 0]),  # no GPU (CPU run): the index is not used
    ],
)
def test_gpu_of_four_local_ranks(visible, gpus):
    assert [launch_info(node_of(4, r), gpus=visible).gpu for r in range(4)] == gpus


@pytest.mark.parametrize("visible", [2, 3])
def test_fewer_gpus_than_local_ranks_is_one_clear_error(visible):
    """Two ranks would share a GPU; NCCL refuses that with
    "Multiple Ranks are using the same GPU/Partition", later and less clearly."""
    mask = ",".join(str(i) for i in range(visible))
    # every rank of the node says so (its local rank 0 prints it: common/launcher.py)
    for r in range(4):
        with pytest.raises(LauncherError) as exc:
            launch_info(node_of(4, r, mask), gpus=visible)
        assert str(exc.value) == (
            f"4 ranks on this node but {visible} GPUs visible to rank {r} "
            f"(CUDA_VISIBLE_DEVICES={mask}): one rank per GPU, seeing all or its own"
        )


def test_gpu_choice_over_every_small_node():
    """Exhaustively, for 1-8 local ranks and 0-9 visible GPUs: each rank
    gets a GPU it can see; where all ranks share one view, no two get
    the same one; the only refusals are 1 < visible < local ranks."""
    for n in range(1, 9):
        for visible in range(10):
            picks = []
            for r in range(n):
                try:
                    picks.append(launch_info(node_of(n, r), gpus=visible).gpu)
                except LauncherError:
                    picks.append(None)
            if 1 < visible < n:
                assert picks == [None] * n, (n, visible)
            elif visible == 0:
                assert picks == [0] * n  # CPU
            else:
                assert all(0 <= g < visible for g in picks), (n, visible, picks)
                # one view: all different
                assert visible == 1 or len(set(picks)) == n, (n, visible, picks)


def test_detect_launcher_asks_torch_how_many_gpus_this_process_sees(monkeypatch):
    """The wiring, in-process. No GPU can exist on the machines the suite runs on, so torch.cuda's
    answers are stood in for; CUDA_VISIBLE_DEVICES is what torch.cuda.device_count() honours."""
    import torch

    from common.launcher import detect_launcher

    for name, value in node_of(4, 1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert detect_launcher().gpu == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert detect_launcher().gpu == 0
    # Without CUDA the count is not consulted (and a CPU run is never refused for it).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert detect_launcher().gpu == 0


def test_mp_spawn_inside_a_slurm_job_uses_its_own_rank_as_local_rank():
    """mp.spawn starts every rank on this node; a Slurm job around it must
    not make them all local rank 0 (they would all pick GPU 0)."""
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu01",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4000",
    }
    infos = [launch_info(env, rank=r, world_size=4, gpus=4) for r in range(4)]
    assert [(i.local_rank, i.local_world_size, i.gpu) for i in infos] == [
        (r, 4, r) for r in range(4)
    ]


def test_a_process_started_alone_takes_any_free_port(monkeypatch):
    """Outside any launcher and job nobody connects to its store, so any free port serves and two
    such runs on one machine do not collide (test_basic_ddp runs two). launch_info says 0 ("any");
    detect_launcher asks the OS for one, because torch up to 2.7 refuses port 0 in the tcp:// URL
    the scripts build (rendezvous.py: `if not result.port: raise ... "port number missing"`; 2.8
    changed it to `is None`). The minimum-torch tier runs the scripts alone on such a torch.
    In a job or with MASTER_PORT: as before."""
    from urllib.parse import urlparse

    from common.launcher import detect_launcher

    assert launch_info({}).master_port == 0
    for name in list(os.environ):
        monkeypatch.delenv(name)
    ports = {detect_launcher().master_port for _ in range(2)}
    for port in ports:
        # what torch 2.3-2.7 checks, and port 0 (the control) fails
        assert urlparse(f"tcp://127.0.0.1:{port}").port and not urlparse("tcp://127.0.0.1:0").port
        with socket.socket() as store:  # free: a store can bind it
            store.bind(("127.0.0.1", port))
    assert launch_info({"MASTER_PORT": "4000"}).master_port == 4000
    # an salloc shell (the job's variables, no step: salloc.c), whose python runs on the login
    # node, or a batch shell: alone too, on loopback (before: a store at the job's first node)
    shell = launch_info({"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert (shell.launcher, shell.master_addr, shell.master_port) == ("single", "127.0.0.1", 0)
    # a launcher's world of one
    assert launch_info({"RANK": "0", "WORLD_SIZE": "1"}).master_port == DEFAULT_PORT


# -- srun with Slurm's cray_shasta MPI plugin (HPE Cray EX), as Slurm 23.02 and newer set it up ---
# This machine's Slurm (22.05) runs every plugin for real: tests/test_jobs.py, the launcher matrix.
# Newer Slurm cannot run here, so its task environment is built from the source. Slurm 22.05's
# src/plugins/mpi/cray_shasta/mpi_cray_shasta.c sets PALS_APID ("%u.%u" job.step), PALS_RANKID
# (gtaskid), PALS_NODEID (nodeid), PALS_SPOOL_DIR, PALS_APINFO; commit 0dbdbf9399 ("PE-42785: Add
# new PALS/PMI environment variables", first in slurm-23-02-0-0rc1) adds
#     PALS_LOCAL_RANKID = ltaskid, PMI_RANK = gtaskid, PMI_SIZE = ntasks, PMI_LOCAL_RANK = ltaskid,
#     PMI_LOCAL_SIZE = ltasks, PMI_UNIVERSE_SIZE = ntasks, PMI_JOBID = job id
# where ltasks is this node's task count in the step (src/slurmd/slurmstepd/task.c). No Slurm sets
# PALS_LOCAL_SIZE. The SLURM_* variables are every srun task's, as the test cluster prints them.


def srun_task(distribution: str, rank: int, nodes: int = 2, per_node: int = 2, slurm_23=True):
    """Task `rank` of `srun --mpi=cray_shasta -N<nodes> --ntasks-per-node=<per_node>
    -m <distribution>` in job 1517, step 0."""
    if distribution == "block":
        node, local_rank = divmod(rank, per_node)
    else:
        local_rank, node = divmod(rank, nodes)
    world, spool = nodes * per_node, f"/var/spool/slurmd/node{node + 1}/mpi_cray_shasta/1517.0"
    env = dict(PALS_APID="1517.0", PALS_APINFO=f"{spool}/apinfo", PALS_SPOOL_DIR=spool)
    env.update(PALS_NODEID=node, PALS_RANKID=rank, SLURM_MPI_TYPE="cray_shasta")
    if slurm_23:
        env.update(PALS_LOCAL_RANKID=local_rank, PMI_RANK=rank, PMI_SIZE=world, PMI_JOBID=1517)
        env.update(PMI_LOCAL_RANK=local_rank, PMI_LOCAL_SIZE=per_node, PMI_UNIVERSE_SIZE=world)
    env.update(SLURM_JOB_ID=1517, SLURM_STEP_ID=0, SLURM_PROCID=rank, SLURM_LOCALID=local_rank)
    env.update(SLURM_NODEID=node, SLURM_NTASKS=world, SLURM_STEP_NUM_TASKS=world)
    env.update(SLURM_JOB_NODELIST=f"node[1-{nodes}]", SLURM_STEP_NODELIST=f"node[1-{nodes}]")
    tasks_per_node = f"{per_node}(x{nodes})"
    env.update(SLURM_TASKS_PER_NODE=tasks_per_node, SLURM_STEP_TASKS_PER_NODE=tasks_per_node)
    return {name: str(value) for name, value in env.items()}


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_srun_with_the_cray_shasta_plugin_of_slurm_23_is_read_from_slurm(distribution):
    """Slurm 23.02's plugin also exports PALS_LOCAL_RANKID, which made it PALS' mpiexec, whose
    local world size (PALS_LOCAL_SIZE) Slurm never sets: guessed as local rank + 1. Now each
    task's four numbers are what Slurm says they are."""
    for rank in range(4):
        task = srun_task(distribution, rank)
        info = launch_info(task, gpus=2)
        assert (info.launcher, info.rank, info.local_rank, info.world_size) == (
            "slurm",
            rank,
            int(task["SLURM_LOCALID"]),
            int(task["SLURM_NTASKS"]),
        )
        assert info.local_world_size == 2 and info.gpu == info.local_rank
        assert (info.master_addr, info.master_port) == ("node1", PORT_BASE + 1517)


def test_every_rank_of_an_oversubscribed_node_says_so(monkeypatch, capsys):
    """Four tasks of a Slurm 23.02 cray_shasta step on a node with two GPUs: every rank stops
    with exit code 2 and its own `error:` line. Before, the lower local ranks guessed a local
    world small enough to pass, and the higher ones exited silently (local rank 0 printed)."""
    import torch

    from common.launcher import detect_launcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for rank in range(4):
        monkeypatch.setattr(os, "environ", srun_task("block", rank, nodes=1, per_node=4))
        with pytest.raises(SystemExit) as exc:
            detect_launcher()
        assert exc.value.code == 2
        assert capsys.readouterr().err == (
            f"error: 4 ranks on this node but 2 GPUs visible to rank {rank} "
            "(CUDA_VISIBLE_DEVICES=unset): one rank per GPU, seeing all or its own\n"
        )


def test_pals_rank_without_pals_mpiexec_or_an_srun_step_is_an_error():
    with pytest.raises(LauncherError, match="^PALS_RANKID is set, but by no launcher"):
        launch_info({"PALS_RANKID": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})


def test_srun_arbitrary_distribution_puts_rank_0_on_the_host_files_first_line(tmp_path):
    """`srun -m arbitrary` with SLURM_HOSTFILE: task i on line i, while SLURM_STEP_NODELIST is
    sorted (srun_job.c, hostlist_uniq)."""
    (tmp_path / "hosts").write_text("node2\nnode1\n")
    env = srun_task("block", 0, per_node=1)
    env.update(SLURM_DISTRIBUTION="arbitrary", SLURM_HOSTFILE=str(tmp_path / "hosts"))
    assert launch_info(env).master_addr == "node2"
    assert launch_info({**env, "SLURM_DISTRIBUTION": "block"}).master_addr == "node1"


def test_the_host_file_is_read_as_slurm_reads_it(tmp_path):
    """slurm_read_hostfile (src/api/allocate.c, 22.05 and master): '#' to the end of a line is a
    comment, blank lines are skipped, hosts are split at commas, 'host*N' repeats a host. Before,
    the file's first word was rank 0's host: '#' after a comment line."""
    (tmp_path / "hosts").write_text("# rank 0 first\n\nnode2*2, node1 # then two\nnode1\n")
    assert hostfile_hosts((tmp_path / "hosts").read_text()) == ["node2", "node2", "node1", "node1"]
    env = srun_task("block", 0, per_node=2)
    env.update(SLURM_DISTRIBUTION="arbitrary", SLURM_HOSTFILE=str(tmp_path / "hosts"))
    assert launch_info(env).master_addr == "node2"


def het_step_task(rank: int) -> dict[str, str]:
    """Task `rank` of `srun -n1 -w node2 a : -n2 -w node1 b` in one allocation (a local het step):
    SLURM_PROCID is global; the node list is the sorted union, its task counts in that order;
    SLURM_NODEID counts nodes in component order (src/srun/srun.c, _reorder_het_job_recs)."""
    node, nodeid, localid = ("node2", 0, 0) if rank == 0 else ("node1", 1, rank - 1)
    env = dict(SLURM_JOB_ID="88", SLURM_STEP_ID="0", SLURM_PROCID=str(rank))
    env.update(SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid), SLURMD_NODENAME=node)
    env.update(SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3", SLURM_JOB_NODELIST="node[1-2]")
    env.update(SLURM_STEP_NODELIST="node[1-2]", SLURM_STEP_TASKS_PER_NODE="2,1")
    return env


def test_a_heterogeneous_srun_step_is_refused_naming_master_addr():
    """Read as a plain step, rank 0 met at node1 (the sorted list's first), where no rank listens,
    and rank 0 counted node1's two tasks as its own node's. Refused, one line naming MASTER_ADDR;
    with the five variables exported it runs."""
    for env in (het_step_task(0), {**het_step_task(0), "SLURM_HET_SIZE": "2"}):
        with pytest.raises(LauncherError, match=r"heterogeneous srun step .* MASTER_ADDR="):
            launch_info(env)
    by_hand = dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    info = launch_info({**het_step_task(0), **by_hand, "MASTER_ADDR": "node2"})
    assert (info.rank, info.local_world_size, info.master_addr) == (0, 1, "node2")
    # a plain step, its node named where the list puts it: as before
    assert launch_info({**srun_task("block", 2), "SLURMD_NODENAME": "node2"}).rank == 2


def test_a_malformed_task_count_names_its_variable():
    env = {**srun_task("block", 0), "SLURM_STEP_TASKS_PER_NODE": "2(3)"}
    with pytest.raises(LauncherError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(3\)' is not a task"):
        launch_info(env)


# -- RANK and WORLD_SIZE exported by a wrapper, without LOCAL_RANK ---------------------------------
def test_rank_and_world_size_without_local_rank_take_the_jobs_local_rank():
    """`export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS` in a wrapper (or RANK=$PMI_RANK under
    PALS): the local rank, and so the GPU, is srun's or mpiexec's. Before, every rank was local
    rank 0 of a local world of 1 and drove cuda:0."""
    for distribution in ("block", "cyclic"):
        tasks = [srun_task(distribution, r) for r in range(4)]
        for task in tasks:
            task.update(RANK=task["SLURM_PROCID"], WORLD_SIZE=task["SLURM_NTASKS"])
        infos = [launch_info(task, gpus=2) for task in tasks]
        assert [(i.launcher, i.rank, i.local_rank, i.local_world_size, i.gpu) for i in infos] == [
            ("env", r, int(task["SLURM_LOCALID"]), 2, int(task["SLURM_LOCALID"]))
            for r, task in enumerate(tasks)
        ]
    pals = {**pals_rank(5, 1, 8, 4), "PBS_JOBID": "4321.pbs01", "RANK": "5", "WORLD_SIZE": "8"}
    info = launch_info(pals, gpus=4)
    assert (info.launcher, info.local_rank, info.local_world_size, info.gpu) == ("env", 1, 4, 1)
    # LOCAL_RANK given: it is taken as it is, as before
    assert launch_info({**pals, "LOCAL_RANK": "3"}, gpus=4).gpu == 3


@pytest.mark.parametrize(
    "env,message",
    [
        (  # ranks started by hand in a Slurm batch shell: nothing says which is local rank 1
            {"RANK": "1", "WORLD_SIZE": "4", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"},
            "^env: rank 1 of 4 in a slurm job, but no launcher counts the ranks of this node: "
            "export LOCAL_RANK and LOCAL_WORLD_SIZE",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "PBS_JOBID": "9.pbs01", "MASTER_ADDR": "x1"},
            "in a pbs job, but no launcher counts the ranks of this node",
        ),
        (
            {**srun_task("block", 2), "RANK": "1", "WORLD_SIZE": "4"},
            r"^RANK=1 and WORLD_SIZE=4 disagree with slurm's rank 2 of 4",
        ),
    ],
)
def test_rank_without_local_rank_in_a_job_that_has_none_is_an_error(env, message):
    with pytest.raises(LauncherError, match=message):
        launch_info(env, gpus=4)


def test_rank_without_a_world_size_is_refused():
    """RANK alone was a world of one: each rank trained alone, or rank 1 was "outside the world
    size 1". Now one line names what is missing."""
    for env in (
        {"RANK": "0"},
        {"RANK": "1", "LOCAL_RANK": "1"},
        {**srun_task("block", 1), "RANK": "1"},
    ):
        with pytest.raises(LauncherError, match=r"^RANK=\d is set but WORLD_SIZE is not"):
            launch_info(env)
    assert launch_info({"WORLD_SIZE": "1"}).world_size == 1  # a world of one, said so


def openmpi_in_slurm(rank: int) -> dict[str, str]:
    """Rank `rank` of `mpirun -n 4` (2 a node) in Slurm job 77 on n[1-2]. mpirun runs in the batch
    step on n1 and starts its daemon on n2 with `srun --nodelist=n2` (plm/slurm), a step of its
    own: the ranks on n2 inherit that step's SLURM_STEP_ID, SLURM_PROCID and SLURM_STEP_NODELIST."""
    env = {**openmpi_rank(rank, rank % 2, 4, 2), "SLURM_JOB_ID": "77"}
    env.update(SLURM_JOB_NODELIST="n[1-2]", SLURM_NODELIST="n[1-2]")
    if rank >= 2:  # on the daemon's node
        env.update(SLURM_STEP_ID="2", SLURM_PROCID="0", SLURM_STEP_NODELIST="n2")  # third step
    return env


def test_a_rank_and_world_size_wrapper_under_open_mpi_in_slurm_meets_at_rank_0s_host():
    """`export RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE` (common/README.md's
    wrappers) under mpirun in a Slurm job: rank 0's host and the port follow mpirun's rule, as
    without the wrapper. Before, the ranks on the daemon's node read the daemon step's node list
    and step id, and met at n2 on another port."""
    plain = [launch_info(openmpi_in_slurm(rank)) for rank in range(4)]
    wrapped = []
    for rank in range(4):
        env = openmpi_in_slurm(rank)
        env.update(RANK=env["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=env["OMPI_COMM_WORLD_SIZE"])
        wrapped.append(launch_info(env))
        # with the local numbers set by the wrapper too
        env.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
        wrapped.append(launch_info(env))
    assert {(i.master_addr, i.master_port) for i in plain} == {("n1", PORT_BASE + 77)}
    assert {(i.master_addr, i.master_port) for i in wrapped} == {("n1", PORT_BASE + 77)}
    assert [(i.launcher, i.rank, i.local_rank) for i in wrapped[::2]] == [
        ("env", r, r % 2) for r in range(4)
    ]


def test_rank_without_local_rank_outside_a_job_is_the_local_rank():
    """One machine, no scheduler (ranks started by hand in terminals): as before."""
    info = launch_info({"RANK": "2", "WORLD_SIZE": "4"}, gpus=4)
    assert (info.local_rank, info.local_world_size, info.gpu) == (2, 4, 2)


# -- a CPU run on a GPU node -----------------------------------------------------------------------
class _PastDetection(Exception):
    pass


@pytest.mark.parametrize(
    "script,argv,stop_at",
    [
        ("02_sampler_patterns/partition_viewer.py", [], "init_process_group"),
        ("benchmark/train.py", ["--device", "cpu"], "train"),
        ("06_multinode/comm_check.py", ["--device", "cpu"], "check_in"),
    ],
)
def test_cpu_scripts_on_a_gpu_node_run_more_ranks_than_gpus(monkeypatch, script, argv, stop_at):
    """partition_viewer.py, benchmark/train.py --device cpu and comm_check.py --device cpu run 3
    gloo ranks on a node with 2 GPUs (stood in for: none exists here): each main() gets past
    launcher detection, detect_launcher(uses_gpu=False) not counting the GPUs, to the process
    group (stopped there). The control: the benchmark on the GPUs (--device auto) exits with
    code 2."""
    import torch

    from tests.paths import load_script

    if script == "benchmark/train.py":  # it imports its neighbour perf.py
        monkeypatch.setitem(sys.modules, "perf", load_script("benchmark/perf.py", "perf"))
    module = load_script(script, "cpu_script_under_test")
    for name, value in node_of(3, 0).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def stop(*args, **kwargs):
        raise _PastDetection

    target = module.dist if stop_at == "init_process_group" else module
    monkeypatch.setattr(target, stop_at, stop)
    monkeypatch.setattr("sys.argv", [script, *argv])
    with pytest.raises(_PastDetection):
        module.main()
    if script == "benchmark/train.py":
        monkeypatch.setattr("sys.argv", [script, "--device", "auto"])
        with pytest.raises(SystemExit) as exc:
            module.main()
        assert exc.value.code == 2


# --- the backend: what the torch build has (README "On a laptop", the guide's Windows entry) ---


@pytest.mark.parametrize(
    "nccl_built, device, expected",
    [
        (True, "cuda", "nccl"),  # a Linux GPU build
        (False, "cuda", "gloo"),  # Windows: GPUs, but no NCCL in the build
        (True, "cpu", "gloo"),  # a Linux machine without GPU
        (False, "cpu", "gloo"),  # macOS (the scripts never pick MPS) or Windows without GPU
    ],
)
def test_the_backend_is_nccl_only_for_a_gpu_of_a_build_with_nccl(
    monkeypatch, nccl_built, device, expected
):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl_built)
    assert choose_backend(torch.device(device)) == expected


def test_the_scripts_tcp_rendezvous_uses_no_libuv_on_windows(monkeypatch):
    """torch >= 2.7 (torch/distributed/rendezvous.py): a tcp:// init on win32 defaults to the
    store without libuv, which the Windows builds lack; so the scripts' init_process_group needs
    no setting there. Control: the same URL on Linux uses libuv."""
    import torch.distributed as dist

    for platform, libuv in (("win32", False), ("linux", True)):
        monkeypatch.setattr(sys, "platform", platform)
        store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1))
        assert store.libuvBackend is libuv, platform
        del store


@pytest.mark.launchers
@pytest.mark.parametrize("master_addr", ["127.0.0.1", "::1"])
def test_ranks_started_by_hand_with_torchruns_variables_train(tmp_path, master_addr):
    """The README's launch where torchrun cannot run (Windows): one process per rank, each
    started by hand with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; here 07, which has no
    mp.spawn wrapper. At MASTER_ADDR=::1 (loopback's IPv6 address) too: before, the URL
    tcp://::1:PORT failed in every rank ("Port could not be cast to integer value")."""
    with socket.socket(socket.AF_INET6 if ":" in master_addr else socket.AF_INET) as probe:
        probe.bind((master_addr, 0))  # a port free at that address
        port = str(probe.getsockname()[1])
    command = [PYTHON, REPO / "07_metrics" / "train.py", "--epochs", "1", "--max-steps", "3"]
    ranks = [
        start(
            [*command, "--output-dir", tmp_path],
            env=clean_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=master_addr, MASTER_PORT=port
            ),
        )
        for rank in range(2)
    ]
    outputs = [
        finish(proc, 120, f"rank {rank} of 07 started by hand") for rank, proc in enumerate(ranks)
    ]
    assert [proc.returncode for proc in ranks] == [0, 0], outputs
    summary = read_summary(tmp_path)
    assert (summary["launcher"], summary["world_size"], summary["steps"]) == ("env", 2, 3)
    assert summary["replicas_identical"]


# --- Kubernetes operators' pods (tests/launcher_tools.py: each environment from the operator's
# source; no API server here)


@pytest.mark.parametrize("gpus", [0, 1, 2])
@pytest.mark.parametrize(
    "operator,master", [("pytorchjob", "job-master-0"), ("volcano", "job-master-0.job")]
)
def test_a_pytorchjob_or_volcano_pod_under_plain_python_is_one_rank_on_its_own_node(
    operator, master, gpus
):
    """PyTorchJob v1 or a Volcano Job, one process a pod (plain python): rank = the pod's index,
    world = pods, one rank on its node whatever the GPUs it sees, rank 0's address the master
    pod's. Before, the world was taken as one node's, and 2 GPUs for "4 ranks" were refused."""
    info = launch_info(kubernetes_pod_env(operator, index=2, pods=4), gpus=gpus)
    assert (info.launcher, info.rank, info.world_size) == (operator, 2, 4)
    assert (info.local_rank, info.local_world_size, info.gpu) == (0, 1, 0)
    assert (info.master_addr, info.master_port) == (master, 23456)


def test_without_volcanos_host_lists_rank_and_world_size_are_one_nodes():
    """The negative control: the same RANK and WORLD_SIZE without the VC_<TASK>_HOSTS that
    Volcano's svc plugin sets are set by hand, one node's ranks: 4 ranks and 2 GPUs, refused."""
    env = kubernetes_pod_env("volcano", index=2, pods=4)
    by_hand = {name: value for name, value in env.items() if not name.startswith("VC_")}
    assert launch_info(by_hand, gpus=0).local_world_size == 4
    with pytest.raises(LauncherError, match="^4 ranks on this node but 2 GPUs"):
        launch_info(by_hand, gpus=2)


@pytest.mark.parametrize(
    "operator,per_pod,message",
    [
        ("pytorchjob", 4, r"^PET_NNODES=4, PET_NPROC_PER_NODE=4, PET_NODE_RANK=2: the job asks "
         r"for 4 processes a pod \(WORLD_SIZE=16\), but this pod runs one: start the script with "
         r"torchrun"),
        ("trainjob", 1, r"^PET_NNODES=4, PET_NPROC_PER_NODE=1, PET_NODE_RANK=2 are torchrun's "
         r"settings .* each pod would train alone. Start the script with torchrun$"),
        ("trainjob", 2, "each pod would train alone"),
        ("elastic-pytorchjob", 1, r"^PET_NNODES=1:4, PET_NPROC_PER_NODE=1 are torchrun's"),
    ],
)  # fmt: skip
def test_plain_python_where_an_operator_expects_torchrun_is_refused(operator, per_pod, message):
    """Trainer v2 (JobSet) and an elastic PyTorchJob set only torchrun's PET_* variables: each
    pod would be a world of one and exit 0 having trained alone; a PyTorchJob whose WORLD_SIZE
    counts processes the pod never starts would wait until the timeout. Both refused."""
    with pytest.raises(LauncherError, match=message):
        launch_info(kubernetes_pod_env(operator, index=2, pods=4, per_pod=per_pod))


@pytest.mark.parametrize("operator", ["pytorchjob", "trainjob", "elastic-pytorchjob"])
def test_torchrun_in_an_operators_pod_is_torchrun(operator):
    """torchrun reads the PET_* variables and starts the workers with its own; its rule comes
    first, whatever the operator set."""
    env = kubernetes_pod_env(operator, index=1, pods=2, per_pod=2)
    env.update(TORCHELASTIC_RUN_ID="job", RANK="3", LOCAL_RANK="1", WORLD_SIZE="4")
    env.update(LOCAL_WORLD_SIZE="2", MASTER_ADDR="job-node-0-0.job", MASTER_PORT="29500")
    info = launch_info(env, gpus=2)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("torchrun", 3, 1, 4)
    assert info.gpu == 1


def test_one_process_in_all_under_trainer_v2_is_a_process_alone():
    """A TrainJob of 1 node x 1 process: plain python is right, a world of one."""
    info = launch_info(kubernetes_pod_env("trainjob", index=0, pods=1, per_pod=1))
    assert (info.launcher, info.world_size) == ("single", 1)


def test_01_under_trainer_v2_without_torchrun_says_one_line_and_exits_2(tmp_path):
    """The refusal as a user meets it: 01's train.py with a TrainJob pod's environment exits 2
    with one `error:` line, before any process group, and writes nothing."""
    env = clean_env(**kubernetes_pod_env("trainjob", index=1, pods=2))
    result = run(
        [PYTHON, REPO / "01_basic_ddp" / "train.py", "--output-dir", tmp_path], 120, env=env
    )
    assert result.returncode == 2, result.output[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: PET_NNODES=2,"), result.stderr
    assert "Start the script with torchrun" in lines[0] and not any(tmp_path.iterdir())
