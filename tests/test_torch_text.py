"""debugging/README.md, "Timeouts on nccl": what a machine without a GPU can check of it.

The watchdog cannot run here (no GPU), so the guide's nccl part is read from
PyTorch's source. These tests hold it to the installed torch (2.14.1): the messages
it quotes are in torch's NCCL library, the older wording is not; the default timeouts
torch exposes; what torchrun sets in its workers; and the flight-recorder analyzer's
options and its verdicts on dumps shaped like each case the guide's table names.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import mmap
import os
import pickle
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from tests.markdown import markdown_blocks, markdown_section, readme_sample, readme_words
from tests.paths import PYTHON, REPO, load_script
from tests.processes import clean_env, command_argv, free_port, run, torchrun, warm_command
from tests.quoted import READY_ONCE
from tests.results import read_summary, root_cause
from tests.sample_runs import shared_runs
from tests.torch_versions import C10D_HEADERS

# All of it is torch's own text and source, read again after a torch upgrade.
pytestmark = pytest.mark.torch_text

GUIDE = REPO / "debugging" / "README.md"
README = readme_words()
DIR = "02_sampler_patterns"
DEMO = "debugging/demo_bugs.py"
demo = load_script(DEMO, "demo_bugs")


TORCH_LIB = Path(__import__("torch").__file__).parent / "lib"

# Quoted by the guide; in torch's NCCL backend
# (libtorch_cuda.so) as literals (runtime values left out).
WATCHDOG_MESSAGES = [
    "Watchdog caught collective operation timeout: ",
    "WorkNCCL(",
    "SeqNum=",
    ", OpType=",
    ", NumelIn=",
    ", NumelOut=",
    ", Timeout(ms)=",
    " milliseconds before timing out.",
    "[PG ID ",
    " PG GUID ",
    " failure detected by watchdog at work sequence id: ",
    " PG status: last enqueued work: ",
    ", last completed work: ",
    "Stack trace of the failed collective: ",
    "Some NCCL operations have failed or timed out. Due to the ",
    "asynchronous nature of CUDA kernels, subsequent GPU operations ",
    "might run on corrupted/incomplete data.",
    "To avoid data inconsistency, we are taking the entire process down.",
    "Process group watchdog thread terminated with exception: ",
    "To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
    "] joined but didn't finish collective #",
    " (count from 1)",
    "] finished collective #",
    ", but didn't join collective #",
    "] are the lagging ranks that caused this timeout. They never joined any collectives",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_DESYNC_DEBUG",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
]
# The flight recorder's file names are in the core library (libtorch_cpu.so).
RECORDER_VARIABLES = [
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "XDG_CACHE_HOME",
]
# The wording of earlier releases, which the guide names as gone.
OLD_WORDING = "Exception (either an error or timeout) detected by watchdog at work: "


def assert_in_order(code: str, *needles: str) -> None:
    """Each of `needles` is in `code`, in this order."""
    where = [code.index(needle) for needle in needles]
    assert where == sorted(where), needles


def found_in_library(name: str, needles: list[str]) -> dict[str, bool]:
    path = TORCH_LIB / name
    if not path.exists():
        pytest.skip(f"{path} not installed (a CPU-only torch build has no NCCL backend to read)")
    return found_in(path, needles)


def test_watchdog_messages_in_the_guide_are_torchs_own():
    guide = " ".join(GUIDE.read_text().split())  # the guide's line breaks as spaces
    assert [
        m for m in WATCHDOG_MESSAGES + RECORDER_VARIABLES + [OLD_WORDING] if m.strip() not in guide
    ] == []
    found = found_in_library("libtorch_cuda.so", WATCHDOG_MESSAGES + [OLD_WORDING])
    assert [m for m in WATCHDOG_MESSAGES if not found[m]] == []
    # Negative control: the check can fail, and the message of earlier releases is not in 2.14.1.
    assert not found[OLD_WORDING]
    assert all(found_in_library("libtorch_cpu.so", RECORDER_VARIABLES).values())


def test_default_timeouts_are_10_minutes_for_nccl_and_30_for_gloo():
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    assert (default_pg_nccl_timeout, default_pg_timeout) == (
        timedelta(minutes=10),
        timedelta(minutes=30),
    )
    guide = GUIDE.read_text()
    assert "PyTorch's own default is 10 min for NCCL, 30 min for gloo" in guide
    assert "the job sits for 10 minutes (nccl) or 30 (gloo)" in guide


def test_error_handling_modes_and_trace_buffer_default_are_the_installed_headers():
    """The guide's meaning of each TORCH_NCCL_ASYNC_ERROR_HANDLING
    value, its C++ default (3) and the flight recorder's default size
    (2000), read from the C++ headers installed with torch 2.14.1."""
    nccl = (C10D_HEADERS / "ProcessGroupNCCL.hpp").read_text()
    enum = nccl.split("enum ErrorHandlingMode")[1].split("}")[0]
    modes = {int(value): name for name, value in re.findall(r"^\s*(\w+) = (\d),?$", enum, re.M)}
    assert modes == {0: "NoHandling", 1: "TearDown", 2: "CleanUpOnly", 3: "SkipCleanUp"}
    assert "the default value (3 - SkipCleanUp)" in nccl
    # What each value does: clean up = abort the communicators; tear down = take the process down.
    assert "#define SHOULD_CLEAN_UP(a) (a != NoHandling && a != SkipCleanUp)" in nccl
    assert "#define SHOULD_TEAR_DOWN(a) (a != NoHandling && a != CleanUpOnly)" in nccl
    recorder = (C10D_HEADERS / "FlightRecorder.hpp").read_text()
    assert (
        'getCvarInt(\n        {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)'
        in recorder
    )
    guide = " ".join(GUIDE.read_text().split())
    for claim in (
        "`3`, the default in PyTorch's C++ code, takes the process down without aborting the NCCL "
        "communicators;",
        "- `1` aborts them first",
        "- `2` only aborts them;",
        "- `0` only logs",
        "`TORCH_FR_BUFFER_SIZE` collectives (2000 by default from torch 2.11",
    ):
        assert claim in guide, claim


def test_renamed_variables_are_torchs_pairs_and_the_new_name_wins():
    """The guide's table of renamed variables, read from torch 2.14.1's headers: each old name
    is the second of a pair whose first (the new name) is read last and so wins; the warning
    comes from Utils.hpp's macro; torchrun sets the new name for its workers; the nccl backend
    calls TORCH_NCCL_AVOID_RECORD_STREAMS deprecated. (The warning on a CPU run:
    tests/test_forum_errors.py.)"""
    nccl = " ".join((C10D_HEADERS / "ProcessGroupNCCL.hpp").read_text().split())
    for name in ("ASYNC_ERROR_HANDLING", "BLOCKING_WAIT", "DESYNC_DEBUG", "ENABLE_TIMING"):
        pair = f'TORCH_NCCL_{name} = {{ "TORCH_NCCL_{name}", "NCCL_{name}"}};'
        assert pair in nccl, pair
    assert 'TORCH_NCCL_AVOID_RECORD_STREAMS = { "TORCH_NCCL_AVOID_RECORD_STREAMS"};' in nccl
    assert '"NCCL_AVOID_RECORD_STREAMS"' not in nccl  # the name without TORCH_ is read nowhere
    recorder = " ".join((C10D_HEADERS / "FlightRecorder.hpp").read_text().split())
    assert '{"TORCH_FR_CPP_STACK", "TORCH_NCCL_TRACE_CPP_STACK"}, false)' in recorder
    utils = " ".join((C10D_HEADERS / "Utils.hpp").read_text().replace("\\\n", " ").split())
    assert (
        '"Environment variable " + deprecated_env + " is deprecated; use " + new_env + " instead");'
        in utils
    )
    assert utils.count("parse environment variable in reverse order") >= 3
    import torch.distributed.elastic.agent.server.local_elastic_agent as agent

    source = " ".join(inspect.getsource(agent).split())
    assert (
        '"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv( "TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)'
        in source
    )
    deprecated = (
        "TORCH_NCCL_AVOID_RECORD_STREAMS is the default now, this environment variable is thus "
        "deprecated."
    )
    assert found_in_library("libtorch_cuda.so", [deprecated])[deprecated]
    guide = " ".join(GUIDE.read_text().split())
    for old, new in (
        ("NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        ("NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"),
        ("NCCL_DESYNC_DEBUG", "TORCH_NCCL_DESYNC_DEBUG"),
        ("NCCL_ENABLE_TIMING", "TORCH_NCCL_ENABLE_TIMING"),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"),
        ("TORCH_NCCL_TRACE_CPP_STACK", "TORCH_FR_CPP_STACK"),
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"),
    ):
        assert f"| `{old}` | `{new}` |" in guide, old
    assert f"`{deprecated}`" in guide


def test_debug_levels_and_nccl_errors_the_guide_names_are_torchs():
    """The Tools table, read from torch 2.14.1: DETAIL wraps gloo and nccl
    process groups alike in the checking wrapper; INFO makes DDP log its
    set-up and name the parameters that got no gradient (torch's own error
    says so); ncclRemoteError is a name torch's NCCL backend prints."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    source = inspect.getsource(c10d)
    wrapped = source.split("backend_str in [Backend.GLOO, Backend.NCCL")[1].split("elif")[0]
    assert (
        "get_debug_level() == DebugLevel.DETAIL" in wrapped
        and "_create_process_group_wrapper(" in wrapped
    )
    # The wrapper checks each collective over a gloo
    # group of its own: the cost the guide calls slow.
    wrapper = (C10D_HEADERS / "ProcessGroupWrapper.hpp").read_text()
    assert (
        "Gloo process group responsible for internal coordination such as monitored\n  // "
        "barrier, sequence "
        "number checking, collective fingerprint collecting." in wrapper
    )
    ddp = [
        "DDP Initialized with",
        "Parameters which did not receive grad for rank",
        "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to "
        "print out information "
        "about which particular parameters did not receive gradient",
    ]
    assert all(found_in_library("libtorch_cpu.so", ddp).values())
    assert found_in_library("libtorch_cuda.so", ["ncclRemoteError"]) == {"ncclRemoteError": True}
    guide = " ".join(GUIDE.read_text().split())
    assert (
        "`INFO`: DDP logs its set-up and, on the unused-parameter error, names the parameters"
        in guide
    )
    assert "also checks before **every** collective" in guide and "`ncclRemoteError`" in guide
    assert "Slow (a gloo exchange of fingerprints before each collective)" in guide


def test_torchrun_sets_async_error_handling_1_in_its_workers_unless_set():
    """The guide: 3 is the C++ default, and torchrun sets 1 in its workers unless you set it."""

    def worker_value(extra):
        env = clean_env()
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        env.update(extra)
        cmd = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "--no-python",
            "printenv",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        ]
        return run(cmd, 180, env=env, check=True).stdout.split()

    with ThreadPoolExecutor(2) as pool:  # two torchruns side by side
        unset, yours = pool.map(worker_value, [{}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}])
    assert unset == ["1"]
    assert yours == ["3"]  # a value of your own is kept
    assert "`1` (what torchrun sets in its workers unless you set it)" in GUIDE.read_text()


def test_flight_recorder_analyzer_takes_the_options_the_guide_shows(capsys):
    from torch.distributed.flight_recorder.fr_trace import main

    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts.get("torchfrtrace") == "torch.distributed.flight_recorder.fr_trace:main"
    with pytest.raises(SystemExit):
        main(["--help"])  # torchfrtrace --help, in this process
    usage = capsys.readouterr().out
    for option in (
        "trace_dir",
        "-p PREFIX, --prefix PREFIX",
        "-j, --just_print_entries",
        "--allow-incomplete-ranks",
    ):
        assert option in usage
    guide = GUIDE.read_text()
    assert (
        "torchfrtrace runs/fr -p trace_ " in guide and "torchfrtrace runs/fr -p trace_ -j" in guide
    )
    # Its tables need tabulate, which it imports if it can ("pip install tabulate" in the guide).
    import inspect

    from torch.distributed.flight_recorder.components import utils

    assert (
        "from tabulate import tabulate" in inspect.getsource(utils)
        and "`pip install tabulate`" in guide
    )


# -- the analyzer's verdicts on dumps shaped like each row of the guide's table -------------------


def entry(seq: int, numel: int, state: str = "completed", op: str = "all_reduce") -> dict:
    """One flight-recorder entry as ProcessGroupNCCL writes it (the dump format's field names)."""
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": seq,
        "input_sizes": [[numel]],
        "output_sizes": [[numel]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": state == "completed",
        "timeout_ms": 60000,
        "is_p2p": False,
        "frames": [],
    }


@pytest.fixture
def analyze(tmp_path, caplog):
    """Write one dump per rank and run the analyzer on them
    (its main(), as torchfrtrace does); its log."""
    from torch.distributed.flight_recorder.fr_trace import main

    def analyze(ranks: dict[int, list[dict]], *extra: str) -> str:
        folder = tmp_path / f"fr{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for rank, entries in ranks.items():
            dump = {
                "version": "2.10",
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                "pg_status": {},
                "entries": entries,
            }
            (folder / f"trace_{rank}").write_bytes(pickle.dumps(dump))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="Flight Recorder"):
            main([str(folder), "-p", "trace_", *extra])
        # what torchfrtrace prints
        return "\n".join(record.getMessage() for record in caplog.records)

    return analyze


GRADIENTS = 2410  # a gradient bucket's elements


def test_analyzer_gives_each_verdict_the_guide_names(analyze):
    out = analyze(
        {
            0: [entry(1, GRADIENTS), entry(2, 1, "scheduled")],
            1: [entry(1, GRADIENTS), entry(2, 2, "scheduled")],
        }
    )
    assert "Collective sequence number: 2 has errors" in out, out
    # The line the guide shows.
    line = (
        "error msg: Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input "
        "sizes: '[[1]]' "
        "does not match found input sizes: '[[2]]'"
    )
    assert line in out.splitlines() and line in GUIDE.read_text(), out
    out = analyze(
        {
            0: [entry(1, GRADIENTS), entry(2, 1, "scheduled")],
            1: [entry(1, GRADIENTS), entry(2, 1, "scheduled", op="broadcast")],
        }
    )
    assert (
        "Collective sequence number: 2 has errors" in out and "COLLECTIVE_TYPE_MISMATCH" in out
    ), out

    out = analyze({0: [entry(1, GRADIENTS), entry(2, 1, "scheduled")], 1: [entry(1, GRADIENTS)]})
    assert (
        "Not all ranks joining collective, sequence number: 2" in out
        and "missing ranks: {1}" in out
    ), out

    out = analyze(
        {0: [entry(1, GRADIENTS), entry(2, GRADIENTS, "scheduled")]}, "--allow-incomplete-ranks"
    )
    assert "we missed FR dumps from ranks ({1})" in out, out

    # The table's first row, and the negative control of the others:
    # both ranks entered collective 2 with the same size and it never
    # finished (the network, NCCL, a GPU): no mismatch to report.
    out = analyze({r: [entry(1, GRADIENTS), entry(2, GRADIENTS, "scheduled")] for r in (0, 1)})
    assert not re.search(r"has errors|Not all ranks joining|missed FR dumps|mismatch", out, re.I), (
        out
    )

    guide = (REPO / "debugging" / "README.md").read_text()
    for verdict in (
        "`Collective sequence number: N has errors`",
        "`Error type: SIZE_OR_SYNTAX_MISMATCH`",
        "`Not all ranks joining collective, sequence number: N`",
        "`missing ranks: {1}`",
        "`we missed FR dumps from ranks ({1})`",
    ):
        assert verdict in guide, verdict


def nccl_library() -> Path:
    """The libnccl.so.2 of the nvidia-nccl wheel that torch's CUDA build loads."""
    for dist in metadata.distributions():
        if (dist.metadata["Name"] or "").startswith("nvidia-nccl"):
            for file in dist.files or []:
                if str(file).endswith("libnccl.so.2"):
                    return Path(dist.locate_file(file))
    pytest.skip("no nvidia-nccl wheel installed (a CPU-only torch build has no NCCL to read)")


def found_in(path: Path, needles: list[str]) -> dict[str, bool]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return {n: data.find(n.encode()) >= 0 for n in needles}


def test_the_shared_gpu_refusal_the_readmes_quote_is_nccls_and_torchs_own():
    """The guide's "Multiple Ranks are using the same GPU/Partition" section quotes what a rank
    prints when NCCL refuses two ranks on one GPU: torch's DistBackendError (its parts in
    libtorch_cuda.so) around NCCL's own texts (in the bundled libnccl.so.2). The wording of older
    NCCL releases, "Duplicate GPU detected", is not in that library (the control: the check can
    fail); no README quotes it as what a user sees."""
    section = markdown_section(GUIDE.read_text(), '## "Multiple Ranks are using the same GPU')
    [quoted] = [b.lines for b in markdown_blocks(section)]
    nccl_refusal = quoted[3]
    nccl_texts = [nccl_refusal, "invalid usage (run with NCCL_DEBUG=WARN for details)"]
    torch_texts = [
        "NCCL error in: ",
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.",
        "Last error:",
    ]
    assert quoted[0].startswith("torch.distributed.DistBackendError: " + torch_texts[0])
    assert nccl_texts[1] in quoted[0] and quoted[1:3] == tuple(torch_texts[1:])
    assert nccl_refusal.startswith("Multiple Ranks are using the same GPU/Partition. Set NCCL_")
    found = found_in(nccl_library(), [*nccl_texts, "Duplicate GPU detected"])
    assert found == {**dict.fromkeys(nccl_texts, True), "Duplicate GPU detected": False}
    assert all(found_in_library("libtorch_cuda.so", torch_texts).values())
    torch = __import__("torch")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    assert quoted[0].endswith(f"NCCL version {version}")
    torch_version = torch.__version__.split("+")[0]
    assert f"NCCL that torch {torch_version} bundles ({version})" in " ".join(section.split())
    multinode = " ".join((REPO / "06_multinode" / "README.md").read_text().split())
    assert f"`{nccl_refusal}`" in multinode
    for readme in [REPO / "README.md", *REPO.glob("*/README.md")]:
        text = " ".join(readme.read_text().split())
        for sentence in re.findall(r"[^.]*Duplicate GPU detected[^.]*", text):
            assert "older NCCL releases" in sentence, (readme.name, sentence)


def test_the_dev_shm_error_the_guide_quotes_is_nccls_own():
    """ "NCCL/gloo connection errors", /dev/shm too small: the line the guide quotes is NCCL's
    format string with the path and size filled in (the bundled libnccl.so.2), and so is the
    path NCCL creates there. The control: a wording NCCL does not print is not found."""
    guide = " ".join(GUIDE.read_text().split())
    assert "`Error: failed to extend /dev/shm/nccl-… to N bytes`" in guide
    texts = ["Error: failed to extend %s to %ld bytes", "/dev/shm/nccl-", "unhandled system error"]
    found = found_in(nccl_library(), [*texts, "failed to extend /dev/shm to"])
    assert found == {**dict.fromkeys(texts, True), "failed to extend /dev/shm to": False}


# --- the guide's Windows errors (the missing nccl: with its run, further down)


def test_torchruns_store_asks_for_libuv_whatever_use_libuv_says():
    """The guide's second Windows error: torchrun's default (static) rendezvous creates its
    TCPStore without a use_libuv argument, so TCPStore's default (True) applies and USE_LIBUV is
    never read (torch 2.8 to 2.14.1; pytorch/pytorch#148283). Hence mp.spawn on Windows."""
    import inspect

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    source = inspect.getsource(static_tcp_rendezvous)
    call = source[source.index("TCPStore(") :].split(")", 1)[0]
    assert "use_libuv" not in call and "USE_LIBUV" not in source
    assert "use_libuv: bool = True" in TCPStore.__init__.__doc__
    quoted = (
        "use_libuv was requested but PyTorch was built without libuv support, run with "
        "USE_LIBUV=0 to disable it."
    )
    guide = " ".join(GUIDE.read_text().split())
    assert f"`{quoted}`" in guide
    # the quote is torch's own text (the store's C++ code); the control: a reworded one is not
    reworded = quoted.replace("was requested", "is requested")
    assert found_in_library("libtorch_cpu.so", [quoted, reworded]) == {
        quoted: True,
        reworded: False,
    }


def test_08_quotes_torchs_error_for_the_g_step_without_detach():
    """Printed on each rank in tests/test_several_models.py::
    test_gan_without_detach_fails_in_the_g_step."""

    quoted = readme_sample(REPO / "08_several_models" / "README.md", "The D step then uses `fake`")
    assert quoted == [f"[rank0]: {GAN_G_STEP_ERROR}"]


# --- the heartbeat monitor (debugging/README.md, "ProcessGroupNCCL's watchdog got stuck")

HEARTBEAT_MESSAGES = [
    "ProcessGroupNCCL's watchdog got stuck for ",
    " seconds without making progress in monitoring enqueued collectives. ",
    "you can either increase the timeout (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or "
    "disable the heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).",
    "Terminating the process after attempting to dump debug info, due to ",
    "ProcessGroupNCCL watchdog hang",
    "ProcessGroupNCCL monitor thread is disabled, but would have terminated the process",
]
# The first line torch 2.3 and 2.4 logged (their wheels' libtorch_cuda.so); gone in 2.5.
OLD_HEARTBEAT = "Heartbeat monitor timed out!"
HEARTBEAT_CONSTRUCTOR = "_ZN4c10d16ProcessGroupNCCL16HeartbeatMonitorC2EPS0_"


def cvar_defaults(library: Path, function: str) -> dict[str, int]:
    """The defaults `function` passes to getCvarInt/getCvarBool, by variable: in its machine code,
    each `mov $N,%esi` (the default) before the `lea` of a TORCH_NCCL_* variable's name. Read with
    binutils (nm for the function's address, objdump to disassemble it)."""
    import shutil
    import subprocess

    if not (shutil.which("nm") and shutil.which("objdump")):
        pytest.skip("binutils (nm, objdump) not installed: they read the library's machine code")
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    [address] = re.findall(rf"^([0-9a-f]+) T {re.escape(function)}$", symbols, re.M)
    start = int(address, 16)
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--start-address={start}"]
        + [f"--stop-address={start + 0x200}", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defaults, value = {}, None
    for line in code.splitlines():
        if move := re.search(r"\smov\s+\$0x([0-9a-f]+),%esi$", line):
            value = int(move[1], 16)
        elif name := re.search(r"<_ZN4c10dL\d+(TORCH_NCCL_\w+)E>", line):
            defaults[name[1]] = value
    return defaults


def test_heartbeat_monitor_messages_and_defaults_are_the_installed_librarys():
    """torch 2.14.1's libtorch_cuda.so: the heartbeat monitor's messages the guide quotes (the
    wording of 2.3 and 2.4 is not there), and the defaults its constructor passes: 480 s before it
    aborts, monitoring on, 15 s for the flight-recorder dump."""
    found = found_in_library("libtorch_cuda.so", HEARTBEAT_MESSAGES + [OLD_HEARTBEAT])
    assert [m for m in HEARTBEAT_MESSAGES if not found[m]] == [] and not found[OLD_HEARTBEAT]
    defaults = cvar_defaults(TORCH_LIB / "libtorch_cuda.so", HEARTBEAT_CONSTRUCTOR)
    assert {
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": 480,
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": 15000,
        "TORCH_NCCL_ENABLE_MONITORING": 1,
    }.items() <= defaults.items(), defaults
    guide = " ".join(GUIDE.read_text().split())
    for claim in (
        "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in "
        "monitoring enqueued collectives.",
        "`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC` (480 s in torch 2.14.1",
        "`TORCH_NCCL_ENABLE_MONITORING=0`",
        f"`{OLD_HEARTBEAT}",
    ):
        assert claim in guide, claim


# --- P2P over PCIe (debugging/README.md, "The first all-reduce hangs")


def test_the_nccl_lines_and_variables_the_guide_names_for_p2p_are_nccls():
    """The bundled libnccl.so.2: NCCL_DEBUG=INFO's channel lines for the P2P and shared-memory
    transports, and the variables the guide names. The control: a wording NCCL does not print."""
    texts = [
        "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/%s%s%s",
        "Channel %02d : %d[%d] -> %d[%d] via SHM/direct",
        "NCCL_P2P_DISABLE",
        "NCCL_P2P_LEVEL",
    ]
    found = found_in(nccl_library(), [*texts, "via PCIe/P2P"])
    assert found == {**dict.fromkeys(texts, True), "via PCIe/P2P": False}
    guide = " ".join(GUIDE.read_text().split())
    for claim in ("`via P2P/…`", "`via SHM/direct`", "`NCCL_P2P_DISABLE=1`", "`NCCL_P2P_LEVEL`"):
        assert claim in guide, claim


# --- destroy_process_group() at exit (debugging/README.md)

NOT_DESTROYED = (
    "WARNING: destroy_process_group() was not called before program exit, which can leak "
    "resources. For more info, please see https://pytorch.org/docs/stable/distributed.html#shutdown"
)
# torch 2.4 and 2.5's wording (their wheels; 2.3 printed its own, opt-in); 2.6 shortened it.
NOT_DESTROYED_BEFORE_2_6 = "WARNING: process group has NOT been destroyed before"


def test_the_exit_warning_is_nccls_alone():
    """In torch 2.14.1 the warning is in the NCCL backend's library only (ProcessGroupNCCL's
    destructor): gloo, in libtorch_cpu.so, has no such text (a gloo run prints none:
    tests/test_forum_errors.py). The longer wording of 2.3 to 2.5 is gone."""
    cuda = found_in_library("libtorch_cuda.so", [NOT_DESTROYED, NOT_DESTROYED_BEFORE_2_6])
    assert cuda == {NOT_DESTROYED: True, NOT_DESTROYED_BEFORE_2_6: False}
    assert found_in_library("libtorch_cpu.so", [NOT_DESTROYED]) == {NOT_DESTROYED: False}
    guide = " ".join(GUIDE.read_text().split())
    assert f"{NOT_DESTROYED} (function operator())" in guide
    assert f"`{NOT_DESTROYED_BEFORE_2_6} ...`" in guide


# --- barrier() and init_process_group(device_id=...) (debugging/README.md)

BARRIER_WARNING = (
    "barrier(): using the device under current context. You can specify `device_id` in "
    "`init_process_group` to mute this warning."
)


def test_barrier_runs_on_device_ids_the_bound_device_an_earlier_collectives_or_a_guess():
    """Where a barrier on nccl runs, read down to the C++ of torch 2.14.1. Python picks the
    device of a 1-byte tensor (device_ids, the bound device, the CPU, else the current device
    with a warning from rank 0); ProcessGroup::barrier uses that device only to allocate the
    tensor that picks the backend, and the c10d::barrier op passes the backend device_ids, the
    async flag and the timeout, not the device. ProcessGroupNCCL's own order is the docstring's
    note: device_ids, the bound device, an earlier collective's, else global rank mod the GPUs,
    with torch's warning in its nccl library. The guide says that order, not "the current
    device" (which an earlier version of it said)."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    code = inspect.getsource(c10d.barrier).split('"""')[-1]
    assert_in_order(
        code,
        "if isinstance(device_ids, list):",
        'elif getattr(group, "bound_device_id", None) is not None:',
        'elif device.type == "cpu"',
        "if group.rank() == 0:",
    )
    warned = code.index("if group.rank() == 0:")
    call = code[code.index("warnings.warn(", warned) : code.index("stacklevel", warned)]
    assert "".join(re.findall(r'"([^"]*)"', call)) == BARRIER_WARNING, call
    assert not re.search(r"\w+Warning\b", call)  # no category given: a UserWarning

    # C++: the device makes the tensor; the op call carries no device to the backend.
    group_hpp = (C10D_HEADERS / "ProcessGroup.hpp").read_text()
    barrier = group_hpp[group_hpp.index("virtual c10::intrusive_ptr<Work> barrier(") :]
    barrier = " ".join(barrier[: barrier.index("return work;")].split())
    assert "auto device = opts.device;" in barrier
    assert "tensor = at::empty( {1}, at::TensorOptions().device(device.value())" in barrier
    call_args = barrier[barrier.index("op.call(") :]
    assert re.sub(r"\s", "", call_args[: call_args.index(";")]) == (
        "op.call(tensor,c10::intrusive_ptr<ProcessGroup>::unsafe_reclaim_from_nonowning(this),"
        "opts.device_ids,opts.asyncOp,opts.timeout.count())"
    )
    assert barrier.count("opts.device") == 2  # `auto device = opts.device` and `opts.device_ids`
    nccl_hpp = " ".join((C10D_HEADERS / "ProcessGroupNCCL.hpp").read_text().split())
    assert (
        "A helper function to guess the device id of the current rank, based on // bounded "
        "device or used device. Do not use this function if you already know // the device id "
        "to operate on. c10::DeviceIndex guessDeviceId() const;" in nccl_hpp
    )
    note = " ".join(c10d.barrier.__doc__.split())
    assert (
        "(1) the first device passed to `device_ids` arg of barrier if not None, (2) the device "
        "passed to init_process_group if not None, (3) the device that was first used with this "
        "process group, if another collective with tensor inputs has been performed, (4) the "
        "device index indicated by the global rank mod local device count." in note
    )
    guessing = [
        "Guessing device ID based on global rank. ",
        "This can cause a hang if rank to GPU mapping is heterogeneous. ",
        "You can specify device_id in init_process_group()",
    ]
    assert all(found_in_library("libtorch_cuda.so", guessing).values())
    # Negative control: the nccl backend's text is not in the CPU library.
    assert not any(found_in_library("libtorch_cpu.so", guessing[:1]).values())

    doc = " ".join(c10d.init_process_group.__doc__.split())
    assert "the communicator is immediately formed (calling ``ncclCommInit*`` immediately" in doc
    assert "sub-groups will use ``ncclCommSplit`` when possible" in doc
    guide = " ".join(GUIDE.read_text().split())
    assert f"UserWarning: {BARRIER_WARNING}" in guide
    assert (
        "with a warning from torch's nccl backend: `Guessing device ID based on global rank. This "
        "can cause a hang if rank to GPU mapping is heterogeneous. You can specify device_id in "
        "init_process_group()`" in guide
    )
    assert "`torch.cuda.set_device` is not in the list." in guide
    assert "uses the current device" not in guide


def test_reentrant_needs_an_input_that_requires_grad_and_is_torchs_fallback():
    """Why the first layers run outside any checkpoint: under the reentrant variant a
    block whose inputs need no gradient (the images) gives its parameters none. torch
    2.14.1 still falls back to it, with a warning, when use_reentrant is not passed."""
    layer, images = nn.Linear(4, 4), torch.randn(2, 4)
    assert checkpoint(layer, images, use_reentrant=False).requires_grad
    with pytest.warns(
        UserWarning, match="None of the inputs have requires_grad=True. Gradients will be None"
    ):
        # no path back to layer.weight
        assert not checkpoint(layer, images, use_reentrant=True).requires_grad
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
            assert not checkpoint(layer, images).requires_grad


@pytest.mark.parametrize(
    "use_reentrant,static_graph,fails",
    [(True, False, True), (True, True, False), (False, False, False)],
)
def test_a_block_checkpointed_twice_needs_static_graph_when_reentrant(
    one_rank_group, use_reentrant, static_graph, fails
):
    """Each reentrant checkpoint runs its own backward, so the shared
    weights are marked ready twice; static_graph=True lets DDP
    expect it, and the non-reentrant variant has one backward."""
    torch.manual_seed(0)
    model = DDP(SharedTwice(use_reentrant), static_graph=static_graph)
    inputs = torch.randn(2, 4)
    if fails:
        with pytest.raises(RuntimeError, match=READY_ONCE) as error:
            model(inputs).sum().backward()
        # torch's message names this cause, and others (debugging/README.md quotes it)
        assert "2) Reused parameters in multiple reentrant backward passes" in str(error.value)
        assert "1) Use of a module parameter outside the `forward` function" in str(error.value)
        return
    for _ in range(2):  # static_graph: DDP learns the graph in the first iteration
        model.zero_grad()
        model(inputs).sum().backward()
    plain = SharedTwice(use_reentrant=None)
    plain.load_state_dict(model.module.state_dict())
    plain(inputs).sum().backward()
    for a, b in zip(plain.parameters(), model.module.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


def test_the_why_is_read_from_torch_source():
    """benchmark/README.md's "Why", read from torch 2.14.1: the reentrant checkpoint runs
    the block under no_grad and calls torch.autograd.backward itself in backward; the
    non-reentrant one works through saved-tensor hooks; DDP walks the graph after
    forward (prepare_for_backward on the outputs) only with find_unused_parameters and
    without static_graph; and DDP's docstring says what the README quotes."""
    reentrant = inspect.getsource(torch.utils.checkpoint.CheckpointFunction)
    assert "with torch.no_grad():" in reentrant and "torch.autograd.backward(" in reentrant
    checkpoint_source = Path(torch.utils.checkpoint.__file__).read_text()
    assert (
        "class _checkpoint_internal_hook(torch.autograd.graph.saved_tensors_hooks):"
        in checkpoint_source
    )
    assert "class _checkpoint_hook(_checkpoint_internal_hook):" in checkpoint_source
    # the non-reentrant forward
    assert "    with _checkpoint_hook(new_frame), forward_context:" in checkpoint_source
    ddp_source = Path(inspect.getsourcefile(DDP)).read_text()
    assert (
        "            if self.find_unused_parameters and not self.static_graph:\n"
        "                # Do not need to populate this for static graph.\n"
        "                self.reducer.prepare_for_backward(list(_find_tensors(output)))"
    ) in ddp_source
    doc = " ".join(inspect.getdoc(DDP).split())
    for quoted in (
        "If the checkpoint is done with use_reentrant=False (recommended), DDP will work as "
        "expected "
        "without any limitations.",
        "DDP will work as expected when there are no unused parameters in the model and each "
        "layer is "
        "checkpointed at most once (make sure you are not passing "
        "`find_unused_parameters=True` to DDP)",
        "1) Reentrant backwards. 2) Activation checkpointing multiple times. 3) Activation "
        "checkpointing "
        "when model has unused parameters.",
    ):
        assert quoted in doc, quoted


def test_requeue_code_and_torch_facts_the_readme_names():
    assert (
        load_script("05_checkpointing/checkpoint.py", "checkpoint").REQUEUE_EXIT_CODE
        == os.EX_TEMPFAIL
        == 75
        and 128 + signal.SIGTERM == 143
    )
    torch_dir = Path(torch.__file__).parent
    # torch 2.14: without map_location, tensors go back to the device they were saved from.
    assert "moved to the device they were saved from" in " ".join(torch.load.__doc__.split())
    # torch 2.14: the variable that keeps restarted workers off the old rendezvous store.
    rendezvous = (torch_dir / "distributed/elastic/rendezvous/dynamic_rendezvous.py").read_text()
    assert 'os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")' in rendezvous
    # torchrun forwards only the signals it is told to
    # handle; SIGUSR1 is not among the default ones.
    run_py = (torch_dir / "distributed/run.py").read_text()
    assert '"--signals-to-handle"' in run_py and 'default="SIGTERM,SIGINT,SIGHUP,SIGQUIT"' in run_py
    import torch.distributed.checkpoint as dcp

    assert callable(dcp.async_save)


def test_nn_syncbatchnorm_all_gathers_mean_invstd_count_and_all_reduces_gradient_sums():
    """04's README: nn.SyncBatchNorm's forward all-gathers each rank's per-channel mean,
    inverse standard deviation and count (all_gather on gloo, all_gather_single
    otherwise) and all-reduces nothing; its backward all-reduces the two per-channel
    gradient sums. (CpuSyncBatchNorm all-reduces sums instead.)"""
    forward, backward = syncbn_method("forward"), syncbn_method("backward")
    assert collectives(forward) == {"all_gather", "all_gather_single"}
    assert ["mean", "invstd", "count"] in concatenated(forward)
    assert "batch_norm_gather_stats_with_counts" in ast.unparse(forward)
    assert collectives(backward) == {"all_reduce"}
    assert ["sum_dy", "sum_dy_xmu"] in concatenated(backward)
    # Which all-gather: all_gather where the group's
    # backend is gloo, all_gather_single on any other.
    (branch,) = [
        n for n in ast.walk(forward) if isinstance(n, ast.If) and "'gloo'" in ast.unparse(n.test)
    ]
    assert "!=" in ast.unparse(branch.test)
    assert collectives(ast.Module(body=branch.body)) == {"all_gather_single"}
    assert collectives(ast.Module(body=branch.orelse)) == {"all_gather"}


def test_the_differentiable_all_reduce_is_deprecated_with_the_warning_04_silences():
    """04_syncbn/cpu_sync_batchnorm.py: torch 2.14 marks torch.distributed.nn.functional.all_reduce
    deprecated (in favour of a private module); the lesson filters exactly that warning."""
    import inspect
    import re
    import warnings

    import torch.distributed.nn.functional as dist_nn

    assert "_deprecated(" in inspect.getsource(dist_nn.all_reduce)
    lesson = (
        Path(__file__).resolve().parents[1] / "04_syncbn" / "cpu_sync_batchnorm.py"
    ).read_text()
    (pattern,) = re.findall(r'message=r"([^"]+)"', lesson)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # no process group: the warning comes first, then the error
            dist_nn.all_reduce(torch.ones(1))
        except (RuntimeError, ValueError):
            pass
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert (
        messages and re.match(pattern, messages[0]) and "_functional_collectives" in messages[0]
    ), messages


def test_demo_mismatched_collective_gloo_aborts_on_the_size_mismatch(tmp_path):
    """Without debugging aids: rank 1's all-reduce of 2 doubles meets rank 0's of 1 float, and gloo
    aborts the receiving process (SIGABRT) with its own message."""
    result = torchrun(
        DEMO,
        "--bug",
        "mismatched_collective",
        "--output-dir",
        str(tmp_path),
        check=False,
        timeout=120,
    )
    out = result.output
    assert result.returncode != 0
    assert (
        "Received data size doesn't match expected size. Is there a distributed collective mismatch"
        in out
    ), out[-3000:]
    # The receiving process aborts (SIGABRT). torchrun's
    # summary usually says so, but an abort can leave
    # that rank's error file half written, and torchrun
    # then fails reading it: check the abort itself.
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in out, out[
        -3000:
    ]
    # torchrun names that rank's exit code -6 (its log
    # line and its summary), unless it failed reading the
    # half-written error file, which it then says.
    assert re.search(r"exitcode(: |  : )-6\b", out) or "Failed to parse reply file" in out, out[
        -3000:
    ]


def test_demo_mismatched_collective_named_by_debug_detail(tmp_path):
    # TORCH_SHOW_CPP_STACKTRACES adds the C++ stack to the
    # error c10d raises (addr2line off: symbolizing is slow).
    env = clean_env(
        TORCH_DISTRIBUTED_DEBUG="DETAIL",
        TORCH_SHOW_CPP_STACKTRACES="1",
        TORCH_DISABLE_ADDR2LINE="1",
    )
    result = torchrun(
        DEMO,
        "--bug",
        "mismatched_collective",
        "--output-dir",
        str(tmp_path),
        env=env,
        check=False,
        timeout=120,
    )
    out = result.output
    assert result.returncode != 0
    # The skipped all-reduce (shape [1], on rank 0 only) meets rank 1's next one (shape [2]) at the
    # same sequence number; the check runs on both ranks, either may report first.
    pattern = (
        r"Detected mismatch between collectives on ranks\. Rank (\d) is running collective: "
        r"CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=ALLREDUCE, TensorShape=\[(\d)\], "
        r"TensorDtypes=(\w+).*?"
        r"but Rank (\d) is running collective: CollectiveFingerPrint\(SequenceNumber=\2, "
        r"OpType=ALLREDUCE, TensorShape=\[(\d)\], TensorDtypes=(\w+)"
    )
    m = re.search(pattern, out)
    assert m, out[-3000:]
    # rank 0's loss (one float), rank 1's counts (two doubles)
    assert {int(m[1]): (m[3], m[4]), int(m[5]): (m[6], m[7])} == {
        0: ("1", "Float"),
        1: ("2", "Double"),
    }
    assert re.search(r"^\[rank\d\]: RuntimeError: Detected mismatch between collectives", out, re.M)
    # @record put the exception into torchrun's summary.
    assert "Detected mismatch between collectives on ranks" in root_cause(out)
    assert re.search(
        r"^\[rank\d\]: Exception raised from \w+ at \S+/c10d/ProcessGroupWrapper\.cpp:\d+ "
        r"\(most recent "
        r"call first\):$",
        out,
        re.M,
    ), out[-3000:]


def test_the_torch_documentation_the_guide_cites():
    """Read from the installed torch (2.14.1): find_unused_parameters walks the
    graph from forward's outputs, after every forward (in _post_forward);
    torch.load puts tensors back on the device they were saved from."""
    ddp_docs = " ".join(DDP.__doc__.split())
    assert (
        "find_unused_parameters (bool): Traverse the autograd graph from all tensors "
        "contained in the return "
        "value of the wrapped module's ``forward`` function. Parameters that don't receive "
        "gradients as part "
        "of this graph are preemptively marked as being ready to be reduced."
    ) in ddp_docs
    assert re.search(
        r"if self\.find_unused_parameters and not self\.static_graph:\n(\s+#.*\n)*"
        r"\s+self\.reducer\.prepare_for_backward\(list\(_find_tensors\(output\)\)\)",
        inspect.getsource(DDP._post_forward),
    )
    load_docs = " ".join(torch.load.__doc__.split())
    assert (
        "They are first deserialized on the CPU and are then moved to the device they were "
        "saved from." in load_docs
    )
    assert (
        "storages can be dynamically remapped to an alternative set of devices using the "
        ":attr:`map_location`" in load_docs
    )


def test_frozen_models_and_layers_errors_and_fixes(tmp_path, sample_run):
    """The guide's commands: DDP refuses a frozen model, in the words the guide quotes, and the
    unwrapped teacher runs; a part of the model frozen after the wrap passes step 1 (with
    unaveraged gradients: replicas differ after one step) and fails at step 2's forward as
    quoted; freezing first, wrapping again and find_unused_parameters each run, and train alike."""

    refused = sample_run("guide-wrap-frozen")  # as the guide quotes it: tests/test_readme_text.py
    assert refused.returncodes == (1,), refused.output[-3000:]
    assert "DistributedDataParallel is not needed" in root_cause(refused.output)
    assert "step 1 mean loss" not in refused.output  # raised by the wrap, before any step
    # the runs that end well: their claim is what the script does, so their ranks start warm
    fixed = warm_command(WRAP_FROZEN_FIX, "--output-dir", str(tmp_path / "no_wrap"))
    assert fixed.returncode == 0 and "done: no bug" in fixed.stdout, fixed.output[-3000:]
    assert read_summary(tmp_path / "no_wrap")["replicas_identical"]

    frozen = sample_run("guide-freeze-after-wrap")
    assert frozen.returncodes == (1,), frozen.output[-3000:]
    # the first step runs; the second step's forward raises
    assert "step 1 mean loss" in frozen.output and "step 2 mean loss" not in frozen.output
    assert re.search(r"^\[rank\d\]:\s+logits = model\(x, use_aux=use_aux\)$", frozen.output, re.M)
    assert "Expected to have finished reduction" in root_cause(frozen.output)
    one_step = warm_command(FREEZE_AFTER_WRAP_ONE_STEP, "--output-dir", str(tmp_path / "one_step"))
    assert one_step.returncode == 0, one_step.output[-3000:]
    assert read_summary(tmp_path / "one_step")["replicas_identical"] is False

    checksums = {}
    for command, name in (
        (FREEZE_FIRST, "freeze_first"),
        (FREEZE_REWRAP, "rewrap"),
        (FREEZE_FIND_UNUSED, "find_unused"),
    ):
        fixed = warm_command(command, "--output-dir", str(tmp_path / name))
        assert fixed.returncode == 0 and "done: no bug" in fixed.stdout, fixed.output[-3000:]
        summary = read_summary(tmp_path / name)
        assert summary["replicas_identical"], summary
        checksums[name] = summary["replica_checksums"][0]
    # the three fixes train alike
    assert len(set(checksums.values())) == 1, checksums


def test_different_models_error_and_fix(tmp_path, sample_run):
    """The guide's commands: ranks that built different models (an auxiliary head on rank 0 only)
    are refused at the wrap, before any step, in the words the guide quotes (each rank names its
    own count first); the model decided from the data set runs on both ranks alike."""
    refused = sample_run("guide-different-models")  # as the guide quotes it: test_readme_text.py
    assert refused.returncodes == (1,), refused.output[-3000:]
    assert re.search(
        r"Rank 0 has 6 params, while rank 1 has inconsistent 4 params|"
        r"Rank 1 has 4 params, while rank 0 has inconsistent 6 params",
        refused.output,
    )
    assert "DDP expects same model across all ranks" in root_cause(refused.output)
    assert "step 1 mean loss" not in refused.output  # raised by the wrap, before any step
    fixed = run(
        command_argv(DIFFERENT_MODELS_FIX) + ["--output-dir", str(tmp_path / "fix")],
        timeout=120,
    )
    assert fixed.returncode == 0 and "done: no bug" in fixed.stdout, fixed.output[-3000:]
    assert read_summary(tmp_path / "fix")["replicas_identical"]


def test_rank_aborted_is_exitcode_minus_6_sigabrt():
    result = run(command_argv(RANK_ABORT), timeout=120)
    out = result.output
    assert result.returncode != 0
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in out
    # torchrun's own traceback (the same every time), then its summary: one entry per failed rank.
    assert "in launch_agent\n" in out and "raise ChildFailedError(" in out
    assert re.search(
        r"debugging/rank_signal\.py FAILED\n-+\nFailures:\n\[\d\]:\n(.*\n){6}-+\n"
        r"Root Cause \(first observed failure\):\n\[\d\]:\n",
        out,
    ), out[-3000:]
    root = root_cause(out)
    m = re.search(
        r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -6 \(pid: (\d+)\)  \(SIGABRT\)\n"
        r"  error_file: <N/A>\n  traceback : Signal 6 \(SIGABRT\) received by PID (\d+)",
        root,
    )
    assert m and m[1] == m[2], root
    # The rank that was only waiting was stopped by
    # torchrun: listed under Failures, not as the cause.
    failures = out.split("Root Cause")[0].split("Failures:")[-1]
    assert re.search(
        r"rank      : 0 \(local_rank: 0\)\n  exitcode  : -15 \(pid: \d+\)  \(SIGTERM\)", failures
    )


def test_torchrun_summary_times_are_whole_seconds_and_root_cause_is_the_earliest(tmp_path):
    """debugging/README.md: a rank killed by a signal writes no error file, so
    its time is when torchrun collected it (whole seconds); Root Cause is the
    failure with the earliest time, even an error file's earlier second."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    start = int(time.time())
    killed = ProcessFailure(
        local_rank=1, pid=12145, exitcode=-7, error_file=str(tmp_path / "none.json")
    )
    assert start <= killed.timestamp <= time.time() and isinstance(killed.timestamp, int)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d", killed.timestamp_isoformat())
    assert (killed.error_file, killed.message) == (
        "<N/A>",
        "Signal 7 (SIGBUS) received by PID 12145",
    )
    # A survivor whose error file (written by @record)
    # says it raised a second earlier is named Root Cause.
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: Connection reset by peer",
                    "extraInfo": {"py_callstack": "...", "timestamp": str(start - 1)},
                }
            }
        )
    )
    survivor = ProcessFailure(local_rank=0, pid=12144, exitcode=1, error_file=str(error_file))
    assert ChildFailedError("x.py", {1: killed, 0: survivor}).get_first_failure()[0] == 0
    survivor.timestamp = killed.timestamp + 1  # control: the later failure is not the root cause
    assert ChildFailedError("x.py", {1: killed, 0: survivor}).get_first_failure()[0] == 1


def test_launch_appends_local_rank_unless_use_env_and_the_spelling_changed_in_2_0():
    """Read from the installed torch (2.14.1): torch.distributed.launch
    appends --local-rank=N unless --use-env (torchrun's use_env is
    always true); torch 2.0 changed the spelling from --local_rank."""
    import torch.distributed.launch as launch_module
    import torch.distributed.run as run_module

    config_from_args = inspect.getsource(run_module.config_from_args)
    assert re.search(
        r'if not use_env:\n\s+cmd_args\.append\(f"--local-rank=\{macros\.local_rank\}"\)',
        config_from_args,
    )
    assert 'if not hasattr(args, "use_env"):\n        return True' in inspect.getsource(
        run_module.get_use_env
    )
    docs = " ".join(launch_module.__doc__.split())
    assert (
        "From PyTorch 2.0.0 onwards, the dashed ``--local-rank`` is preferred over the "
        "previously used "
        "underscored ``--local_rank``"
    ) in docs


def test_is_bf16_supported_reads_the_current_gpu_and_counts_emulation_below_ampere():
    """benchmark/README.md: torch 2.14.1's is_bf16_supported() asks the current device only; at
    compute capability 8 or more it says True, below that (with emulation, the default) it builds
    a bf16 tensor on that device and says whether that worked."""
    import torch.cuda

    code = inspect.getsource(torch.cuda.is_bf16_supported).split('"""')[-1]
    assert_in_order(
        code,
        "device = torch.cuda.current_device()",
        "if torch.cuda.get_device_properties(device).major >= 8:",
        "if not including_emulation:",
        "return _check_bf16_tensor_supported(device)",
    )
    assert inspect.signature(torch.cuda.is_bf16_supported).parameters["including_emulation"].default
    check = inspect.getsource(torch.cuda._check_bf16_tensor_supported)
    assert "torch.tensor([1.0], dtype=torch.bfloat16, device=device)" in check
    readme = " ".join((REPO / "benchmark" / "README.md").read_text().split())
    assert (
        "`torch.cuda.is_bf16_supported()` would count emulation: below compute capability 8 it "
        "says True where a bf16 tensor can be made on the current device" in readme
    )


def test_only_torchrun_across_nodes_defaults_to_port_29500():
    """Read from the installed torch (2.14.1), run(): --standalone, and a
    one-node torchrun given no --master-port or rendezvous endpoint, listen
    on a free port (localhost:0); otherwise the static rendezvous uses
    --master-port, 29500 unless given."""
    import torch.distributed.run as run_module

    source = inspect.getsource(run_module.run)
    standalone = source.index("if args.standalone:")
    one_node = source.index("if max_nodes == 1:")
    assert source.count('args.rdzv_endpoint = "localhost:0"') == 2
    assert standalone < source.index('args.rdzv_endpoint = "localhost:0"') < one_node
    assert "args.master_port is None" in source[standalone:one_node]
    assert "if args.master_port is None:\n        args.master_port = 29500" in source
    # --rdzv-endpoint without a port: the c10d rendezvous's own default, not --master-port's
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    assert c10d_rendezvous_backend.DEFAULT_PORT == 29400
    assert "If no port number is specified ``HOST_NODE_ADDR`` defaults to 29400." in (
        " ".join(run_module.__doc__.split())
    )
    guide = " ".join(GUIDE.read_text().split())
    assert "both take port 29500, the static rendezvous's default" in guide
    assert "both take 29400, the c10d rendezvous's default" in guide


def test_ddp_syncs_buffers_without_bumping_their_version_and_forward_sync_buffers_keeps_init_sync():
    """Read from the installed torch (2.14.1): DDP's buffer sync in forward keeps
    the buffers' version counters (the 2.12 fix, pytorch/pytorch#175851);
    broadcast_buffers=False also skips the sync at construction,
    forward_sync_buffers=False does not (torch's own FutureWarning says so)."""

    assert "_unsafe_preserve_version_counter(" in inspect.getsource(DDP._sync_buffers)
    init = inspect.getsource(DDP.__init__)
    assert '"instead. IMPORTANT: unlike `broadcast_buffers=False`, "' in init
    assert '"`forward_sync_buffers=False` still syncs buffers at "' in init
    assert re.search(
        r"if forward_sync_buffers is not None:\n\s+self\.forward_sync_buffers = "
        r"forward_sync_buffers\n"
        r"\s+init_sync_buffers = True",
        init,
    )


def test_ddp_optimizer_is_on_by_default_and_splits_at_ddps_buckets():
    """Read from the installed torch (2.14.1): optimize_ddp defaults to True ("ddp_optimizer"),
    and DDPOptimizer's graph breaks name the switch; a bucket cap below DDP's first bucket
    (1 MiB) is refused."""
    import torch._dynamo
    from torch._dynamo.backends import distributed as ddp_optimizer
    from torch._dynamo.utils import get_optimize_ddp_mode

    assert torch._dynamo.config.optimize_ddp is True and get_optimize_ddp_mode() == "ddp_optimizer"
    source = inspect.getsource(ddp_optimizer)
    assert "Set `torch._dynamo.config.optimize_ddp = False` to disable." in source
    assert "First bucket should be smaller/equal to other buckets" in source
    assert torch.distributed._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    import importlib.util

    config = Path(importlib.util.find_spec("torch._dynamo.config").origin).read_text()
    assert "There will no comm/compute overlap." in " ".join(
        line.lstrip("# ") for line in config.splitlines()
    )
    # The names it takes besides True and False, and what they map to.
    import typing

    hints = typing.get_type_hints(torch._dynamo.config)
    names = {a for arg in typing.get_args(hints["optimize_ddp"]) for a in typing.get_args(arg)}
    assert names == {
        "ddp_optimizer",
        "python_reducer",
        "python_reducer_without_compiled_forward",
        "no_optimization",
    }
    assert "this optimization requires the usage of compiled_autograd" in " ".join(
        line.lstrip("# ") for line in config.splitlines()
    )
    with torch._dynamo.config.patch(optimize_ddp=False):
        assert get_optimize_ddp_mode() == "no_optimization"
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    assert "`torch._dynamo.config.optimize_ddp = False`" in guide
    assert (
        '`"ddp_optimizer"` (`True`), `"no_optimization"` (`False`), and the experimental '
        '`"python_reducer"`, which needs compiled autograd' in guide
    )


def test_the_loader_and_forkserver_texts_the_guide_quotes_are_torchs_and_pythons():
    """The signal message of torch's SIGCHLD handler (libtorch_python.so); the persistent_workers
    docstring; the forkserver's preload switch."""
    import multiprocessing
    from pathlib import Path as _Path

    import torch
    from torch.utils.data import DataLoader

    library = _Path(torch.__file__).parent / "lib" / "libtorch_python.so"
    assert b"DataLoader worker (pid {}) is killed by signal: {}. " in library.read_bytes()
    doc = " ".join(DataLoader.__doc__.split())
    assert (
        "persistent_workers (bool, optional): If ``True``, the data loader will not shut down "
        "the worker processes after a dataset has been consumed once." in doc
    )
    assert callable(multiprocessing.get_context("forkserver").set_forkserver_preload)


def test_nccl_alone_serves_cuda_and_no_backend_means_the_accelerators_since_2_6(monkeypatch):
    """Read from, and run in, the installed torch (2.14.1): "nccl" maps cuda only; with no backend
    given, BackendConfig takes the detected accelerator's backend alone (the accelerator faked as
    cuda here); the docstring dates that to 2.6, while its note still says both are created."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    assert c10d.Backend.backend_capability["nccl"] == ["cuda"]
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    monkeypatch.setattr(c10d.Backend, "_ensure_backend_registered", lambda backend: None)
    assert c10d.BackendConfig(c10d.Backend.UNDEFINED).get_device_backend_map() == {"cuda": "nccl"}
    doc = " ".join(c10d.init_process_group.__doc__.split())
    assert "Since 2.6, if ``backend`` is not provided, c10d will use a backend registered" in doc
    assert (
        "Currently when no backend is specified, both ``gloo`` and ``nccl`` backends will be "
        "created." in doc
    )


def test_a_build_without_nccl_refuses_it_and_the_chosen_backend_starts():
    """01 used to pick nccl whenever CUDA was there: on a Windows GPU machine torch's error below.
    The chosen backend starts a process group where nccl cannot."""
    result = run([PYTHON, "-c", NO_NCCL_BUILD, REPO, str(free_port())], timeout=60)
    assert result.returncode == 0, result.output[-3000:]
    assert result.stdout.splitlines() == [f"nccl: {NCCL_NOT_BUILT}", "chosen: gloo"]
    assert f"`RuntimeError: {NCCL_NOT_BUILT}`" in GUIDE.read_text()  # the guide quotes it


def test_ddp_optimizer_splits_the_module_compiled_before_the_wrap(one_rank_group):
    """README's compile row: compiled in place and then wrapped, the module still gets DDP's
    graph split: torch.compile's DDPOptimizer cuts the graph where DDP's gradient buckets end
    (the first bucket holds 1 MiB of parameters, the rest here), so each bucket's all-reduce
    can start before the backward ends. Without DDP the same module is one graph."""
    assert compiled_graphs(None) == 1
    assert compiled_graphs({}) == 2
    # Buckets smaller than DDP's first one (1 MiB) fail
    # in torch 2.14.1, which is why the script refuses
    # --compile with --bucket-cap-mb below 1
    # (test_compile_with_small_buckets_is_refused). If torch starts
    # to accept them, this fails: drop the refusal.
    with pytest.raises(
        AssertionError, match="First bucket should be smaller/equal to other buckets"
    ):
        compiled_graphs({"bucket_cap_mb": 0.5})


def test_scaler_step_unscales_before_the_optimizer_step_and_skips_it_on_overflow():
    """Read from torch 2.14.1's source: with fp16 the unscale and the inf check happen inside
    scaler.step() before optimizer.step() (so in the profile's exposed_comm), and a step with an
    overflow calls no optimizer.step() (the profile leaves that step's last three parts out)."""
    step = inspect.getsource(torch.amp.GradScaler.step)
    assert -1 < step.index("self.unscale_(optimizer)") < step.index("self._maybe_opt_step(")
    maybe_step = inspect.getsource(torch.amp.GradScaler._maybe_opt_step)
    assert (
        'if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):'
        in maybe_step
    )


def test_what_the_help_texts_say_about_torch_is_its_documentation():
    """Read from torch 2.14.1: DDP's, DataLoader's and max_memory_allocated's docstrings,
    and inductor's C++ compiler lookup (why --compile on CPU needs a C compiler)."""
    ddp = " ".join(inspect.getdoc(DDP).split())
    for said in (
        "gradients will be views pointing to different offsets of ``allreduce`` "
        "communication buckets",
        "it avoids the overhead of copying between gradients and ``allreduce`` communication "
        "buckets",
        "When set to ``True``, DDP knows the trained graph is static",
        "find_unused_parameters (bool): Traverse the autograd graph",
        "a default size of 25 MiB will be used",
    ):
        assert said in ddp, said
    loader = " ".join(inspect.getdoc(torch.utils.data.DataLoader).split())
    assert (
        "will not shut down the worker processes after a dataset has been consumed once" in loader
    )
    assert (
        "prefetch_factor (int, optional, keyword-only arg): Number of batches loaded in "
        "advance by each worker" in loader
    )
    assert "maximum GPU memory occupied by tensors" in torch.cuda.max_memory_allocated.__doc__
    cpp_builder = (Path(torch.__file__).parent / "_inductor" / "cpp_builder.py").read_text()
    assert "def get_cpp_compiler()" in cpp_builder and "cpp_compiler_search(" in cpp_builder


def test_the_messages_the_troubleshooting_section_quotes_are_torchs_own():
    """ "Troubleshooting": gloo's `Timed out waiting 60000ms for recv operation to complete` and
    `Connection closed by peer` are in torch's CPU library; nccl's watchdog line is made of
    literals of its NCCL library that tests/test_torch_text.py finds there (torch 2.14.1)."""

    troubleshooting = readme_words("## Troubleshooting")
    quoted = "`Timed out waiting 60000ms for recv operation to complete`"
    assert quoted in troubleshooting and "`Connection closed by peer`" in troubleshooting
    found = found_in_library(
        "libtorch_cpu.so",
        [
            "Timed out waiting ",
            "ms for recv operation to complete",
            "Connection closed by peer",
            "Timed out waiting 60000ms",
        ],
    )
    assert found == {
        "Timed out waiting ": True,
        "ms for recv operation to complete": True,
        "Connection closed by peer": True,
        # filled in at run time: the check can fail
        "Timed out waiting 60000ms": False,
    }
    watchdog = re.search(
        r"`(Watchdog caught collective operation timeout: [^`]+)`", troubleshooting
    )[1]
    pieces = [piece for piece in watchdog.split("...") if piece.strip(", )")]
    assert pieces == [
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=",
        ", OpType=",
        ", NumelIn=",
    ]
    literals = [
        "Watchdog caught collective operation timeout: ",
        "WorkNCCL(",
        "SeqNum=",
        ", OpType=",
        ", NumelIn=",
    ]
    assert "".join(literals[:3]) == pieces[0] and literals[3:] == pieces[1:]
    assert all(literal in WATCHDOG_MESSAGES for literal in literals)


def test_the_pinned_wheels_are_a_few_gb_with_their_own_nccl_and_no_network_plugin():
    """ "Quick start": the first install downloads torch, a few GB. "On a cluster":
    requirements.txt brings the wheel's own NCCL, and a generic wheel has no NCCL
    network plugin (libnccl-net*.so, e.g. AWS OFI for Slingshot) that a site's
    build carries. Read from the installed distributions of requirements.txt."""
    from tests.torch_api import installed_closure, requirement_lines

    PINNED = REPO / "requirements.txt"

    pulled = installed_closure(requirement_lines(PINNED))
    files = {name: metadata.distribution(name).files or [] for name in pulled}
    size = sum(int(f.size or 0) for found in files.values() for f in found)
    # measured here: 5.7 GB installed (torch 2.14.1, CUDA 13)
    assert size > 2 * 10**9, f"{size / 1e9:.1f} GB"
    nccl = [name for name in pulled if name.startswith("nvidia-nccl")]
    assert nccl and pulled[nccl[0]].endswith(
        f"torch -> {metadata.distribution(nccl[0]).metadata['Name']}"
    )
    libraries = [str(f) for found in files.values() for f in found if "libnccl" in str(f)]
    assert any(lib.endswith("libnccl.so.2") for lib in libraries), libraries
    assert not [lib for lib in libraries if "libnccl-net" in lib], libraries


def test_dataparallel_docs_recommend_ddp_even_on_one_node():
    """ "DataParallel or DDP?": torch's DataParallel docstring recommends DDP "even if there is
    only a single node", splits the batch and replicates the module in every forward; its
    parallel_apply runs the replicas in threads of the one process (torch 2.14.1)."""
    import inspect

    from torch import nn
    from torch.nn.parallel import parallel_apply

    doc = " ".join(nn.DataParallel.__doc__.split())
    assert "In the forward pass, the module is replicated on each device" in doc
    assert "splitting the input across the specified devices" in doc
    assert "threading.Thread(" in inspect.getsource(parallel_apply)
    assert "one process with one thread per GPU" in README
    assert "recommended to use :class:`~torch.nn.parallel.DistributedDataParallel`" in doc
    assert "even if there is only a single node" in doc
    assert '"even if there is only a single node"' in README


def test_the_guides_quoted_errors_are_what_its_demos_print(sample_run):
    """Each error the guide quotes (and 08's README, DDP's refusal of a frozen model) is what the
    guide's command printed: torch's, Python's or gloo's words, from any rank."""
    guide = REPO / "debugging/README.md"
    names = [
        "guide-module-prefix",
        "guide-wrapper-attribute",
        "guide-wrap-frozen",
        "guide-freeze-after-wrap",
        "guide-different-models",
    ]
    ran = dict(shared_runs(names, sample_run.folder))
    for marker, name, lines in (
        ("Both come from using the wrapper", "guide-module-prefix", 3),
        ('## "DistributedDataParallel is not needed', "guide-wrap-frozen", 1),
        ("`model.module.trunk.requires_grad_(False)` after", "guide-freeze-after-wrap", 2),
    ):
        quoted = readme_sample(guide, marker)
        assert len(quoted) == lines and ran[name].returncodes == (1,), quoted
        missing = _quoted_lines_printed(quoted, ran[name].output)
        assert missing == [], (missing, ran[name].output[-3000:])
    error = "AttributeError: 'DistributedDataParallel' object has no attribute 'num_classes'"
    assert f"`{error}`" in guide.read_text() and error in ran["guide-wrapper-attribute"].output

    def counts_masked(line):  # each rank names its own count first
        return re.sub(r"\b[Rr]ank \d|\d+ params", "#", _any_rank(line))

    (quoted,) = readme_sample(guide, '## "DDP expects same model across all ranks"')
    printed = {counts_masked(line) for line in ran["guide-different-models"].output.splitlines()}
    assert counts_masked(quoted) in printed, ran["guide-different-models"].output[-3000:]
    # 08's README quotes the frozen model's refusal, wrapped over three lines
    lesson = " ".join((REPO / "08_several_models/README.md").read_text().split())
    refusal = re.search(r"RuntimeError: DistributedDataParallel is not needed[^`]*", lesson)
    assert refusal and refusal.group() in ran["guide-wrap-frozen"].output, refusal


def test_gan_without_detach_fails_in_the_g_step(tmp_path):
    """The error the README quotes, raised by the G step's backward on a rank."""
    result = run(
        command_argv(GAN_NO_DETACH) + ["--max-steps", "3", "--output-dir", str(tmp_path)],
        timeout=120,
    )
    assert result.returncode == 1, result.output[-3000:]
    printed = [_any_rank(line) for line in result.output.splitlines()]
    assert f"[rankN]: {GAN_G_STEP_ERROR}" in printed, result.output[-3000:]
    assert re.search(r"^\[rank\d\]:\s+g_loss\.backward\(\)$", result.output, re.M)
    assert "Trying to backward through the graph a second time" in root_cause(result.output)


def test_nn_syncbatchnorm_takes_cuda_xpu_hpu_privateuse1_and_no_cpu_kernel(one_rank_group):
    """The devices nn.SyncBatchNorm.forward accepts (torch 2.14.1's source: cuda, hpu, xpu and the
    PrivateUse1 backend), and why not CPU: its statistics kernel has no CPU implementation. In a
    process group, a CPU tensor is refused with the error 04's README quotes."""
    refusal = "SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone"
    with pytest.raises(ValueError, match=f"^{refusal}$"):
        nn.SyncBatchNorm(4).train()(torch.randn(2, 4, 3, 3))
    readme = " ".join((REPO / "04_syncbn" / "README.md").read_text().split())
    assert f"`ValueError: {refusal}`" in readme
    import inspect

    source = inspect.getsource(nn.SyncBatchNorm.forward)
    devices = re.search(r"input\.device\.type not in \[(.*?)\]", source, re.S).group(1)
    named = re.findall(r'"(\w+)"', devices)
    assert sorted(named) == ["cuda", "hpu", "xpu"], devices
    assert "_get_privateuse1_backend_name()" in devices
    with pytest.raises(
        NotImplementedError, match="'aten::batch_norm_stats' with arguments from the 'CPU' backend"
    ):
        torch.batch_norm_stats(torch.randn(4, 3, 2, 2), 1e-5)


def test_the_readmes_warm_up_is_torchs_linear_lr_stepped_after_the_optimizer():
    """The README names torch's LinearLR, whose step() torch wants after optimizer.step()
    (it warns otherwise; torch 2.14.1, torch/optim/lr_scheduler.py)."""
    parameters = inspect.signature(torch.optim.lr_scheduler.LinearLR).parameters
    assert {"start_factor", "total_iters"} <= parameters.keys()
    assert "Detected call of `lr_scheduler.step()` before `optimizer.step()`" in inspect.getsource(
        torch.optim.lr_scheduler
    )
    # the README's worked example of the linear scaling rule
    assert 0.1 * 256 / 32 == pytest.approx(0.8)


def test_uneven_inputs_defaults_and_what_torch_does_for_join_and_barriers():
    """The defaults the README names, and the PyTorch
    behaviour it describes (torch 2.14.1's source)."""
    config = load_script(f"{DIR}/uneven_inputs.py", "uneven_inputs").UnevenConfig()
    assert (config.timeout_s, config.momentum, config.uneven, config.fix) == (60.0, 0.0, 64, "join")
    assert inspect.signature(DDP.join).parameters["divide_by_initial_world_size"].default is True
    ddp_source = inspect.getsource(DDP)
    # A joined rank's all-reduces carry zeros; at the end
    # the last rank to join is the source of the weights.
    assert "real tensors are substituted with\n        # zero tensors" in ddp_source
    assert "Joined processes contribute zero gradient" in ddp_source
    assert re.search(r"_find_common_rank\(\s*self._distributed_rank, is_last_joiner", ddp_source)
    assert "only supported with the GLOO backend" in inspect.getdoc(
        torch.distributed.monitored_barrier
    )


def syncbn_method(name: str) -> ast.FunctionDef:
    """A method of the autograd Function behind nn.SyncBatchNorm, from torch's source file."""
    tree = ast.parse(SYNCBN_FUNCTION.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SyncBatchNorm")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def concatenated(function: ast.FunctionDef) -> list[list[str]]:
    """The names in each `torch.cat([a, b, ...])` of a method: what goes into one message."""
    return [
        [ast.unparse(e) for e in node.args[0].elts]
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.cat"
        and node.args
        and isinstance(node.args[0], ast.List)
    ]


def compiled_graphs(ddp_kwargs: dict | None) -> int:
    """How many graphs torch.compile hands its backend for a 2.4 MiB MLP
    compiled in place (model.compile()), then wrapped in DDP with
    `ddp_kwargs` (None: not wrapped), after one forward and backward."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 64),
    )
    graphs = []
    model.compile(
        backend=lambda graph_module, example_inputs: (
            graphs.append(graph_module) or graph_module.forward
        )
    )
    run = model if ddp_kwargs is None else DDP(model, **ddp_kwargs)
    try:
        run(torch.randn(8, 64)).sum().backward()
    finally:
        torch.compiler.reset()
    return len(graphs)


class SharedTwice(nn.Module):
    """One layer run twice in a forward, each time in its own
    checkpoint (use_reentrant None: no checkpoint)."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.first, self.shared, self.use_reentrant = (
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            use_reentrant,
        )

    def forward(self, x):
        x = self.first(x)
        for _ in range(2):
            x = (
                self.shared(x)
                if self.use_reentrant is None
                else checkpoint(self.shared, x, use_reentrant=self.use_reentrant)
            )
        return x


def _quoted_lines_printed(quoted: list[str], output: str) -> list[str]:
    """The quoted lines that no line of `output` matches, from any rank (a quote that ends in
    ' ...' is the start of its line)."""
    printed = [_any_rank(line) for line in output.splitlines()]
    missing = []
    for line in map(_any_rank, quoted):
        head = line[: -len(" ...")] if line.endswith(" ...") else None
        if not (line in printed or (head and any(p.startswith(head) for p in printed))):
            missing.append(line)
    return missing


WRAP_FROZEN_FIX = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug wrap_frozen "
    "--fix no_wrap"
)


FREEZE_REWRAP = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug freeze_after_wrap "
    "--fix rewrap"
)


FREEZE_FIRST = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug freeze_after_wrap "
    "--fix freeze_first"
)


FREEZE_FIND_UNUSED = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug freeze_after_wrap "
    "--fix find_unused"
)


FREEZE_AFTER_WRAP_ONE_STEP = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug freeze_after_wrap "
    "--steps 1"
)


DIFFERENT_MODELS_FIX = (
    "torchrun --standalone --nproc_per_node=2 debugging/demo_bugs.py --bug different_models "
    "--fix data_set_size"
)


RANK_ABORT = "torchrun --standalone --nproc_per_node=2 debugging/rank_signal.py --how abort"


# torch's error for nccl on a build without it (the guide quotes it: tests/test_torch_text.py)
NCCL_NOT_BUILT = "Distributed package doesn't have NCCL built in"


NO_NCCL_BUILD = """
import sys, torch, torch.distributed as dist
from torch.distributed import distributed_c10d
sys.path.insert(0, sys.argv[1])
from common.launcher import choose_backend
# a build without NCCL (Windows, macOS), faked: torch's own check of its build answers False
dist.is_nccl_available = distributed_c10d.is_nccl_available = lambda: False
url = f"tcp://127.0.0.1:{sys.argv[2]}"
try:
    dist.init_process_group("nccl", init_method=url, rank=0, world_size=1)
except RuntimeError as error:
    print(f"nccl: {error}")
backend = choose_backend(torch.device("cuda", 0))
dist.init_process_group(backend, init_method=url, rank=0, world_size=1)
print(f"chosen: {dist.get_backend()}")
dist.destroy_process_group()
"""


GAN_NO_DETACH = "torchrun --standalone --nproc_per_node=2 08_several_models/gan.py --no-detach"


# torch's error in the G step without .detach(), as printed (the README quotes it:
# tests/test_torch_text.py)
GAN_G_STEP_ERROR = (
    "RuntimeError: Trying to backward through the graph a second time (or directly access saved "
    "tensors after they have already been freed). Saved intermediate values of the graph are "
    "freed when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)


def collectives(function: ast.FunctionDef) -> set[str]:
    """The torch.distributed functions a method calls (as
    `dist.x(...)` or `torch.distributed.x(...)`)."""
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.add(node.func.attr)
    return found


def _any_rank(line: str) -> str:
    """A line of output with the rank it came from left out: `[rankN]:`, `for rank N:`."""
    return re.sub(r"rank \d+:", "rank N:", re.sub(r"^\[rank\d+\]:", "[rankN]:", line))


SYNCBN_FUNCTION = Path(torch.__file__).parent / "nn" / "modules" / "_functions.py"


def test_09s_readme_on_fsdp2_is_torchs_own_source():
    """09's README, "What changes" and "Equal to DDP": set_requires_gradient_sync is FSDP2's no_sync
    (its docstring); float32 and bfloat16 gradients are reduce-scattered with an average
    (_get_gradient_divide_factors), while DDP divides by the world size before it sums (the
    reducer's div_factor_, the Python allreduce_hook); replicate() on FSDP2 ships as a private
    module."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as ddp_hooks
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    from torch.distributed.fsdp import FSDPModule, fully_shard

    readme = (REPO / "09_fsdp2" / "README.md").read_text()
    doc = inspect.getdoc(FSDPModule.set_requires_gradient_sync)
    assert "gradient accumulation *without communication*" in doc and "`no_sync`" in doc
    assert "`model.set_requires_gradient_sync(False)`" in readme
    divide = inspect.getsource(collectives._get_gradient_divide_factors)
    assert "reduce_dtype not in (torch.float32, torch.bfloat16)" in divide
    assert "return None, None, ReduceOp.AVG, ReduceOp.AVG" in divide
    root = Path(torch.__file__).parent
    reducer = (root / "include/torch/csrc/distributed/c10d/reducer.hpp").read_text()
    assert "int div_factor_;" in reducer and "Equal to the process group size" in reducer
    assert "_allreduce_fut(" in inspect.getsource(ddp_hooks.allreduce_hook)
    hook = inspect.getsource(ddp_hooks._allreduce_fut)
    assert hook.index(".div_(") < hook.index("all_reduce(")
    assert "_get_gradient_divide_factors" in readme and "`div_factor_`" in readme
    assert (root / "distributed/_composable/replicate_with_fsdp.py").is_file()
    # "Stay on DDP, or switch": the all-gathers, and reshard_after_forward's trade
    contract = " ".join(inspect.getdoc(fully_shard).split())
    for said in (
        "Before forward, FSDP all-gathers the sharded parameters",
        "re-all-gathers them in backward before gradient computation",
        "reduce-scatters the unsharded gradients",
        "reshards parameters after forward and re-all-gathers in backward",
        "keeps the unsharded parameters in memory after forward and avoids the all-gather in "
        "backward",
    ):
        assert said in contract, said
    assert "(`fully_shard`'s docstring)" in readme and "avoids the all-gather in backward" in readme
    assert "`torch/distributed/_composable/replicate_with_fsdp.py`" in readme


def test_the_nccl_that_ships_with_torch_is_the_one_the_guide_reads():
    """The guide's NCCL memory entry reads NCCL 2.30.7's source: the version torch 2.14.1 loads
    (2.8.0's, 2.27.3, read in its wheel)."""
    import torch

    if not torch.distributed.is_nccl_available():
        pytest.skip("a CPU-only torch build ships no NCCL")
    assert torch.cuda.nccl.version() == (2, 30, 7)
    guide = " ".join(GUIDE.read_text().split())
    assert "2.27.3 in torch 2.8.0, 2.30.7 in 2.14.1" in guide
    assert "what follows is read from NCCL 2.30.7's source" in guide


def test_torchrun_restarts_only_when_told_and_names_joining_nodes_alone():
    """The guide's elastic entry, read from torch 2.14.1: --max-restarts defaults to 0; the agent
    announces nodes that join (a restart that costs none), not nodes that leave; the rendezvous
    waits 30 s by default for more nodes; the agent logs at LOGLEVEL, warnings by default. (A node
    leaving, run on two hosts: tests/test_multinode.py.)"""
    import torch.distributed.elastic.agent.server.api as agent_api
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic
    import torch.distributed.elastic.utils.logging as elastic_logging
    import torch.distributed.run as run_module

    parser = run_module.get_args_parser()
    assert parser.parse_args(["script.py"]).max_restarts == 0
    source = " ".join(inspect.getsource(agent_api.SimpleElasticAgent._invoke_run).split())
    assert '"[%s] Detected %s " "new nodes from group_rank=%s; " "will restart worker group",' in (
        source
    )
    assert "# membership changes do not count as retries" in source
    assert dynamic.RendezvousTimeout().last_call == timedelta(seconds=30)
    logging_source = inspect.getsource(elastic_logging)
    assert 'os.environ.get("LOGLEVEL", get_log_level())' in logging_source
    assert 'return "WARNING"' in inspect.getsource(elastic_logging.get_log_level)
    guide = " ".join(GUIDE.read_text().split())
    assert "`[default] Detected 1 new nodes from group_rank=0; will restart worker group`" in guide
    assert "torchrun's default is `--max-restarts=0`" in guide
    assert "after `last_call_timeout` (30 s by default) for more" in guide
