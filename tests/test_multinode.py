"""06_multinode: train.py and comm_check.py under real launchers (torchrun c10d, Open MPI, MPICH,
two network namespaces), and the failures a first multi-node launch meets."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest

from tests.launcher_tools import need_tools, openmpi_env, start_on_host, two_hosts
from tests.paths import PYTHON, REPO, load_script
from tests.processes import (
    short_run,
    clean_env,
    finish,
    free_port,
    full_logs,
    kill_group,
    run,
    start,
    torchrun_nodes,
    wait_all,
    warm_ranks,
)
from tests.quoted import ELASTIC_RESTART, NEVER_CHECKED_IN, UNREACHABLE
from tests.results import ROW, read_summary, summary_fields

TRAIN = REPO / "06_multinode" / "train.py"
COMM = REPO / "06_multinode" / "comm_check.py"
SMALL = short_run(max_steps=4)


@pytest.mark.launchers
@pytest.mark.min_torch
def test_torchrun_two_nodes_c10d_agrees_with_one_node(tmp_path, sample_run):
    # one worker each (the run the README's sample shows: tests/sample_runs.py)
    ran = sample_run("06-two-nodes").ok()
    two = read_summary(ran.output_dir / "two")
    # the one-node reference: its arithmetic is the claim, so its ranks start warm
    warm_ranks("06_multinode/train.py", *SMALL, "--output-dir", str(tmp_path / "one"), nproc=2)
    one = read_summary(tmp_path / "one")
    assert two["world_size"] == 2 and two["launcher"] == "torchrun"
    assert [p["rank"] for p in two["placement"]] == [0, 1]
    assert [p["local_rank"] for p in two["placement"]] == [0, 0]  # one worker per "node"
    assert [p["local_rank"] for p in one["placement"]] == [0, 1]  # two workers on one node
    assert two["replicas_identical"]
    # Same global batch and seed: the split into nodes does not change the arithmetic.
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert two["replica_checksums"] == one["replica_checksums"]
    # the printed table: tests/test_readme_text.py, 06's samples
    # summary.json: 01's fields and four more.
    assert summary_fields(TRAIN) - summary_fields(REPO / "01_basic_ddp" / "train.py") == {
        "placement",
        "scheduler",
        "master_addr",
        "master_port",
    }
    assert summary_fields(TRAIN) <= two.keys()


def test_placement_table_warns_when_two_ranks_share_a_gpu(capsys):
    """Two torchruns started on one node (a classic mistake) put two ranks
    on each of its GPUs. A GPU is known by its UUID: under per-rank GPU
    binding every rank uses cuda:0, each a different GPU."""
    train = load_script("06_multinode/train.py", "multinode_train")

    def rank(host, r, local_rank, device, uuid, visible="unset"):
        return dict(
            host=host, rank=r, local_rank=local_rank, device=device, gpu_uuid=uuid, visible=visible
        )

    train.print_placement(
        [
            rank("gpu1", 0, 0, "cuda:0", "GPU-a"),
            rank("gpu1", 1, 0, "cuda:0", "GPU-a"),
            rank("gpu2", 2, 0, "cuda:0", "GPU-c"),
            rank("gpu2", 3, 1, "cuda:1", "GPU-d"),
        ]
    )
    out = capsys.readouterr().out
    assert re.search(r"^\s+1\s+0\s+gpu1\s+cuda:0\s+unset$", out, re.M)
    assert "4 ranks on 2 host(s): gpu1, gpu2" in out
    assert (
        out.count("WARNING") == 1
        and "WARNING: ranks [0, 1] share one GPU (cuda:0 of rank 0) on gpu1" in out
    )
    # Per-rank binding (srun --gpus-per-task=1): cuda:0
    # everywhere, four GPUs, no warning; the masks are shown.
    train.print_placement(
        [rank("gpu1", r, r, "cuda:0", f"GPU-{r}", visible=str(r)) for r in range(4)]
    )
    out = capsys.readouterr().out
    assert "WARNING" not in out and re.search(r"^\s+3\s+3\s+gpu1\s+cuda:0\s+3$", out, re.M)
    train.print_placement([rank("vm", r, r, "cpu", "") for r in range(2)])
    assert "WARNING" not in capsys.readouterr().out  # CPU processes share the cores by design


def test_placement_table_is_printed_before_the_first_collective_of_the_default_group(
    tmp_path, monkeypatch, capsys
):
    """NCCL refuses two ranks on one GPU when it creates the default group's communicator, at
    its first collective (the DDP wrap's broadcast, or the download barrier). 06 gathers its
    table over a gloo group of its own and prints it before that. In-process, one rank, gloo: the
    DDP wrap is replaced by NCCL's refusal (no GPU can exist here); the table and its gather over
    the other group come first, and no collective reached the default group before the wrap."""
    import torch.distributed as dist

    from common.config import TrainConfig, load_config
    from common.launcher import launch_info

    train = load_script("06_multinode/train.py", "multinode_train")
    calls = []
    for name in ("all_gather_object", "all_reduce", "barrier", "broadcast"):
        real = getattr(dist, name)

        def recorder(*args, real=real, name=name, **kwargs):
            group = kwargs.get("group")
            calls.append((name, "default" if group in (None, dist.group.WORLD) else "own"))
            return real(*args, **kwargs)

        monkeypatch.setattr(dist, name, recorder)
    refusal = "Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1"

    def nccl_refuses(*args, **kwargs):
        calls.append(("DDP", "default"))
        raise RuntimeError(refusal)

    monkeypatch.setattr(train, "DDP", nccl_refuses)
    cfg = load_config(TrainConfig, ["--max-steps", "1", "--output-dir", str(tmp_path)])
    try:
        with pytest.raises(RuntimeError, match=refusal):
            train.train(cfg, launch_info({}))
    finally:
        dist.destroy_process_group()
    assert calls == [("all_gather_object", "own"), ("DDP", "default")]
    assert re.search(r"^\s+0\s+0\s+\S+\s+cpu\s+unset$", capsys.readouterr().out, re.M)


@pytest.mark.launchers
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
    began = time.perf_counter()
    run([*cmd, PYTHON, TRAIN, *SMALL, "--output-dir", tmp_path / "train"], 150, env=env, check=True)
    summary = read_summary(tmp_path / "train")
    assert summary["launcher"] == flavour
    assert summary["world_size"] == 2 and summary["replicas_identical"]
    assert [(p["rank"], p["local_rank"]) for p in summary["placement"]] == [(0, 0), (1, 1)]
    result = run(
        [*cmd, PYTHON, COMM, "--max-bytes", "65536", "--iters", "3", "--output-dir", tmp_path],
        150,
        env=env,
        check=True,
    )
    report = json.loads((tmp_path / "comm_check.json").read_text())
    assert report["launcher"] == flavour and report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["correct"] for r in report["results"])
    assert "peak busbw" in result.stdout
    print(f"{flavour}: train + comm_check wall time {time.perf_counter() - began:.1f} s")


# tests/inject/sitecustomize.py: DDP_TEST_SLOW_ALL_REDUCE_S
INJECT = f"{REPO}:{REPO / 'tests' / 'inject'}"


def check_figures(results, ranks):
    """nccl-tests' arithmetic: time averaged over the ranks, algbw = bytes / time,
    busbw = algbw * 2(n-1)/n; the slowest rank's figures from its own time."""
    n = len(ranks)
    for r in results:
        assert r["correct"]
        assert len(r["time_us_per_rank"]) == n
        assert r["time_us"] == pytest.approx(sum(r["time_us_per_rank"]) / n, rel=1e-9)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n, rel=1e-9)
        slowest = max(range(n), key=lambda i: r["time_us_per_rank"][i])
        assert r["slowest_rank"] == ranks[slowest]
        assert r["time_us_slowest"] == pytest.approx(r["time_us_per_rank"][slowest], rel=1e-9)
        assert r["busbw_gbps_slowest"] == pytest.approx(
            r["bytes"] / (r["time_us_slowest"] * 1e-6) / 1e9 * 2 * (n - 1) / n, rel=1e-9
        )


def check_avg_bus_bandwidth(part):
    """nccl-tests' "# Avg bus bandwidth": the mean busbw over
    the message sizes; and the same for the slowest rank."""
    busbw = [r["busbw_gbps"] for r in part["results"]]
    assert part["avg_busbw_gbps"] == pytest.approx(sum(busbw) / len(busbw), rel=1e-9)
    slowest = [r["busbw_gbps_slowest"] for r in part["results"]]
    assert part["avg_busbw_gbps_slowest"] == pytest.approx(sum(slowest) / len(slowest), rel=1e-9)
    assert part["avg_busbw_gbps_slowest"] <= part["avg_busbw_gbps"] * (1 + 1e-9)


def test_comm_check_prints_busbw_per_size(sample_run):
    """The README's command, as written, with smaller messages and fewer iterations, and three
    settings in its environment (the run the README's sample shows: tests/sample_runs.py)."""
    import torch

    result = sample_run("06-comm-check").ok()
    report = json.loads((result.output_dir / "comm_check.json").read_text())
    sizes = [r["bytes"] for r in report["results"]]
    assert sizes == [8 * 2**i for i in range(14)]  # 8 B, 16 B, ..., 64 KiB
    rows = {}
    for line in result.stdout.splitlines():
        if m := ROW.fullmatch(line):
            rows[int(m.group(1))] = (float(m.group(5)), int(m.group(6)), float(m.group(8)))
    assert sorted(rows) == sizes, result.stdout
    check_figures(report["results"], ranks=[0, 1])
    check_avg_bus_bandwidth(report)
    for r in report["results"]:
        assert rows[r["bytes"]] == (
            pytest.approx(r["busbw_gbps"], abs=1e-4),
            r["slowest_rank"],
            pytest.approx(r["busbw_gbps_slowest"], abs=1e-4),
        )
    assert (
        f"avg bus bandwidth {report['avg_busbw_gbps']:.4f} GB/s (slowest rank: "
        f"{report['avg_busbw_gbps_slowest']:.4f} GB/s)"
    ) in result.stdout
    # One node: its environment, and the sections that need several nodes say why they are skipped.
    [node] = report["nodes"]
    assert (
        node["ranks"] == [0, 1]
        and node["host"] == socket.gethostname()
        and node["torch"] == torch.__version__
    )
    assert (
        node["variables"]["FI_PROVIDER"] == "tcp"
        and node["variables"]["NCCL_SOCKET_IFNAME"] == "lo"
    )
    # only NCCL_*, FI_*, GLOO_*, TORCH_NCCL_*, *_SOCKET_IFNAME
    assert "UNRELATED_SETTING" not in node["variables"]
    address = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    assert node["transport"].startswith(
        f"gloo on {address}, the address this host name resolves to"
    )
    assert report["mismatches"] == {} and report["pairs"] is None
    assert report["intra_node"] == {
        "skipped": "one node: the all-ranks figures are the intra-node ones"
    }
    assert (
        "verdict: settings that differ: none; slow nodes: none; all results correct: True"
        in result.stdout
    )


@pytest.mark.launchers
def test_comm_check_two_nodes_environment_groups_and_a_slow_node(sample_run):
    """Two torchrun "nodes" of two ranks each; node B has another NCCL_IB_HCA and,
    injected from outside (tests/inject), sleeps 50 ms before every all-reduce.
    comm_check flags the setting, measures each node and the two nodes' first ranks,
    and names B as the slow node within a node; two nodes are too few for pairs (the run the
    README's sample shows: tests/sample_runs.py)."""
    ran = sample_run("06-comm-two-nodes").ok()
    output, tmp_path = ran.stdout, ran.output_dir
    report = json.loads((tmp_path / "comm_check.json").read_text())
    host = socket.gethostname()
    nodes = {n["node"]: n for n in report["nodes"]}
    # Two torchrun agents on one host are two nodes, told apart by torchrun's node rank.
    assert sorted(nodes) == [f"{host}/node0", f"{host}/node1"]
    assert [n["ranks"] for n in report["nodes"]] == [[0, 1], [2, 3]]
    assert [r["node"] for r in report["ranks"]] == [report["nodes"][0]["node"]] * 2 + [
        report["nodes"][1]["node"]
    ] * 2
    slow = next(label for label, n in nodes.items() if n["variables"]["NCCL_IB_HCA"] == "mlx5_1")
    fast = next(label for label in nodes if label != slow)
    assert all(
        n["transport"] == "gloo on interface lo (GLOO_SOCKET_IFNAME)" for n in nodes.values()
    )
    # Only the setting that differs is flagged, not the one both nodes share (GLOO_SOCKET_IFNAME).
    assert report["mismatches"] == {"NCCL_IB_HCA": {"mlx5_0": [fast], "mlx5_1": [slow]}}
    order = sorted(
        [("mlx5_0", fast), ("mlx5_1", slow)], key=lambda vn: vn[1] != report["nodes"][0]["node"]
    )
    assert (
        f"MISMATCH NCCL_IB_HCA: {order[0][0]} on {order[0][1]}; {order[1][0]} on {order[1][1]}"
        in output
    )
    # All ranks, each node's ranks, one rank per node.
    check_figures(report["results"], ranks=[0, 1, 2, 3])
    check_avg_bus_bandwidth(report)
    intra = {n["node"]: n for n in report["intra_node"]["nodes"]}
    for label, n in intra.items():
        check_figures(n["results"], ranks=nodes[label]["ranks"])
        check_avg_bus_bandwidth(n)
    assert report["intra_node"]["slow_nodes"] == [slow]  # and not the other node
    assert re.search(rf"^{re.escape(slow)}\s+2\s+[\d.]+\s+[\d.]+  SLOW$", output, re.M)
    assert report["inter_node"]["ranks"] == [0, 2]
    check_figures(report["inter_node"]["results"], ranks=[0, 2])
    check_avg_bus_bandwidth(report["inter_node"])
    [pair] = report["pairs"]["results"]
    assert sorted(pair["nodes"]) == sorted(nodes) and report["pairs"]["slow_nodes"] == []
    assert "slow nodes: cannot tell with 2 nodes" in output
    assert (
        f"verdict: settings that differ: NCCL_IB_HCA; slow nodes: {slow}; all results correct: True"
        in output
    )


@pytest.mark.launchers
@pytest.mark.parametrize("slow_node", [2, None], ids=["one-slow-node", "none-slow"])
def test_comm_check_pairs_name_the_slow_node(tmp_path, slow_node):
    """Three one-rank "nodes", every pair tested; a node whose every pair is slow (injected: 150 ms
    before each all-reduce, some 50x a pair's time here) is named, and none is named when no node
    is slowed (negative control). On this shared 2-core machine load alone moved pair figures up
    to 5x apart (measured), so the test asks for --slow-factor 10 rather than the default 2."""

    def env_of_node(node):
        slow = dict(DDP_TEST_SLOW_ALL_REDUCE_S="0.15") if node == slow_node else {}
        return clean_env(
            PYTHONPATH=INJECT, NCCL_IB_HCA="mlx5_1" if node == slow_node else "mlx5_0", **slow
        )

    torchrun_nodes(
        tmp_path,
        COMM,
        [
            "--min-bytes",
            "1048576",
            "--max-bytes",
            "1048576",
            "--iters",
            "10",
            "--pairs",
            "--slow-factor",
            "10",
            "--output-dir",
            str(tmp_path),
        ],
        nodes=3,
        env_of_node=env_of_node,
    )
    output = full_logs(tmp_path)
    report = json.loads((tmp_path / "comm_check.json").read_text())
    pairs = report["pairs"]
    labels = [n["node"] for n in report["nodes"]]
    assert sorted(p["nodes"] for p in pairs["results"]) == [
        [a, b] for i, a in enumerate(labels) for b in labels[i + 1 :]
    ]
    assert pairs["rounds"] == 3  # three nodes: one pair per round, one node sits out
    first_rank = {n["node"]: n["ranks"][0] for n in report["nodes"]}
    for p in pairs["results"]:
        assert p["ranks"] == [first_rank[label] for label in p["nodes"]]
        check_figures([p], ranks=p["ranks"])
    marked = [n["node"] for n in report["nodes"] if n["variables"]["NCCL_IB_HCA"] == "mlx5_1"]
    assert pairs["slow_nodes"] == marked, output[-3000:]
    assert (
        "slow nodes (even the fastest pair below the median node's fastest pair / 10): "
        f"{', '.join(marked) or 'none'}" in output
    )
    assert f"slow nodes: {', '.join(marked) or 'none'};" in output  # the verdict
    assert report["intra_node"] == {
        "skipped": "one rank per node: nothing to measure within a node"
    }


@pytest.fixture(scope="module")
def comm():
    return load_script("06_multinode/comm_check.py", "comm_check")


def test_pair_rounds_meet_every_pair_once_in_disjoint_rounds(comm):
    for n in range(2, 10):
        rounds = comm.pair_rounds(n)
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)
        assert sorted(p for r in rounds for p in r) == [
            (a, b) for a in range(n) for b in range(a + 1, n)
        ]
        for r in rounds:  # disjoint, so a round's pairs can run at the same time
            nodes = [node for pair in r for node in pair]
            assert len(nodes) == len(set(nodes))


def test_nodes_are_host_names_and_torchrun_node_ranks_on_a_shared_host(comm):
    def table(*host_agent):
        return [
            dict(rank=r, host=h, agent=a, local_rank=0, device="cpu")
            for r, (h, a) in enumerate(host_agent)
        ]

    assert comm.group_nodes(table(("gpu1", "0"), ("gpu1", "0"), ("gpu2", "1"))) == [
        ("gpu1", [0, 1]),
        ("gpu2", [2]),
    ]
    assert comm.group_nodes(table(("gpu1", ""), ("gpu2", ""), ("gpu1", ""))) == [
        ("gpu1", [0, 2]),
        ("gpu2", [1]),
    ]
    assert comm.group_nodes(table(("vm", "0"), ("vm", "1"), ("vm", "0"))) == [
        ("vm/node0", [0, 2]),
        ("vm/node1", [1]),
    ]


def test_mismatches_cover_versions_and_variables(comm):
    def env(torch="2.14.1", **variables):
        return dict(
            torch=torch,
            cuda="13.0",
            nccl="2.30.7",
            gpus="8 x H100",
            variables=variables,
            host_address="x",
        )

    envs = [
        env(NCCL_IB_HCA="mlx5_0"),
        env(NCCL_IB_HCA="mlx5_0"),
        env("2.13.0", NCCL_IB_HCA="mlx5_0", FI_PROVIDER="efa"),
    ]
    node_of_rank = {0: "a", 1: "a", 2: "b"}
    assert comm.mismatches(envs, node_of_rank) == {
        "torch": {"2.14.1": ["a"], "2.13.0": ["b"]},
        "FI_PROVIDER": {"(unset)": ["a"], "efa": ["b"]},
    }
    assert comm.mismatches(envs[:2], node_of_rank) == {}


def test_transport_says_what_the_backend_uses_or_how_to_see_it(comm):
    assert comm.transport("gloo", dict(variables={}, host_address="10.0.0.1")).startswith(
        "gloo on 10.0.0.1, the address this host name resolves to (GLOO_SOCKET_IFNAME unset"
    )
    quiet = comm.transport("nccl", dict(variables={}, host_address="x"))
    assert (
        "only with NCCL_DEBUG=INFO" in quiet
        and "'NCCL INFO Using network IB'" in quiet
        and "AWS Libfabric" in quiet
    )
    verbose = comm.transport("nccl", dict(variables={"NCCL_DEBUG": "INFO"}, host_address="x"))
    assert (
        "its choice is in this job's log (NCCL_DEBUG=INFO)" in verbose
        and "only with" not in verbose
    )


def test_loopback_host_name_warns_only_for_gloo_across_hosts(comm, capsys):
    env = dict(torch="t", cuda="c", nccl="n", gpus="none", variables={}, host_address="127.0.1.1")
    nodes = [("h1", [0]), ("h2", [1])]
    comm.print_environment("gloo", nodes, [env, env], {}, several_hosts=True)
    assert (
        capsys.readouterr().out.count(
            "WARNING: the host name resolves to 127.0.1.1, so gloo listens on loopback"
        )
        == 2
    )
    # one host: loopback reaches all
    comm.print_environment("gloo", nodes, [env, env], {}, several_hosts=False)
    with_ifname = dict(env, variables={"GLOO_SOCKET_IFNAME": "eth0"})
    comm.print_environment("gloo", nodes, [with_ifname] * 2, {}, several_hosts=True)
    assert "WARNING" not in capsys.readouterr().out


def test_nccl_version_is_torchs_or_says_why_not(comm, monkeypatch):
    import torch
    import torch.distributed as dist

    if dist.is_nccl_available():
        assert comm.environment(torch.device("cpu"))["nccl"] == ".".join(
            map(str, torch.cuda.nccl.version())
        )
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert comm.environment(torch.device("cpu"))["nccl"] == "n/a (torch built without NCCL)"


def test_slow_nodes_are_below_half_the_median(comm):
    assert comm.slow_nodes({"a": 10.0, "b": 9.0, "c": 4.4}, 2.0) == ["c"]
    assert comm.slow_nodes({"a": 10.0, "b": 9.0, "c": 4.6}, 2.0) == []
    assert comm.slow_nodes({"a": 10.0, "b": 9.0, "c": 4.4}, 3.0) == []


def test_timed_iterations_are_fewer_above_one_mib_and_at_least_3(comm):
    """--iters' help (the README samples' iters column: tests/test_readme_text.py); the sizes go up
    to 256 MiB by default (06's README)."""
    fields = comm.CommConfig.__dataclass_fields__
    assert fields["iters"].default == 20 and fields["max_bytes"].default == 2**28
    assert [comm.timed_iterations(2**k, 20) for k in (3, 20, 21, 22, 23, 28)] == [
        20,
        20,
        10,
        5,
        3,
        3,
    ]


def test_comm_check_refuses_cuda_without_a_visible_gpu():
    """--device cuda where the mask hides every GPU (or there
    is none): one line and exit code 2, no process group."""
    result = run([PYTHON, COMM, "--device", "cuda"], 120, env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2, result.output
    assert (
        result.stderr
        == "error: --device cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES=)\n"
    )


@pytest.mark.launchers
def test_wrong_master_addr_fails_clearly_within_timeout(tmp_path):
    """An unreachable MASTER_ADDR: every rank gives up after
    its timeout, naming the address and what to check."""
    began = time.perf_counter()
    unreachable = dict(MASTER_ADDR="192.0.2.1", MASTER_PORT="29999")
    procs = [
        start(
            [PYTHON, COMM, "--timeout-s", "3"],
            env=clean_env(RANK=str(rank), WORLD_SIZE="2", **unreachable),
        )
        for rank in range(2)
    ]
    outputs = [finish(p, 90, "comm_check on an unreachable MASTER_ADDR") for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    error = [line for line in outputs[0][1].splitlines() if line.startswith("error:")]
    assert len(error) == 1, outputs[0][1]
    for needle in (
        "rank 0",
        socket.gethostname(),
        "192.0.2.1:29999",
        "MASTER_ADDR",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "NCCL_DEBUG=INFO",
    ):
        assert needle in error[0]
    # (the README's table of errors quotes it: tests/test_readme_text.py)
    unreachable = UNREACHABLE.format(rank=0, host=socket.gethostname(), addr="192.0.2.1:29999", s=3)
    assert error[0].startswith(unreachable), error[0]
    print(f"wrong MASTER_ADDR: both ranks exited in {time.perf_counter() - began:.1f} s")


@pytest.mark.launchers
def test_missing_rank_is_named(tmp_path):
    """Rank 0 alone of a world of 3: it names ranks 1 and 2 as never checked in."""
    env = clean_env(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run([PYTHON, COMM, "--timeout-s", "3"], 60, env=env)
    assert result.returncode == 2
    assert NEVER_CHECKED_IN.format(ranks="1, 2", world=3) in result.stderr
    assert "GLOO_SOCKET_IFNAME" in result.stderr


# -- two hosts with their own addresses (tests/launcher_tools.py, two_hosts) -------------------


@pytest.mark.launchers
def test_two_namespace_hosts_train_across_veth(tmp_path):
    with two_hosts(206) as (ns, veth, addr):
        tag, port, procs = os.getpid() % 10000, 29411, []
        for node in range(2):
            # Own UTS namespace too, so each "host" has its own host name in the placement table.
            inner = (
                f"exec {PYTHON} -m torch.distributed.run --nnodes=2 "
                f"--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={addr[0]}:{port} "
                f"--rdzv_id=ns{tag} --rdzv_conf=is_host={1 - node} --local_addr={addr[node]} "
                f"{TRAIN} {' '.join(SMALL)} --output-dir {tmp_path / 'out'}"
            )
            env = clean_env(GLOO_SOCKET_IFNAME=veth[node])
            procs.append(
                start_on_host(ns[node], f"host{node}", inner, env, tmp_path / f"node{node}.log")
            )
        wait_all(procs, 150, tmp_path, "two-namespace run")
        summary = read_summary(tmp_path / "out")
        assert summary["world_size"] == 2 and summary["replicas_identical"]
        assert [(p["rank"], p["host"]) for p in summary["placement"]] == [
            (0, "host0"),
            (1, "host1"),
        ]
        assert "2 ranks on 2 host(s): host0, host1" in (tmp_path / "node0.log").read_text()


# -- torchrun --nnodes=1:2: a node leaves -------------------------------------------------------

ELASTIC_STEPS = """
import os, socket, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}: rank {rank} of {world} on "
      f"{socket.gethostname()}", flush=True)
# long enough that the kill finds both training however slow the machine; short once restarted
for step in range(48 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 8):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.25)
print(f"rank {rank} finished in a world of {world}", flush=True)
dist.destroy_process_group()
"""


def _elastic_pair(tmp_path, ns, veth, addr, run_id, max_restarts):
    """Both hosts' torchrun --nnodes=1:2, host 1 killed whole once both train; host 0's exit code
    and log."""
    script = tmp_path / "steps.py"
    script.write_text(ELASTIC_STEPS)
    port, procs, logs = free_port(), [], [tmp_path / f"{run_id}-host{n}.log" for n in (0, 1)]
    for node in (0, 1):
        conf = (
            f"is_host={1 - node},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2"
        )
        inner = (
            f"exec {PYTHON} -m torch.distributed.run --nnodes=1:2 --nproc-per-node=1 "
            f"--max-restarts={max_restarts} --monitor-interval=1 --rdzv-backend=c10d "
            f"--rdzv-endpoint={addr[0]}:{port} --rdzv-id={run_id} --rdzv-conf={conf} "
            f"--local-addr={addr[node]} {script}"
        )
        env = clean_env(GLOO_SOCKET_IFNAME=veth[node], LOGLEVEL="INFO")
        procs.append(start_on_host(ns[node], f"host{node}", inner, env, logs[node]))
    try:
        deadline = time.monotonic() + 90
        while "attempt 0: rank 0 of 2" not in logs[0].read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, full_logs(tmp_path)
            time.sleep(0.5)
        time.sleep(1)
        kill_group(procs[1])  # the host goes: its torchrun and its worker, at once
        procs[1].wait()
        finish(procs[0], 120, f"the remaining host of {run_id}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
    return procs[0].returncode, logs[0].read_text()


@pytest.mark.launchers
def test_elastic_torchrun_goes_on_without_a_host_that_leaves_only_with_a_restart_left(tmp_path):
    """The guide's elastic entry on two hosts of their own: torchrun --nnodes=1:2, host 1 killed
    while both train. With --max-restarts=1, host 0's worker fails (gloo: connection closed),
    torchrun restarts it, the rendezvous completes with host 0 alone, and it finishes in a world of
    1. With torchrun's default, --max-restarts=0, the same loss ends host 0's run."""
    with two_hosts(207) as (ns, veth, addr):
        code, log = _elastic_pair(tmp_path, ns, veth, addr, "elastic1", max_restarts=1)
        assert code == 0, log[-4000:]
        assert ELASTIC_RESTART in log
        assert "attempt 1: rank 0 of 1 on host0" in log
        assert "rank 0 finished in a world of 1" in log and "finished in a world of 2" not in log
        code, log = _elastic_pair(tmp_path, ns, veth, addr, "elastic0", max_restarts=0)
        assert code == 1, log[-4000:]
        assert "attempts left" not in log and "attempt 1:" not in log, log[-4000:]
