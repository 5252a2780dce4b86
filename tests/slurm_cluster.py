"""A real two-node Slurm cluster on this machine, of two distinct hosts, for tests (root only).

    with SlurmCluster(tmp_dir) as cluster:
        job_id = cluster.sbatch(["jobs/slurm_srun.sbatch"], env, REPO)
        state = cluster.wait(job_id, timeout=180)

Each node is a host of its own: a network namespace (`ip netns`) with its own address on a bridge
the cluster makes (10.A.B.11 and .12, the bridge .1), and its own host name ("node1", "node2", a
UTS namespace), which resolves through a hosts file of the cluster's, bind-mounted over
/etc/hosts in the node's mount namespace. The node's slurmd runs there, and so does every job
step it starts: a wrong rendezvous host, a name that does not resolve or an address that is only
loopback fails as on a real cluster. slurmctld and munged run on this machine (the bridge's
address), as on a head node; clients (sbatch, scontrol) reach slurmctld there.

Everything else lives under one temporary folder: munged with its own key and socket, the
configuration, spool folders; with `qos_preemption`, a MariaDB on loopback and slurmdbd beside
slurmctld, for accounting and its QOS. Names and the subnet are picked per cluster, so several
clusters can run side by side. `stop()` ends exactly what it started (by pid and namespace),
also after a failure.
"""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from tests.processes import free_port

TOOLS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "scancel",
    "ip",
    "nsenter",
    "unshare",
)
NODES = ("node1", "node2")
CPUS_PER_NODE = 2  # what each fake node advertises; both share this machine's cores


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface of this machine is on."""
    taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    while True:
        subnet = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
        if (
            f" 10.{subnet.network_address.packed[1]}.{subnet.network_address.packed[2]}."
            not in taken
        ):
            return subnet


class SlurmCluster:
    FINAL_STATES = (
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    )

    def __init__(
        self,
        root: Path,
        cluster_mode: str = "REQUEUE",
        partition_mode: str = "REQUEUE",
        qos_preemption: bool = False,
    ):
        """`cluster_mode`, `partition_mode`: the cluster's PreemptMode, and the "debug"
        partition's own ("": none, so it shows the cluster's). `qos_preemption`: accounting
        (slurmdbd on a MariaDB of its own) with QOS "scavenger" (PreemptMode=requeue, 60 s of
        grace), which "urgent" preempts, under PreemptType=preempt/qos."""
        self.root = Path(root)
        self.cluster_mode, self.partition_mode = cluster_mode, partition_mode
        self.qos_preemption = qos_preemption
        self.procs: list[subprocess.Popen] = []
        self.munge_pid_file = self.root / "munge" / "munged.pid"
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.tag = f"{os.getpid() % 100000}{random.randint(0, 99)}"  # interface names: 15 bytes
        self.bridge = f"sbr{self.tag}"
        self.netns = {node: f"slurm{self.tag}-{node}" for node in NODES}
        self.subnet = _free_subnet()
        self.head_address = str(self.subnet[1])
        self.address = {node: str(self.subnet[11 + i]) for i, node in enumerate(NODES)}
        self.hosts_file = self.root / "hosts"
        self.network_made: list[list[str]] = []  # how to undo each piece, newest last

    # -- the hosts: namespaces, a bridge, names -------------------------------------------------
    def _make_network(self) -> None:
        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

        ip("link", "add", self.bridge, "type", "bridge")
        self.network_made.append(["link", "del", self.bridge])
        ip("addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, node in enumerate(NODES):
            ns, outside = self.netns[node], f"sve{self.tag}{i}"
            ip("netns", "add", ns)
            self.network_made.append(["netns", "del", ns])
            ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", outside, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.address[node]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # The nodes' /etc/hosts: every node by name, and the head node as "slurmctld".
        lines = ["127.0.0.1 localhost", f"{self.head_address} slurmctld"]
        lines += [f"{self.address[node]} {node}" for node in NODES]
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def on_node(self, node: str, command: list[str]) -> list[str]:
        """`command` as a process of host `node`: its network, its host name, its /etc/hosts."""
        # nsenter, not `ip netns exec`, which mounts a new /sys (without the cgroup file system
        # slurmd needs)
        return [
            "nsenter", f"--net=/run/netns/{self.netns[node]}",
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", f'mount --bind "$0" /etc/hosts && hostname {node} && exec "$@"',
            str(self.hosts_file), *command,
        ]  # fmt: skip

    # -- environment for clients (sbatch, srun, scontrol) -------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self, timeout: float = 60) -> "SlurmCluster":
        munge_dir = self.root / "munge"
        munge_dir.mkdir(parents=True)
        munge_dir.chmod(0o755)
        key = munge_dir / "munge.key"
        subprocess.run(
            ["mungekey", "--create", "--keyfile", str(key), "--force"],
            check=True,
            capture_output=True,
        )
        key.chmod(0o400)
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={self.munge_pid_file}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
        )
        self._make_network()
        self._write_conf()
        env = self.env()
        if self.qos_preemption:
            self._start_accounting(env)
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True)
        (self.root / "state").mkdir()
        log = self.root / "log"
        log.mkdir(exist_ok=True)
        # -D: stay in the foreground, so the Popen object
        # is the daemon and stop() can end it by pid.
        self.procs.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-c", "-f", str(self.conf)],
                env=env,
                stdout=open(log / "slurmctld.out", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        for node in NODES:
            self.procs.append(
                subprocess.Popen(
                    self.on_node(
                        node, ["slurmd", "-D", "-N", node, "-f", str(self._node_conf(node))]
                    ),
                    env=env,
                    stdout=open(log / f"slurmd-{node}.out", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{proc.args[0]} exited with {proc.returncode}:\n{self.logs()}"
                    )
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True
            )
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(node) in ("idle", "mix", "alloc") for node in NODES):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s:\n{self.logs()}")

    def _node_conf(self, node: str) -> Path:
        return self.root / "conf" / node / "slurm.conf"

    def _write_conf(self) -> None:
        ctld_port = free_port()
        ports = {node: free_port() for node in NODES}
        root, nodes = self.root, ",".join(NODES)
        debug_mode = f"PreemptMode={self.partition_mode}" if self.partition_mode else ""
        preemption = (
            "PreemptType=preempt/partition_prio\nAccountingStorageType=accounting_storage/none"
        )
        if self.qos_preemption:
            self.dbd_port = free_port()
            preemption = (
                "PreemptType=preempt/qos\nAccountingStorageType=accounting_storage/slurmdbd\n"
                f"AccountingStorageHost={self.head_address}\nAccountingStoragePort={self.dbd_port}\n"
                # for slurmdbd, the munge socket to authenticate with (slurm.conf(5))
                f"AccountingStoragePass={self.socket}"
            )
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname={node} NodeAddr={self.address[node]} Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            for node, port in ports.items()
        )
        self.conf.write_text(f"""\
ClusterName=testcluster
# A random first job id: job files derive their port from it, so side-by-side clusters differ.
FirstJobId={random.randint(1000, 14000)}
SlurmctldHost=localhost({self.head_address})
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/spool/%n/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
MinJobAge=600
{node_lines}
# Preemption as sites set it up: a job of the higher tier ("urgent") preempts those of "debug",
# which get SIGTERM and GraceTime seconds to save, then are requeued. "debug" has a mode of its
# own, or none: then it shows the cluster's (partition_info.c), such as GANG,REQUEUE.
{preemption}
PreemptMode={self.cluster_mode}
PartitionName=debug Nodes={nodes} Default=YES PriorityTier=1 GraceTime=60 {debug_mode}
PartitionName=urgent Nodes={nodes} PriorityTier=2 PreemptMode=OFF
""")
        # srun --mpi=pmix: the plugin makes a client directory per job step under
        # PMIxCliTmpDirBase, named without the node, so two slurmd on one host would collide
        # ("Cannot create directory ...: File exists"). Each slurmd reads the same slurm.conf
        # from a folder of its own, beside an mpi.conf (read from there) with its own base.
        for node in NODES:
            conf = self._node_conf(node)
            (self.root / "pmix" / node).mkdir(parents=True)
            conf.parent.mkdir(parents=True)
            conf.write_text(self.conf.read_text())
            (conf.parent / "mpi.conf").write_text(
                f"PMIxCliTmpDirBase={self.root / 'pmix' / node}\n"
            )

    def _start_accounting(self, env: dict[str, str]) -> None:
        """MariaDB on loopback in a folder of the cluster's, slurmdbd on the head's address, and
        the QOS the preemption needs (sacctmgr)."""
        db, log = self.root / "mariadb", self.root / "log"
        log.mkdir(exist_ok=True)
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root"]
            + ["--auth-root-authentication-method=normal", "--skip-test-db"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        port, socket_path = free_port(), self.root / "mariadb.sock"
        self.procs.append(
            subprocess.Popen(
                ["mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={socket_path}"]
                + ["--bind-address=127.0.0.1", f"--port={port}", "--user=root"],
                stdout=open(log / "mariadbd.out", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        grant = "CREATE USER 'slurm'@'127.0.0.1'; GRANT ALL ON *.* TO 'slurm'@'127.0.0.1';"
        self._until(
            lambda: (
                subprocess.run(
                    ["mariadb", "--no-defaults", f"--socket={socket_path}", "-uroot", "-e", grant],
                    capture_output=True,
                ).returncode
                == 0
            ),
            "MariaDB",
        )
        dbd_conf = self.root / "slurmdbd.conf"
        dbd_conf.write_text(
            f"AuthType=auth/munge\nAuthInfo=socket={self.socket}\nDbdHost=localhost\n"
            f"DbdAddr={self.head_address}\nDbdPort={self.dbd_port}\nSlurmUser=root\n"
            f"PidFile={self.root}/slurmdbd.pid\nLogFile={log}/slurmdbd.log\n"
            "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={port}\nStorageUser=slurm\nStorageLoc=slurm_acct_db\n"
        )
        dbd_conf.chmod(0o600)
        self.procs.append(
            subprocess.Popen(
                ["slurmdbd", "-D"],  # reads slurmdbd.conf beside SLURM_CONF's slurm.conf
                env=env,
                stdout=open(log / "slurmdbd.out", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        sacctmgr = ["sacctmgr", "-i"]
        self._until(
            lambda: (
                subprocess.run(
                    [*sacctmgr, "add", "cluster", "testcluster"], env=env, capture_output=True
                ).returncode
                == 0
            ),
            "slurmdbd",
        )
        for command in (
            ["add", "account", "test", "Cluster=testcluster"],
            ["add", "qos", "scavenger", "PreemptMode=requeue", "GraceTime=60"],
            ["add", "qos", "urgent", "Preempt=scavenger"],
            ["add", "user", "root", "Account=test", "QOS=normal,scavenger,urgent"],
        ):
            subprocess.run([*sacctmgr, *command], env=env, check=True, capture_output=True)

    def _until(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start:\n{self.logs()}")
            time.sleep(0.5)

    # -- jobs ---------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(state, exit code 'N:S') from scontrol; jobs stay listed for MinJobAge seconds."""
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")

    def wait(self, job_id: str, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        state = ("UNKNOWN", "")
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state[0] in self.FINAL_STATES:
                return state
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env(), capture_output=True, timeout=30)
        return ("TIMEOUT (test)", state[1])

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) if (self.root / "log").exists() else []:
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # -- shutdown -----------------------------------------------------------------------------
    def stop(self) -> None:
        for proc in reversed(self.procs):  # slurmd first, then slurmctld
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self.procs.clear()
        # what a job left running on a node (the namespace lives on while a process is in it)
        for ns in self.netns.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for undo in reversed(self.network_made):
            subprocess.run(["ip", *undo], capture_output=True, timeout=30)
        self.network_made.clear()
        try:
            pid = int(self.munge_pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
