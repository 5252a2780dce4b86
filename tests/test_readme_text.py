"""What the READMEs say, held to the code, to the runs they show and to each other: each test names
its sentence. All checks of README text live here, in the `readme_text` tier (pytest.ini).

The top-level README's own statements first (DistributedSampler's padding, --download's order on
rank 0 and the others, a virtual environment on top of this Python, the defaults it quotes), then
the lessons', the benchmark's and the guide's statements that a test can check without a run, the
samples of output the READMEs show, the markers of their commands, and their links. The runs that
show a behaviour live in the lesson's own test file; a test here names it.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common.config import DATASETS, TrainConfig
from common.data import DIGITS_FILE, digits
from tests import readme_samples
from tests.markdown import (
    markdown_blocks,
    markdown_commands,
    markdown_headings,
    markdown_links,
    markdown_section,
    markdown_table,
    readme_commands,
    readme_sample,
    readme_words,
)
from tests.paths import REPO, load_script, tracked_files
from tests.processes import clean_env, command_argv, torchrun
from tests.quoted import UCI_TEST_CLASS_COUNTS
from tests.results import assert_same_params
from tests.sample_runs import Ran, shared_runs
from tests.torch_versions import pinned_torch_only

# README text only moves with an edit of a README: CI runs this tier, the default run leaves it out.
pytestmark = pytest.mark.readme_text

README_TEXT = (REPO / "README.md").read_text()
README = readme_words()


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


# Stands in for the network (the one thing this machine cannot reach): in each rank, before the
# lesson runs, build_datasets records its calls; a "download" takes a second (or fails), and
# opening the data set gives the digits.
NO_NETWORK_SITECUSTOMIZE = """
import json, os, time
if "RANK" in os.environ:
    import common.data

    opened = common.data.build_datasets

    def build_datasets(name, data_dir="data", image_size=0, download=False):
        log = os.path.join(os.environ["DOWNLOAD_LOG"], "rank" + os.environ["RANK"])
        start = time.time()
        if download:
            time.sleep(1)
        if download and os.environ.get("DOWNLOAD_FAILS"):
            raise common.data.DataError(name + ": download failed (no network)")
        if not download and not os.path.exists(os.environ["DOWNLOAD_LOG"] + "/downloaded"):
            raise common.data.DataError(name + ": not on disk")
        if download:
            open(os.environ["DOWNLOAD_LOG"] + "/downloaded", "w").close()
        with open(log, "a") as f:
            f.write(json.dumps(["download" if download else "open", start, time.time()]) + "\\n")
        return opened("digits", data_dir, image_size)

    common.data.build_datasets = build_datasets
"""


def run_01_with_download(tmp_path, fail: bool):
    site, log = tmp_path / "site", tmp_path / "log"
    site.mkdir()
    log.mkdir()
    (site / "sitecustomize.py").write_text(NO_NETWORK_SITECUSTOMIZE)
    env = clean_env(PYTHONPATH=f"{site}:{REPO}", DOWNLOAD_LOG=str(log))
    if fail:
        env["DOWNLOAD_FAILS"] = "1"
    args = ["--dataset", "cifar10", "--download", "--epochs", "1", "--max-steps", "1"]
    result = torchrun(
        "01_basic_ddp/train.py", *args, "--output-dir", tmp_path / "out", env=env, check=False
    )
    calls = {
        path.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(log.glob("rank*"))
    }
    return result, calls


def test_download_rank_0_downloads_while_the_others_wait_at_a_barrier(tmp_path):
    """ "Data sets": pass --download: rank 0 downloads while the other ranks wait at a barrier.
    01 under torchrun, the download replaced by a one-second stand-in (no network here)."""
    assert "rank 0 downloads while the other ranks wait at a barrier" in README
    result, calls = run_01_with_download(tmp_path, fail=False)
    assert result.returncode == 0, result.output[-3000:]
    assert [call[0] for call in calls["rank0"]] == ["download", "open"]
    # no download of its own, and it opens the data only after rank 0's download ended
    assert [call[0] for call in calls["rank1"]] == ["open"]
    download_end, rank1_open = calls["rank0"][0][2], calls["rank1"][0][1]
    assert rank1_open >= download_end


def test_a_failed_download_still_releases_the_others_and_every_rank_exits_with_2(tmp_path):
    result, calls = run_01_with_download(tmp_path, fail=True)
    assert result.returncode != 0
    assert "cifar10: download failed (no network)" in result.output
    assert calls == {}
    # each rank's own `error:` line, then exit code 2 (torchrun's summary names it)
    assert len(re.findall(r"^(\[rank\d\]:)?error: cifar10: not on disk", result.output, re.M)) >= 1
    assert re.search(r"exitcode\s*: 2", result.output), result.output[-3000:]


def test_a_venv_sees_the_site_pythons_torch_only_with_system_site_packages(tmp_path):
    """ "On a cluster": a virtual environment on top of the site's Python needs
    `python -m venv --system-site-packages` to see the site's torch. The site's Python is the base
    interpreter of the one running the tests (itself, unless the suite runs in a venv, whose own
    packages a venv made from it would not see anyway); its torch, or where the base has none,
    another package of the base's own site-packages (pip), stands for the site's torch."""
    assert "needs `python -m venv --system-site-packages` to see the site's torch" in README
    base = Path(sys.base_prefix) / "bin" / "python3"
    find = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    package = next(
        (
            name
            for name in ("torch", "pip")
            if subprocess.run([base, "-c", find, name], timeout=120).returncode == 0
        ),
        None,
    )
    if package is None:
        pytest.skip(f"{base} has neither torch nor pip in its own site-packages")
    codes = {}
    for flags in ([], ["--system-site-packages"]):
        venv = tmp_path / ("system" if flags else "plain")
        subprocess.run([base, "-m", "venv", "--without-pip", *flags, venv], check=True, timeout=120)
        codes[bool(flags)] = subprocess.run(
            [venv / "bin" / "python", "-c", find, package], timeout=120
        ).returncode
    assert codes == {False: 3, True: 0}, package


def test_the_defaults_and_choices_the_readme_quotes():
    """ "Troubleshooting": `--timeout-s` (60 s); "Data sets": digits is the
    default, then the other five; "Concepts": --local-batch-size is per rank."""
    defaults = TrainConfig()
    assert f"`--timeout-s` ({defaults.timeout_s:.0f} s)" in README
    assert defaults.dataset == "digits" and "`--dataset digits` (default;" in README
    for name in DATASETS[1:]:
        assert re.search(rf"`{name}`", readme_words("## Data sets")), name
    help_text = TrainConfig.__dataclass_fields__["local_batch_size"].metadata["help"]
    assert (
        "per rank" in help_text and "`--local-batch-size` is per rank (the local batch)" in README
    )

    # debugging/README.md: 60 s by default, 10 s in the demos
    demo = load_script("debugging/demo_bugs.py", "demo_bugs")
    assert (TrainConfig().timeout_s, demo.DemoConfig().timeout_s) == (60.0, 10.0)
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    assert "is `--timeout-s` (60 s by default, 10 s in the demos)" in guide
    assert "(default 60 s here, 10 s in the demos;" in guide


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


# --- debugging/README.md: what the guide says of the code
# --------------------------------------------


# --- 04_syncbn/README.md
# -----------------------------------------------------------------------------

SYNCBN_README = REPO / "04_syncbn" / "README.md"
SYNCBN_SCRIPT = "04_syncbn/train.py"


def test_04s_defaults_are_the_readmes():
    folder = str(REPO / "04_syncbn")
    # the script imports its neighbour cpu_sync_batchnorm.py, as when run
    sys.path.insert(0, folder)
    try:
        syncbn_config = load_script(SYNCBN_SCRIPT, "syncbn_for_defaults").SyncBNConfig()
    finally:
        sys.path.remove(folder)
    assert (
        syncbn_config.batch_norm,
        syncbn_config.local_batch_size,
        syncbn_config.epochs,
        syncbn_config.lr,
    ) == ("compare", 4, 3, 0.01)
    assert (
        "`--batch-norm compare|plain|sync`; defaults: 4 samples per rank, 3 epochs, lr 0.01"
        in SYNCBN_README.read_text()
    )


def test_resnet50_has_53_batchnorm_layers_and_vit_and_convnext_none():
    """The README: a ResNet-50 has 53 BatchNorm layers; ViT
    and ConvNeXt (torchvision's) use LayerNorm only."""
    from torchvision.models import convnext_tiny, resnet50, vit_b_16

    with torch.device("meta"):  # the layers, without initializing their weights
        resnet, models = resnet50(), [vit_b_16(), convnext_tiny()]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in resnet.modules()) == 53
    assert "A ResNet-50 has 53 BatchNorm layers." in SYNCBN_README.read_text()
    for model in models:
        names = {type(m).__name__ for m in model.modules()}
        assert "LayerNorm" in names and not any("BatchNorm" in name for name in names), names


# --- 03_grad_accum/README.md
# -------------------------------------------------------------------------

ACCUM_README = REPO / "03_grad_accum" / "README.md"


def test_the_sample_outputs_counts():
    """90 micro-batches of 8 per rank per epoch (719 samples per rank) make 23 optimizer steps of
    accum 4: 22 full windows and a last one of 2; the sample's step lines follow from that."""
    data = digits()
    loader = DataLoader(
        data.train, batch_size=8, sampler=DistributedSampler(data.train, num_replicas=2, rank=0)
    )
    per_epoch = len(loader)
    steps = math.ceil(per_epoch / 4)
    text = " ".join(ACCUM_README.read_text().split())
    assert (per_epoch, steps) == (90, 23)
    assert (
        f"{per_epoch} micro-batches per epoch make {steps} optimizer steps: {per_epoch // 4} "
        "windows of 4 and a "
        f"last window of {per_epoch % 4}."
    ) in text
    sample = "\n".join(readme_sample(ACCUM_README, "## Output"))
    # the banner's numbers (its words: test_readme_sample_lines_are_what_the_script_prints)
    assert re.search(r"\b8 x 2 x accum 4 = 64, 90 micro-batches\b", sample)
    logged = [(int(e), int(s)) for e, s in re.findall(r"epoch (\d) step (\d+) loss", sample)]
    # the epoch each step falls in
    assert logged and all((s - 1) // steps + 1 == e for e, s in logged)


# --- benchmark/README.md
# -----------------------------------------------------------------------------

BENCH_README = (REPO / "benchmark" / "README.md").read_text()


def test_the_readme_lists_every_sweep_knob():
    bench = load_script("benchmark/benchmark.py", "benchmark_main")
    listed = BENCH_README.split("Available knobs:")[1].split("Both tables")[0]
    assert re.findall(r"`(\w+)`", listed) == list(bench.KNOBS)


def bench_table(after: str) -> list[list[str]]:
    """The body rows of the first table after the line with `after`, as cells without bold."""
    return [[cell.strip("*") for cell in row] for row in markdown_table(BENCH_README, after)]


DDP_COST = "python benchmark/ddp_cost.py --mode count"
# the README table's rows -> ddp_cost.py's variants
DDP_COST_ROWS = {
    "DDP's defaults": "default",
    "`--no-broadcast-buffers`": "no_broadcast_buffers",
    "`--gradient-as-bucket-view`": "gradient_as_bucket_view",
    "the same, gradients zeroed in place": "gradient_as_bucket_view_zeroed",
    "`--bucket-cap-mb 100`": "bucket_100mb",
    "`--static-graph`": "static_graph",
    "`--batched-grad-copy`": "batched_grad_copy",
    "the four knobs together": "knobs",
}


@pinned_torch_only("the counts of torch 2.14.1's DDP")
def test_the_ddp_cost_table_is_what_ddp_cost_counts(tmp_path):
    """benchmark/README.md, "What DDP adds to a step": the table is the command's counts, in its
    column order, and the sentences under it quote them."""
    argv = command_argv(DDP_COST) + ["--output-dir", str(tmp_path)]
    subprocess.run(argv, cwd=REPO, env=clean_env(), check=True, capture_output=True, timeout=300)
    counted = json.loads((tmp_path / "ddp_cost.json").read_text())["variants"]
    table = bench_table("| variant | all-reduces |")
    assert [row[0] for row in table] == list(DDP_COST_ROWS)
    for row in table:
        added = counted[DDP_COST_ROWS[row[0]]]
        # the columns in ddp_cost.py's order, as it writes them
        assert [float(v) for v in row[1:]] == [
            v for k, v in added.items() if k.startswith("added_")
        ]
    section = " ".join(markdown_section(BENCH_README, "## What DDP adds to a step").split())
    default, knobs = counted["default"], counted["knobs"]
    from torchvision.models import resnet50

    model = resnet50()
    said = re.search(
        r"ResNet-50 has (\d+) parameter tensors in (\d+) buckets .* and (\d+) buffers", section
    )
    assert [int(v) for v in said.groups()] == [
        len(list(model.parameters())),
        default["added_all_reduces"],
        len(list(model.buffers())),
    ]
    collectives = default["added_all_reduces"] + default["added_broadcasts"]
    assert f"add {default['added_kernels']:.0f} kernels a step" in section
    assert f"and {collectives:.0f} collectives" in section
    assert f"back out: {default['added_gradient_copies']:.0f} copies" in section
    broadcast = default["added_kernels"] - counted["no_broadcast_buffers"]["added_kernels"]
    assert f"The buffer broadcast adds {broadcast:.0f} kernels" in section
    zeroed = counted["gradient_as_bucket_view_zeroed"]["added_kernels"]
    assert f"divide every gradient: {zeroed:.0f} kernels" in section
    assert f"leave {knobs['added_kernels']:.0f} kernels, one all-reduce" in section
    assert knobs["added_all_reduces"] == 1 and knobs["added_broadcasts"] == 0


def test_the_targets_table_is_what_gpu_check_checks(monkeypatch):
    """benchmark/README.md, "Targets": one row per target of gpu_check.py's TARGETS, in order, with
    its limits; the anchors' arithmetic (0.55 and 0.67 of 7,000; 989 TFLOPS over 24.5 GFLOP)."""
    monkeypatch.setitem(
        sys.modules, "benchmark", load_script("benchmark/benchmark.py", "benchmark")
    )
    gpu_check = load_script("benchmark/gpu_check.py", "gpu_check_readme")
    table = bench_table("| target | figure | limit | anchor |")
    assert [row[0].strip("`") for row in table] == [t[0] for t in gpu_check.TARGETS]
    for row, (name, what, rows, lowest, highest, gpus, anchor) in zip(table, gpu_check.TARGETS):
        numbers = [float(n.replace(",", "")) for n in re.findall(r"\d[\d,.]*", row[2])]
        percent = "%" in row[2]
        limits = [v / 100 if percent else v for v in numbers]
        assert limits == pytest.approx([v for v in (lowest, highest) if v is not None]), row
        for gpu in gpus or ():
            assert gpu in row[1], row
    section = " ".join(markdown_section(BENCH_README, "### Targets").split())
    assert f"{gpu_check.MLPERF_H100_PER_GPU:,} images/s per GPU" in section
    assert f"{gpu_check.NVIDIA_A100:,} with mixed precision" in section
    assert round(989e12 / 24.5e9, -3) == 40_000 and "about 40,000 images/s" in section


# --- README.md: the install commands
# -----------------------------------------------------------------


def test_the_readme_shows_the_quick_start_and_the_cluster_install():
    quick = markdown_section(README_TEXT, "## Quick start")
    assert (
        "```bash\npip install -r requirements.txt && torchrun --standalone --nproc_per_node=2 "
        "01_basic_ddp/train.py\n```"
    ) in quick
    cluster = markdown_section(README_TEXT, "## On a cluster")
    block = re.search(r"```bash\n(.+?)\n```", cluster, re.S).group(1)
    assert block.splitlines()[-1] == "pip install -r requirements-site.txt"


# --- 04_syncbn/README.md: the module's size
# ----------------------------------------------------------


# --- 06_multinode/README.md: the launcher's refusal
# --------------------------------------------------


def test_readme_quotes_the_launchers_error_for_more_ranks_than_gpus():
    """The README's row for 8 ranks on a node of 4 GPUs is common.launcher's message."""
    from common.errors import LauncherError
    from common.launcher import launch_info
    from tests.processes import node_of

    with pytest.raises(LauncherError) as exc:
        launch_info(node_of(8, 0, None), gpus=4)
    readme = (REPO / "06_multinode" / "README.md").read_text()
    assert f"`error: {exc.value}`" in readme
    # Raised while reading the launcher's variables, before
    # any process group: no script gets to set_device.
    assert (
        "are refused by every script, `comm_check.py` included, with one `error:` line "
        "before any process "
        "group"
    ) in " ".join(readme.split())


@pinned_torch_only("reads the APIs of the installed torch")
def test_versions_names_the_minimum_and_the_newest_api_the_code_uses():
    """ "Versions": "Minimum torch: X" is requirements-min.txt's pin; "The APIs the code uses date
    from torch Y", Y the newest API of every file at or below the minimum, naming the files that
    set it; "`path` needs Z" for each file above the minimum (tests/test_install.py reads the
    code)."""
    from packaging.version import Version

    from tests.torch_api import api_date, api_date_by_file, minimum_torch

    versions = markdown_section(README_TEXT, "## Versions")
    minimum = minimum_torch()
    assert f"**Minimum torch: {minimum}**" in versions
    by_file = api_date_by_file()
    above = {path: v for path, v in by_file.items() if Version(v) > Version(minimum)}
    assert dict(re.findall(r"`([\w./-]+)` needs (\d+\.\d+)", versions)) == above
    newest = api_date(by_file)
    assert f"The APIs the code uses date from torch {newest}:" in versions
    setting = {path for path, version in by_file.items() if version == newest}
    assert setting and all(f"`{path}`" in versions for path in setting)


def test_the_guide_quotes_the_rendezvous_timeout_as_torch_prints_it():
    """Printed by a rank alone at the rendezvous in tests/test_failures.py::
    test_rank_missing_at_start_waits_at_the_rendezvous_silently."""
    from tests.quoted import RENDEZVOUS_TIMED_OUT

    assert RENDEZVOUS_TIMED_OUT in (REPO / "debugging" / "README.md").read_text()


def _sites_table() -> dict[str, dict[str, object]]:
    """jobs/sites/README.md's table: per site, the modules,
    the exported variables and the placement."""
    rows = {}
    text = (REPO / "jobs" / "sites" / "README.md").read_text()
    for cells in markdown_table(text, "| site | scheduler"):
        m = re.match(r"\[`(\w+)\.sh`\]", cells[0])
        if m:
            pairs = [
                dict(re.findall(r"`([A-Z_]+)=([^`]*)`", cell)) for cell in (cells[3], cells[4])
            ]
            rows[m.group(1)] = {
                "modules": re.findall(r"`([^`]+)`", cells[2]),
                "exported": pairs[0],
                "placement": pairs[1],
            }
    return rows


@pytest.mark.parametrize("site", ["derecho", "perlmutter", "polaris"])
def test_the_sites_table_is_what_each_site_file_exports_and_loads(site, tmp_path):
    """jobs/sites/README.md's table: the first module, the exported variables and the placement of
    each site file, as it does them when sourced (tests/test_sites.py::source_site)."""
    from tests.launcher_tools import SITE_JOBS, source_site

    assert sorted(_sites_table()) == sorted(SITE_JOBS)
    exported, placement, calls = source_site(site, tmp_path)
    row = _sites_table()[site]
    assert exported == row["exported"]
    assert placement == row["placement"]
    assert f"module load {row['modules'][0]}" in calls, calls


MULTINODE_README = REPO / "06_multinode" / "README.md"


def test_06s_table_of_errors_quotes_comm_checks_errors_with_its_own_values():
    """06's table of errors: comm_check's line for an unreachable store (there rank 1 on nodeB,
    10.0.0.1:29500, the default 60 s) and for ranks that never checked in (2 and 3 of 4), as
    tests/test_multinode.py sees them printed."""
    from tests.quoted import NEVER_CHECKED_IN, UNREACHABLE

    readme = MULTINODE_README.read_text()
    unreachable = UNREACHABLE.format(rank=1, host="nodeB", addr="10.0.0.1:29500", s=60)
    assert f"`{unreachable}`" in readme
    comm = load_script("06_multinode/comm_check.py", "comm_check")
    assert f"`{NEVER_CHECKED_IN.format(ranks=comm._ranges([2, 3]), world=4)}`" in readme


def test_06_quotes_the_placement_tables_warning_as_printed(capsys):
    """06's README quotes the warning for two ranks on one GPU in full once, then as a pattern
    (tests/test_multinode.py::test_placement_table_warns_when_two_ranks_share_a_gpu)."""
    train = load_script("06_multinode/train.py", "multinode_train")
    fields = ("host", "rank", "local_rank", "device", "gpu_uuid", "visible")
    train.print_placement(
        [
            dict(zip(fields, ("gpu1", 0, 0, "cuda:0", "GPU-a", "unset"))),
            dict(zip(fields, ("gpu1", 1, 0, "cuda:0", "GPU-a", "unset"))),
        ]
    )
    [warning] = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    readme = " ".join(MULTINODE_README.read_text().split())
    assert f"`{warning}`" in readme
    assert "`WARNING: ranks [...] share one GPU (cuda:0 of rank ...) on <host>`" in readme


def test_08_quotes_the_missing_teacher_errors_as_printed():
    """tests/test_several_models.py::test_a_missing_teacher_is_one_error_line_and_exit_code_2 sees
    them printed."""
    from tests.quoted import TEACHER_ERRORS

    readme = " ".join((REPO / "08_several_models" / "README.md").read_text().split())
    assert all(f"`{line}`" in readme for line in TEACHER_ERRORS)


def test_the_guide_quotes_the_errors_its_runs_print():
    """Each error and warning the guide quotes is the constant that a run in
    tests/test_forum_errors.py (tests/test_multinode.py: the elastic restart) prints."""
    from tests.quoted import (
        DEVICE_ID_ON_CPU,
        ELASTIC_RESTART,
        LOCAL_LAMBDA,
        NO_CPU_BACKEND,
        OMP_BANNER,
        PICKLE_WARNING,
        RENAMED_VARIABLE,
        SEGFAULT,
        SHUFFLE_BESIDE_A_SAMPLER,
        UNUSED_WARNING,
        WORKER_EXITED,
    )

    guide = (REPO / "debugging" / "README.md").read_text()
    assert f"```\n{PICKLE_WARNING}\n{LOCAL_LAMBDA}\n```" in guide
    assert f"```\n{SHUFFLE_BESIDE_A_SAMPLER}\n```" in guide
    assert WORKER_EXITED.format(pids=12345) in guide
    assert f"```\n{NO_CPU_BACKEND}\n```" in guide
    flowing = " ".join(guide.split())
    assert f"`{DEVICE_ID_ON_CPU}`" in flowing
    assert f"`{SEGFAULT}` in `_ddp_init_helper`" in flowing
    assert OMP_BANNER in flowing and " ".join(UNUSED_WARNING.split()) in flowing
    assert RENAMED_VARIABLE in guide and f"] {ELASTIC_RESTART}" in flowing


def test_the_guide_shows_the_mp_spawn_worker_and_cell_that_run():
    """The code tests/test_forum_errors.py::
    test_mp_spawn_of_a_worker_defined_in_main_fails_and_an_imported_one_runs runs is the code
    debugging/README.md shows."""
    from tests.quoted import FIXED_CELL, WORKER_FILE

    guide = (REPO / "debugging" / "README.md").read_text()
    assert f"```python\n# ddp_worker.py\n{WORKER_FILE.strip()}\n```" in guide
    assert f"```python\n# the notebook cell\n{FIXED_CELL.format(port=29500).strip()}\n```" in guide


def test_the_guides_ddp_memory_figure_is_resnet18s_parameters():
    """The guide's "DDP's own memory": the buckets and, without gradient_as_bucket_view, the
    gradients are each the size of ResNet-18's float32 parameters, the figure it gives three times
    (the allocations themselves: tests/test_debugging.py::
    test_ddp_buckets_hold_one_copy_of_the_gradients)."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=10)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    section = markdown_section(
        (REPO / "debugging" / "README.md").read_text(), "## DDP's own memory"
    )
    assert f"({size:.1f} MiB of float32 parameters; " in section
    assert section.count(f"{size:.1f} MiB") == 3
    # The figure holds for 10 classes; torchvision's default head (1,000 classes) is larger.
    full = sum(p.numel() * p.element_size() for p in resnet18().parameters()) / 2**20
    assert f"; {full:.1f} MiB with 1,000)" in section and f"{full:.1f}" != f"{size:.1f}"


def test_06s_samples_time_as_many_iterations_as_comm_check_does():
    """The iters column of 06's two comm_check samples (run with the default --iters 20) is
    comm_check's timed_iterations() (held to --iters' help in tests/test_multinode.py)."""
    from tests.results import ROW

    comm = load_script("06_multinode/comm_check.py", "comm_check")
    rows = [
        m
        for marker in ("comm_check on this machine", 'Two "nodes" of two ranks each')
        for m in map(ROW.fullmatch, readme_sample(MULTINODE_README, marker))
        if m
    ]
    assert len(rows) > 30
    assert all(int(m.group(2)) == comm.timed_iterations(int(m.group(1)), 20) for m in rows)


# --- the READMEs' sample outputs, one test per README, each against the run it shows: the same
# run a behaviour test reads (tests/sample_runs.py). A failure names the command that regenerates
# the sample (tests/readme_samples.py).
# -------------------------------------------------------------------------------------------------


def assert_printed(name, ran, lines=None):
    """Every line of sample `name` (or `lines` of it) is a line `ran` printed."""
    problems = readme_samples.drift(name, ran.output, ran.output_dir, lines)
    assert not problems, readme_samples.drift_message(name, problems)


@pinned_torch_only("compares the figures the README's run printed")
def test_01s_sample_is_what_the_quick_start_prints(sample_run):
    """01's sample is lines the quick start prints (decimals masked), its last epoch's accuracy
    within 0.02 of this run's: the one test that a reworded print line of 01 fails, naming the
    command that regenerates the sample."""
    ran = sample_run("01").ok()
    problems = readme_samples.drift("01", ran.stdout, ran.output_dir)
    assert not problems, readme_samples.drift_message("01", problems)
    shown = readme_samples.sample_lines("01")
    last_epoch = next(line for line in reversed(shown) if "eval accuracy" in line)
    done = last_epoch.split(":")[0] + ":"  # "epoch 12 done:"
    [printed] = [line for line in ran.stdout.splitlines() if line.startswith(done)]
    accuracy = [float(line.split("eval accuracy ")[1].split()[0]) for line in (last_epoch, printed)]
    assert abs(accuracy[0] - accuracy[1]) < 0.02, (last_epoch, printed)
    # The sample's output folder is the default one (the test moved it).
    assert readme_sample(REPO / "01_basic_ddp/README.md", "Output (rank 0 only")[-1].endswith(
        f" {TrainConfig().output_dir}/summary.json"
    )

    # `...` stands for any text; a line that is only `...` is an elision. Controls: a changed
    # number, a cut line, a wrong line number behind `...`.
    output = "rank 0: [0, 3]\n[rank1]: [/a/b/tcp.cc:1] Timed out\n"
    ran = Ran((output,), ("",), (0,), Path("/nowhere"))
    lines = ["rank 0: [0, 3]", "[rank1]:   ...", "[rank1]: [.../tcp.cc:1] Timed out"]
    assert readme_samples.drift("02-viewer", output, lines=lines) == []
    for wrong in (["rank 0: [0, 4]"], ["rank 0: [0, 3"], ["[rank1]: [.../tcp.cc:2] Timed out"]):
        with pytest.raises(
            AssertionError, match="python tests/readme_samples.py --write 02-viewer"
        ):
            assert_printed("02-viewer", ran, lines=wrong)


def test_01s_port_patch_is_the_one_the_copied_out_test_applies():
    """01's README, "Your own model and data": its diff is tests/port_01.diff, which
    tests/test_basic_ddp.py applies to a copy of train.py and runs. Reworded the README's diff?
    Copy the block into that file."""
    section = markdown_section((REPO / "01_basic_ddp/README.md").read_text(), "## Your own model")
    [patch] = [b for b in markdown_blocks(section) if b.info == "diff"]
    assert "\n".join(patch.lines) + "\n" == (REPO / "tests/port_01.diff").read_text(), (
        "01's README and tests/port_01.diff differ: copy the README's diff block into the file"
    )


@pytest.mark.parametrize("name", ["03", "04"])
def test_03s_and_04s_samples_have_the_lines_of_a_shorter_run(sample_run, name):
    """Every line of the README's sample output (its command's), numbers masked, is a line a
    shorter run of the lesson prints (2 ranks, 3 steps: tests/sample_runs.py)."""
    ran = sample_run(name).ok()
    problems = readme_samples.drift(name, ran.stdout, ran.output_dir)
    assert not problems, readme_samples.drift_message(name, problems)


def test_the_porting_samples_are_what_the_doctor_prints(sample_run):
    """porting/README.md: the doctor's lint of the plain script and of its port, each sample line
    for line (the exit codes: tests/test_doctor.py)."""
    for name in ("porting-lint-plain", "porting-lint-port"):
        assert_printed(name, sample_run(name))
        assert len(readme_samples.sample_lines(name)) == len(sample_run(name).stdout.splitlines())


def test_02s_samples_are_what_its_commands_print(sample_run):
    """02's seven samples, each against the README's command (02-uneven's two paragraphs against
    its two runs), and the shard sample's plan against prepare_shards.py's manifest."""
    names = [
        "02-viewer",
        "02-no-sampler",
        "02-eval",
        "02-gather",
        "02-gather-padded",
        "02-weighted",
        "02-uneven-join",
        "02-uneven-drop-last",
        "02-uneven-none",
        "02-shards",
    ]
    ran = dict(shared_runs(names, sample_run.folder))
    for name in ("02-viewer", "02-no-sampler", "02-eval", "02-weighted"):
        assert_printed(name, ran[name].ok())
    # but for the figures, which depend on the weights (01's in the README)
    for name in ("02-gather", "02-gather-padded"):
        lines = readme_samples.sample_lines(name)
        assert_printed(
            name, ran[name].ok(), [x for x in lines if not x.startswith("from the file:")]
        )
    join, drop_last = readme_samples.paragraphs("02-uneven")
    assert_printed("02-uneven", ran["02-uneven-join"].ok(), join)
    assert_printed("02-uneven", ran["02-uneven-drop-last"].ok(), drop_last)
    # The abridged output without a fix: rank 1's 21 batches, its traceback. Its last line, rank
    # 1's own send timing out, is "Connection closed by peer" instead when rank 0's timeout ends
    # first.
    *shown, own_timeout = sample = readme_samples.sample_lines("02-uneven-none")
    assert "Timed out waiting 5000ms for send" in own_timeout
    rank1 = [x for x in ran["02-uneven-none"].output.splitlines() if x.startswith("[rank1]:")]
    closed_first = any("Connection closed by peer" in x for x in rank1)
    assert_printed("02-uneven-none", ran["02-uneven-none"], shown if closed_first else sample)
    assert_shard_plan(json.loads((ran["02-shards"].ok().output_dir / "manifest.json").read_text()))


def assert_shard_plan(manifest):
    """The README's run (2 ranks, batch 32, no loader workers): its shard lists are
    shards_for's, its step count the smallest rank's batches, from the manifest alone."""
    script = load_script("02_sampler_patterns/sharded_loading.py", "sharded_loading")
    files = [entry["file"] for entry in manifest["shards"]]
    sizes = {entry["file"]: entry["samples"] for entry in manifest["shards"]}
    sample = [
        line.rstrip()
        for line in readme_sample(
            REPO / "02_sampler_patterns/README.md", "## 6. `sharded_loading.py`"
        )
        if line.strip()
    ]
    assert sample[0] == f"{manifest['total']} samples in {len(files)} shards, 2 ranks"
    for epoch, line in enumerate(sample[1:]):
        found = re.fullmatch(
            r"epoch (\d+): (\d+) steps on every rank, (\d+) of (\d+) samples read \((\d+) "
            r"left over\); "
            r"shards per rank: (.*)",
            line,
        )
        number, steps, read, assigned, left = map(int, found.groups()[:5])
        per_rank = [script.shards_for(r, 2, files, 0, epoch) for r in range(2)]
        assert number == epoch + 1 and ast.literal_eval(found.group(6)) == per_rank
        samples = [sum(sizes[f] for f in mine) for mine in per_rank]
        assert steps == min(math.ceil(n / 32) for n in samples)
        assert (read, assigned, left) == (
            sum(min(n, steps * 32) for n in samples),
            sum(samples),
            sum(samples) - sum(min(n, steps * 32) for n in samples),
        )


def test_05s_sample_is_what_a_stopped_and_resumed_run_prints(sample_run):
    """Every line of 05's sample is a line the stopped and resumed runs printed (decimals masked:
    they vary from CPU to CPU); the figures the README says the uninterrupted run prints too are
    the sample's (the resumed run equals the uninterrupted one bitwise:
    tests/test_checkpointing.py)."""
    ran = sample_run("05-resume").ok()
    assert_printed("05-resume", ran)
    text = (REPO / "05_checkpointing/README.md").read_text()
    figures = r"train loss (\d\.\d{4}), eval loss (\d\.\d{4}), eval accuracy (\d\.\d{4})"
    ends = re.findall(figures, text)
    assert len(ends) == 2 and len(set(ends)) == 1, ends
    assert re.search(figures, ran.stdouts[1])  # the resumed run prints them


def test_09s_samples_are_what_its_commands_print(sample_run):
    """09's training sample (decimals masked) and its memory table (exact: sizes of tensors do not
    vary from CPU to CPU) are lines their runs printed."""
    assert_printed("09", sample_run("09").ok())
    assert_printed("09-memory", sample_run("09-memory").ok())


def shapes(lines, host):
    """Lines with numbers as N, the host name as HOST and runs
    of blanks as one: what a sample shares with a run."""
    return {readme_samples.shape(re.sub(rf"\b{re.escape(host)}\b", "HOST", x)) for x in lines}


@pytest.mark.launchers
def test_06s_samples_have_the_shape_of_its_runs(sample_run):
    """Every line of 06's samples (README host: vm) has the shape of a line its run printed, but
    for the machine-specific ones (torch build, the address), the lines of the README's longer
    run (steps, paths) and the two-node check's findings of this run."""
    readme, host = REPO / "06_multinode/README.md", socket.gethostname()
    ran = dict(
        shared_runs(["06-two-nodes", "06-comm-check", "06-comm-two-nodes"], sample_run.folder)
    )
    machine = r"node \S+ \(ranks .*\): torch |\s+transport: "
    for marker, name, left_out, least in (
        ("Output of the first command", "06-two-nodes", "^(epoch|summary written)", 5),
        ("comm_check on this machine", "06-comm-check", machine, 11),
        (
            'Two "nodes" of two ranks each',
            "06-comm-two-nodes",
            f"{machine}|.*(agree|slow nodes|verdict)",
            11,
        ),
    ):
        sample = [x for x in readme_sample(readme, marker) if not re.match(left_out, x)]
        assert len(sample) >= least, sample
        missing = shapes(sample, "vm") - shapes(ran[name].ok().stdout.splitlines(), host)
        assert not missing, f"{readme}: sample lines not printed: {sorted(missing)}"


def test_the_global_batch_tolerance_in_the_readmes_is_the_tested_one():
    rtol = inspect.signature(assert_same_params).parameters["rtol"].default
    quoted = f"{rtol:.0e}".replace("e-0", "e-")  # 1e-05 -> 1e-5, as the READMEs write it
    assert quoted == "1e-5"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"It holds to a relative tolerance of {quoted} for a model without BatchNorm" in readme
    basic = " ".join((REPO / "01_basic_ddp" / "README.md").read_text().split())
    assert f"as 1 process with batch 32 on the same samples (relative tolerance {quoted})" in basic
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    claim = re.search(
        r"DDP with the same global batch should match one process to (\D*\d+e-\d+)", guide
    )
    assert claim and claim[1] == f"a relative {quoted}", claim and claim[0]


def test_every_link_and_named_test_in_the_readmes_resolves(tmp_path):
    """Each relative link leads to a file and heading. Each test a README names as its proof
    ("Proven by `tests/test_x.py::test_y`", and a bare `::test_z` after it for the same file) is a
    test of that file."""
    problems = [
        f"{doc.relative_to(REPO)}: {p}"
        for doc in tracked_files("*.md")
        for p in link_problems(doc) + unknown_tests(doc.read_text())
    ]
    assert problems == [], problems
    # The checks themselves: a missing file, or heading, is reported; a link in a code block is
    # not. A test that is not there, or is in another file, is reported.
    doc = tmp_path / "README.md"
    doc.write_text(
        '## "Address already in use" (`EADDRINUSE`)\n\n[a](#address-already-in-use-eaddrinuse) '
        "[b](#address-already-in-use) [c](missing.md) [d](https://example.org)\n\n"
        "```\n[e](#x)\n```\n"
    )
    assert link_problems(doc) == [
        "#address-already-in-use: no such heading",
        "missing.md: no such file",
    ]
    pair = "test_requirements_pin_a_torch_torchvision_pair_whose_compiled_ops_work"
    text = f"`tests/test_repo.py::test_gone`, `::{pair}`; `test_config.py::{pair}`"
    assert unknown_tests(text) == ["test_repo.py::test_gone", f"test_config.py::{pair}"]


def test_only_the_tests_readme_names_test_functions():
    """A reader's page names at most the test file that proves a section; tests/README.md maps
    each claim to its tests (and fixtures)."""
    named = {
        f"{doc.relative_to(REPO)}: {name}"
        for doc in tracked_files("*.md")
        if doc != REPO / "tests" / "README.md"
        for name in named_test_functions(doc.read_text())
    }
    assert named == set(), sorted(named)
    # the control: a test and a fixture are found, a file and a variable (01's test_loader) not
    text = (
        "`test_fsdp2.py`, `test_dcp_save_on_two_ranks_loads_on_one`, `x.py::viewer`, `test_loader`"
    )
    assert named_test_functions(text) == ["test_dcp_save_on_two_ranks_loads_on_one", "viewer"]


def named_test_functions(text: str) -> list[str]:
    """The tests of tests/test_*.py that `text` names, and any `x.py::name` (a fixture too)."""
    tests = {
        node.name
        for path in (REPO / "tests").glob("test_*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    return [
        name
        for qualified, bare in re.findall(r"\.py::(\w+)|\b(test_\w+)\b", text)
        for name in [qualified or bare]
        if qualified or name in tests
    ]


def test_every_readme_command_is_marked_run_proven_by_or_not_run():
    commands = readme_commands()  # fails on a block without a marker, or a count that differs
    assert len(commands) > 40, commands  # the reader still finds the blocks
    for command in commands:
        where = f"{command.readme}: `{command.text}`: {command.how}"
        assert len(command.how) == 1 and next(iter(command.how)) in (
            "run",
            "proven-by",
            "not-run",
        ), where
        if next(iter(command.how)) == "run":
            assert set(command.how["run"] or {}) <= RUN_OPTIONS, where
        if next(iter(command.how)) == "not-run":
            assert command.how["not-run"] in REASON_WORDS, where

    # The reader's own controls, on Markdown written here: a marked block reads, one entry a
    # command; a block without a marker, or with one entry too few, fails naming the block's line.
    block = "```bash\npython a.py   # one\npython b.py \\\n    --flag\n```\n"
    marked = f"Run these:\n\n<!-- commands:\n- run\n- not-run: gpu\n-->\n{block}"
    commands = markdown_commands(marked, "X.md")
    assert [(c.text, c.comment, c.how, c.before) for c in commands] == [
        ("python a.py", "one", {"run": None}, "Run these:"),
        ("python b.py --flag", "", {"not-run": "gpu"}, "Run these:"),
    ]
    with pytest.raises(AssertionError, match=r"X\.md:3: no <!-- commands: --> marker above"):
        markdown_commands(f"Run these:\n\n{block}", "X.md")
    with pytest.raises(AssertionError, match=r"X\.md:6: 2 commands, marker \['run'\]"):
        markdown_commands(marked.replace("- not-run: gpu\n", ""), "X.md")


def test_commands_not_run_say_why_next_to_them():
    silent = []
    for command in readme_commands():
        reason = command.how.get("not-run")
        if reason and not re.search(
            REASON_WORDS[reason], f"{command.comment}\n{command.before}", re.I
        ):
            silent.append(f"{command.readme}: `{command.text}` ({reason}: {REASON_WORDS[reason]})")
    assert not silent, (
        "not run, but neither the comment nor the paragraph before the block says why:\n"
        + ("\n".join(silent))
    )


def test_digits_md_names_the_file_its_digest_source_and_licence():
    notice = (REPO / "common" / "DIGITS.md").read_text()
    assert hashlib.sha256(DIGITS_FILE.read_bytes()).hexdigest() in notice
    assert ", ".join(map(str, UCI_TEST_CLASS_COUNTS)) in " ".join(notice.split())
    for source in ("Alpaydin", "Kaynak", "10.24432/C50P49", "CC BY 4.0"):
        assert source in notice

    # "Data sets": the digits' notice (common/DIGITS.md, held to the file by tests/test_data.py)
    # and its licence.
    assert "common/DIGITS.md" in README_TEXT and "CC BY 4.0" in README_TEXT


# The words a README must show next to a command that
# is not run (comment or paragraph before the block).
REASON_WORDS = {
    "gpu": r"\bGPU",
    "download": r"download|pip install",
    "scheduler": r"cluster|Slurm|PBS|allocation",
    "test-suite": r"\btests?\b",
}


RUN_OPTIONS = {"short", "exit", "expect", "files", "summary", "torch", "warm"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(doc: Path) -> list[str]:
    """The relative links of `doc` whose file, or whose #anchor's heading, does not exist."""
    problems = []
    for target in map(unquote, markdown_links(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.is_file():
            if anchor not in {slug(h) for h in markdown_headings(file.read_text())}:
                problems.append(f"{target}: no such heading")
    return problems


def test_readme_names_the_shortening_flags():
    """tests/README.md's section on README commands names the flags `short: true` appends."""
    text = (REPO / "tests" / "README.md").read_text()
    section = text.split("## README statements, samples and commands", 1)[1].split("\n## ", 1)[0]
    # `short: true` appends these flags (tests/test_readme_commands.py, SHORT)
    assert "`--max-steps 2 --epochs 1`" in section


NAMED_TEST = re.compile(r"(?:tests/)?(test_\w+\.py)|::(test_\w+)")


def unknown_tests(text: str) -> list[str]:
    """The tests that a README's `text` names (`test_x.py::test_y`, or `::test_y` after a test
    file's name) and that are not a function of that file."""
    missing, current = [], None
    for file, name in NAMED_TEST.findall(text):
        if file:
            current = file
            continue
        path = REPO / "tests" / str(current)
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[])
        if name not in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}:
            missing.append(f"{current}::{name}")
    return missing
