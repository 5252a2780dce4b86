"""No example calls a backend-only torch.distributed API where the other
backend may run: every use sits under an `if` (or a conditional
expression) whose test names that backend, as in 02's uneven_inputs.py:

    if backend == "gloo":
        dist.monitored_barrier()
    else:
        dist.barrier()

The list, from torch 2.14's source (torch/distributed/distributed_c10d.py, ProcessGroupNCCL.cpp):
  gloo only:  monitored_barrier ("requires a group with a CPU-capable backend (e.g. GLOO)"),
              ReduceOp.BAND / BOR / BXOR ("Cannot use ReduceOp.BAND with NCCL"), ProcessGroupGloo
  nccl only:  torch.cuda.nccl.* (direct NCCL calls on CUDA tensors), ProcessGroupNCCL (and its
  Options),
              split_group ("currently this API only support NCCL and XCCL backend"),
              ReduceOp.PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo")
ReduceOp.AVG is documented as NCCL-only but gloo computes it in
torch 2.14, and batch_isend_irecv works on both: neither is listed.
"""

from __future__ import annotations

import ast

import pytest

from tests.helpers import REPO, tracked_files

BACKEND_ONLY = {
    "monitored_barrier": "gloo",
    "BAND": "gloo",
    "BOR": "gloo",
    "BXOR": "gloo",
    "ProcessGroupGloo": "gloo",
    "ProcessGroupNCCL": "nccl",
    "split_group": "nccl",
    "PREMUL_SUM": "nccl",
    "torch.cuda.nccl": "nccl",
}


def names_backend(node: ast.AST, backend: str) -> bool:
    """`node` mentions the backend: a string "gloo", a name or
    attribute such as Backend.GLOO or is_nccl_available."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.lower() == backend:
            return True
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if backend in name.lower():
            return True
    return False


def polarity(test: ast.AST, backend: str) -> int:
    """+1 if `test` being true means the backend is `backend`,
    -1 if its being false does, 0 if it tells neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -polarity(test.operand, backend)
    if isinstance(test, ast.BoolOp):  # `a and b` true: both are; `a or b` false: both are false
        signs = [polarity(v, backend) for v in test.values]
        wanted = 1 if isinstance(test.op, ast.And) else -1
        return wanted if wanted in signs else 0
    if not names_backend(test, backend):
        return 0
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return -1 if isinstance(test.ops[0], (ast.NotEq, ast.NotIn, ast.IsNot)) else 1
    return 1  # e.g. dist.is_nccl_available()


def backend_only_use(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        dotted = ast.unparse(node)
        if dotted == "torch.cuda.nccl" or dotted.startswith("torch.cuda.nccl."):
            return "torch.cuda.nccl"
        return node.attr if node.attr in BACKEND_ONLY else None
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in BACKEND_ONLY:
        return node.id  # from torch.distributed import monitored_barrier
    return None


def unguarded_uses(source: str) -> list[tuple[int, str]]:
    """(line, API) of every backend-only use outside a guard that names its backend."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, guards: frozenset[str]) -> None:
        if isinstance(node, (ast.If, ast.IfExp)):
            visit(node.test, guards)
            signs = {b: polarity(node.test, b) for b in ("gloo", "nccl")}
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            for child in body:
                visit(child, guards | {b for b, s in signs.items() if s == 1})
            for child in orelse:
                visit(child, guards | {b for b, s in signs.items() if s == -1})
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return  # importing is fine everywhere; using is not
        api = backend_only_use(node)
        if api is not None:
            if BACKEND_ONLY[api] not in guards:
                found.append((node.lineno, api))
            return  # one finding per use, not one per sub-attribute
        for child in ast.iter_child_nodes(node):
            visit(child, guards)

    visit(ast.parse(source), frozenset())
    return found


# Every .py of the repository outside tests/.
EXAMPLES = [p for p in tracked_files("*.py") if p.relative_to(REPO).parts[0] != "tests"]


def test_every_python_file_outside_tests_is_scanned():
    scanned = {p.relative_to(REPO).as_posix() for p in EXAMPLES}
    assert {
        "02_sampler_patterns/uneven_inputs.py",
        "01_basic_ddp/train.py",
        "common/launcher.py",
        "benchmark/perf.py",
        "debugging/demo_bugs.py",
    } <= scanned
    # uneven_inputs.py uses monitored_barrier, under its gloo guard: the scan sees the use.
    source = (REPO / "02_sampler_patterns/uneven_inputs.py").read_text()
    assert "dist.monitored_barrier()" in source and unguarded_uses(
        source.replace('backend == "gloo"', "True")
    )


def test_no_example_uses_a_backend_only_api_unguarded():
    found = [
        f"{p.relative_to(REPO)}:{line}: {api} ({BACKEND_ONLY[api]} only)"
        for p in EXAMPLES
        for line, api in unguarded_uses(p.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    "source,expected",
    [
        # Unguarded: flagged.
        ("dist.monitored_barrier()", [(1, "monitored_barrier")]),
        (
            "from torch.distributed import monitored_barrier\nmonitored_barrier()",
            [(2, "monitored_barrier")],
        ),
        ("torch.cuda.nccl.all_reduce([t])", [(1, "torch.cuda.nccl")]),
        ("dist.all_reduce(t, op=dist.ReduceOp.BAND)", [(1, "BAND")]),
        ("opts = dist.ProcessGroupNCCL.Options()", [(1, "ProcessGroupNCCL")]),
        # cuda is not nccl
        (
            "if device.type == 'cuda':\n    dist.split_group(split_ranks=[[0]])",
            [(2, "split_group")],
        ),
        # the wrong backend
        ("if backend == 'nccl':\n    dist.monitored_barrier()", [(2, "monitored_barrier")]),
        (
            "if backend == 'gloo':\n    dist.barrier()\nelse:\n    dist.monitored_barrier()",
            [(4, "monitored_barrier")],
        ),
        ("if backend != 'gloo':\n    dist.monitored_barrier()", [(2, "monitored_barrier")]),
        ("if backend == 'gloo' or fast:\n    dist.monitored_barrier()", [(2, "monitored_barrier")]),
        # Guarded: not flagged.
        ("if backend == 'gloo':\n    dist.monitored_barrier()\nelse:\n    dist.barrier()", []),
        ("if dist.get_backend() == dist.Backend.GLOO:\n    dist.monitored_barrier()", []),
        ("if backend != 'gloo':\n    dist.barrier()\nelse:\n    dist.monitored_barrier()", []),
        (
            "if not dist.is_nccl_available():\n    pass\nelse:\n    "
            "torch.cuda.nccl.all_reduce([t])",
            [],
        ),
        ("if backend == 'gloo' and debug:\n    dist.monitored_barrier()", []),
        ("op = dist.ReduceOp.PREMUL_SUM(2.0) if backend == 'nccl' else dist.ReduceOp.SUM", []),
        ("from torch.distributed import monitored_barrier", []),  # an import alone runs nothing
    ],
)
def test_the_scan_flags_unguarded_uses_only(source, expected):
    """Negative and positive controls: the scan can fail,
    and a guard silences it only for its backend."""
    assert unguarded_uses(source) == expected


# -- barriers on nccl ------------------------------------------------------------------------------
def barriers_without_device_ids(source: str) -> list[int]:
    """Lines of `barrier(...)` calls (dist.barrier, torch.distributed.barrier, an imported
    barrier) that do not pass device_ids. On nccl up to torch 2.7 such a barrier, before the
    group's first other collective, picked its GPU as the global rank modulo the visible GPUs
    (whatever set_device said): with cyclic placement two ranks then shared one GPU, which NCCL
    refuses. Newer torch uses the current device, with a warning."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "barrier")
            or (isinstance(node.func, ast.Name) and node.func.id == "barrier")
        )
        and not any(k.arg == "device_ids" for k in node.keywords)
        and not (  # comm_check's barrier(device, group), which passes device_ids itself
            isinstance(node.func, ast.Name)
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "device"
        )
    ]


def test_every_barrier_outside_tests_names_its_device():
    """Every `dist.barrier` in the examples, the benchmark and the guide's scripts passes
    device_ids (None on gloo). comm_check's own `barrier(device, group)` helper passes it too."""
    found = [
        f"{p.relative_to(REPO)}:{line}"
        for p in EXAMPLES
        for line in barriers_without_device_ids(p.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    "source,expected",
    [
        ("dist.barrier()", [1]),
        ("torch.distributed.barrier(group=g)", [1]),
        ("from torch.distributed import barrier\nbarrier()", [2]),
        ("dist.barrier(device_ids=[device.index])", []),
        ("dist.barrier(device_ids=[d.index] if d.type == 'cuda' else None)", []),
        ("barrier(device, group)", []),  # comm_check's helper, which passes device_ids itself
        ("from torch.distributed import barrier\nbarrier(group)", [2]),
    ],
)
def test_the_barrier_scan_flags_barriers_without_device_ids(source, expected):
    assert barriers_without_device_ids(source) == expected
