"""06 - comm_check: the network and node-health check to run on a new allocation before training.

1. Every rank checks in at rank 0's store (MASTER_ADDR:MASTER_PORT) with its host and device; rank 0
   prints the table, or names the ranks that never arrived.
2. The environment of every node: torch, CUDA and NCCL versions, GPUs, every NCCL_*, FI_*, GLOO_*,
   TORCH_NCCL_* and *_SOCKET_IFNAME variable, and the network the backend uses. A version or setting
   that differs between nodes is flagged MISMATCH (a classic cause of hangs and of one slow node).
3. All-reduce latency and bandwidth for message sizes from --min-bytes (8 B) to --max-bytes (256
   MiB),
   doubling, as nccl-tests report them:
       algbw = bytes / time          busbw = algbw * 2 (n - 1) / n
   busbw is what each link carries in a ring all-reduce, so it is comparable across world sizes and
   against the hardware's link speed. `time` is each rank's time per all-reduce averaged over the
   ranks
   (nccl-tests' default, `-a 1`); the slowest rank's time and busbw stand next to it. "avg bus
   bandwidth" is the mean busbw over the sizes, as nccl-tests' "# Avg bus bandwidth". Measured for
   all
   ranks, within each node (all nodes at once) and between nodes (one rank per node).
4. --pairs: every pair of nodes (one rank each) at --max-bytes, in rounds of disjoint pairs. A node
   whose fastest pair is below the median node's fastest pair / --slow-factor (2) is named slow:
   every
   pair it is in is slow (needs 3+ nodes). Within nodes, the same rule on each node's avg bus
   bandwidth.
5. A failure ends within --timeout-s with one line naming the rank, the host and the address it
   could not reach, and the environment variables to check.

A node is a host name; under torchrun, the host name and torchrun's node rank (GROUP_RANK),
so two torchrun "nodes" on one machine count as two (labelled host/node0, host/node1).

Run it with the same launcher and resources as the training job:
    torchrun --standalone --nproc_per_node=2 06_multinode/comm_check.py --max-bytes 16777216
    mpiexec -n 2 python 06_multinode/comm_check.py
    srun --ntasks-per-node=4 python 06_multinode/comm_check.py --pairs     # GPUs: nccl
"""

import dataclasses
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from common.config import field, load_config
from common.errors import ConfigError, LauncherError
from common.bad_input import exit_on_bad_input
from common.launcher import choose_backend, detect_launcher, host_address
from common.report import write_json_atomic

MIB = 1 << 20
CHECK_VARIABLES = (
    "MASTER_ADDR/MASTER_PORT (reachable from every node, port open)",
    "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the interface on the network between the nodes)",
    "NCCL_DEBUG=INFO (NCCL's own account of what it tried)",
)
REPORTED_PREFIXES = ("NCCL_", "FI_", "GLOO_", "TORCH_NCCL_")  # and every *_SOCKET_IFNAME
VERSIONS = ("torch", "cuda", "nccl", "gpus")  # compared across nodes, as the variables are
NCCL_TRANSPORT_LINES = (
    "'NCCL INFO Using network IB' (InfiniBand or RoCE), 'Socket' (TCP: slow between nodes) "
    "or a plugin's name ('AWS Libfabric' or 'Libfabric' for aws-ofi-nccl, EFA); "
    "'NET/IB : Using ...' and 'NET/Socket : Using ...' name the devices"
)


@dataclasses.dataclass
class CommConfig:
    """All-reduce latency and bus bandwidth across all ranks, within and between nodes,
    with the environment of every node and a clear error when a rank is unreachable."""

    min_bytes: int = field(8, "smallest message in bytes", min=4)
    max_bytes: int = field(256 * MIB, "largest message in bytes (doubling from --min-bytes)", min=4)
    iters: int = field(20, "timed all-reduces per size (fewer above 1 MiB, at least 3)", min=1)
    warmup: int = field(2, "untimed all-reduces per size", min=0)
    pairs: bool = field(
        False, "also test every pair of nodes (one rank each) at --max-bytes and name slow nodes"
    )
    slow_factor: float = field(
        2.0,
        "a node is slow when its bus bandwidth is below the median node's divided by this",
        min=1.0,
    )
    backend: str = field(
        "auto",
        "process-group backend (auto: nccl on GPUs, gloo on CPUs)",
        choices=("auto", "gloo", "nccl"),
    )
    device: str = field(
        "auto",
        "device type (auto: cuda if there is a GPU, else cpu)",
        choices=("auto", "cpu", "cuda"),
    )
    timeout_s: float = field(
        60.0, "seconds to wait for every rank to check in, and for each collective", min=1.0
    )
    output_dir: str = field("", "if set, rank 0 writes comm_check.json here")

    def validate(self):  # called by load_config
        if self.max_bytes < self.min_bytes:
            raise ConfigError(f"--max-bytes {self.max_bytes} is below --min-bytes {self.min_bytes}")
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError("backend: nccl does not support cpu tensors (use gloo or auto)")


def hint() -> str:
    return "check " + "; ".join(CHECK_VARIABLES)


# -- who is where
# --------------------------------------------------------------------------------------


def check_in(info, device, timeout_s):
    """Rendezvous at rank 0's TCP store; return every rank's row (host,
    local rank, device, torchrun node rank, CUDA_VISIBLE_DEVICES).

    We build the store ourselves (the same MASTER_ADDR/PORT that env:// would use)
    so that rank 0 can tell which ranks never arrived instead of only "timed out".
    """
    host = socket.gethostname()
    where = f"{info.master_addr}:{info.master_port}"
    # Under torchrun the agent already serves the store on MASTER_PORT; the workers are clients.
    is_server = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(
            info.master_addr.strip("[]"),
            info.master_port,
            info.world_size,
            is_server,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise LauncherError(
            f"rank {info.rank} on {host} cannot reach rank 0's store at {where} within "
            f"{timeout_s:.0f} s "
            f"({_first_line(exc)}); {hint()}"
        ) from None
    prefix = f"comm_check/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(prefix, store)
    # torchrun's node rank
    agent = os.environ.get("GROUP_RANK", "") if info.launcher == "torchrun" else ""
    # a site's per-rank GPU binding sets it
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    store.set(f"rank{info.rank}", f"{host}|{info.local_rank}|{device}|{agent}|{visible}")
    keys = [f"rank{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError):
        missing = [r for r, key in enumerate(keys) if not _has(store, key)]
        arrived = sorted({store.get(k).decode().split("|")[0] for k in keys if _has(store, k)})
        raise LauncherError(
            f"rank {info.rank} on {host}: rank(s) {_ranges(missing)} of {info.world_size} "
            "never checked in at "
            f"{where} within {timeout_s:.0f} s (arrived from: "
            f"{', '.join(arrived) or 'none'}); were all "
            f"{info.world_size} processes started, and do the missing hosts reach {where}? {hint()}"
        ) from None
    table = []
    for rank, key in enumerate(keys):
        h, lr, dev, ag, visible = store.get(key).decode().split("|")
        table.append(
            dict(rank=rank, host=h, local_rank=int(lr), device=dev, agent=ag, visible=visible)
        )
    return store, table


def _has(store, key) -> bool:
    try:
        return store.check([key])
    except RuntimeError:
        return False


def _ranges(ranks) -> str:
    return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")


def _first_line(exc) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def group_nodes(table):
    """[(label, ranks)] in order of each node's first rank. A node is a host,
    or under torchrun a host and torchrun's node rank; the label is the
    host name, with /node<GROUP_RANK> where two nodes share a host."""
    nodes = {}
    for row in table:
        nodes.setdefault((row["host"], row["agent"]), []).append(row["rank"])
    shared = {host for host, _ in nodes if sum(h == host for h, _ in nodes) > 1}
    return [
        (f"{host}/node{agent}" if host in shared else host, ranks)
        for (host, agent), ranks in nodes.items()
    ]


# -- the environment of every node
# ---------------------------------------------------------------------


def environment(device) -> dict:
    """This rank's versions, GPUs, communication variables
    and the address its host name resolves to."""
    nccl = "n/a (torch built without NCCL)"
    if dist.is_nccl_available():
        # the NCCL library torch loaded; a CUDA build reports it even on a machine without a GPU
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError) as exc:
            nccl = f"n/a ({_first_line(exc)})"
    gpus = "none"
    if device.type == "cuda":
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
    variables = {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(REPORTED_PREFIXES) or name.endswith("_SOCKET_IFNAME")
    }
    address = host_address()
    return dict(
        torch=torch.__version__,
        cuda=torch.version.cuda or "none",
        nccl=nccl,
        gpus=gpus,
        variables=variables,
        host_address=address,
    )


def transport(backend, env) -> str:
    """Which network the backend uses on this node, or how to see it."""
    variables = env["variables"]
    if backend == "gloo":
        if "GLOO_SOCKET_IFNAME" in variables:
            return f"gloo on interface {variables['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
        return (
            f"gloo on {env['host_address']}, the address this host name resolves to "
            "(GLOO_SOCKET_IFNAME "
            "unset; gloo falls back to loopback if it cannot use it)"
        )
    if variables.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        return (
            "nccl: its choice is in this job's log "
            f"(NCCL_DEBUG={variables['NCCL_DEBUG']}): {NCCL_TRANSPORT_LINES}"
        )
    return (
        "nccl prints its choice only with NCCL_DEBUG=INFO: rerun with it and look for "
        f"{NCCL_TRANSPORT_LINES}"
    )


def mismatches(envs, node_of_rank) -> dict:
    """{setting: {value: [nodes]}} for every version or
    variable whose value is not the same on all ranks."""
    names = list(VERSIONS) + sorted({name for env in envs for name in env["variables"]})
    found = {}
    for name in names:
        by_value = {}
        for rank, env in enumerate(envs):
            value = env[name] if name in VERSIONS else env["variables"].get(name, "(unset)")
            nodes = by_value.setdefault(value, [])
            if node_of_rank[rank] not in nodes:
                nodes.append(node_of_rank[rank])
        if len(by_value) > 1:
            found[name] = by_value
    return found


def print_environment(backend, nodes, envs, differ, several_hosts):
    print(
        "environment (one block per node; MISMATCH: a version or setting that differs "
        "between nodes):"
    )
    for label, ranks in nodes:
        env = envs[ranks[0]]
        print(
            f"node {label} (ranks {_ranges(ranks)}): torch {env['torch']}, cuda "
            f"{env['cuda']}, nccl {env['nccl']}, "
            f"gpus {env['gpus']}"
        )
        print(f"    transport: {transport(backend, env)}")
        if (
            backend == "gloo"
            and several_hosts
            and "GLOO_SOCKET_IFNAME" not in env["variables"]
            and (
                env["host_address"].startswith("127.")
                or env["host_address"] in ("::1", "unresolved")
            )
        ):
            print(
                f"    WARNING: the host name resolves to {env['host_address']}, so gloo "
                "listens on loopback, "
                "where other hosts cannot connect: set GLOO_SOCKET_IFNAME"
            )
        for name, value in env["variables"].items():
            print(f"    {name}={value}")
    for name, by_value in differ.items():
        print(
            f"MISMATCH {name}: "
            + "; ".join(f"{value} on {', '.join(on)}" for value, on in by_value.items())
        )
    if not differ:
        print(f"all {len(nodes)} node(s) agree on versions, GPUs and NCCL_*/FI_*/GLOO_* settings")


# -- all-reduce timing
# ---------------------------------------------------------------------------------


def sizes(cfg):
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        yield size
        size *= 2


def timed_iterations(size, iters):
    """--iters up to 1 MiB; above it fewer (a large
    all-reduce takes long enough to time), at least 3."""
    return iters if size <= MIB else max(3, iters * MIB // size)


def bench(size, cfg, device, group):
    """Collective on `group`: every member's seconds per all-reduce
    of `size` bytes, and whether all sums were right."""
    n = dist.get_world_size(group)
    count = max(1, size // 4)  # float32 elements
    iters = timed_iterations(size, cfg.iters)
    tensor = torch.full((count,), float(dist.get_rank(group) + 1), device=device)
    dist.all_reduce(tensor, group=group)  # correctness first: sum of (rank + 1) over the group
    correct = bool((tensor == n * (n + 1) / 2).all())
    tensor.zero_()  # zeros stay zeros, however often they are summed
    for _ in range(cfg.warmup):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    barrier(device, group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    mine = torch.tensor(
        [(time.perf_counter() - start) / iters, float(not correct)],
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine, group=group)
    return [t[0].item() for t in everyone], iters, all(t[1].item() == 0.0 for t in everyone)


@contextmanager
def failing_clearly(size, backend):
    """A collective that fails ends this rank with one line saying what to check."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        raise LauncherError(
            f"rank {dist.get_rank()} on {socket.gethostname()}: all-reduce of {size} bytes failed "
            f"({_first_line(exc)}): a rank died or the nodes cannot open {backend}'s own "
            "connections "
            f"(ports other than MASTER_PORT); {hint()}"
        ) from None


def barrier(device, group=None):
    """dist.barrier() on this rank's GPU where `group` runs nccl: without device_ids, a barrier
    before the group's first collective guesses the GPU from the global rank."""
    nccl = dist.get_backend(group) == "nccl"
    dist.barrier(group=group, device_ids=[device.index] if nccl else None)


def _sync(device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def figures(size, iters, seconds, correct, ranks) -> dict:
    """One size: nccl-tests' figures (time averaged over the ranks) and the slowest rank's."""
    n = len(seconds)
    factor = 2 * (n - 1) / n  # bytes each link carries in a ring all-reduce, per byte reduced
    average = sum(seconds) / n
    slowest = max(range(n), key=lambda i: seconds[i])
    algbw = size / average / 1e9
    return dict(
        bytes=size,
        iters=iters,
        time_us=average * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * factor,
        slowest_rank=ranks[slowest],
        time_us_slowest=seconds[slowest] * 1e6,
        busbw_gbps_slowest=size / seconds[slowest] / 1e9 * factor,
        time_us_per_rank=[s * 1e6 for s in seconds],
        correct=correct,
    )


def overall(results) -> dict:
    big = [r["busbw_gbps"] for r in results if r["bytes"] >= MIB] or [
        r["busbw_gbps"] for r in results
    ]
    # nccl-tests' "Avg bus bandwidth"
    return dict(
        avg_busbw_gbps=statistics.mean(r["busbw_gbps"] for r in results),
        avg_busbw_gbps_slowest=statistics.mean(r["busbw_gbps_slowest"] for r in results),
        peak_busbw_gbps=max(big),
        all_correct=all(r["correct"] for r in results),
    )


TABLE_HEADER = (
    f"{'size(B)':>12} {'iters':>6} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}   "
    f"{'slowest':>7} {'time(us)':>12} {'busbw(GB/s)':>12}  correct"
)


def table_row(r) -> str:
    return (
        f"{r['bytes']:>12} {r['iters']:>6} {r['time_us']:>12.1f} {r['algbw_gbps']:>12.4f} "
        f"{r['busbw_gbps']:>12.4f}   "
        f"{r['slowest_rank']:>7} {r['time_us_slowest']:>12.1f} "
        f"{r['busbw_gbps_slowest']:>12.4f}  {r['correct']}"
    )


def summary_line(s) -> str:
    return (
        f"avg bus bandwidth {s['avg_busbw_gbps']:.4f} GB/s (slowest rank: "
        f"{s['avg_busbw_gbps_slowest']:.4f} GB/s); "
        f"peak busbw {s['peak_busbw_gbps']:.3f} GB/s; all results correct: {s['all_correct']}"
    )


def measure(cfg, device, backend, group, show):
    """Collective over all ranks: every size on `group` (a member's group, or
    None for a non-member), all ranks in step after each size, so no rank
    waits in a collective longer than one size's test. Members get rows."""
    results = []
    for size in sizes(cfg):
        with failing_clearly(size, backend):
            if group is not None:
                seconds, iters, correct = bench(size, cfg, device, group)
                results.append(
                    figures(size, iters, seconds, correct, dist.get_process_group_ranks(group))
                )
                if show:
                    print(table_row(results[-1]), flush=True)
            barrier(device)
    return results


def new_groups(rank_lists, cfg):
    """Collective: one process group per list, created by every
    rank in the same order; this rank's group or None."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timedelta(seconds=cfg.timeout_s))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def slow_nodes(figure_by_node, factor) -> list:
    """Nodes whose figure is below the median node's / factor."""
    reference = statistics.median(figure_by_node.values())
    return [node for node, value in figure_by_node.items() if value < reference / factor]


def intra_node(cfg, device, backend, nodes):
    """Each node's ranks together, all nodes at once; rank
    0 prints the lowest node per size and each node."""
    multi = [(label, ranks) for label, ranks in nodes if len(ranks) > 1]
    if len(nodes) == 1 or not multi:
        return dict(
            skipped="one node: the all-ranks figures are the intra-node ones"
            if len(nodes) == 1
            else "one rank per node: nothing to measure within a node"
        )
    group = new_groups([ranks for _, ranks in multi], cfg)
    results = measure(cfg, device, backend, group, show=False)
    # each node's first rank reports
    mine = next((label for label, ranks in multi if ranks[0] == dist.get_rank()), None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, results) if mine else None)
    ranks_of = dict(multi)
    per_node = [
        dict(node=label, ranks=ranks_of[label], results=rows, **overall(rows))
        for label, rows in filter(None, gathered)
    ]
    slow = slow_nodes({n["node"]: n["avg_busbw_gbps"] for n in per_node}, cfg.slow_factor)
    if dist.get_rank() == 0:
        print(
            f"intra-node: the ranks of each node together, {len(multi)} nodes at once "
            "(rank-averaged time, as above)"
        )
        print(
            f"{'size(B)':>12} {'iters':>6} {'median node busbw(GB/s)':>24} "
            f"{'lowest busbw(GB/s)':>19}  lowest node"
        )
        for i, size in enumerate(sizes(cfg)):
            rows = sorted(((n["results"][i]["busbw_gbps"], n["node"]) for n in per_node))
            print(
                f"{size:>12} {per_node[0]['results'][i]['iters']:>6} "
                f"{statistics.median(b for b, _ in rows):>24.4f} {rows[0][0]:>19.4f}  {rows[0][1]}"
            )
        print(f"{'node':<24} {'ranks':>5} {'avg bus bandwidth(GB/s)':>24} {'peak busbw(GB/s)':>17}")
        for n in per_node:
            print(
                f"{n['node']:<24} {len(n['ranks']):>5} {n['avg_busbw_gbps']:>24.4f} "
                f"{n['peak_busbw_gbps']:>17.3f}" + ("  SLOW" if n["node"] in slow else "")
            )
        print(
            f"slow nodes (avg bus bandwidth below the median node's / {cfg.slow_factor:g}): "
            f"{', '.join(slow) or 'none'}",
            flush=True,
        )
    return dict(nodes=per_node, slow_nodes=slow)


def inter_node(cfg, device, backend, nodes):
    """One rank per node (each node's first rank), all in one group."""
    if len(nodes) == 1 or all(len(ranks) == 1 for _, ranks in nodes):
        return dict(
            skipped="one node: nothing crosses a network"
            if len(nodes) == 1
            else "one rank per node: the all-ranks figures are the inter-node ones"
        )
    firsts = [ranks[0] for _, ranks in nodes]
    group = new_groups([firsts], cfg)
    if dist.get_rank() == 0:
        print(
            f"inter-node: one rank per node (ranks {_ranges(firsts)}), {len(nodes)} "
            f"nodes\n{TABLE_HEADER}",
            flush=True,
        )
    results = measure(cfg, device, backend, group, show=dist.get_rank() == 0)
    gathered = [None] * dist.get_world_size()
    # rank 0 is a member
    dist.all_gather_object(gathered, results if dist.get_rank() == 0 else None)
    results = gathered[0]
    if dist.get_rank() == 0:
        print(summary_line(overall(results)), flush=True)
    return dict(ranks=firsts, results=results, **overall(results))


def pair_rounds(n) -> list:
    """Every pair of n nodes exactly once, in rounds of disjoint pairs:
    the circle method of round-robin tournaments (n - 1 rounds for
    even n, n for odd n, where one node sits each round out)."""
    seats = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(seats) - 1):
        half = len(seats) // 2
        rounds.append(
            [tuple(sorted(p)) for p in zip(seats[:half], reversed(seats[half:])) if None not in p]
        )
        seats = [seats[0], seats[-1], *seats[1:-1]]  # keep seat 0, turn the others one place
    return rounds


def node_pairs(cfg, device, backend, nodes):
    """Every pair of nodes, first rank of each, at
    --max-bytes; disjoint pairs run at the same time."""
    firsts, labels, size = (
        [ranks[0] for _, ranks in nodes],
        [label for label, _ in nodes],
        cfg.max_bytes,
    )
    rounds = pair_rounds(len(nodes))
    if dist.get_rank() == 0:
        print(
            f"node pairs: one rank per node, {size} B; {sum(map(len, rounds))} pair(s) in "
            f"{len(rounds)} round(s), "
            f"the pairs of a round at the same time\n"
            f"{'node':<24} {'node':<24} {'busbw(GB/s)':>12} {'time(us)':>12}  correct",
            flush=True,
        )
    mine = []
    for pairs in rounds:
        groups = [
            dist.new_group([firsts[a], firsts[b]], timeout=timedelta(seconds=cfg.timeout_s))
            for a, b in pairs
        ]
        with failing_clearly(size, backend):
            for (a, b), group in zip(pairs, groups):
                if dist.get_rank() in (firsts[a], firsts[b]):
                    seconds, iters, correct = bench(size, cfg, device, group)
                    if dist.get_rank() == firsts[a]:  # one report per pair
                        mine.append(
                            dict(
                                nodes=[labels[a], labels[b]],
                                ranks=[firsts[a], firsts[b]],
                                **figures(size, iters, seconds, correct, [firsts[a], firsts[b]]),
                            )
                        )
            barrier(device)  # the round is over on every rank before its groups go
        for group in groups:
            # frees NCCL's communicators; a no-op where this rank is no member
            dist.destroy_process_group(group)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    # slowest pair first
    results = sorted((p for ps in gathered for p in ps), key=lambda p: p["busbw_gbps"])
    best = {label: max(p["busbw_gbps"] for p in results if label in p["nodes"]) for label in labels}
    slow = slow_nodes(best, cfg.slow_factor) if len(nodes) >= 3 else []
    if dist.get_rank() == 0:
        for p in results:
            print(
                f"{p['nodes'][0]:<24} {p['nodes'][1]:<24} {p['busbw_gbps']:>12.4f} "
                f"{p['time_us']:>12.1f}  {p['correct']}"
            )
        if len(nodes) < 3:
            print(
                "slow nodes: cannot tell with 2 nodes (a slow pair does not say which of its "
                "nodes is slow); use 3+"
            )
        else:
            print(
                "slow nodes (even the fastest pair below the median node's fastest pair / "
                f"{cfg.slow_factor:g}): "
                f"{', '.join(slow) or 'none'}",
                flush=True,
            )
    return dict(bytes=size, rounds=len(rounds), results=results, slow_nodes=slow)


def check(cfg, info, device, backend, table):
    n, rank = info.world_size, info.rank
    nodes = group_nodes(table)
    node_of_rank = {r: label for label, ranks in nodes for r in ranks}
    envs = [None] * n
    dist.all_gather_object(envs, environment(device))
    differ = mismatches(envs, node_of_rank)
    if rank == 0:
        print(
            "\n".join(
                [
                    f"comm_check: {n} ranks, launcher {info.launcher} (scheduler: "
                    f"{info.scheduler}), "
                    f"backend {backend}, rendezvous {info.master_addr}:{info.master_port}",
                    f"{'rank':>5} {'local':>5}  {'node':<24} {'device':<8} CUDA_VISIBLE_DEVICES",
                    *(
                        f"{row['rank']:>5} {row['local_rank']:>5}  {node_of_rank[row['rank']]:<24} "
                        f"{row['device']:<8} {row['visible']}"
                        for row in table
                    ),
                    f"{n} ranks on {len(nodes)} node(s): {', '.join(label for label, _ in nodes)}",
                ]
            )
        )
        print_environment(backend, nodes, envs, differ, len({row["host"] for row in table}) > 1)
        print(
            f"all ranks: {n} ranks on {len(nodes)} node(s); time: average over the ranks (as "
            "nccl-tests), "
            f"slowest: the slowest rank\n{TABLE_HEADER}",
            flush=True,
        )
    results = measure(cfg, device, backend, dist.group.WORLD, show=rank == 0)
    if rank == 0:
        print(summary_line(overall(results)), flush=True)
    intra = intra_node(cfg, device, backend, nodes)
    inter = inter_node(cfg, device, backend, nodes)
    pairs = node_pairs(cfg, device, backend, nodes) if cfg.pairs and len(nodes) > 1 else None
    sections = [
        results,
        inter.get("results", []),
        (pairs or {}).get("results", []),
        *(nd["results"] for nd in intra.get("nodes", [])),
    ]
    correct = all(r["correct"] for rows in sections for r in rows)
    if rank == 0:
        for label, section in (("intra-node", intra), ("inter-node", inter)):
            if "skipped" in section:
                print(f"{label}: skipped, {section['skipped']}")
        if cfg.pairs and pairs is None:
            print("node pairs: skipped, one node")
        slow = sorted(set(intra.get("slow_nodes", [])) | set((pairs or {}).get("slow_nodes", [])))
        print(
            f"verdict: settings that differ: {', '.join(differ) or 'none'}; slow nodes: "
            f"{', '.join(slow) or 'none'}"
            f"; all results correct: {correct}",
            flush=True,
        )
    if cfg.output_dir and rank == 0:
        write_json_atomic(
            Path(cfg.output_dir) / "comm_check.json",
            dict(
                world_size=n,
                launcher=info.launcher,
                scheduler=info.scheduler,
                backend=backend,
                master_addr=info.master_addr.strip("[]"),
                master_port=info.master_port,
                ranks=[
                    dict(
                        rank=row["rank"],
                        host=row["host"],
                        local_rank=row["local_rank"],
                        device=row["device"],
                        cuda_visible_devices=row["visible"],
                        node=node_of_rank[row["rank"]],
                    )
                    for row in table
                ],
                nodes=[
                    dict(
                        node=label,
                        ranks=ranks,
                        host=table[ranks[0]]["host"],
                        transport=transport(backend, envs[ranks[0]]),
                        **envs[ranks[0]],
                    )
                    for label, ranks in nodes
                ],
                mismatches=differ,
                results=results,
                **overall(results),
                intra_node=intra,
                inter_node=inter,
                pairs=pairs,
            ),
        )
    if not correct:
        raise LauncherError(
            "all-reduce returned wrong sums: the backend or the network corrupts data"
        )


@record
def main():
    cfg = load_config(CommConfig)
    # One GPU per process, as in 01: the local rank's, or 0
    # where each rank sees only its own; CPU (gloo) without.
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    info = detect_launcher(uses_gpu=use_cuda)
    device = torch.device("cuda", info.gpu) if use_cuda else torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else choose_backend(device)
    # whatever fails to connect: one "error:" line naming rank, host, address; exit code 2
    with exit_on_bad_input():
        if use_cuda and not torch.cuda.is_available():
            raise LauncherError(
                f"--device cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        if use_cuda:
            # before the process group, so its collectives use this device
            torch.cuda.set_device(device)
        store, table = check_in(info, device, cfg.timeout_s)
        dist.init_process_group(
            backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        check(cfg, info, device, backend, table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
