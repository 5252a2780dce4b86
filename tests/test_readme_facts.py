"""What the READMEs say, held to the code and the installed torch: each test names its sentence.

The top-level README's own statements first (DistributedSampler's padding, --download's order on
rank 0 and the others, a virtual environment on top of this Python, the defaults it quotes), then
the lessons', the benchmark's and the guide's statements that a test can check without a run. The
runs that show a behaviour live in the lesson's own test file; a test here names it.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common.config import DATASETS, TrainConfig
from common.data import digits
from tests.helpers import (
    REPO,
    clean_env,
    command_argv,
    load_script,
    pinned_torch_only,
    torchrun,
    tracked_files,
)
from tests.markdown import markdown_blocks, markdown_section, markdown_table, readme_sample
from tests import readme_samples
from tests.sample_runs import Ran, shared_runs
from tests.test_lessons import TOPIC_SCRIPTS, diff_count

README_TEXT = (REPO / "README.md").read_text()
README = " ".join(README_TEXT.split())  # line breaks as spaces


def readme_section(heading: str) -> str:
    return " ".join(markdown_section(README_TEXT, heading).split())


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
    default, then the other five; "Concepts": --batch-size is per rank;
    """
    defaults = TrainConfig()
    assert f"`--timeout-s` ({defaults.timeout_s:.0f} s)" in README
    assert defaults.dataset == "digits" and "`--dataset digits` (default;" in README
    for name in DATASETS[1:]:
        assert re.search(rf"`{name}`", readme_section("## Data sets")), name
    help_text = TrainConfig.__dataclass_fields__["batch_size"].metadata["help"]
    assert "per rank" in help_text and "`--batch-size` is per rank (the local batch)" in README


@pytest.mark.torch_text
def test_the_messages_the_troubleshooting_section_quotes_are_torchs_own():
    """ "Troubleshooting": gloo's `Timed out waiting 60000ms for recv operation to complete` and
    `Connection closed by peer` are in torch's CPU library; nccl's watchdog line is made of
    literals of its NCCL library that tests/test_nccl_docs.py finds there (torch 2.14.1)."""
    from tests.test_nccl_docs import WATCHDOG_MESSAGES, found_in_library

    troubleshooting = readme_section("## Troubleshooting")
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
    assert "(Python 3.10+)" in README
    files = tracked_files("*.py")
    assert len(files) > 30
    for path in files:
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    with pytest.raises(SyntaxError, match="3.11"):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))


@pytest.mark.torch_text
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


@pytest.mark.torch_text
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


# --- debugging/README.md: what the guide says of the code
# --------------------------------------------


def test_timeout_defaults_are_60_s_and_10_s_in_the_demos():
    from common.config import TrainConfig
    from tests.helpers import load_script

    demo = load_script("debugging/demo_bugs.py", "demo_bugs")
    assert (TrainConfig().timeout_s, demo.DemoConfig().timeout_s) == (60.0, 10.0)
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    assert "is `--timeout-s` (60 s by default, 10 s in the demos)" in guide
    assert "(default 60 s here, 10 s in the demos;" in guide


def test_the_guide_says_collectives_in_another_order_silently_mix_same_shaped_tensors():
    """ "Hang mid-epoch": shown by tests/test_ddp_facts.py::
    test_collectives_in_a_different_order_silently_mix_tensors_of_the_same_shape."""
    guide = " ".join((REPO / "debugging" / "README.md").read_text().split())
    assert "if the shapes happen to match, **silently mixes the wrong tensors**" in guide


# --- 04_syncbn/README.md
# -----------------------------------------------------------------------------

SYNCBN_README = REPO / "04_syncbn" / "README.md"
SYNCBN_SCRIPT = "04_syncbn/train.py"


def test_04s_readme_code_is_the_scripts():
    """The README's three lines are the script's statements (`...` stands for arguments left out;
    compared as `ast.unparse` writes them, so the formatter's line breaks do not matter)."""
    statements = [
        ast.unparse(node)
        for node in ast.walk(ast.parse((REPO / SYNCBN_SCRIPT).read_text()))
        if isinstance(node, ast.Assign)
    ]
    (block,) = [b.lines for b in markdown_blocks(SYNCBN_README.read_text()) if b.info == "python"]
    code = [line.split("  #")[0].strip() for line in block if line.strip()]
    assert len(code) == 3
    for line in code:
        line = line.replace('"', "'")
        pattern = r".*".join(map(re.escape, line.split("...")))
        assert any(re.fullmatch(pattern, s) for s in statements), line


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
        syncbn_config.batch_size,
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
ACCUM_SCRIPT = "03_grad_accum/train.py"


def test_03s_readme_code_is_the_scripts():
    """Each line of the README's loop excerpt (without its comment) is a line of the script."""
    script = {
        line.split("  #")[0].strip() for line in (REPO / ACCUM_SCRIPT).read_text().splitlines()
    }
    blocks = [b.lines for b in markdown_blocks(ACCUM_README.read_text()) if b.info == "python"]
    code = [[line.split("  #")[0].strip() for line in block if line.strip()] for block in blocks]
    assert [len(lines) for lines in code] == [7, 5]  # the accumulation loop; clipping
    assert [line for lines in code for line in lines if line not in script] == []
    # "a config subclass with six keys"
    source = (REPO / ACCUM_SCRIPT).read_text()
    accum_config = source.split("class AccumConfig(TrainConfig):", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^    (\w+): ", accum_config, re.M) == [
        "accum_steps",
        "use_no_sync",
        "precision",
        "max_grad_norm",
        "lr_base_batch",
        "warmup_steps",
    ]


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


def test_the_published_figures_agree_with_the_formulas():
    """The README's tables, as printed: efficiency = images/s / (2 x the
    1-rank images/s), images/s = global batch / step, exposed-comm
    ratio = default / setting, and the sentences that quote them."""
    digits = bench_table("Small CNN on the embedded digits")
    one = float(digits[0][1])
    assert 128 / (float(digits[0][4]) / 1000) == pytest.approx(one, rel=0.005)
    for row in digits[1:]:
        images_per_s, efficiency, step_ms = float(row[1]), float(row[2]), float(row[4])
        assert efficiency == pytest.approx(images_per_s / (2 * one), abs=0.001), row
        assert 2 * 128 / (step_ms / 1000) == pytest.approx(images_per_s, rel=0.005), row
    # "brings efficiency above 0.9" (the bf16 hook)
    assert max(float(row[2]) for row in digits[1:]) > 0.9
    # "a step of only 14 ms", "2-3 ms"
    assert float(digits[0][4]) == 14.0 and 2 <= float(digits[1][3]) <= 3
    resnet = bench_table("ResNet-18 at 32x32 on CIFAR-10-format data")
    one, default_comm = float(resnet[0][1]), float(resnet[1][3])
    for row in resnet[1:]:
        # integer images/s
        assert float(row[2]) == pytest.approx(float(row[1]) / (2 * one), rel=0.02), row
        assert float(row[4]) == pytest.approx(default_comm / float(row[3]), abs=0.01), row
    assert max(float(row[4]) for row in resnet[1:]) == 1.58  # "cuts exposed communication 1.58x"
    # "data wait ... under 1% of the step"
    assert all(float(row[5].rstrip("%")) < 1 for row in resnet)
    memory = bench_table("| setting (2 ranks) | peak memory, batch 64")
    plain64, plain128 = float(memory[0][1]), [float(v) for v in memory[0][2].split(",")]
    saved64, saved128 = [], []
    for row in memory[1:]:
        peak64, saving = re.fullmatch(r"(\d+) \(-(\d+)\)", row[1]).groups()
        assert plain64 - float(peak64) == float(saving), row
        saved64.append(float(saving))
        saved128 += [p - float(v) for p, v in zip(plain128, row[2].split(","))]
    assert (min(saved64), max(saved64), min(saved128), max(saved128)) == (108, 137, 150, 255)
    rank_gaps = [abs(a - b) for a, b in (map(float, row[2].split(",")) for row in memory)]
    assert max(rank_gaps) == 100  # "peaks differ by up to 100 MiB between ranks"
    # "(2x slower)"
    assert [round(float(memory[0][3]) / float(row[3])) for row in memory[1:]] == [2, 2]


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


def test_the_line_count_04s_readme_gives_for_cpu_sync_batchnorm_is_the_files():
    """ "about N lines of code": within 10% of the file's code lines (the diff counts of every
    lesson: test_each_lesson_is_01_plus_its_topic)."""
    readme = " ".join((REPO / "04_syncbn/README.md").read_text().split())
    said = re.search(
        r"`CpuSyncBatchNorm` \(`cpu_sync_batchnorm.py`, about (\d+) lines of code\)", readme
    )
    assert said
    from tests.test_lessons import code_lines

    measured = code_lines(REPO / "04_syncbn/cpu_sync_batchnorm.py")
    assert abs(measured - int(said[1])) <= 0.1 * int(said[1]), (measured, said[1])


# --- 06_multinode/README.md: the launcher's refusal
# --------------------------------------------------


def test_readme_quotes_the_launchers_error_for_more_ranks_than_gpus():
    """The README's row for 8 ranks on a node of 4 GPUs is common.launcher's message."""
    from tests.test_launcher import launch_info, node_of
    from common.errors import LauncherError

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

    from tests.test_install import api_date, api_date_by_file, minimum_torch

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


def test_the_readme_names_the_digits_notice_and_its_licence():
    """ "Data sets": the digits' notice (common/DIGITS.md, held to the file by tests/test_data.py)
    and its licence."""
    assert "common/DIGITS.md" in README_TEXT and "CC BY 4.0" in README_TEXT


def test_the_guide_quotes_the_rendezvous_timeout_as_torch_prints_it():
    """Printed by a rank alone at the rendezvous in tests/test_failures.py::
    test_rank_missing_at_start_waits_at_the_rendezvous_silently."""
    from tests.test_failures import RENDEZVOUS_TIMED_OUT

    assert RENDEZVOUS_TIMED_OUT in (REPO / "debugging" / "README.md").read_text()


def _said_diff_count(readme: Path, a: str, b: str) -> int:
    """The "about N lines" a README gives for `diff a b`, in the sentence that names it."""
    text = " ".join(readme.read_text().split())
    said = re.search(rf"`diff {re.escape(a)} {re.escape(b)}`[^.]*?about (\d+) lines", text)
    assert said, f"{readme.relative_to(REPO)} gives no 'about N lines' for `diff {a} {b}`"
    return int(said[1])


@pytest.mark.parametrize(
    "a,b",
    [("01_basic_ddp/train.py", s) for s in TOPIC_SCRIPTS]
    + [("05_checkpointing/train.py", "05_checkpointing/preempt.py")],
)
def test_a_lessons_diff_is_about_the_lines_its_readme_says(a, b):
    """Each topic lesson's README: `diff 01_basic_ddp/train.py NN_topic/train.py` changes "about N
    lines", within 10% either way: the lesson's budget (tests/test_lessons.py counts them, each
    print(...) one line); 05's README says the same of preempt.py against its train.py."""
    said = _said_diff_count(REPO / b.split("/")[0] / "README.md", a, b)
    changed = diff_count(REPO / a, REPO / b)
    assert 0.9 * said <= changed <= 1.1 * said, f"diff {a} {b}: {changed} lines, README: {said}"


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
    from tests.test_sites import SITE_JOBS, source_site

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
    from tests.test_multinode import NEVER_CHECKED_IN, UNREACHABLE

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
    from tests.test_several_models import TEACHER_ERRORS

    readme = " ".join((REPO / "08_several_models" / "README.md").read_text().split())
    assert all(f"`{line}`" in readme for line in TEACHER_ERRORS)


def test_the_guide_shows_the_mp_spawn_worker_and_cell_that_run():
    """The code tests/test_forum_errors.py::
    test_mp_spawn_of_a_worker_defined_in_main_fails_and_an_imported_one_runs runs is the code
    debugging/README.md shows."""
    from tests.test_forum_errors import FIXED_CELL, WORKER_FILE

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
    assert f"({size:.1f} MiB of float32 parameters)" in section
    assert section.count(f"{size:.1f} MiB") == 3


def test_06s_samples_time_as_many_iterations_as_comm_check_does():
    """The iters column of 06's two comm_check samples (run with the default --iters 20) is
    comm_check's timed_iterations() (held to --iters' help in tests/test_multinode.py)."""
    from tests.test_multinode import ROW

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


def test_the_sample_check_fails_on_a_line_that_was_not_printed_and_names_the_fix():
    """`...` stands for any text; a line that is only `...` is an elision. Controls: a changed
    number, a cut line, a wrong line number behind `...`."""
    output = "rank 0: [0, 3]\n[rank1]: [/a/b/tcp.cc:1] Timed out\n"
    ran = Ran((output,), ("",), (0,), Path("/nowhere"))
    lines = ["rank 0: [0, 3]", "[rank1]:   ...", "[rank1]: [.../tcp.cc:1] Timed out"]
    assert readme_samples.drift("02-viewer", output, lines=lines) == []
    for wrong in (["rank 0: [0, 4]"], ["rank 0: [0, 3"], ["[rank1]: [.../tcp.cc:2] Timed out"]):
        with pytest.raises(
            AssertionError, match="python tests/readme_samples.py --write 02-viewer"
        ):
            assert_printed("02-viewer", ran, lines=wrong)


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


def test_a_reworded_print_line_fails_the_sample_check_naming_the_regeneration_command():
    """01's sample, as a run would print it (the `...` left out), agrees with itself; the same
    output with one line reworded does not, and the message says how to regenerate."""
    printed = "\n".join(line for line in readme_samples.sample_lines("01") if line != "...")
    assert readme_samples.drift("01", printed) == []
    problems = readme_samples.drift("01", printed.replace("eval accuracy", "eval acc"))
    assert len(problems) == 1 and "eval accuracy" in problems[0]
    assert "python tests/readme_samples.py --write 01" in readme_samples.drift_message(
        "01", problems
    )


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


def _any_rank(line: str) -> str:
    """A line of output with the rank it came from left out: `[rankN]:`, `for rank N:`."""
    return re.sub(r"rank \d+:", "rank N:", re.sub(r"^\[rank\d+\]:", "[rankN]:", line))


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


@pytest.mark.torch_text
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
