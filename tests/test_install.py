"""Installing next to a site's own torch, and the oldest torch
the code runs with; the README's "Versions" is checked against these in tests/test_readme_text.py.

requirements-site.txt is everything but torch and torchvision, so a cluster keeps its
own build; requirements.txt is the tested pair plus that file. The minimum torch is the pair in
requirements-min.txt, on which CI runs the `min_torch` tier (.ci/run). Below it, the date of the
APIs the code uses: every torch and torchvision use that tests/torch_api.py finds must be either
in tests/torch_2_0_api.txt (present in torch 2.0.1 and torchvision 0.15.2) or in NEWER_THAN_2_0
below, with the release it first appeared in.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.paths import REPO
from tests.torch_api import (
    MIN_PAIR,
    NEWER_THAN_2_0,
    NOT_TORCH,
    OLD_LIST,
    api_date,
    installed_closure,
    member_names,
    minimum_torch,
    newest,
    python_uses,
    requirement_lines,
    torch_2_0_uses,
    torch_classes,
    torchrun_flags,
    torchrun_flags_used,
    uses_by_file,
)
from tests.torch_versions import PINNED_TORCH, RUNNING_TORCH, pinned_torch_only

SITE = REPO / "requirements-site.txt"
PINNED = REPO / "requirements.txt"
TORCH_PACKAGES = {"torch", "torchvision"}


def torch_pulled_in(requirements: list[str], path: list[str] | None = None) -> list[str]:
    named = [
        line for line in requirements if canonicalize_name(Requirement(line).name) in TORCH_PACKAGES
    ]
    pulled = [
        chain
        for name, chain in installed_closure(requirements, path).items()
        if name in TORCH_PACKAGES
    ]
    return named + pulled


def test_the_site_and_test_requirements_neither_name_nor_pull_in_torch(tmp_path):
    """`pip install -r requirements-site.txt -r requirements-test.txt` leaves the environment's
    torch and torchvision alone (the minimum-torch tier installs them so): neither file names
    or pulls in torch or torchvision, and the test file holds the whole site file."""
    site = requirement_lines(SITE)
    assert site and torch_pulled_in(site) == []
    test = requirement_lines(REPO / "requirements-test.txt")
    assert torch_pulled_in(test) == [] and set(site) < set(test)
    # The installed closure is real: tensorboard brings numpy, among others.
    assert "numpy" in installed_closure(site)

    # Negative controls: torch added to the site file;
    # a package whose metadata requires torchvision.
    edited = tmp_path / "requirements-site.txt"
    edited.write_text(SITE.read_text() + "torch>=2.3\n")
    assert torch_pulled_in(requirement_lines(edited)) == ["torch>=2.3", "torch"]
    info = tmp_path / "site" / "needs_vision-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: needs-vision\nVersion: 1.0\nRequires-Dist: torchvision\n"
    )
    pulled = torch_pulled_in(
        [*requirement_lines(SITE), "needs-vision"], path=[str(tmp_path / "site"), *sys.path]
    )
    assert (
        "needs-vision -> torchvision" in pulled and "needs-vision -> torchvision -> torch" in pulled
    )


@pinned_torch_only("the installed pair is the pinned one")
def test_requirements_txt_is_the_installed_pair_plus_the_site_file():
    """The quick start installs the pair CI tests and then exactly the site file."""
    lines = requirement_lines(PINNED)
    pins = {
        canonicalize_name(Requirement(line).name): line
        for line in lines
        if canonicalize_name(Requirement(line).name) in TORCH_PACKAGES
    }
    # 2.14.1+cpu -> 2.14.1
    installed = {name: Version(metadata.version(name)).public for name in TORCH_PACKAGES}
    assert pins == {name: f"{name}=={version}" for name, version in installed.items()}
    assert lines == [pins["torch"], pins["torchvision"], *requirement_lines(SITE)]


# --- the minimum torch version
# -------------------------------------------------------------------------------


def test_every_torch_use_in_the_code_has_a_known_first_release(tmp_path):
    known = torch_2_0_uses() | NEWER_THAN_2_0.keys() | NOT_TORCH.keys()
    unknown = {
        f"{path}: {use}"
        for path, uses in uses_by_file().items()
        for use in uses
        if use not in known
    }
    assert not unknown, (
        "torch APIs of unknown age (find the first release that has each, then add it to "
        f"NEWER_THAN_2_0 or, if torch 2.0.1 had it, to {OLD_LIST.name}): {sorted(unknown)}"
    )

    # Negative controls: a newer call, a method on a variable,
    # an unknown name; a stdlib method is not torch's.
    members = member_names(torch_classes())
    source = (
        "import re\nimport torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ok = torch.amp.is_autocast_available('cpu')\nmodel = DDP(torch.nn.Linear(1, 1))\n"
        "model.compile()\nPATTERN = re.compile('x')\ntorch.accelerator.current_accelerator()\n"
        "import torch.distributed.flight_recorder.fr_trace\n"
    )
    uses = python_uses(source, members)
    assert {
        "torch.amp.is_autocast_available",
        ".compile",
        "torch.accelerator.current_accelerator",
        "torch.nn.parallel.DistributedDataParallel",
    } <= uses
    assert newest(uses) == "2.10" and Version(newest(uses)) > Version(api_date())
    assert "torch.accelerator.current_accelerator" not in torch_2_0_uses() | NEWER_THAN_2_0.keys()
    assert (
        "re.compile" not in uses and python_uses("import re\nre.compile('x')\n", members) == set()
    )

    # A flag in a torchrun command (or an array it expands) counts; one in a comment or after the
    # script not. The flags are the installed torchrun's: the pinned one's here.
    if RUNNING_TORCH != PINNED_TORCH:
        return
    known = torchrun_flags()
    job = (
        '# torchrun must know --signals-to-handle\nextra+=("--local_addr=$HOST")\n'
        '"$PYTHON" -m torch.distributed.run \\\n    --nnodes=2 --signals-to-handle=SIGUSR1 \\\n'
        '    "$SCRIPT" --standalone  # --rdzv_id\n'
    )
    assert torchrun_flags_used(job, known) == {
        "torchrun --local_addr",
        "torchrun --nnodes",
        "torchrun --signals-to-handle",
    }
    assert newest(torchrun_flags_used(job, known)) == "2.10"
    assert torchrun_flags_used(job.replace("--signals-to-handle=SIGUSR1 ", ""), known) == {
        "torchrun --local_addr",
        "torchrun --nnodes",
    }


LESSON_TESTS = [
    "basic_ddp",
    "sampler_patterns",
    "grad_accum",
    "syncbn",
    "checkpointing",
    "multinode",
    "metrics",
    "several_models",
]


def marked_min_torch(path: Path) -> list[str]:
    """Test functions of a file that carry the min_torch mark (on the function or a parameter)."""
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and "pytest.mark.min_torch" in "".join(ast.unparse(d) for d in node.decorator_list)
    ]


def test_the_minimum_is_the_pair_ci_runs_the_min_torch_tier_on():
    """requirements-min.txt pins the minimum torch and its torchvision; .ci/run installs it
    beside the test requirements (no other torch) in a virtual environment of its own and runs
    the tier there; every lesson's test file has tests in the tier."""
    pins = {Requirement(line).name: Requirement(line) for line in requirement_lines(MIN_PAIR)}
    assert pins.keys() == TORCH_PACKAGES and all(len(r.specifier) == 1 for r in pins.values())
    assert all(next(iter(r.specifier)).operator == "==" for r in pins.values())
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"python -m venv \S+", ci)
    assert re.search(r'pip"? install .*-r requirements-min\.txt -r requirements-test\.txt', ci)
    assert re.search(r"python -m pytest -m min_torch", ci)
    for name in LESSON_TESTS:
        assert marked_min_torch(REPO / "tests" / f"test_{name}.py"), name
    # the scan sees a parameter's mark too (02's 3-rank evaluation), and nothing unmarked
    assert "test_distributed_eval_equals_one_process" in marked_min_torch(
        REPO / "tests" / "test_sampler_patterns.py"
    )
    assert "test_launch_info_cases" not in marked_min_torch(REPO / "tests" / "test_launcher.py")

    assert f"Needs torch >= {minimum_torch()}" in SITE.read_text()
