"""The DDP doctor: checks a port of your own training script, by reading it and by running it.

    python debugging/doctor.py lint my_train.py [my_module.py ...]
    python debugging/doctor.py run [--nproc 2] [--steps 20] [--batch-flag --batch-size] \\
        -- my_train.py --batch-size 32 [its other arguments]

lint reads the code and names the classic mistakes of a DDP port, one line each with file and
line. It follows the values that come from the rank, so a save under `if rank == 0:` passes.

run starts the unmodified script with torchrun twice: on N ranks with the batch as given, and
as one process with N times the batch. A recorder, loaded before the script, notes every step's
loss, a hash of the parameters, and the samples each rank drew. The report says whether the
replicas stay identical, whether the ranks share the data set without overlap, whether each
epoch is reshuffled, and whether the ranks' mean loss follows the one process's, or why it may
not. When the ranks stop agreeing on collectives, it names where each rank is instead of waiting.

Each finding is one line starting with `problem:`; the last line sums up. Exit code 0: nothing
found; 1: problems found; 2: bad usage, or a script that does not start.
Standard library and torch only: copy this one file into your project if you like.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

USAGE_EXIT_CODE = 2

# Calls every rank of the group must make, in the same order (torch.distributed's collectives).
COLLECTIVES = set(
    (
        "all_gather all_gather_into_tensor all_gather_object all_reduce all_to_all "
        "all_to_all_single barrier broadcast broadcast_object_list gather gather_object "
        "monitored_barrier new_group reduce reduce_scatter reduce_scatter_tensor scatter "
        "scatter_object_list "
    ).split()
)
# torch.distributed.checkpoint's save and load are collective too.
CHECKPOINT_COLLECTIVES = {"save", "load", "async_save", "save_state_dict", "load_state_dict"}
# Where a rank number comes from: launchers' variables, attribute and function names.
RANK_VARIABLES = set(
    (
        "RANK LOCAL_RANK GROUP_RANK SLURM_PROCID SLURM_LOCALID OMPI_COMM_WORLD_RANK "
        "OMPI_COMM_WORLD_LOCAL_RANK PMI_RANK PMIX_RANK PALS_RANKID PALS_LOCAL_RANKID "
    ).split()
)
RANK_NAMES = {"rank", "local_rank", "global_rank", "world_rank", "node_rank"}
RANK_ATTRIBUTES = RANK_NAMES | set(
    (
        "process_index local_process_index is_main_process is_local_main_process is_master "
        "is_main is_global_zero "
    ).split()
)
RANK_FUNCTIONS = {"get_rank", "get_local_rank", "get_node_local_rank", "is_main_process"}
# Samplers that hand every rank the whole data set.
UNSHARDED_SAMPLERS = set(
    ("RandomSampler SequentialSampler SubsetRandomSampler WeightedRandomSampler ").split()
)
WRITE_METHODS = {"write_text", "write_bytes", "savefig", "save_pretrained", "to_csv"}
# Loader arguments a worker process must unpickle under forkserver or spawn.
WORKER_ARGUMENTS = {"transform", "target_transform", "transforms", "collate_fn", "worker_init_fn"}
# Where a ported script's results may differ from one process's, and why.
RANDOM_LAYERS = ("Dropout",)
BATCH_STATISTICS_LAYERS = ("BatchNorm", "InstanceNorm")
ADAPTIVE_OPTIMIZERS = tuple("Adadelta Adagrad Adam AdamW Adamax NAdam RAdam RMSprop".split())


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str
    message: str

    def __str__(self):
        return f"problem: {self.path}:{self.line}: {self.message} [{self.kind}]"


class BadUsage(Exception):
    """What the user must fix in the doctor's own command line."""


# --- lint: reading the code -------------------------------------------------------------------


def _call_name(call: ast.Call) -> str:
    """The last part of a call's name: `dist.all_reduce(...)` -> all_reduce."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _names_in(node) -> set[str]:
    """Plain names and attribute names an expression reads: `enumerate(self.loader)` -> loader."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _target_name(target) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_backward(call: ast.Call) -> bool:
    """`loss.backward()` or `torch.autograd.backward(loss)`."""
    return isinstance(call.func, ast.Attribute) and call.func.attr == "backward"


def _keyword_in(expression, node) -> bool:
    """Whether node is part of expression (a sampler built inline in a loop's header)."""
    return any(sub is node for sub in ast.walk(expression))


def _is_minus_one(node) -> bool:
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and node.operand.value == 1
    )


def _is_constant(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class Source:
    """One file's syntax tree, with what the checks look up: import aliases, function
    definitions, the parent of every node."""

    def __init__(self, path: str):
        self.path = path
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise BadUsage(f"cannot read {path}: {exc.strerror}") from None
        try:
            self.tree = ast.parse(text, filename=path)
        except SyntaxError as exc:
            raise BadUsage(f"{path}:{exc.lineno}: not Python: {exc.msg}") from None
        self.aliases: dict[str, str] = {}
        self.parent: dict[ast.AST, ast.AST] = {}
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
            if isinstance(node, ast.Import):
                for item in node.names:
                    self.aliases[item.asname or item.name.split(".")[0]] = (
                        item.name if item.asname else item.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module:
                for item in node.names:
                    self.aliases[item.asname or item.name] = f"{node.module}.{item.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(self.key(node), []).append(node)

    def dotted(self, node) -> str:
        """The full name an expression stands for: `dist.barrier` -> torch.distributed.barrier."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            return f"{self.dotted(node.value)}.{node.attr}"
        return ""

    def key(self, function) -> str:
        """How calls name a function of the file: `save` for a function, `.save` for a method
        (a class's), which only an attribute call (`self.save()`, `trainer.save()`) reaches."""
        method = isinstance(self.parent.get(function), ast.ClassDef)
        return f".{function.name}" if method else function.name

    def local_name(self, call: ast.Call) -> str | None:
        """The key (Source.key) of a function of the user's own a call may reach: `save(...)`,
        `self.save(...)` (a method: `.save`); None for a library's (`torch.save`)."""
        root = call.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.aliases:
            return None
        name = _call_name(call)
        if not name:
            return None
        return f".{name}" if isinstance(call.func, ast.Attribute) else name

    def calls(self):
        return [node for node in ast.walk(self.tree) if isinstance(node, ast.Call)]

    def enclosing(self, node, kinds):
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, kinds):
                return node
        return None


class Linter:
    """The checks over a set of files (a script and the modules it imports)."""

    def __init__(self, paths: list[str]):
        self.sources = [Source(path) for path in paths]
        self.findings: set[Finding] = set()
        self.rank_names = set(RANK_NAMES)
        self.rank_attributes = set(RANK_ATTRIBUTES)
        self.rank_functions = set(RANK_FUNCTIONS)
        # function name -> positions of the returned tuple that hold a rank
        self.rank_tuple_functions: dict[str, set[int]] = {}
        self.functions: dict[str, list] = {}
        self.classes: dict[str, list] = {}
        for source in self.sources:
            for name, defs in source.functions.items():
                self.functions.setdefault(name, []).extend((source, d) for d in defs)
            for node in ast.walk(source.tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((source, node))
        self._follow_rank_values()
        self._follow_per_rank_values()
        self.collective_functions = self._functions_that(self._is_collective)
        self.training_functions = self._functions_that(self._is_collective_or_backward)

    def key(self, function) -> str:
        source = next(s for s in self.sources if function in s.parent)
        return source.key(function)

    def add(self, source: Source, node, kind: str, message: str):
        self.findings.add(Finding(source.path, node.lineno, kind, message))

    # - values derived from the rank

    def rank_valued(self, node) -> bool:
        """Whether an expression's value depends on the rank (`rank == 0`, `is_main`)."""
        if isinstance(node, ast.Name):
            return node.id in self.rank_names
        if isinstance(node, ast.Attribute):
            return node.attr in self.rank_attributes
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name in self.rank_functions:
                return True
            if name in ("get", "getenv"):
                return any(
                    isinstance(a, ast.Constant) and a.value in RANK_VARIABLES for a in node.args
                )
            if name in ("int", "bool", "str"):
                return any(self.rank_valued(a) for a in node.args)
            return False
        if isinstance(node, ast.Subscript):
            key = node.slice
            return isinstance(key, ast.Constant) and key.value in RANK_VARIABLES
        if isinstance(node, ast.Compare):
            # `rank != -1`, `local_rank == -1`: whether the process is in a DDP run at all,
            # the same on every rank (the launchers set the rank, -1 is a default)
            if any(_is_minus_one(n) for n in [node.left, *node.comparators]):
                return False
            return any(self.rank_valued(n) for n in [node.left, *node.comparators])
        if isinstance(node, ast.BoolOp):
            return any(self.rank_valued(v) for v in node.values)
        if isinstance(node, ast.UnaryOp):
            return self.rank_valued(node.operand)
        if isinstance(node, ast.BinOp):
            return self.rank_valued(node.left) or self.rank_valued(node.right)
        if isinstance(node, ast.IfExp):
            return self.rank_valued(node.body) or self.rank_valued(node.orelse)
        if isinstance(node, ast.NamedExpr):
            return self.rank_valued(node.value)
        return False

    def mentions_rank(self, node) -> bool:
        """Whether the rank takes part anywhere in an expression, or a value made from it (a
        file name per rank, a data set of this rank's samples)."""
        return any(
            self.rank_valued(sub)
            or (isinstance(sub, ast.Name) and sub.id in self.per_rank)
            or (isinstance(sub, ast.Attribute) and sub.attr in self.per_rank)
            for sub in ast.walk(node)
        )

    def _follow_per_rank_values(self):
        """Names assigned from anything the rank takes part in, until nothing changes."""
        self.per_rank: set[str] = set()
        assignments = [
            (target, node.value)
            for source in self.sources
            for node in ast.walk(source.tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
        ]
        changed = True
        while changed:
            changed = False
            for target, value in assignments:
                name = _target_name(target)
                if name and name not in self.per_rank and self.mentions_rank(value):
                    self.per_rank.add(name)
                    changed = True

    def _mark(self, target, value_is_rank: bool) -> bool:
        name = _target_name(target)
        if not value_is_rank or name is None:
            return False
        names = self.rank_names if isinstance(target, ast.Name) else self.rank_attributes
        if name in names:
            return False
        names.add(name)
        return True

    def _follow_rank_values(self):
        """Until nothing changes: names assigned from the rank, functions returning it, and the
        first parameter of a function mp.spawn starts (its rank)."""
        changed = True
        while changed:
            changed = False
            for source in self.sources:
                for node in ast.walk(source.tree):
                    if isinstance(node, ast.Assign):
                        value = node.value
                        for target in node.targets:
                            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                                for t, v in zip(target.elts, value.elts):
                                    changed |= self._mark(t, self.rank_valued(v))
                            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
                                positions = self.rank_tuple_functions.get(_call_name(value), ())
                                for i, t in enumerate(target.elts):
                                    changed |= self._mark(t, i in positions)
                            else:
                                changed |= self._mark(target, self.rank_valued(value))
                    elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value:
                        changed |= self._mark(node.target, self.rank_valued(node.value))
                    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        changed |= self._follow_returns(node)
                    elif isinstance(node, ast.Call) and _call_name(node) == "spawn" and node.args:
                        for _, fn in self.functions.get(_target_name(node.args[0]) or "", []):
                            if fn.args.args:
                                changed |= self._mark(ast.Name(fn.args.args[0].arg), True)

    def _follow_returns(self, function) -> bool:
        changed = False
        for node in ast.walk(function):
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            if isinstance(node.value, ast.Tuple):
                positions = {i for i, v in enumerate(node.value.elts) if self.rank_valued(v)}
                known = self.rank_tuple_functions.setdefault(function.name, set())
                if not positions <= known:
                    known |= positions
                    changed = True
            elif self.rank_valued(node.value) and function.name not in self.rank_functions:
                self.rank_functions.add(function.name)
                changed = True
        return changed

    # - what a call does

    def _is_collective(self, source: Source, call: ast.Call) -> bool:
        full = source.dotted(call.func)
        module, _, name = full.rpartition(".")
        if module.startswith("torch.distributed.checkpoint"):
            return name in CHECKPOINT_COLLECTIVES
        return module.startswith("torch.distributed") and name in COLLECTIVES

    def _is_collective_or_backward(self, source: Source, call: ast.Call) -> bool:
        return _is_backward(call) or self._is_collective(source, call)

    def _functions_that(self, predicate) -> set[str]:
        """Names of the functions that make such a call, directly or through another."""
        found: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, defs in self.functions.items():
                if name in found:
                    continue
                for source, function in defs:
                    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
                    if any(predicate(source, c) or source.local_name(c) in found for c in calls):
                        found.add(name)
                        changed = True
                        break
        return found

    def does(self, source: Source, node, functions: set[str], predicate) -> bool:
        """Whether a piece of code makes such a call, directly or through a function."""
        return any(
            isinstance(n, ast.Call) and (predicate(source, n) or source.local_name(n) in functions)
            for n in ast.walk(node)
        )

    def has_collective(self, source, node) -> bool:
        return self.does(source, node, self.collective_functions, self._is_collective)

    def trains(self, source, node) -> bool:
        return self.does(source, node, self.training_functions, self._is_collective_or_backward)

    # - the checks

    def run(self) -> list[Finding]:
        calls = [(s, c) for s in self.sources for c in s.calls()]
        named = {}
        for source, call in calls:
            named.setdefault(source.dotted(call.func).rpartition(".")[2], []).append((source, call))
        starts_group = "init_process_group" in named
        if not starts_group:
            for source in self.sources:
                backward = next((c for c in source.calls() if _is_backward(c)), None)
                if backward is not None:
                    self.add(
                        source,
                        backward,
                        "no-process-group",
                        "training without a process group (init_process_group): each process "
                        "trains alone",
                    )
        elif "destroy_process_group" not in named:
            source, call = named["init_process_group"][0]
            self.add(
                source,
                call,
                "no-destroy",
                "no dist.destroy_process_group() at the end: the group's threads run into "
                "the interpreter's exit (a warning, or an abort)",
            )
        for source, call in named.get("DataParallel", []):
            if "DistributedDataParallel" in named and source.enclosing(call, (ast.If, ast.IfExp)):
                continue  # a branch beside the DDP wrap: the script's mode without DDP
            self.add(
                source,
                call,
                "data-parallel",
                "nn.DataParallel: one process driving every GPU; under DDP each process "
                "drives one GPU, so drop it",
            )
        self.writes, self.function_calls = [], []
        self.wrapped = {
            _target_name(t)
            for source, call in named.get("DistributedDataParallel", [])
            if isinstance(source.parent.get(call), ast.Assign)
            for t in source.parent[call].targets
        }
        self.ddp_models = self._ddp_models()
        # FSDP2 shards a model in place: fully_shard(model), or sharded = fully_shard(model)
        shards = named.get("fully_shard", [])
        self.sharded_models = {
            _target_name(call.args[0])
            for source, call in shards
            if call.args and isinstance(call.args[0], ast.Name)
        } | {
            _target_name(target)
            for source, call in shards
            if isinstance(source.parent.get(call), ast.Assign)
            for target in source.parent[call].targets
        }
        self.guarded_barriers: dict[tuple, list] = {}
        for source in self.sources:
            _Walk(self, source).statements(source.tree.body, _Context())
        for (source, _), barriers in self.guarded_barriers.items():
            if len({id(guard) for _, guard in barriers}) > 1:
                continue  # barriers under two branches on the rank: paired, silent
            for call, guard in barriers:
                self.add(
                    source,
                    call,
                    "collective-in-rank-branch",
                    f"{source.dotted(call.func)}() inside a branch on the rank (line "
                    f"{guard.lineno}): the other ranks never call it, and wait",
                )
        self._check_writes()
        self._check_loaders(named)
        self._check_seed(named)
        self._check_devices(named, starts_group)
        return sorted(self.findings, key=lambda f: (f.path, f.line, f.kind))

    def _ddp_models(self) -> set[str]:
        """Names that hold a DDP model: the wrap's target, and copies of it (copy.deepcopy)."""
        names = set(self.wrapped)

        def holds_ddp(node) -> bool:
            if isinstance(node, ast.Name):
                return node.id in names
            if isinstance(node, ast.IfExp):
                return holds_ddp(node.body) or holds_ddp(node.orelse)
            if isinstance(node, ast.Call) and _call_name(node) == "deepcopy":
                return any(holds_ddp(a) for a in node.args)
            return False

        changed = True
        while changed:
            changed = False
            for source in self.sources:
                for node in ast.walk(source.tree):
                    if isinstance(node, ast.Assign) and holds_ddp(node.value):
                        for target in node.targets:
                            if isinstance(target, ast.Name) and target.id not in names:
                                names.add(target.id)
                                changed = True
        return names

    def _check_writes(self):
        """Writes every rank reaches: not under a branch on the rank, and not in a function
        only ever called under one."""
        guarded_only = set()
        changed = True
        while changed:
            changed = False
            for name in self.functions:
                sites = [(g, f) for called, g, f in self.function_calls if called == name]
                if name not in guarded_only and sites:
                    if all(g or (f is not None and self.key(f) in guarded_only) for g, f in sites):
                        guarded_only.add(name)
                        changed = True
        called = {name for name, _, _ in self.function_calls}
        # files that train or start a process group (not a tool that prepares data beside them)
        training_files = {
            source.path
            for source in self.sources
            for call in source.calls()
            if _is_backward(call) or _call_name(call) == "init_process_group"
        }
        for source, call, context, function in self.writes:
            if source.path not in training_files:
                continue
            if context.write_guard or (function is not None and self.key(function) in guarded_only):
                continue
            if function is not None and self.key(function) not in called:
                continue  # called from files not read here: cannot tell
            self.add(
                source,
                call,
                "every-rank-writes",
                f"{source.dotted(call.func) or _call_name(call)}() on every rank: all ranks "
                "write the same file at once; do it on rank 0 (if rank == 0:)",
            )

    def _loader_names(self, named) -> dict[str, tuple[Source, ast.Call]]:
        loaders = {}
        for source, call in named.get("DataLoader", []):
            parent = source.parent.get(call)
            if isinstance(parent, ast.Assign):
                for target in parent.targets:
                    if _target_name(target):
                        loaders[_target_name(target)] = (source, call)
        return loaders

    def _bound_names(self, loops) -> set[str]:
        """The names a set of loops iterate over, followed back through function parameters to
        what each caller passes."""
        names = set()
        pending = list(loops)
        while pending:
            source, node, expression = pending.pop()
            for name in _names_in(expression) - names:
                names.add(name)
                function = source.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                if function is None:
                    continue
                parameters = [a.arg for a in function.args.args]
                if name not in parameters:
                    continue
                position = parameters.index(name)
                if parameters and parameters[0] in ("self", "cls"):
                    position -= 1
                for caller_source in self.sources:
                    for call in caller_source.calls():
                        if _call_name(call) != function.name:
                            continue
                        passed = _keyword(call, name)
                        if passed is None and 0 <= position < len(call.args):
                            passed = call.args[position]
                        if passed is not None:
                            pending.append((caller_source, call, passed))
        return names

    def _check_loaders(self, named):
        loaders = self._loader_names(named)
        training_loops = [
            (s, loop, loop.iter)
            for s in self.sources
            for loop in ast.walk(s.tree)
            if isinstance(loop, (ast.For, ast.AsyncFor)) and self.trains(s, loop)
        ]
        trained = self._bound_names(training_loops)
        workers = False
        for name, (source, call) in loaders.items():
            sampler = _keyword(call, "sampler") or _keyword(call, "batch_sampler")
            if sampler is not None and _is_constant(_keyword(call, "shuffle"), True):
                self.add(
                    source,
                    call,
                    "shuffle-and-sampler",
                    "shuffle=True beside a sampler: DataLoader raises 'sampler option is "
                    "mutually exclusive with shuffle'; the sampler shuffles (drop shuffle)",
                )
            num_workers = _keyword(call, "num_workers")
            workers |= num_workers is not None and not _is_constant(num_workers, 0)
            if name not in trained or self._sharded_by_hand(source, call):
                continue
            if sampler is None:
                self.add(
                    source,
                    call,
                    "no-sampler",
                    f"the training loader {name} has no DistributedSampler: every rank "
                    "trains on the whole data set",
                )
            elif self._sampler_class(source, sampler) in UNSHARDED_SAMPLERS:
                self.add(
                    source,
                    call,
                    "unsharded-sampler",
                    f"the training loader {name}'s {self._sampler_class(source, sampler)} "
                    "hands every rank the whole data set; shard it (DistributedSampler)",
                )
        for source, call in named.get("DistributedSampler", []):
            if (
                not _is_constant(_keyword(call, "shuffle"), False)
                and "set_epoch" not in named
                and self._read_every_epoch(source, call, loaders)
            ):
                self.add(
                    source,
                    call,
                    "no-set-epoch",
                    "a shuffling DistributedSampler and no sampler.set_epoch(epoch): every "
                    "epoch repeats the first epoch's order",
                )
        self._check_sharded_means(loaders, named)
        if workers:
            self._check_worker_functions()

    def _sharded_by_hand(self, source, loader) -> bool:
        """A loader over this rank's own part (a Subset by rank), or over an IterableDataset
        (which shards itself; DataLoader takes no sampler for it)."""
        dataset = loader.args[0] if loader.args else _keyword(loader, "dataset")
        if dataset is None or self.mentions_rank(dataset):
            return dataset is not None
        if isinstance(dataset, ast.Name):
            for node in ast.walk(source.tree):
                if isinstance(node, ast.Assign) and any(
                    _target_name(t) == dataset.id for t in node.targets
                ):
                    made = node.value
                    if isinstance(made, ast.Call):
                        for _, cls in self.classes.get(_call_name(made), []):
                            if any("IterableDataset" in _names_in(b) for b in cls.bases):
                                return True
        return False

    def _read_every_epoch(self, source, sampler, loaders) -> bool:
        """Whether a loop over the sampler's loader sits inside another loop (the epochs),
        directly or through the function it is in."""
        assigned = source.parent.get(sampler)
        sampler_names = {_target_name(t) for t in getattr(assigned, "targets", [])}
        loader_names = {
            name
            for name, (_, call) in loaders.items()
            if (_keyword(call, "sampler") is sampler)
            or (_names_in(_keyword(call, "sampler") or ast.Constant(None)) & sampler_names)
        }
        for loop_source in self.sources:
            for loop in ast.walk(loop_source.tree):
                if not isinstance(loop, (ast.For, ast.AsyncFor)):
                    continue
                over_loader = _keyword_in(loop.iter, sampler) or (
                    self._bound_names([(loop_source, loop, loop.iter)]) & loader_names
                )
                if not over_loader:
                    continue
                if loop_source.enclosing(loop, (ast.For, ast.AsyncFor, ast.While)):
                    return True
                function = loop_source.enclosing(loop, (ast.FunctionDef, ast.AsyncFunctionDef))
                if function is not None and any(
                    _call_name(c) == function.name
                    and s.enclosing(c, (ast.For, ast.AsyncFor, ast.While))
                    for s in self.sources
                    for c in s.calls()
                ):
                    return True
        return False

    def _sampler_class(self, source, sampler) -> str:
        if isinstance(sampler, ast.Name):
            name = sampler.id
            for node in ast.walk(source.tree):
                if isinstance(node, ast.Assign) and any(
                    _target_name(t) == name for t in node.targets
                ):
                    sampler = node.value
        return _call_name(sampler) if isinstance(sampler, ast.Call) else ""

    def _check_sharded_means(self, loaders, named):
        """`/ len(loader.dataset)` where each rank reads only its shard of that data set."""
        sharded = {
            name
            for name, (source, call) in loaders.items()
            if _keyword(call, "sampler") is not None
            and self._sampler_class(source, _keyword(call, "sampler")) not in UNSHARDED_SAMPLERS
        }
        for source in self.sources:
            for node in ast.walk(source.tree):
                divisor = None
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                    divisor = node.right
                elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
                    divisor = node.value
                if not (
                    isinstance(divisor, ast.Call)
                    and _call_name(divisor) == "len"
                    and divisor.args
                    and isinstance(divisor.args[0], ast.Attribute)
                    and divisor.args[0].attr == "dataset"
                ):
                    continue
                reads = self._bound_names([(source, node, divisor.args[0].value)])
                if reads & sharded:
                    self.add(
                        source,
                        node,
                        "mean-over-whole-dataset",
                        "this rank's sum over its shard divided by the whole data set's "
                        "size: all-reduce the sum and the count, then divide",
                    )

    def _check_worker_functions(self):
        """Lambdas and nested functions a loader worker must unpickle."""
        for source in self.sources:
            nested = {
                inner.name
                for outer in ast.walk(source.tree)
                if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef))
                for inner in ast.walk(outer)
                if inner is not outer and isinstance(inner, ast.FunctionDef)
            }
            for call in source.calls():
                candidates = [kw.value for kw in call.keywords if kw.arg in WORKER_ARGUMENTS]
                if _call_name(call) == "Lambda":
                    candidates += call.args
                for value in candidates:
                    if isinstance(value, ast.Lambda) or (
                        isinstance(value, ast.Name) and value.id in nested
                    ):
                        self.add(
                            source,
                            value,
                            "worker-pickles-local-function",
                            "a lambda or local function in a loader worker's data: workers "
                            "started by forkserver or spawn cannot pickle it ('Can't pickle "
                            "local object'); use a module-level function",
                        )

    def _check_seed(self, named):
        """The wrapped model built before torch.manual_seed in the same function."""
        seeds = named.get("manual_seed", []) + named.get("seed_everything", [])
        for source, wrap in named.get("DistributedDataParallel", []):
            if not wrap.args or not isinstance(wrap.args[0], ast.Name):
                continue
            function = source.enclosing(wrap, (ast.FunctionDef, ast.AsyncFunctionDef))
            scope = function or source.tree
            model = wrap.args[0].id
            built = None
            for node in ast.walk(scope):
                if (
                    isinstance(node, ast.Assign)
                    and node.lineno < wrap.lineno
                    and any(_target_name(t) == model for t in node.targets)
                    and model not in _names_in(node.value)
                ):
                    built = node if built is None or node.lineno > built.lineno else built
            if built is None:
                continue
            here = [
                c for s, c in seeds if s is source and source.enclosing(c, type(scope)) is function
            ]
            if not seeds:
                self.add(
                    source,
                    built,
                    "unseeded-model",
                    "no torch.manual_seed: the initial weights differ from run to run (DDP "
                    "copies rank 0's at the wrap)",
                )
            elif here and all(c.lineno > built.lineno for c in here):
                self.add(
                    source,
                    built,
                    "model-before-seed",
                    "the model is built before torch.manual_seed: its initial weights "
                    "differ from run to run (DDP copies rank 0's at the wrap)",
                )

    def _check_devices(self, named, starts_group):
        """`.cuda()` or "cuda" without an index, and no torch.cuda.set_device."""
        if not starts_group or "set_device" in named:
            return
        for source, call in [c for calls in named.values() for c in calls]:
            bare = (_call_name(call) == "cuda" and not call.args and not call.keywords) or (
                _call_name(call) in ("to", "device")
                and len(call.args) == 1
                and isinstance(call.args[0], ast.Constant)
                and call.args[0].value == "cuda"
            )
            if bare:
                self.add(
                    source,
                    call,
                    "every-rank-on-gpu-0",
                    "'cuda' without an index and no torch.cuda.set_device(local_rank): every "
                    "rank of a node uses GPU 0",
                )


@dataclass(frozen=True)
class _Context:
    loops: tuple = ()  # the enclosing loops of this function, innermost last
    guard: ast.If | None = None  # the innermost branch on the rank
    guard_loops: int = 0  # how many loops enclosed that branch
    write_guard: bool = False  # inside a branch on the rank, or after `if rank != 0: return`
    rests: tuple = ()  # the statements after each enclosing one, outermost first
    loop_rests: tuple = ()  # len(rests) where each loop began


class _Walk:
    """One pass over a file's statements with the context a check needs: the enclosing loops and
    branch on the rank, and the statements a jump would skip."""

    def __init__(self, linter: Linter, source: Source):
        self.linter, self.source = linter, source

    def statements(self, body, context: _Context, function=None):
        for index, statement in enumerate(body):
            rest = body[index + 1 :]
            self.statement(statement, replace(context, rests=(*context.rests, rest)), function)
            if (
                isinstance(statement, ast.If)
                and self.linter.rank_valued(statement.test)
                and not statement.orelse
                and isinstance(statement.body[-1], (ast.Return, ast.Continue))
            ):
                # `if rank != 0: return`: what follows runs on the other ranks only
                context = replace(context, write_guard=True)

    def statement(self, node, context: _Context, function):
        linter = self.linter
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.statements(node.body, _Context(), node)
            return
        if isinstance(node, ast.ClassDef):
            self.statements(node.body, _Context(), function)
            return
        if isinstance(node, (ast.If, ast.While)):
            headers = [node.test]
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            headers = [node.iter]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            headers = [item.context_expr for item in node.items]
        elif isinstance(node, ast.Match):
            headers = [node.subject]
        elif isinstance(node, ast.Try):
            headers = []
        else:
            headers = [node]
        for sub in _walk_all(headers):
            if isinstance(sub, ast.Call):
                self.call(sub, context, function)
        if isinstance(node, ast.If) and linter.rank_valued(node.test):
            branch = replace(context, guard=node, guard_loops=len(context.loops), write_guard=True)
            self.statements(node.body, branch, function)
            self.statements(node.orelse, branch, function)
            return
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            looped = replace(
                context,
                loops=(*context.loops, node),
                loop_rests=(*context.loop_rests, len(context.rests)),
            )
            self.statements(node.body, looped, function)
            self.statements(node.orelse, context, function)
            return
        for field in ("body", "orelse", "finalbody"):
            if isinstance(getattr(node, field, None), list):
                self.statements(getattr(node, field), context, function)
        for handler in getattr(node, "handlers", []):
            self.statements(handler.body, context, function)
        for case in getattr(node, "cases", []):
            self.statements(case.body, context, function)
        if isinstance(node, (ast.Break, ast.Continue, ast.Return)):
            self.jump(node, context)

    def call(self, call: ast.Call, context: _Context, function):
        linter, source = self.linter, self.source
        name = _call_name(call)
        linter.function_calls.append((source.local_name(call), context.write_guard, function))
        # a collective on a subgroup is made by the ranks of that group only
        on_subgroup = any("group" in _names_in(a) for a in call.args) or any(
            k.arg == "group" for k in call.keywords
        )
        if context.guard is not None and not on_subgroup:
            if isinstance(call.func, ast.Name) and call.func.id in linter.ddp_models:
                linter.add(
                    source,
                    call,
                    "ddp-forward-in-rank-branch",
                    f"a forward of the DDP model {call.func.id} inside a branch on the rank (line "
                    f"{context.guard.lineno}): DDP's forward can broadcast rank 0's buffers, a "
                    "collective the other ranks never make; call its .module",
                )
            elif isinstance(call.func, ast.Name) and call.func.id in linter.sharded_models:
                linter.add(
                    source,
                    call,
                    "ddp-forward-in-rank-branch",
                    f"a forward of the sharded (FSDP2) model {call.func.id} inside a branch on the "
                    f"rank (line {context.guard.lineno}): each forward all-gathers the parameters, "
                    "a collective the other ranks never make; run it on every rank",
                )
            elif linter._is_collective(source, call) and name == "barrier":
                # torch_distributed_zero_first: some ranks wait before the work, the others after
                # it, each rank once; decided once the whole function is read (run)
                linter.guarded_barriers.setdefault((source, function), []).append(
                    (call, context.guard)
                )
            elif linter._is_collective(source, call):
                linter.add(
                    source,
                    call,
                    "collective-in-rank-branch",
                    f"{source.dotted(call.func)}() inside a branch on the rank (line "
                    f"{context.guard.lineno}): the other ranks never call it, and wait",
                )
            elif source.local_name(call) in linter.collective_functions:
                linter.add(
                    source,
                    call,
                    "collective-in-rank-branch",
                    f"{name}() makes a collective call, inside a branch on the rank (line "
                    f"{context.guard.lineno}): the other ranks never make it, and wait",
                )
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        if (
            name == "module"
            and _target_name(receiver) in linter.wrapped
            and any(linter.trains(source, loop) for loop in context.loops)
        ):
            linter.add(
                source,
                call,
                "forward-skips-ddp",
                "a training forward through .module skips DDP: no gradient all-reduce, and the "
                "replicas drift apart; call the DDP model itself",
            )
        if self._writes(call) and not any(
            linter.mentions_rank(a) for a in [*call.args, *([receiver] if receiver else [])]
        ):
            linter.writes.append((source, call, context, function))

    def _writes(self, call: ast.Call) -> bool:
        full = self.source.dotted(call.func)
        name = _call_name(call)
        if full in ("torch.save", "numpy.save", "numpy.savez", "numpy.savetxt"):
            return True
        if name in WRITE_METHODS or name == "SummaryWriter":
            return True
        if name == "open":
            mode = call.args[1] if len(call.args) > 1 else _keyword(call, "mode")
            if isinstance(call.func, ast.Attribute) and call.args:
                mode = call.args[0]  # Path.open(mode)
            return isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+")
        return False

    def jump(self, node, context: _Context):
        """break, continue or return inside a branch on the rank, that skips collectives."""
        if context.guard is None:
            return
        linter, source = self.linter, self.source
        word = type(node).__name__.lower()
        # break and continue leave the innermost loop: the branch must sit inside it (a loop
        # inside the branch runs on those ranks only, and may end as it likes)
        branch_in_loop = bool(context.loops) and context.guard_loops == len(context.loops)
        if isinstance(node, ast.Break):
            skips_collectives = branch_in_loop and linter.trains(source, context.loops[-1])
        elif isinstance(node, ast.Continue):
            rests = context.rests[context.loop_rests[-1] :] if context.loops else ()
            skips_collectives = branch_in_loop and any(
                linter.trains(source, s) for rest in rests for s in rest
            )
        else:
            loops_around_branch = context.loops[: context.guard_loops]
            skips_collectives = any(
                linter.trains(source, loop) for loop in loops_around_branch
            ) or any(linter.has_collective(source, s) for rest in context.rests for s in rest)
        if skips_collectives:
            linter.add(
                source,
                node,
                "rank-control-flow",
                f"{word} inside a branch on the rank (line {context.guard.lineno}): only "
                "those ranks leave, the others wait in their next collective (a hang)",
            )


def _walk_all(nodes):
    for node in nodes:
        yield from ast.walk(node)


def lint(paths: list[str]) -> int:
    findings = Linter(paths).run()
    for finding in findings:
        print(finding)
    if findings:
        print(f"lint: {len(findings)} problem{'s' if len(findings) > 1 else ''} found")
        return 1
    print(f"lint: the port looks right ({len(paths)} file{'s' if len(paths) > 1 else ''} read)")
    return 0


# --- run: the recorder, loaded in every rank before the script --------------------------------


def _user_site(frame) -> str:
    """file:line of the innermost frame of the user's code (not a library's, not this file's)."""
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Recorder:
    """Notes, in RECORD_DIR/rank<R>.jsonl: each collective call and backward() with the line of
    the user's code that made it; each optimizer step with the loss, a hash of the parameters
    and the sample indices of its batches; each pass of a data loader. Exits the rank after the
    given number of steps. faulthandler writes every thread's stack on SIGUSR2 and SIGTERM."""

    def __init__(self, record_dir: Path, rank: int, max_steps: int):
        self.rank, self.max_steps, self.steps = rank, max_steps, 0
        self.events = open(record_dir / f"rank{rank}.jsonl", "w", buffering=1)  # noqa: SIM115
        self.stacks = open(record_dir / f"stacks{rank}.txt", "w")  # noqa: SIM115
        (record_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
        self.loss = None
        self.batches: list = []  # consumed since the last backward(): (loader, pass, indices)
        self.step_batches: list = []  # taken by backward() since the last step
        self.depth = 0  # collective calls inside collective calls are not noted

    def note(self, **event):
        self.events.write(json.dumps(event) + "\n")

    def install(self):
        import faulthandler

        import torch
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import BatchSampler, DataLoader

        faulthandler.enable(file=self.stacks, all_threads=True)
        faulthandler.register(signal.SIGUSR2, file=self.stacks, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=self.stacks, all_threads=True, chain=True)
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap_collective(name, getattr(dist, name)))
        backward = torch.autograd.backward

        def recorded_backward(tensors, *args, **kwargs):
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                self.loss = float(tensors.detach())
            self.note(e="backward", site=_user_site(sys._getframe(1)))
            if self.batches:
                loader = self.batches[-1][0]
                self.step_batches += [b for b in self.batches if b[0] == loader]
                self.batches = []
            return backward(tensors, *args, **kwargs)

        torch.autograd.backward = recorded_backward
        register_optimizer_step_post_hook(self._after_step)
        self._record_loaders(DataLoader, BatchSampler)
        self._record_model(torch)

    def _wrap_collective(self, name, function):
        def recorded(*args, **kwargs):
            if self.depth == 0:
                self.note(e=name, site=_user_site(sys._getframe(1)))
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1

        return recorded

    def _record_loaders(self, DataLoader, BatchSampler):  # noqa: N803
        from torch.utils.data import DistributedSampler

        recorder, drawn = self, {}  # id(batch sampler) -> batches drawn and not yet consumed
        passes = {}  # id(loader) -> number of passes begun
        sampler_iter = BatchSampler.__iter__

        def recorded_sampler_iter(batch_sampler):
            queue = drawn[id(batch_sampler)] = []
            for batch in sampler_iter(batch_sampler):
                queue.append([int(i) for i in batch])
                yield batch

        class RecordedIterator:
            def __init__(self, loader, iterator):
                self.loader, self.iterator = loader, iterator
                passes[id(loader)] = number = passes.get(id(loader), 0) + 1
                self.key = (id(loader), number)
                sampler = loader.sampler
                order = None
                if isinstance(sampler, DistributedSampler):
                    order = [int(i) for i in sampler]  # no side effect: seeded by its epoch
                try:
                    size = len(loader.dataset)
                except TypeError:
                    size = None
                recorder.note(
                    e="pass",
                    loader=id(loader),
                    n=number,
                    sampler=type(sampler).__name__,
                    epoch=getattr(sampler, "epoch", None),
                    order=order,
                    dataset_size=size,
                    transform=repr(getattr(loader.dataset, "transform", "")),
                )

            def __iter__(self):
                return self

            def __len__(self):
                return len(self.iterator)

            def __next__(self):
                try:
                    batch = next(self.iterator)
                except StopIteration:
                    recorder.note(e="pass_end", loader=self.key[0], n=self.key[1])
                    raise
                queue = drawn.get(id(self.loader.batch_sampler))
                if queue:
                    recorder.batches.append((*self.key, queue.pop(0)))
                return batch

            def __getattr__(self, name):
                return getattr(self.iterator, name)

        loader_iter = DataLoader.__iter__

        def recorded_loader_iter(loader):
            return RecordedIterator(loader, loader_iter(loader))

        BatchSampler.__iter__ = recorded_sampler_iter
        DataLoader.__iter__ = recorded_loader_iter

    def _record_model(self, torch):
        import functools

        import torch.distributed.fsdp as fsdp
        from torch.nn.parallel import DistributedDataParallel

        wrap = DistributedDataParallel.__init__
        # FSDP2's public fully_shard: torch 2.6 and newer (the doctor runs on older ones too)
        shard = getattr(fsdp, "fully_shard", None)
        recorder = self

        def note_layers(module):
            # layers that make a correct port's numbers differ from one process's
            layers = {
                type(m).__name__
                for m in module.modules()
                if getattr(m, "p", 1) > 0 and (m.training or "Dropout" not in type(m).__name__)
            }
            recorder.note(e="model", layers=sorted(layers))

        def recorded_wrap(ddp, module, *args, **kwargs):
            note_layers(module)
            return wrap(ddp, module, *args, **kwargs)

        DistributedDataParallel.__init__ = recorded_wrap
        if shard is not None:

            @functools.wraps(shard)  # keeps fully_shard.state
            def recorded_shard(module, *args, **kwargs):  # FSDP2, each block and the root
                note_layers(module)
                return shard(module, *args, **kwargs)

            setattr(fsdp, "fully_shard", recorded_shard)

    def _after_step(self, optimizer, args, kwargs):
        import hashlib

        import torch

        self.steps += 1
        digest = hashlib.blake2b(digest_size=16)
        sums = []
        sharded = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p = p.detach()
                    if hasattr(p, "to_local"):  # a DTensor (FSDP2): this rank's shard
                        p, sharded = p.to_local(), True
                    flat = p.cpu().contiguous().view(-1)
                    digest.update(flat.view(torch.uint8).numpy().tobytes())
                    sums.append(float(flat.double().sum()))
        self.note(
            e="step",
            n=self.steps,
            loss=self.loss,
            hash=digest.hexdigest(),
            sums=sums,
            sharded=sharded,
            optimizer=type(optimizer).__name__,
            batches=[[b[1], b[2]] for b in self.step_batches],
            loader=self.step_batches[-1][0] if self.step_batches else None,
            passes=sorted({b[1] for b in self.step_batches}),
        )
        self.step_batches = []
        if self.steps >= self.max_steps:
            self.note(e="stopped", n=self.steps)
            sys.stdout.flush()
            sys.stderr.flush()
            # Stop here, on every rank after the same step: the script's own code after this
            # (the next batch, a collective in a finally, an atexit) would wait for ranks that
            # have stopped.
            os._exit(0)  # lint: allow[os-exit] the user's script must not go on


def rank_main(script: str, script_args: list[str]) -> None:
    """One rank under torchrun: the recorder first, then the user's script as __main__."""
    import runpy
    import traceback

    record_dir = Path(os.environ["DDP_DOCTOR_RECORD_DIR"])
    recorder = Recorder(record_dir, int(os.environ["RANK"]), int(os.environ["DDP_DOCTOR_STEPS"]))
    recorder.install()
    sys.argv = [script, *script_args]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        recorder.note(e="exit", code=exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        sites = [f"{f.filename}:{f.lineno}" for f in frames if f.filename != __file__]
        recorder.note(
            e="error",
            type=type(exc).__name__,
            message=str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "",
            site=next(
                (s for s in reversed(sites) if f"{os.sep}torch{os.sep}" not in s),
                sites[-1] if sites else "?",
            ),
        )
        raise
    recorder.note(e="exit", code=0)


# --- run: starting the script, reading the records --------------------------------------------

LOSS_TOLERANCE = 1e-3  # relative; float rounding alone stays far below
WEIGHT_TOLERANCE = 1e-5


@dataclass
class Run:
    """One torchrun start of the script: each rank's events and stack dumps."""

    returncode: int | None  # None: stopped at the deadline
    ranks: list[list[dict]]
    stacks: list[str]

    def of(self, rank: int, kind: str) -> list[dict]:
        return [e for e in self.ranks[rank] if e["e"] == kind]

    def trail(self, rank: int) -> list[dict]:
        """The collective calls, in order (backward() is DDP's gradient all-reduce)."""
        return [e for e in self.ranks[rank] if e["e"] in COLLECTIVES or e["e"] == "backward"]


def _start(script, args, nproc, steps, record_dir: Path, deadline_s: float) -> Run:
    record_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        # each rank's output also in a file of its own: logs/<run>/attempt_0/<rank>/stderr.log
        f"--log-dir={record_dir / 'logs'}",
        "--redirects=3",
        "--tee=3",
        os.path.abspath(__file__),
        "_rank",
        script,
        *args,
    ]
    env = dict(os.environ, DDP_DOCTOR_RECORD_DIR=str(record_dir), DDP_DOCTOR_STEPS=str(steps))
    with open(record_dir / "output.log", "w") as log:
        launcher = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            returncode = launcher.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            returncode = None
            _signal_ranks(record_dir, signal.SIGUSR2)  # every thread's stack, then stop them
            time.sleep(2)
        finally:
            # torchrun starts each rank in a session of its own: stop those and their workers
            _signal_ranks(record_dir, signal.SIGKILL, group=True)
            _kill_group(launcher.pid)
            launcher.wait()
    ranks, stacks = [], []
    for rank in range(nproc):
        events_file = record_dir / f"rank{rank}.jsonl"
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        ranks.append([json.loads(line) for line in lines if line.endswith("}")])
        stack_file = record_dir / f"stacks{rank}.txt"
        stacks.append(stack_file.read_text() if stack_file.exists() else "")
    return Run(returncode, ranks, stacks)


def _signal_ranks(record_dir: Path, signum, group=False):
    for pid_file in record_dir.glob("rank*.pid"):
        pid = int(pid_file.read_text())
        try:
            os.killpg(pid, signum) if group else os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _where(stack: str) -> str | None:
    """From a faulthandler dump: the innermost line of the user's code in the thread running
    the script, and the library function it waits in."""
    for block in stack.split("\n\n"):
        frames = []
        for line in block.splitlines():
            line = line.strip()
            if line.startswith('File "'):
                filename, _, rest = line[6:].partition('", line ')
                number, _, function = rest.partition(" in ")
                frames.append((filename, number, function))
        for index, (filename, number, _) in enumerate(frames):
            if _is_user_file(filename):
                # the library function the script called: the next frame in, not this file's
                inside = next(
                    (
                        f[2]
                        for f in reversed(frames[:index])
                        if not _is_doctor(f[0]) and f[2] != "wrapper"  # torch's decorators
                    ),
                    None,
                )
                waits = f" (waiting in {inside})" if inside else ""
                return f"{_short(filename)}:{number}{waits}"
    return None


def _is_doctor(filename: str) -> bool:
    return os.path.abspath(filename) == os.path.abspath(__file__)


@functools.cache
def _is_user_file(filename: str) -> bool:
    """Not the standard library's, an installed package's (torch), this file's, or generated."""
    path = os.path.abspath(filename)
    return not (
        filename.startswith("<")
        or _is_doctor(filename)
        or path.startswith(os.path.abspath(sysconfig.get_paths()["stdlib"]))
        or "site-packages" in path
        or "dist-packages" in path
    )


def _short(site: str) -> str:
    """A path relative to the current folder where it is inside it."""
    try:
        return os.path.relpath(site) if not os.path.relpath(site).startswith("..") else site
    except ValueError:
        return site


def _describe(event: dict | None) -> str:
    if event is None:
        return "none"
    what = "backward() (DDP's gradient all-reduce)" if event["e"] == "backward" else event["e"]
    return f"{what} at {_short(event['site'])}"


def _divergence(run: Run, script: str) -> list[str]:
    """Where the ranks' sequences of collectives part, where each rank is now, and the lines
    of the script that let one rank take another path."""
    lines = []
    trails = [run.trail(rank) for rank in range(len(run.ranks))]
    for index in range(max(len(t) for t in trails)):
        events = [t[index] if index < len(t) else None for t in trails]
        if len({(e["e"], e["site"]) if e else None for e in events}) == 1:
            continue
        done = min(len(run.of(rank, "step")) for rank in range(len(run.ranks)))
        parts = []
        for rank, event in enumerate(events):
            if event is not None:
                parts.append(f"rank {rank} called {_describe(event)}")
            elif run.of(rank, "exit") and not run.of(rank, "error"):
                parts.append(f"rank {rank} called none: it ran to its end")
            else:
                parts.append(f"rank {rank} called none")
        lines.append(
            f"problem: the ranks stopped agreeing on collectives after step {done}, at their "
            f"collective call #{index + 1}: " + "; ".join(parts)
        )
        break
    for rank, stack in enumerate(run.stacks):
        place = _where(stack)
        if place:
            lines.append(f"  rank {rank} is at {place}")
    for rank in range(len(run.ranks)):
        for error in run.of(rank, "error"):
            failure = (
                f"rank {rank} failed at {_short(error['site'])}: {error['type']}: "
                f"{error['message'][:200]}"
            )
            lines.append(f"  then {failure}" if lines else f"problem: {failure}")
    if lines:
        # what the code says about it: the branches on the rank that skip collectives
        lines += [
            str(f)
            for f in Linter([script]).run()
            if f.kind
            in ("rank-control-flow", "collective-in-rank-branch", "ddp-forward-in-rank-branch")
        ]
    return lines


def _samples(run: Run, nproc: int) -> tuple[list[str], list[str]]:
    """Whether the ranks' training batches are disjoint, cover the data set, and change order
    from one epoch to the next."""
    problems, notes = [], []
    per_rank = []  # rank -> pass number -> indices drawn, in order
    for rank in range(nproc):
        steps = run.of(rank, "step")
        loader = next((s["loader"] for s in steps if s["loader"] is not None), None)
        drawn: dict[int, list[int]] = {}
        for step in steps:
            for number, batch in step["batches"]:
                drawn.setdefault(number, []).extend(batch)
        passes = {p["n"]: p for p in run.of(rank, "pass") if p["loader"] == loader}
        per_rank.append((drawn, passes))
    if not per_rank[0][0]:
        notes.append("note: no batch of a torch DataLoader was seen: samples not checked")
        return problems, notes
    common = sorted(set.intersection(*(set(drawn) for drawn, _ in per_rank)))
    for number in common:
        seen = [set(drawn[number]) for drawn, _ in per_rank]
        shared = set.union(*[a & b for i, a in enumerate(seen) for b in seen[i + 1 :]] or [set()])
        if len(shared) > nproc - 1:  # a DistributedSampler repeats fewer than nproc to pad
            problems.append(
                f"problem: in epoch {number} {len(shared)} samples went to more than one rank: "
                "every rank reads the whole data set (a DistributedSampler shards it)"
            )
            return problems, notes
        orders = [passes.get(number, {}).get("order") for _, passes in per_rank]
        size = per_rank[0][1].get(number, {}).get("dataset_size")
        if all(orders) and size is not None:
            missing = size - len(set().union(*orders))
            if missing:
                problems.append(
                    f"problem: in epoch {number} the ranks' shards leave out {missing} of the "
                    f"{size} samples"
                )
    notes.append(
        f"ok: the ranks drew disjoint samples ({nproc} ranks, "
        f"{sum(len(set(d[common[0]])) for d, _ in per_rank)} samples in epoch {common[0]})"
    )
    drawn, passes = per_rank[0]
    if 1 in passes and 2 in passes and passes[1]["order"] is not None:
        same = passes[1]["order"] == passes[2]["order"]
    elif 1 in drawn and 2 in drawn:
        first, second = drawn[1], drawn[2]
        same = first[: len(second)] == second[: len(first)]
    else:
        notes.append(
            "note: the reshuffle was not checked: the run ended in the first epoch (raise "
            "--steps past one epoch's steps)"
        )
        return problems, notes
    if same:
        problems.append(
            "problem: epoch 2 draws the same order as epoch 1: call "
            "sampler.set_epoch(epoch) at the start of every epoch"
        )
    else:
        notes.append("ok: each epoch draws a new order")
    return problems, notes


def _compare(ddp: Run, single: Run, nproc: int) -> tuple[list[str], list[str]]:
    """The replicas against each other, the ranks' mean loss against one process's."""
    problems, notes = [], []
    steps = [ddp.of(rank, "step") for rank in range(nproc)]
    count = min(len(s) for s in steps)
    sharded = count > 0 and steps[0][0].get("sharded", False)
    if sharded:
        notes.append("ok: a sharded model (FSDP2): each rank holds its own shard, no replicas")
    else:
        for index in range(count):
            if len({s[index]["hash"] for s in steps}) > 1:
                problems.append(
                    f"problem: the replicas differ after step {index + 1}: the gradients were not "
                    "averaged alike (a forward through model.module, or a model DDP does not wrap)"
                )
                break
        else:
            notes.append(f"ok: the replicas are identical after each of {count} steps")
    sample_problems, sample_notes = _samples(ddp, nproc)
    problems += sample_problems
    notes += sample_notes
    if single is None:
        notes.append("note: no run as one process (--batch-flag none): losses not compared")
        return problems, notes
    alone = single.of(0, "step")
    count = min(count, len(alone))
    losses = [
        (index, [s[index]["loss"] for s in steps], alone[index]["loss"])
        for index in range(count)
        if alone[index]["loss"] is not None and None not in [s[index]["loss"] for s in steps]
    ]
    if not losses:
        notes.append("note: no loss passed to backward() was seen: losses not compared")
        return problems, notes
    worst = max(
        losses, key=lambda item: abs(sum(item[1]) / nproc - item[2]) / max(abs(item[2]), 1e-12)
    )
    index, ranks_losses, loss = worst
    difference = abs(sum(ranks_losses) / nproc - loss) / max(abs(loss), 1e-12)
    reasons = _reasons(ddp)
    if difference <= LOSS_TOLERANCE:
        notes.append(
            f"ok: the ranks' mean loss follows one process's with {nproc}x the batch (largest "
            f"relative difference {difference:.1e}, step {index + 1} of {count})"
        )
    elif reasons:
        notes.append(
            f"note: the ranks' mean loss differs from one process's by up to "
            f"{100 * difference:.2g}% (step {index + 1}): expected, since "
            + "; ".join(reasons)
            + ". Not a fault of the port"
        )
    elif not sample_problems:
        problems.append(
            f"problem: the ranks' mean loss departs from one process's by {100 * difference:.2g}%"
            f" at step {index + 1}, with nothing random in the model: check the loss's "
            "reduction, the learning rate and what each rank reads"
        )
    first, last = steps[0][count - 1]["sums"], alone[count - 1]["sums"]
    if sharded:  # each parameter's sum over the ranks' shards
        first = [sum(values) for values in zip(*(s[count - 1]["sums"] for s in steps))]
    drift = sum((a - b) ** 2 for a, b in zip(first, last)) ** 0.5 / max(
        sum(b * b for b in last) ** 0.5, 1e-12
    )
    optimizer = steps[0][0]["optimizer"]
    if drift > WEIGHT_TOLERANCE and not reasons and optimizer in ADAPTIVE_OPTIMIZERS:
        notes.append(
            f"note: the weights differ from one process's by {drift:.1e} (relative) after step "
            f"{count}: expected with {optimizer}, which divides by running averages of small "
            "gradients and so magnifies the rounding of a sum in another order"
        )
    return problems, notes


def _reasons(run: Run) -> list[str]:
    """What makes a correct port's numbers differ from one process's."""
    layers = set().union(*(set(e["layers"]) for e in run.of(0, "model")))
    reasons = []
    if any(name.startswith(RANDOM_LAYERS) for name in layers):
        reasons.append("the model has dropout (each rank draws its own masks)")
    if any(name.startswith(BATCH_STATISTICS_LAYERS) for name in layers):
        reasons.append("BatchNorm normalizes by each rank's own batch (SyncBatchNorm shares it)")
    if any("Random" in p["transform"] for p in run.of(0, "pass")):
        reasons.append("the data has random augmentation (each rank draws its own)")
    return reasons


def _last_lines(record_dir: Path, count: int = 4) -> list[str]:
    """The last lines each rank wrote to stderr, rank 0's first (its error, as a rule)."""
    lines = []
    for log in sorted(record_dir.glob("logs/*/attempt_*/*/stderr.log")):
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        lines += [line for line in tail[-count:] if line not in lines]
    return lines[:count]


def _scaled(args: list[str], flag: str, factor: int) -> list[str]:
    """The script's arguments with the batch given by FLAG multiplied."""
    scaled = list(args)
    for index, arg in enumerate(scaled):
        value_index, prefix = None, ""
        if arg == flag and index + 1 < len(scaled):
            value_index = index + 1
        elif arg.startswith(flag + "="):
            value_index, prefix = index, flag + "="
        if value_index is not None:
            text = scaled[value_index][len(prefix) :]
            if not text.isdigit():
                raise BadUsage(f"{flag} {text}: not a whole number")
            scaled[value_index] = f"{prefix}{int(text) * factor}"
            return scaled
    raise BadUsage(
        f"{flag} is not among the script's arguments: give the batch per rank ({flag} B), or "
        "name the script's batch option with --batch-flag"
    )


def run(options) -> int:
    script = options.script
    if not Path(script).is_file():
        raise BadUsage(f"{script}: no such file")
    Source(script)  # not Python: bad usage
    compare = options.batch_flag != "none"
    single_args = _scaled(options.args, options.batch_flag, options.nproc) if compare else []
    record_dir = Path(tempfile.mkdtemp(prefix="ddp-doctor-"))
    alone = f", then one process with {options.nproc}x the batch" if compare else ""
    print(
        f"doctor: {options.nproc} ranks{alone}, {options.steps} steps each; records and output "
        f"in {record_dir}",
        flush=True,
    )
    ddp = _start(
        script, options.args, options.nproc, options.steps, record_dir / "ranks", options.deadline
    )
    step_counts = {len(ddp.of(rank, "step")) for rank in range(options.nproc)}
    stepped = 0 not in step_counts and len(step_counts) == 1
    failed = ddp.returncode != 0
    if failed and not any(ddp.of(rank, "step") for rank in range(options.nproc)):
        exits = {e["code"] for rank in range(options.nproc) for e in ddp.of(rank, "exit")}
        errors = [e for rank in range(options.nproc) for e in ddp.of(rank, "error")]
        if exits == {USAGE_EXIT_CODE} or any(
            e["type"] in ("ImportError", "ModuleNotFoundError", "FileNotFoundError") for e in errors
        ):
            print("\n".join(_last_lines(record_dir / "ranks")))
            raise BadUsage("the script does not start (its output is above)")
    if failed or not stepped:
        problems = _divergence(ddp, script)
        if ddp.returncode is None:
            problems.insert(
                0,
                f"problem: the ranks did not finish {options.steps} steps within "
                f"{options.deadline:g} s (a hang); each rank's stack is in {record_dir / 'ranks'}",
            )
        if not problems:
            log = record_dir / "ranks" / "output.log"
            problems.append(
                f"problem: the ranks' run failed (torchrun exit code {ddp.returncode}); the end "
                f"of its output ({log}):"
            )
            problems += ["  " + line for line in _last_lines(record_dir / "ranks")]
        print("\n".join(problems))
        count = sum(p.startswith("problem:") for p in problems)
        print(f"run: {count} problem{'s' if count > 1 else ''} found")
        return 1
    single = None
    if compare:
        single = _start(
            script, single_args, 1, options.steps, record_dir / "one_process", options.deadline
        )
    if single is not None and (single.returncode != 0 or not single.of(0, "step")):
        print(
            "problem: the script fails as one process with the larger batch, where the ranks "
            f"succeeded; its output: {record_dir / 'one_process' / 'output.log'}"
        )
        print("run: 1 problem found")
        return 1
    problems, notes = _compare(ddp, single, options.nproc)
    print("\n".join(notes + problems))
    if problems:
        print(f"run: {len(problems)} problem{'s' if len(problems) > 1 else ''} found")
        return 1
    print("run: the port looks right")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["_rank"]:  # inside torchrun: one rank of `run`
        rank_main(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        prog="doctor.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    lint_mode = modes.add_parser("lint", help="read the code and name the classic mistakes")
    lint_mode.add_argument("files", nargs="+", metavar="FILE")
    run_mode = modes.add_parser(
        "run", help="run the script on N ranks and as one process, and compare"
    )
    run_mode.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    run_mode.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    run_mode.add_argument(
        "--batch-flag",
        default="--batch-size",
        help="the script's option for the batch per rank (default --batch-size)",
    )
    run_mode.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds a run may take before it counts as a hang (default 300)",
    )
    run_mode.add_argument("script", metavar="SCRIPT")
    run_mode.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    options = parser.parse_args(argv)
    try:
        if options.mode == "lint":
            return lint(options.files)
        if options.nproc < 2 or options.steps < 1 or options.deadline <= 0:
            raise BadUsage("--nproc must be at least 2, --steps and --deadline above 0")
        return run(options)
    except BadUsage as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
