"""The top-level README's own statements that no folder's test shows: each test names its sentence.

All in this process or with small subprocesses (no launcher): DistributedSampler's padding,
--download's order on rank 0 and the others,
a virtual environment on top of this Python, the defaults the README quotes.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import math
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import common.data
from common.config import DATASETS, TrainConfig
from common.errors import DataError
from tests.helpers import PYTHON, REPO

README = " ".join((REPO / "README.md").read_text().split())  # line breaks as spaces


def test_distributed_sampler_pads_the_last_ranks_with_the_epochs_first_samples():
    """ "What DDP does", 2: disjoint apart from padding (when N does not divide the
    data set, the last ranks each read one of the epoch's first samples again)."""
    assert "the last ranks each read one of the epoch's first samples again" in README
    for n, w in [(10, 3), (10, 4), (5, 8), (1, 4), (16, 4), (7, 7)]:
        for shuffle in (False, True):
            order = list(
                DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=3)
            )
            shards = [
                list(DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=shuffle, seed=3))
                for r in range(w)
            ]
            extra = math.ceil(n / w) * w - n  # the padding
            for r, shard in enumerate(shards):
                own = order[r::w]  # every W-th sample of the epoch's order
                if r < w - extra:
                    assert shard == own, (n, w, r)
                else:  # one more: the epoch's first samples, in rank order
                    assert shard == own + [order[(r - (w - extra)) % n]], (n, w, r)
            # Without padding (N divisible by W, or drop_last) no sample is read twice.
            dropped = [
                x
                for r in range(w)
                for x in DistributedSampler(range(n), w, r, shuffle=shuffle, seed=3, drop_last=True)
            ]
            assert len(dropped) == len(set(dropped)) == n // w * w
            if extra == 0:
                assert sorted(x for shard in shards for x in shard) == list(range(n))


def recorded_load(monkeypatch, rank: int, fail: bool = False) -> list:
    """common.data.load_datasets(--download) on `rank`,
    with the data set and the barrier recorded."""
    calls = []

    def build(name, data_dir, image_size=0, download=False):
        calls.append(("download" if download else "open", name))
        if download and fail:
            raise DataError(f"{name}: download failed")
        return SimpleNamespace(train=range(100))

    monkeypatch.setattr(common.data, "build_datasets", build)
    monkeypatch.setattr(common.data.dist, "barrier", lambda: calls.append(("barrier",)))
    cfg = SimpleNamespace(dataset="cifar10", data_dir="data", image_size=0, download=True)
    try:
        common.data.load_datasets(cfg, rank)
    except SystemExit as exc:
        calls.append(("exit", exc.code))
    return calls


def test_download_rank_0_downloads_while_the_others_wait_at_a_barrier(monkeypatch):
    """ "Data sets": pass --download: rank 0 downloads while the other ranks wait at a barrier."""
    assert "rank 0 downloads while the other ranks wait at a barrier" in README
    assert recorded_load(monkeypatch, 0) == [
        ("download", "cifar10"),
        ("barrier",),
        ("open", "cifar10"),
    ]
    # no download of its own
    assert recorded_load(monkeypatch, 1) == [("barrier",), ("open", "cifar10")]
    # A failed download still releases the others; every rank then exits with code 2.
    assert recorded_load(monkeypatch, 0, fail=True) == [
        ("download", "cifar10"),
        ("barrier",),
        ("exit", 2),
    ]


def test_a_venv_sees_this_pythons_torch_only_with_system_site_packages(tmp_path):
    """ "On a cluster": a virtual environment on top of the site's Python needs
    `python -m venv --system-site-packages` to see the site's torch (here: this Python's torch)."""
    assert "needs `python -m venv --system-site-packages` to see the site's torch" in README
    finds_torch = (
        "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"
    )
    codes = {}
    for flags in ([], ["--system-site-packages"]):
        venv = tmp_path / ("system" if flags else "plain")
        subprocess.run(
            [PYTHON, "-m", "venv", "--without-pip", *flags, venv], check=True, timeout=120
        )
        codes[bool(flags)] = subprocess.run(
            [venv / "bin" / "python", "-c", finds_torch], timeout=120
        ).returncode
    assert codes == {False: 3, True: 0}


def test_the_defaults_and_choices_the_readme_quotes():
    """ "Troubleshooting": `--timeout-s` (60 s); "Data sets": digits is the
    default, then the other five; "Concepts": --batch-size is per rank;
    "Examples" and "Each numbered script": 01's and common/'s sizes."""
    defaults = TrainConfig()
    assert f"`--timeout-s` ({defaults.timeout_s:.0f} s)" in README
    assert defaults.dataset == "digits" and "`--dataset digits` (default;" in README
    for name in DATASETS[1:]:
        assert re.search(rf"`{name}`", README.split("## Data sets")[1].split("## Output")[0]), name
    help_text = TrainConfig.__dataclass_fields__["batch_size"].metadata["help"]
    assert "per rank" in help_text and "`--batch-size` is per rank (the local batch)" in README
    lesson_lines = len((REPO / "01_basic_ddp" / "train.py").read_text().splitlines())
    assert f"the minimal complete DDP script ({lesson_lines} lines," in README
    common_lines = sum(len(p.read_text().splitlines()) for p in (REPO / "common").glob("*.py"))
    assert common_lines <= 600 and "at most 600 lines" in README


def test_the_messages_the_troubleshooting_section_quotes_are_torchs_own():
    """ "Troubleshooting": gloo's `Timed out waiting 60000ms for recv operation to complete` and
    `Connection closed by peer` are in torch's CPU library; nccl's watchdog line is made of
    literals of its NCCL library that tests/test_nccl_docs.py finds there (torch 2.14.1)."""
    from tests.test_nccl_docs import WATCHDOG_MESSAGES, found_in_library

    troubleshooting = README.split("## Troubleshooting")[1].split("## Data sets")[0]
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


def test_the_code_is_python_3_10_syntax():
    """ "Quick start": Python 3.10+. Every .py file parses with Python 3.10's
    grammar (ast's feature_version, best effort: it catches newer syntax
    such as except*, the control below); tested with 3.11 ("Versions")."""
    assert "(Python 3.10+;" in README
    files = [
        p
        for p in REPO.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    ]
    assert len(files) > 30
    for path in files:
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    with pytest.raises(SyntaxError, match="3.11"):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))


def test_the_pinned_wheels_are_a_few_gb_with_their_own_nccl_and_no_network_plugin():
    """ "Quick start": the first install downloads torch, a few GB. "On a cluster":
    requirements.txt brings the wheel's own NCCL, and a generic wheel has no NCCL
    network plugin (libnccl-net*.so, e.g. AWS OFI for Slingshot) that a site's
    build carries. Read from the installed distributions of requirements.txt."""
    from tests.test_install import PINNED, installed_closure, requirement_lines

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


def test_each_site_file_names_the_date_its_sources_were_read():
    """jobs/sites/README.md: each setting's site page is a [tag] listed at the top of the file,
    with the date it was read (2026-11); Perlmutter's pytorch module is marked [check]."""
    sites = REPO / "jobs" / "sites"
    readme = " ".join((sites / "README.md").read_text().split())
    date = re.search(
        r"each file names the pages and the date they were read \((\d{4}-\d\d)\)", readme
    )[1]
    for path in sorted(sites.glob("*.sh")):
        sources = re.search(r"^# Sources, read (\d{4}-\d\d)\b", path.read_text(), re.M)
        assert sources and sources[1] == date, path.name
    perlmutter = (sites / "perlmutter.sh").read_text()
    assert "Perlmutter's `pytorch` module is marked `[check]`" in readme
    assert (
        re.search(r"^# -+ Modules: .*\[check\]", perlmutter, re.M) and "#   [check]" in perlmutter
    )
