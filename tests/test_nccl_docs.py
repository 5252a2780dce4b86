"""debugging/README.md, "Timeouts on nccl": what a machine without a GPU can check of it.

The watchdog cannot run here (no GPU), so the guide's nccl part is read from
PyTorch's source. These tests hold it to the installed torch (2.14.1): the messages
it quotes are in torch's NCCL library, the older wording is not; the default timeouts
torch exposes; what torchrun sets in its workers; and the flight-recorder analyzer's
options and its verdicts on dumps shaped like each case the guide's table names.
"""

from __future__ import annotations

import logging
import mmap
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, clean_env, run
from tests.markdown import markdown_blocks, markdown_section, readme_sample

# All of it is torch's own text and source, read again after a torch upgrade.
pytestmark = pytest.mark.torch_text

GUIDE = REPO / "debugging" / "README.md"
TORCH_LIB = Path(__import__("torch").__file__).parent / "lib"
C10D_HEADERS = (
    Path(__import__("torch").__file__).parent
    / "include"
    / "torch"
    / "csrc"
    / "distributed"
    / "c10d"
)

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
        "`TORCH_NCCL_TRACE_BUFFER_SIZE` collectives (2000 by default",
    ):
        assert claim in guide, claim


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


def test_analyzer_names_a_size_or_type_mismatch(analyze):
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


def test_analyzer_names_the_rank_that_never_joined(analyze):
    out = analyze({0: [entry(1, GRADIENTS), entry(2, 1, "scheduled")], 1: [entry(1, GRADIENTS)]})
    assert (
        "Not all ranks joining collective, sequence number: 2" in out
        and "missing ranks: {1}" in out
    ), out


def test_analyzer_says_when_a_rank_left_no_dump(analyze):
    out = analyze(
        {0: [entry(1, GRADIENTS), entry(2, GRADIENTS, "scheduled")]}, "--allow-incomplete-ranks"
    )
    assert "we missed FR dumps from ranks ({1})" in out, out


def test_analyzer_finds_no_error_when_every_rank_entered_the_same_collective(analyze):
    """The table's first row, and the negative control of the others:
    both ranks entered collective 2 with the same size and it never
    finished (the network, NCCL, a GPU): no mismatch to report."""
    out = analyze({r: [entry(1, GRADIENTS), entry(2, GRADIENTS, "scheduled")] for r in (0, 1)})
    assert not re.search(r"has errors|Not all ranks joining|missed FR dumps|mismatch", out, re.I), (
        out
    )


def test_guide_quotes_the_analyzer_verdicts():
    guide = GUIDE.read_text()
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


# --- the guide's Windows errors, both torch's own text


def test_the_readme_quotes_torchs_error_for_nccl_on_a_build_without_it():
    """Printed by torch in tests/test_launcher.py::
    test_a_build_without_nccl_refuses_it_and_the_chosen_backend_starts."""
    from tests.test_launcher import NCCL_NOT_BUILT

    assert f"`RuntimeError: {NCCL_NOT_BUILT}`" in GUIDE.read_text()


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
    from tests.test_several_models import GAN_G_STEP_ERROR

    quoted = readme_sample(REPO / "08_several_models" / "README.md", "The D step then uses `fake`")
    assert quoted == [f"[rank0]: {GAN_G_STEP_ERROR}"]


def test_barrier_without_device_ids_uses_the_current_device_as_the_guide_says():
    """The guide: torch 2.14.1's barrier() without device_ids takes the current device (the one
    torch.cuda.set_device chose) and warns once; before (up to 2.7) it took global rank mod the
    local device count. Read from the installed distributed_c10d.py's barrier()."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    source = inspect.getsource(c10d.barrier)
    code = source.split('"""')[-1]  # the body, after the docstring (which still says rank mod)
    assert "Use the current device set by the user" in code and "opts.device = device" in code
    assert "get_rank() %" not in code and "rank %" not in code
    warning = "barrier(): using the device under current context"
    assert warning in code and warning in GUIDE.read_text()


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
# torch 2.3 to 2.5's wording (their wheels); 2.6 shortened it.
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


def test_barrier_warns_on_rank_0_unless_device_ids_or_device_id_name_the_device():
    """torch 2.14.1's barrier(): device_ids first, then the device bound by
    init_process_group(device_id=...), then the CPU; only otherwise the current device, with the
    warning, from the group's rank 0 only. init_process_group's docstring: device_id forms the
    NCCL communicator at once. NCCL's own guess, where nothing named a device, in its library."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    code = inspect.getsource(c10d.barrier).split('"""')[-1]
    order = [
        code.index("if isinstance(device_ids, list):"),
        code.index('elif getattr(group, "bound_device_id", None) is not None:'),
        code.index('elif device.type == "cpu"'),
        code.index("if group.rank() == 0:"),
    ]
    assert order == sorted(order)
    call = code[code.index("warnings.warn(", order[-1]) : code.index("stacklevel", order[-1])]
    assert "".join(re.findall(r'"([^"]*)"', call)) == BARRIER_WARNING, call
    assert not re.search(r"\w+Warning\b", call)  # no category given: a UserWarning
    doc = " ".join(c10d.init_process_group.__doc__.split())
    assert "the communicator is immediately formed (calling ``ncclCommInit*`` immediately" in doc
    assert "sub-groups will use ``ncclCommSplit`` when possible" in doc
    guessing = [
        "Guessing device ID based on global rank. ",
        "This can cause a hang if rank to GPU mapping is heterogeneous. ",
        "You can specify device_id in init_process_group()",
    ]
    assert all(found_in_library("libtorch_cuda.so", guessing).values())
    guide = " ".join(GUIDE.read_text().split())
    assert f"UserWarning: {BARRIER_WARNING}" in guide
    assert (
        "`Guessing device ID based on global rank. This can cause a hang if rank to GPU "
        "mapping is heterogeneous. You can specify device_id in init_process_group()`" in guide
    )
