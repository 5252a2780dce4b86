"""06_multinode: train.py and comm_check.py under real launchers (torchrun c10d, Open MPI, MPICH,
two network namespaces), and the failures a first multi-node launch meets."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest

from tests.helpers import PYTHON, REPO, clean_env, free_port, load_script, read_summary, run, torchrun
from tests.launcher_tools import need_root, need_tools, openmpi_env, unavailable

TRAIN = REPO / "06_multinode" / "train.py"
COMM = REPO / "06_multinode" / "comm_check.py"
SMALL = ("--max-steps", "4", "--epochs", "1", "--batch-size", "16")


def two_node_torchrun(tmp_path, script_args, env=None, timeout=150):
    """Two torchrun processes ("nodes"), one worker each, meeting at a c10d rendezvous on 127.0.0.1."""
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=test{port}",
               str(TRAIN), *script_args]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env or clean_env(), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    wait_all(procs, timeout, tmp_path, "two-node torchrun")


def wait_all(procs, timeout, tmp_path, what):
    """Wait for every "node" within `timeout` seconds in all; kill the leftovers; all must exit 0."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} timed out after {timeout}s:\n" + logs(tmp_path), pytrace=False)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], logs(tmp_path)


def logs(tmp_path):
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


def test_torchrun_two_nodes_c10d_agrees_with_one_node(tmp_path):
    two_node_torchrun(tmp_path, [*SMALL, "--output-dir", str(tmp_path / "two")])
    two = read_summary(tmp_path / "two")
    torchrun("06_multinode/train.py", *SMALL, "--output-dir", str(tmp_path / "one"), nproc=2)
    one = read_summary(tmp_path / "one")
    assert two["world_size"] == 2 and two["launcher"] == "torchrun"
    assert [p["rank"] for p in two["placement"]] == [0, 1]
    assert [p["local_rank"] for p in two["placement"]] == [0, 0]  # one worker per "node"
    assert [p["local_rank"] for p in one["placement"]] == [0, 1]  # two workers on one node
    assert two["replicas_identical"]
    # Same global batch and seed: the split into nodes does not change the arithmetic.
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert two["replica_checksums"] == one["replica_checksums"]
    banner = (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    assert re.search(r"^\s+1\s+0\s+\S+\s+cpu\s+\S+$", banner, re.M), "placement table row for rank 1 missing"


def test_placement_table_warns_when_two_ranks_share_a_gpu(capsys):
    """Two torchruns started on one node (a classic mistake) put two ranks on each of its GPUs. A GPU is
    known by its UUID: under per-rank GPU binding every rank uses cuda:0, each a different GPU."""
    train = load_script("06_multinode/train.py", "multinode_train")

    def rank(host, r, local_rank, device, uuid, visible="unset"):
        return dict(host=host, rank=r, local_rank=local_rank, device=device, gpu_uuid=uuid, visible=visible)

    train.print_placement([rank("gpu1", 0, 0, "cuda:0", "GPU-a"), rank("gpu1", 1, 0, "cuda:0", "GPU-a"),
                           rank("gpu2", 2, 0, "cuda:0", "GPU-c"), rank("gpu2", 3, 1, "cuda:1", "GPU-d")])
    out = capsys.readouterr().out
    assert re.search(r"^\s+1\s+0\s+gpu1\s+cuda:0\s+unset$", out, re.M)
    assert "4 ranks on 2 host(s): gpu1, gpu2" in out
    assert out.count("WARNING") == 1 and "WARNING: ranks [0, 1] share one GPU (cuda:0 of rank 0) on gpu1" in out
    # Per-rank binding (srun --gpus-per-task=1): cuda:0 everywhere, four GPUs, no warning; the masks are shown.
    train.print_placement([rank("gpu1", r, r, "cuda:0", f"GPU-{r}", visible=str(r)) for r in range(4)])
    out = capsys.readouterr().out
    assert "WARNING" not in out and re.search(r"^\s+3\s+3\s+gpu1\s+cuda:0\s+3$", out, re.M)
    train.print_placement([rank("vm", r, r, "cpu", "") for r in range(2)])
    assert "WARNING" not in capsys.readouterr().out  # CPU processes share the cores by design


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_mpiexec_runs_train_and_comm_check(tmp_path, flavour):
    tool = {"openmpi": "mpiexec.openmpi", "mpich": "mpiexec.mpich"}[flavour]
    need_tools(tool)
    port = str(free_port())
    if flavour == "openmpi":
        env = openmpi_env(MASTER_PORT=port)
        cmd = [tool, "-n", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]
    else:
        env = clean_env(MASTER_PORT=port)  # Hydra passes the whole environment on
        cmd = [tool, "-n", "2"]
    start = time.perf_counter()
    run([*cmd, PYTHON, TRAIN, *SMALL, "--output-dir", tmp_path / "train"], 150, env=env, check=True)
    summary = read_summary(tmp_path / "train")
    assert summary["launcher"] == flavour
    assert summary["world_size"] == 2 and summary["replicas_identical"]
    assert [(p["rank"], p["local_rank"]) for p in summary["placement"]] == [(0, 0), (1, 1)]
    result = run([*cmd, PYTHON, COMM, "--max-bytes", "65536", "--iters", "3", "--output-dir", tmp_path],
                 150, env=env, check=True)
    report = json.loads((tmp_path / "comm_check.json").read_text())
    assert report["launcher"] == flavour and report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["correct"] for r in report["results"])
    assert "peak busbw" in result.stdout
    print(f"{flavour}: train + comm_check wall time {time.perf_counter() - start:.1f} s")


def test_comm_check_prints_busbw_per_size(tmp_path):
    result = torchrun("06_multinode/comm_check.py", "--max-bytes", "1048576", "--iters", "3",
                      "--output-dir", str(tmp_path), nproc=2)
    report = json.loads((tmp_path / "comm_check.json").read_text())
    sizes = [r["bytes"] for r in report["results"]]
    assert sizes == [8 * 2 ** i for i in range(18)]  # 8 B, 16 B, ..., 1 MiB
    n = report["world_size"]
    rows = {}
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(True|False)", line)
        if m:
            rows[int(m.group(1))] = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
    assert sorted(rows) == sizes, result.stdout
    for r in report["results"]:
        assert r["correct"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n, rel=1e-9)
        assert rows[r["bytes"]][2] == pytest.approx(r["busbw_gbps"], abs=1e-4)


def test_comm_check_default_reaches_256_mib():
    result = run([PYTHON, COMM, "--help"], 60, check=True)
    assert "largest message in bytes (doubling from --min-bytes) (default: 268435456)" in " ".join(result.stdout.split())


def test_comm_check_refuses_cuda_without_a_visible_gpu():
    """--device cuda where the mask hides every GPU (or there is none): one line and exit code 2, no process group."""
    result = run([PYTHON, COMM, "--device", "cuda"], 120, env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2, result.output
    assert result.stderr == "error: --device cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES=)\n"


def test_wrong_master_addr_fails_clearly_within_timeout(tmp_path):
    """An unreachable MASTER_ADDR: every rank gives up after its timeout, naming the address and what to check."""
    procs, start = [], time.perf_counter()
    for rank in range(2):
        env = clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="192.0.2.1", MASTER_PORT="29999")
        procs.append(subprocess.Popen([PYTHON, COMM, "--timeout-s", "3"], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, 9)
        pytest.fail("comm_check hung on an unreachable MASTER_ADDR")
    assert [p.returncode for p in procs] == [2, 2]
    error = [line for line in outputs[0][1].splitlines() if line.startswith("error:")]
    assert len(error) == 1, outputs[0][1]
    for needle in ("rank 0", socket.gethostname(), "192.0.2.1:29999", "MASTER_ADDR", "GLOO_SOCKET_IFNAME",
                   "NCCL_SOCKET_IFNAME", "NCCL_DEBUG=INFO"):
        assert needle in error[0]
    print(f"wrong MASTER_ADDR: both ranks exited in {time.perf_counter() - start:.1f} s")


def test_missing_rank_is_named(tmp_path):
    """Rank 0 alone of a world of 3: it names ranks 1 and 2 as never checked in."""
    env = clean_env(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run([PYTHON, COMM, "--timeout-s", "3"], 60, env=env)
    assert result.returncode == 2
    assert "rank(s) 1, 2 of 3 never checked in" in result.stderr
    assert "GLOO_SOCKET_IFNAME" in result.stderr


# -- two hosts with their own addresses: network namespaces + a veth pair ----------------------------

def test_two_namespace_hosts_train_across_veth(tmp_path):
    need_root("creating network namespaces")
    need_tools("ip", "unshare")
    tag = f"{os.getpid() % 10000}"
    ns = [f"ddp6a{tag}", f"ddp6b{tag}"]
    veth = [f"v6a{tag}", f"v6b{tag}"]
    addr = ["10.206.0.1", "10.206.0.2"]
    created = []
    try:
        for name in ns:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            created.append(name)
        subprocess.run(["ip", "link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1],
                        "netns", ns[1]], check=True, capture_output=True)
        for name, dev, ip in zip(ns, veth, addr):
            for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", dev], ["ip", "link", "set", dev, "up"],
                        ["ip", "link", "set", "lo", "up"]):
                subprocess.run(["ip", "netns", "exec", name, *cmd], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        _delete_namespaces(created)
        unavailable(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    try:
        port, procs = 29411, []
        for node in range(2):
            # Own UTS namespace too, so each "host" has its own host name in the placement table.
            inner = (f"hostname host{node} && exec {PYTHON} -m torch.distributed.run --nnodes=2 "
                     f"--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={addr[0]}:{port} "
                     f"--rdzv_id=ns{tag} --rdzv_conf=is_host={1 - node} --local_addr={addr[node]} "
                     f"{TRAIN} {' '.join(SMALL)} --output-dir {tmp_path / 'out'}")
            env = clean_env(GLOO_SOCKET_IFNAME=veth[node])
            log = open(tmp_path / f"node{node}.log", "w")
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns[node], "unshare", "--uts", "sh", "-c", inner],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        wait_all(procs, 150, tmp_path, "two-namespace run")
        summary = read_summary(tmp_path / "out")
        assert summary["world_size"] == 2 and summary["replicas_identical"]
        assert [(p["rank"], p["host"]) for p in summary["placement"]] == [(0, "host0"), (1, "host1")]
        assert "2 ranks on 2 host(s): host0, host1" in (tmp_path / "node0.log").read_text()
    finally:
        _delete_namespaces(created)


def _delete_namespaces(names):
    for name in names:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
