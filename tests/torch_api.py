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
import re
from pathlib import Path

from tests.helpers import CODE_DIRS, REPO

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
