"""The repository keeps its promises about itself: a torch pair that works, parallel test files,
common/ free of import cycles. (That CI runs the README's test command:
tests/test_readme_commands.py.)"""

import ast
import re
import shutil
from pathlib import Path

from tests.helpers import REPO


def test_requirements_pin_a_torch_torchvision_pair_whose_compiled_ops_work():
    reqs = (REPO / "requirements.txt").read_text()
    assert re.search(r"^torch==\S+$", reqs, re.M) and re.search(r"^torchvision==\S+$", reqs, re.M)
    import torch
    from torchvision.ops import nms

    # A CPU-only torch with a CUDA torchvision fails exactly
    # here ("operator torchvision::nms does not exist").
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    assert nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5).tolist() == [0, 2]


def common_imports(folder: Path) -> dict[str, set[str]]:
    """Which modules of the package in `folder` each of its modules imports, at the top or inside
    a function (`from common.x import ...`, `import common.x`, `from common import x`, relative)."""
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = "." * node.level + (node.module or "")
                modules = [package] + [f"{package}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                if module.startswith(("common.", ".")):
                    found |= set(module.lstrip(".").split(".")) & names
        graph[path.stem] = found - {path.stem}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as the modules along it, or [] where there is none."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_common_has_no_import_cycle_even_through_an_import_inside_a_function(tmp_path):
    """A copy of common/ is a package a user's own code imports: a cycle breaks the import order
    of whoever imports it first. The control: errors.py importing from launcher.py inside a
    function, as it once did, is found."""
    common = REPO / "common"
    graph = common_imports(common)
    assert graph["launcher"] and import_cycle(graph) == [], graph
    planted = tmp_path / "common"
    shutil.copytree(common, planted, ignore=shutil.ignore_patterns("__pycache__"))
    errors = planted / "errors.py"
    errors.write_text(
        errors.read_text()
        + "\n\ndef _this_rank():\n    from common.launcher import launched_by\n\n"
        + "    return launched_by\n"
    )
    assert import_cycle(common_imports(planted)) in (
        ["errors", "launcher", "errors"],
        ["launcher", "errors", "launcher"],
    )
