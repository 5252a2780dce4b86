"""What a run left: its summary.json and model.pt, compared tensor by tensor; its output read."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from tests.paths import REPO


def read_summary(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "summary.json").read_text())


def repeated_lines(output: str) -> list[str]:
    """The non-blank lines that `output` holds more than once. A script whose ranks all print
    would repeat its banner and its per-epoch lines (the same on every rank): under a launcher,
    an empty list shows that one rank printed, whatever the lines say."""
    lines = [line for line in output.splitlines() if line.strip()]
    return sorted({line for line in lines if lines.count(line) > 1})


def root_cause(output: str) -> str:
    """The part of torchrun's closing summary that names the first failure (its "Root Cause")."""
    assert "Root Cause" in output, output[-3000:]
    return output.split("Root Cause")[-1]


def load_model(output_dir: Path) -> dict:
    """The state_dict a run wrote to output_dir/model.pt."""
    import torch

    return torch.load(Path(output_dir) / "model.pt", map_location="cpu", weights_only=True)


def relative_difference(a: dict, b: dict) -> float:
    """Largest ||a - b|| / ||b|| over the tensors of two state dicts (same keys required)."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in a)


def differing_tensors(a: dict, b: dict) -> list[str]:
    """The keys of two state dicts (the same keys required) whose tensors are not bitwise equal."""
    import torch

    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def summary_fields(script: str | Path) -> set[str]:
    """The fields a script's write_summary(...) call writes to summary.json: its keyword arguments,
    those of a `dict(...)` it unpacks with `**name`, and, where that name is built by
    common/report.py's run_record(...), the record's own fields and the call's keyword arguments."""
    tree = ast.parse((REPO / script).read_text())
    [call] = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "write_summary"
    ]
    built = {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", "") in ("dict", "run_record")
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    report = ast.parse((REPO / "common" / "report.py").read_text())
    [record] = [
        n.value
        for n in ast.walk(report)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "record"
    ]
    fields = {kw.arg for kw in call.keywords if kw.arg}
    for kw in call.keywords:
        if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id in built:
            value = built[kw.value.id]
            fields |= {k.arg for k in value.keywords if k.arg}
            if value.func.id == "run_record":
                fields = fields - {"start_time", "images_seen"} | {k.arg for k in record.keywords}
    if "replica_checksums" in fields:
        fields.add("replicas_identical")
    return fields


def assert_same_params(a, b, rtol=1e-5):
    import torch

    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=1e-7, msg=name)


ROW = re.compile(
    r"\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)"
    r"\s+([\d.]+)\s+([\d.]+)\s+(True|False)"
)
