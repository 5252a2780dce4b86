"""What the repository's code uses of torch and torchvision,
found by reading it (ast), for the minimum-version test.

Four kinds of use, each a string:
  "torch.amp.GradScaler"                 a name reached from an import (aliases resolved: dist.x,
  F.x, DDP)
  "torch.load(weights_only=)"            a keyword argument of a call to such a name
  ".compile"                             a member of a torch class (Tensor, Module, ...) used on a
  variable
                                         (model.compile()); every attribute of a variable whose name
                                         a torch
                                         class has counts, whatever the variable holds
  "torchrun --rdzv_backend"              a torchrun flag in a job file
plus "python -m torch.x.y" commands anywhere in code,
job files or Markdown, as the name "torch.x.y".
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.paths import CODE_DIRS, REPO

ROOTS = ("torch", "torchvision")


def code_files() -> list[Path]:
    return sorted(p for folder in CODE_DIRS for p in (REPO / folder).glob("*.py"))


def job_files() -> list[Path]:
    return sorted(p for p in (REPO / "jobs").iterdir() if p.is_file())


def torch_classes() -> dict[str, type]:
    """The torch classes whose members, used on a variable, count as ".member" uses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from torch.utils.tensorboard import SummaryWriter

    return {
        "Tensor": torch.Tensor,
        "Module": torch.nn.Module,
        "Optimizer": torch.optim.Optimizer,
        "LRScheduler": torch.optim.lr_scheduler.LRScheduler,
        "DistributedDataParallel": DistributedDataParallel,
        "GradScaler": torch.amp.GradScaler,
        "Generator": torch.Generator,
        "DataLoader": DataLoader,
        "DistributedSampler": DistributedSampler,
        "Event": torch.cuda.Event,
        "TCPStore": dist.TCPStore,
        "SummaryWriter": SummaryWriter,
        "Join": Join,
    }


def member_names(classes: dict[str, type]) -> set[str]:
    """The public member names of the given classes."""
    return {member for cls in classes.values() for member in dir(cls) if not member.startswith("_")}


def python_uses(source: str, torch_members: set[str]) -> set[str]:
    """Names, keyword arguments and object members of
    torch/torchvision that one Python file uses."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> qualified name, torch or not
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import torch.nn` binds `torch`
                aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def qualified(node) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = qualified(node.value)
            return base and f"{base}.{node.attr}"
        return None

    def on_a_module(node: ast.Attribute) -> bool:
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in aliases

    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" for a in node.names]
                if node.module and node.level == 0
                else []
            )
            uses.update(n for n in names if n.split(".")[0] in ROOTS)
        elif isinstance(node, ast.Name | ast.Attribute) and (name := qualified(node)):
            if name.split(".")[0] in ROOTS:
                uses.add(name)
        if isinstance(node, ast.Attribute) and not on_a_module(node) and node.attr in torch_members:
            uses.add(f".{node.attr}")
        if (
            isinstance(node, ast.Call)
            and (name := qualified(node.func))
            and name.split(".")[0] in ROOTS
        ):
            uses.update(f"{name}({kw.arg}=)" for kw in node.keywords if kw.arg)
    return uses


MODULE_COMMAND = re.compile(r"-m (torch(?:\.\w+)+)")


def torchrun_flags() -> set[str]:
    """Every flag the installed torchrun knows, as its --help spells it."""
    from torch.distributed.run import get_args_parser

    return set(re.findall(r"--[a-z][a-z_-]*", get_args_parser().format_help()))


def torchrun_flags_used(text: str, known: set[str]) -> set[str]:
    """torchrun flags in a job file: the flags torchrun knows, written in
    a torchrun command or in an array the command expands (continuation
    lines joined; the script's own arguments start at the script)."""
    joined = text.replace("\\\n", " ")
    used = set()
    for line in joined.splitlines():
        # comments (and #SBATCH lines) name flags without passing them
        code = re.sub(r"(^|\s)#.*", "", line)
        if (
            "torch.distributed.run" in code
            or re.search(r"\btorchrun\b", code)
            or re.search(r"\w+\+=\(", code)
        ):
            before_script = re.split(r"\s\S*(?:\.py|SCRIPT\w*)\W", code + " ")[0]
            used.update(
                f"torchrun {flag}"
                for flag in re.findall(r"(--[a-z][a-z_-]*)", before_script)
                if flag in known
            )
    return used


@functools.cache
def uses_by_file() -> dict[str, set[str]]:
    """Relative path -> what that file uses."""
    torch_members = member_names(torch_classes())
    flags = torchrun_flags()
    found: dict[str, set[str]] = {}
    for path in code_files():
        found[path.relative_to(REPO).as_posix()] = python_uses(path.read_text(), torch_members)
    for path in job_files():
        found[path.relative_to(REPO).as_posix()] = torchrun_flags_used(path.read_text(), flags)
    docs = sorted(
        p
        for p in [*REPO.glob("*.md"), *REPO.glob("*/*.md")]
        if not p.parent.name.startswith((".", "tests"))
    )
    for path in [*code_files(), *job_files(), *docs]:
        commands = set(MODULE_COMMAND.findall(path.read_text()))
        found.setdefault(path.relative_to(REPO).as_posix(), set()).update(commands)
    return {name: uses for name, uses in found.items() if uses}


# Uses newer than torch 2.0 -> (first release with it,
# how that was checked). "Checked in the wheels": the
# Python sources of the torch wheels of each release
# from 2.0.1 on, read for the definition (or argument).
NEWER_THAN_2_0 = {
    ".nbytes": ("2.1", "Tensor.nbytes: in torch/_C/__init__.pyi of 2.1.2, not 2.0.1"),
    "torch.testing._internal.distributed.fake_pg.FakeStore": (
        "2.1",
        "fake_pg.py (FakeStore, the fake backend) in the 2.1.2 wheel, not 2.0.1",
    ),
    "torch.compiler": ("2.1", "absent from the 2.0.1 wheel; in the 2.1 docs"),
    "torch.compiler.reset": ("2.1", "in the torch.compiler API list of the 2.1 docs"),
    ".compile": ("2.1", "nn.Module.compile: defined in nn/modules/module.py of 2.1.2, not 2.0.1"),
    ".register_post_accumulate_grad_hook": (
        "2.1",
        "Tensor.register_post_accumulate_grad_hook: in _tensor.py of 2.1.2, not 2.0.1",
    ),
    "torch.distributed.DistError": (
        "2.2",
        "exported by torch/distributed/__init__.py from 2.2.2, not 2.1.2",
    ),
    "torch.distributed.DistStoreError": (
        "2.2",
        "exported by torch/distributed/__init__.py from 2.2.2, not 2.1.2",
    ),
    "torch.distributed.checkpoint.state_dict.get_state_dict": (
        "2.2",
        "defined in 2.2.2's state_dict.py, not 2.1.2",
    ),
    "torch.distributed.checkpoint.state_dict.set_state_dict": (
        "2.2",
        "defined in 2.2.2's state_dict.py, not 2.1.2",
    ),
    "torch.distributed.checkpoint.state_dict.set_state_dict(model_state_dict=)": (
        "2.2",
        "with set_state_dict",
    ),
    "torch.distributed.checkpoint.state_dict.set_state_dict(optim_state_dict=)": (
        "2.2",
        "with set_state_dict",
    ),
    "torch.distributed.checkpoint.save": (
        "2.2",
        "dcp.save: 2.2.2 (storage_writer required), not 2.1.2",
    ),
    "torch.distributed.checkpoint.load": (
        "2.2",
        "dcp.load: 2.2.2 (storage_reader required), not 2.1.2",
    ),
    "torch.distributed.checkpoint.save(checkpoint_id=)": (
        "2.3",
        "argument of dcp.save in 2.3.1, not 2.2.2",
    ),
    "torch.distributed.checkpoint.load(checkpoint_id=)": (
        "2.3",
        "argument of dcp.load in 2.3.1, not 2.2.2",
    ),
    "torch.distributed.checkpoint.format_utils": (
        "2.3",
        "format_utils.py and its dcp_to_torch command: 2.3.1, not 2.2.2",
    ),
    ".check": (
        "2.3",
        "Store.check in Python (TCPStore): in 2.3.1's libtorch_python, not 2.2.2; "
        "pytorch/pytorch#116144",
    ),
    "torch.amp.GradScaler": (
        "2.3",
        "torch/amp/grad_scaler.py (device 'cuda' or 'cpu'): 2.3.1, not 2.2.2; before "
        "it torch.cuda.amp.GradScaler",
    ),
    "torch.amp.GradScaler(enabled=)": ("2.3", "with torch.amp.GradScaler"),
    "torch.distributed.checkpoint.state_dict.get_model_state_dict": (
        "2.2",
        "defined in 2.2.2's state_dict.py beside get_state_dict, not 2.1.2",
    ),
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(options=)": (
        "2.2",
        "with get_model_state_dict",
    ),
    "torch.distributed.checkpoint.state_dict.StateDictOptions": (
        "2.2",
        "defined in 2.2.2's state_dict.py, with full_state_dict and cpu_offload, not 2.1.2",
    ),
    "torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict=)": (
        "2.2",
        "with StateDictOptions",
    ),
    "torch.distributed.checkpoint.state_dict.StateDictOptions(cpu_offload=)": (
        "2.2",
        "with StateDictOptions",
    ),
    "torch.distributed.fsdp.fully_shard": (
        "2.6",
        "exported by torch/distributed/fsdp/__init__.py from 2.6; 2.4 and 2.5 had it only as "
        "torch.distributed._composable.fsdp (its docs page: created Dec 04, 2024)",
    ),
    "torch.distributed.fsdp.fully_shard(mp_policy=)": ("2.6", "with fully_shard"),
    "torch.distributed.fsdp.MixedPrecisionPolicy": ("2.6", "exported with fully_shard"),
    "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=)": ("2.6", "with it"),
    "torch.distributed.fsdp.MixedPrecisionPolicy(reduce_dtype=)": ("2.6", "with it"),
    "torch.amp.is_autocast_available": (
        "2.4",
        "torch/amp/autocast_mode.py of 2.4.1, not 2.3.1 (pytorch/pytorch#124938)",
    ),
    "torch.distributed.flight_recorder.fr_trace": ("2.10", "in the 2.10.0 wheel, not 2.9.0"),
    "torchrun --signals-to-handle": (
        "2.10",
        "torch/distributed/run.py of 2.10.0, not 2.9.0 (pytorch/pytorch#160690)",
    ),
}


# Attribute names of the code's own objects that a
# torch class happens to have too (found as ".name").
NOT_TORCH = {
    ".append": "list.append (the code calls no Store.append)",
    ".index": "list.index and str.index",
}


def requirement_lines(path: Path) -> list[str]:
    """The requirements of a pip requirements file, following `-r other.txt`."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if line.startswith("#") or not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            lines += requirement_lines(path.parent / line.split(maxsplit=1)[1])
        else:
            lines.append(line)
    return lines


def installed_closure(requirements: list[str], path: list[str] | None = None) -> dict[str, str]:
    """Every distribution the requirements pull in, from the installed metadata, recursively:
    normalized name -> the chain that pulled it in ("tensorboard -> numpy")."""
    pulled: dict[str, str] = {}
    todo = [(Requirement(line), "") for line in requirements]
    while todo:
        requirement, chain = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in pulled:
            continue
        pulled[name] = f"{chain} -> {requirement.name}" if chain else requirement.name
        found = list(metadata.distributions(name=requirement.name, path=path or sys.path))
        assert found, (
            f"{requirement.name} is not installed "
            "(pip install -r requirements.txt -r requirements-test.txt)"
        )
        for spec in found[0].requires or []:
            dependency = Requirement(spec)
            extras = requirement.extras or {""}
            if dependency.marker is None or any(
                dependency.marker.evaluate({"extra": e}) for e in extras
            ):
                todo.append((dependency, pulled[name]))
    return pulled


OLD_LIST = REPO / "tests" / "torch_2_0_api.txt"


MIN_PAIR = REPO / "requirements-min.txt"


def torch_2_0_uses() -> set[str]:
    return {line for line in OLD_LIST.read_text().splitlines() if line and not line.startswith("#")}


def minimum_torch() -> str:
    """The oldest torch the examples are tested with: requirements-min.txt's pin, as X.Y."""
    [pin] = [line for line in requirement_lines(MIN_PAIR) if Requirement(line).name == "torch"]
    return ".".join(next(iter(Requirement(pin).specifier)).version.split(".")[:2])


def api_date_by_file() -> dict[str, str]:
    """Each file's newest torch API: the first release that has every API the file uses."""
    return {path: newest(uses) for path, uses in uses_by_file().items()}


def api_date(by_file: dict[str, str] | None = None) -> str:
    """The newest API of the files that run on the minimum torch (of api_date_by_file())."""
    dates = (by_file or api_date_by_file()).values()
    return max((v for v in dates if Version(v) <= Version(minimum_torch())), key=Version)


def newest(uses: set[str]) -> str:
    return max(
        (NEWER_THAN_2_0[use][0] for use in uses if use in NEWER_THAN_2_0),
        key=Version,
        default="2.0",
    )
