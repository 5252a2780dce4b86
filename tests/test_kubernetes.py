"""jobs/kubernetes/: each manifest's own command, with its operator's environment, on two hosts of
their own (network and UTS namespaces), named as the operator names its pods and resolving
each other's names through /etc/hosts as a cluster's DNS would. No Kubernetes API server, kubelet
or operator exists here: the stand-in is what each operator's source does (the environment it
sets: tests/launcher_tools.py, kubernetes_pod_env; the pods' names; the restart rule, below), and
the container's command, env and volume paths read from the YAML a user applies."""

from __future__ import annotations

import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.launcher_tools import kubernetes_pod_env, start_on_host, two_hosts
from tests.paths import PYTHON, REPO
from tests.processes import clean_env, finish, kill_group, node_logs, run, short_run
from tests.results import differing_tensors, load_model, read_summary

pytestmark = pytest.mark.scheduler

MANIFESTS = REPO / "jobs" / "kubernetes"
WRAPPER = "jobs/kubernetes/torchrun_pod.py"
# What the tests change in a manifest, as a user edits it: the run's length and the data (the
# digits set, no download), and one process a pod (no GPU here).
SHORT = " ".join(short_run(max_steps=None, epochs=2, save_every_steps=10, log_every=1))
RESTART_ME = 143
RENDEZVOUS = ("master_addr", "group_rank", "group_world_size")  # torchrun's lines


def documents(name: str) -> list[dict]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command, args and env values: a defined
    variable's value, $$ for $, an undefined reference left as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def job_spec_of(name: str) -> dict:
    """The Job template of a TrainJob's runtime or of a JobSet: its one replicated job's spec."""
    spec = documents(name)[0]["spec"]
    jobset = spec["template"]["spec"] if name == "trainjob.yaml" else spec
    return jobset["replicatedJobs"][0]["template"]["spec"]


def container_of(name: str) -> tuple[dict, dict]:
    """(the training container, its pod spec) as the operator builds it from the manifest."""
    docs = documents(name)
    if name == "pytorchjob.yaml":
        pod = docs[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        return next(c for c in pod["containers"] if c["name"] == "pytorch"), pod
    if name == "trainjob.yaml":
        # Trainer v2.3, pkg/runtime/framework/plugins/jobset/builder.go, Trainer(): the TrainJob's
        # image, command and args replace the runtime's; its env is added to the runtime's.
        pod = job_spec_of(name)["template"]["spec"]
        node = dict(next(c for c in pod["containers"] if c["name"] == "node"))
        trainer = docs[1]["spec"]["trainer"]
        node.update(image=trainer["image"], command=trainer["command"])
        node["env"] = node.get("env", []) + trainer.get("env", [])
        return node, pod
    pod = job_spec_of(name)["template"]["spec"]
    return pod["containers"][0], pod


def pod_environment(container: dict, index: int, operator_env: dict[str, str]) -> dict[str, str]:
    """The container's env list in order (fieldRefs to the Indexed Job's completion index
    resolved), then what the operator adds."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            env[var["name"]] = str(index)
        else:
            env[var["name"]] = expand(str(var["value"]), env)
    return {**env, **operator_env}


# The pods of each manifest: (host name, DNS names) a pod, and the operator's environment. Pod names
# from the operators' source: training-operator v1.9.0 common/util.go GenGeneralName
# (<job>-<replica type>-<index>); Trainer and JobSet: <jobset>-<replicated job>-<job index>-<pod
# index>, in the subdomain <jobset> (JobSet's headless Service).
def pods_of(name: str) -> list[tuple[str, str, dict[str, str]]]:
    if name == "pytorchjob.yaml":
        job = "ddp-pytorchjob"
        names = [f"{job}-master-0", f"{job}-worker-0"]
        return [
            (pod, pod, kubernetes_pod_env("pytorchjob", i, pods=2, per_pod=1, name=job))
            for i, pod in enumerate(names)
        ]
    job = "ddp-trainjob" if name == "trainjob.yaml" else "ddp-jobset"
    pods = []
    for i in range(2):
        pod = f"{job}-node-0-{i}"
        operator_env = {"JOB_COMPLETION_INDEX": str(i)}  # the Job controller's, for Indexed Jobs
        if name == "trainjob.yaml":
            operator_env = kubernetes_pod_env("trainjob", i, pods=2, per_pod=1, name=job)
        else:
            operator_env["PET_NPROC_PER_NODE"] = "1"  # the manifest's 4, as a user edits it
        pods.append((pod, f"{pod}.{job} {pod}", operator_env))
    return pods


def start_pods(name, ns, tmp_path, train_args, script=None, **extra_env):
    """Each pod's PID 1 on its host: the manifest's command, /shared on tmp_path/shared."""
    container, _ = container_of(name)
    shared = tmp_path / "shared"
    procs = []
    for node, ((host, _, operator_env), namespace) in enumerate(zip(pods_of(name), ns)):
        env = pod_environment(container, node, operator_env)
        argv = [expand(word, env) for word in container["command"]]
        # the volume's mount path, /shared, on a folder of the test's
        argv = [re.sub(r"(^|=)/shared\b", rf"\g<1>{shared}", word) for word in argv]
        env = {k: re.sub(r"^/shared\b", str(shared), v) for k, v in env.items()}
        env.update(TRAIN_ARGS=train_args, LOGLEVEL="INFO", **extra_env)
        assert argv[:2] == ["python", WRAPPER], argv
        argv[0] = PYTHON
        if script:  # the one script a user would swap in (the word after the wrapper)
            argv[2] = script
        command = f"cd {shlex.quote(str(REPO))} && exec {shlex.join(argv)}"
        log = tmp_path / f"node{node}.log"
        procs.append(start_on_host(namespace, host, command, clean_env(**env), log))
    return procs


def wait_pods(procs, timeout, tmp_path, what) -> list[int]:
    try:
        for proc in procs:
            finish(proc, timeout, what)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
    return [proc.returncode for proc in procs]


def retried_by_the_operator(name: str, codes: list[int]) -> bool:
    """The restart rule each manifest sets, as its operator applies it. PyTorchJob,
    restartPolicy ExitCode: a failed pod with a code of 128 or more is deleted and created again,
    any other fails the job (training-operator v1.9.0, pkg/controller.v1/common/pod.go,
    ReconcilePods; pkg/util/train/train_util.go, IsRetryableExitCode). TrainJob and JobSet: the
    Job's podFailurePolicy fails it (reason PodFailurePolicy, which failurePolicy turns into
    FailJobSet) on a code outside its NotIn list; another failure exceeds backoffLimit 0 and
    failurePolicy restarts the JobSet (kubernetes batch/v1 PodFailurePolicyRule; JobSet v0.12
    api/jobset/v1alpha2, FailurePolicyRule)."""
    failed = [code for code in codes if code != 0]
    if name == "pytorchjob.yaml":
        policies = documents(name)[0]["spec"]["pytorchReplicaSpecs"]
        assert {spec["restartPolicy"] for spec in policies.values()} == {"ExitCode"}
        return bool(failed) and all(code >= 128 for code in failed)
    _, pod = container_of(name)
    job = job_spec_of(name)
    fail_job = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    (rule,) = fail_job
    assert rule["onExitCodes"]["operator"] == "NotIn"
    return bool(failed) and all(code in rule["onExitCodes"]["values"] for code in failed)


def rendezvous(log: str) -> str:
    """What torchrun's rendezvous gave this pod (LOGLEVEL=INFO): rank 0's host, the pod's node
    rank and the number of nodes, as "host rank/nodes"."""
    said = [re.search(rf"\b{key}=(\S+)$", log, re.M) for key in RENDEZVOUS]
    return "{} {}/{}".format(*(m.group(1) for m in said)) if all(said) else log[-3000:]


def assert_one_run_across_the_pods(name: str, tmp_path: Path) -> dict:
    """Each pod was one node of the same run, whose rank 0 the operator's master name reached; the
    run's summary."""
    master = pod_environment(container_of(name)[0], 0, pods_of(name)[0][2])["PET_MASTER_ADDR"]
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert [rendezvous(log) for log in logs] == [f"{master} 0/2", f"{master} 1/2"]
    summary = read_summary(tmp_path / "shared" / "runs" / f"ddp-{name.removesuffix('.yaml')}")
    assert summary["world_size"] == 2 and summary["replicas_identical"], summary
    return summary


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "trainjob.yaml", "jobset.yaml"])
def test_each_manifest_names_its_operators_kind_and_runs_the_wrapper(name):
    kinds = {
        "pytorchjob.yaml": [("kubeflow.org/v1", "PyTorchJob")],
        "trainjob.yaml": [
            ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"),
            ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        ],
        "jobset.yaml": [("jobset.x-k8s.io/v1alpha2", "JobSet")],
    }[name]
    assert [(d["apiVersion"], d["kind"]) for d in documents(name)] == kinds
    container, pod = container_of(name)
    assert container["command"][:3] == ["python", WRAPPER, "05_checkpointing/preempt.py"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes[mounts["/shared"]]
    shutdown = pod_environment(container, 0, {})["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    assert int(shutdown) < pod["terminationGracePeriodSeconds"]  # torchrun waits, then the pod


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The PyTorchJob's command on its two pods, never stopped: 2 ranks, 2 epochs. Its folder."""
    tmp_path = tmp_path_factory.mktemp("pytorchjob")
    with two_hosts(208, [names for _, names, _ in pods_of("pytorchjob.yaml")]) as (ns, _, _):
        procs = start_pods("pytorchjob.yaml", ns, tmp_path, SHORT)
        codes = wait_pods(procs, 180, tmp_path, "the PyTorchJob's pods")
    assert codes == [0, 0], node_logs(tmp_path)
    return tmp_path


def test_pytorchjob_pods_train_one_model_across_two_hosts(uninterrupted):
    assert_one_run_across_the_pods("pytorchjob.yaml", uninterrupted)


@pytest.mark.parametrize(
    "name,script", [("trainjob.yaml", None), ("jobset.yaml", "01_basic_ddp/train.py")]
)
def test_trainjob_and_jobset_pods_train_one_model_across_two_hosts(tmp_path, name, script):
    """The TrainJob's command as it is (preempt.py); the JobSet's with 01's train.py swapped in,
    as a user edits the script."""
    subnet = 209 if name == "trainjob.yaml" else 210
    with two_hosts(subnet, [names for _, names, _ in pods_of(name)]) as (ns, _, _):
        procs = start_pods(name, ns, tmp_path, " ".join(short_run()), script)
        codes = wait_pods(procs, 180, tmp_path, f"the {name} pods")
    assert codes == [0, 0], node_logs(tmp_path)
    assert_one_run_across_the_pods(name, tmp_path)


def test_an_evicted_pod_saves_both_exit_retryable_and_the_restarted_pods_end_bitwise_equal(
    uninterrupted, tmp_path
):
    """Eviction of the PyTorchJob's master pod (rank 0, the rendezvous host) while training with
    2 loader workers a rank on a data-bound pipeline: SIGTERM to its PID 1 only, as the kubelet
    sends it. The ranks of both pods save at one step; the stopped pod exits 143, and so does the
    other one (it reads preempt.py's REQUEUE note). The operator's rule retries both; the new
    pods resume and end bitwise equal to the uninterrupted run."""
    slow = dict(PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}", DDP_TEST_SLOW_SAMPLE_S="0.02")
    with two_hosts(211, [names for _, names, _ in pods_of("pytorchjob.yaml")]) as (ns, _, _):
        workers = f"{SHORT} --num-workers 2"
        procs = start_pods("pytorchjob.yaml", ns, tmp_path, workers, **slow)
        master_log = tmp_path / "node0.log"
        deadline = time.monotonic() + 120
        while "epoch 1 step 5 " not in master_log.read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, node_logs(tmp_path)
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGTERM)  # the master pod's PID 1: the wrapper
        codes = wait_pods(procs, 150, tmp_path, "the evicted PyTorchJob")
        logs = node_logs(tmp_path)
        assert codes == [RESTART_ME, RESTART_ME], logs
        assert retried_by_the_operator("pytorchjob.yaml", codes)
        saved = re.search(r"SIGTERM: checkpoint at step (\d+) saved", logs)
        assert saved and "exited unexpectedly" not in logs, logs
        for log in tmp_path.glob("node*.log"):
            log.rename(log.with_suffix(".evicted"))
        procs = start_pods("pytorchjob.yaml", ns, tmp_path, workers)
        codes = wait_pods(procs, 180, tmp_path, "the restarted PyTorchJob")
    assert codes == [0, 0], node_logs(tmp_path)
    run_dir = tmp_path / "shared" / "runs" / "ddp-pytorchjob"
    assert read_summary(run_dir)["resumed_from_step"] == int(saved.group(1))
    reference = load_model(uninterrupted / "shared" / "runs" / "ddp-pytorchjob")
    assert differing_tensors(load_model(run_dir), reference) == []


@pytest.mark.parametrize("failure", ["crash", "bad input"])
def test_a_crash_or_bad_input_keeps_its_code_and_is_not_retried(tmp_path, failure):
    """The wrapper on one host (its exit codes are the claim, not the hosts): a rank that fails
    at step 2, or a batch size of 0, in a run folder where an earlier run's save left its REQUEUE
    note. The code stays torchrun's (1, or 2), which no operator here retries; the old note is
    not read as this run's."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "REQUEUE").write_text("SIGTERM at step 12\n")
    env = clean_env(
        RUN_DIR=str(run_dir), TRAIN_ARGS="--max-steps 4 --epochs 1 --local-batch-size 16"
    )
    if failure == "crash":
        env.update(PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}", DDP_TEST_FAIL_AT_STEP="2")
        env.update(DDP_TEST_FAIL_RANK="1")
    else:
        env["TRAIN_ARGS"] += " --local-batch-size 0"
    cmd = [PYTHON, WRAPPER, "--standalone", "--nproc-per-node=2", "05_checkpointing/preempt.py"]
    result = run([*cmd, f"--output-dir={run_dir}"], 180, env=env)
    expected = 1  # torchrun's, whichever way its workers failed
    assert result.returncode == expected, result.output[-3000:]
    assert ("injected failure" if failure == "crash" else "error: ") in result.output
    for name in ("pytorchjob.yaml", "trainjob.yaml", "jobset.yaml"):
        assert not retried_by_the_operator(name, [expected, expected])
        assert retried_by_the_operator(name, [RESTART_ME, RESTART_ME])


def test_a_deleted_trainjob_saves_on_every_pod_and_applying_it_again_resumes(tmp_path):
    """`kubectl delete`: SIGTERM to every pod's PID 1 at once. The ranks save once, at one step,
    and each pod exits 143; the job is gone, so nothing restarts it. `kubectl apply` again: new
    pods resume from that checkpoint and finish."""
    name = "trainjob.yaml"
    slow = dict(PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'inject'}", DDP_TEST_SLOW_SAMPLE_S="0.01")
    with two_hosts(212, [names for _, names, _ in pods_of(name)]) as (ns, _, _):
        procs = start_pods(name, ns, tmp_path, SHORT, **slow)
        deadline = time.monotonic() + 120
        while "epoch 1 step 5 " not in (tmp_path / "node0.log").read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, node_logs(tmp_path)
            time.sleep(0.2)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = wait_pods(procs, 150, tmp_path, "the deleted TrainJob")
        logs = node_logs(tmp_path)
        assert codes == [RESTART_ME, RESTART_ME], logs
        saved = re.findall(r"SIGTERM: checkpoint at step (\d+) saved", logs)
        assert len(saved) == 1, logs
        for log in tmp_path.glob("node*.log"):
            log.rename(log.with_suffix(".deleted"))
        procs = start_pods(name, ns, tmp_path, SHORT)
        codes = wait_pods(procs, 180, tmp_path, "the TrainJob applied again")
    assert codes == [0, 0], node_logs(tmp_path)
    summary = assert_one_run_across_the_pods(name, tmp_path)
    assert summary["resumed_from_step"] == int(saved[0])
