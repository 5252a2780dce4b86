"""Every numbered script reads as one short lesson: 01 plus its topic, the DDP lines visible in it,
no machinery. Checked mechanically, as accelerate's example tests check its by-feature scripts.

"Changed lines" between two files is `diff a b | grep -c '^[<>]'` (a replaced line counts twice,
once removed and once added), except for the single-process baseline, whose budget counts what
DDP adds: the lines of 01 that the baseline does not have.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

from tests.helpers import CODE_DIRS, LESSON_DIRS, REPO, code_lines_without_messages, tracked_files

LESSON = REPO / "01_basic_ddp" / "train.py"
BASELINE = REPO / "01_basic_ddp" / "train_single.py"
# A topic lesson is a numbered folder with a train.py besides 01; its README says how many lines its
# diff against 01 changes, "about N lines", and tests/test_readme_facts.py holds it to diff_count()
# within 10%: the lesson's budget.
TOPIC_SCRIPTS = [
    f"{folder}/train.py"
    for folder in LESSON_DIRS
    if folder != "01_basic_ddp" and (REPO / folder / "train.py").exists()
]
# The lessons' own train.py files: 01 and its topic lessons.
LESSONS = [LESSON] + [REPO / script for script in TOPIC_SCRIPTS]


# Every script a user runs: the lessons, their side scripts, the performance script, the demos.
ALL_SCRIPTS = sorted(
    p for pattern in ("0*/*.py", "benchmark/*.py", "debugging/*.py") for p in REPO.glob(pattern)
)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def diff_lines(a: Path, b: Path) -> list[str]:
    """The removed ('-') and added ('+') lines of a diff from a to b, without the file headers,
    each print(...) call counted as one line whatever its message says (a reworded message in 01
    is not a difference of the lessons' code)."""
    diff = list(
        difflib.unified_diff(
            code_lines_without_messages(a.read_text()),
            code_lines_without_messages(b.read_text()),
            n=0,
            lineterm="",
        )
    )[2:]
    return [line for line in diff if line[:1] in "+-"]


def diff_count(a: Path, b: Path) -> int:
    return len(diff_lines(a, b))


def functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    tree = ast.parse(source)
    return {
        node.name: ast.get_source_segment(source, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def test_diff_count_is_what_diff_prints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("1\n2\n3\n4\n")
    b.write_text("1\nTWO\n3\n4\n5\n")
    assert diff_count(a, b) == 3  # 2 replaced (< and >), 5 added (>)


def test_a_reworded_message_is_no_difference_but_changed_code_is(tmp_path):
    """Rewording (and re-wrapping) a print of 01 leaves its diff with 01 empty; a changed statement
    is counted (removed and added)."""
    source = LESSON.read_text()
    last_print = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print"
    ][-1]
    reworded = tmp_path / "reworded.py"
    reworded.write_text(
        source.replace(
            ast.get_source_segment(source, last_print),
            'print(\n    f"reworded {launch.rank}",\n    "and re-wrapped",\n    flush=True,\n)',
        )
    )
    assert lines(reworded) != lines(LESSON) and diff_count(LESSON, reworded) == 0
    changed = tmp_path / "changed.py"
    changed.write_text(source.replace("train_sampler.set_epoch(epoch)", "pass"))
    assert diff_count(LESSON, changed) == 2


def test_01_shows_every_ddp_line():
    source = LESSON.read_text()
    for visible in (
        'torch.device("cuda", launch.gpu)',
        "torch.cuda.set_device(device)",
        "CUDA_VISIBLE_DEVICES",
        "torch.manual_seed(cfg.seed)",
        "torch.manual_seed(cfg.seed + launch.rank)",
        "dist.init_process_group(",
        "DistributedSampler(",
        "train_sampler.set_epoch(epoch)",
        "model = DDP(model",
        "loss.backward()",
        "dist.all_reduce(totals)",
        "dist.barrier(device_ids=",
        "dist.all_gather_object(checksums, parameter_checksum(model))",
        "# Plain file I/O on one rank",
        "torch.save(model.module.state_dict()",
        "dist.destroy_process_group()",
        "@record",
    ):
        assert visible in source, visible
    # The training loop (epochs, steps, evaluation) is short.
    train = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef) and n.name == "train"
    )
    epoch_loop = next(
        n for n in ast.walk(train) if isinstance(n, ast.For) and ast.unparse(n.target) == "epoch"
    )
    assert epoch_loop.end_lineno - epoch_loop.lineno + 1 <= 40
    # At most five helper modules, one call each for what every script would copy.
    helper_modules = set(re.findall(r"^from common\.(\w+) import", source, re.M))
    assert helper_modules == {"config", "launcher", "data", "models", "report"}


def test_the_baseline_differs_from_01_only_by_ddp():
    added_by_ddp = sum(1 for line in diff_lines(BASELINE, LESSON) if line.startswith("+"))
    assert added_by_ddp <= 110
    baseline = BASELINE.read_text()
    for ddp_only in (
        "torch.distributed",
        "DistributedDataParallel",
        "DistributedSampler",
        "launch.",
    ):
        assert ddp_only not in baseline, ddp_only
    # The shared parts are the same text: the loop body, the model, the optimizer.
    for shared in (
        "loss = F.cross_entropy(model(images), labels)",
        "optimizer.zero_grad(set_to_none=True)",
        "model = build_model(cfg.model, data.num_classes, data.in_channels, data.image_size)",
        "model = model.to(device)",
        "optimizer = torch.optim.SGD(",
    ):
        assert shared in baseline and shared in LESSON.read_text(), shared


@pytest.mark.parametrize("script", TOPIC_SCRIPTS)
def test_each_lesson_is_01_plus_its_topic(script):
    path = REPO / script
    base, lesson = functions(LESSON), functions(path)
    # Exact evaluation is the same code in every lesson.
    assert lesson["evaluate"] == base["evaluate"]
    # main() is 01's, with the lesson's own config class, and may exit with train()'s code.
    config_class = re.search(r"load_config\((\w+)\)", lesson["main"]).group(1)
    main = re.sub(
        r"\n *#[^\n]*\n( *)sys\.exit\(train\(cfg, launch\)\)",
        r"\n\1train(cfg, launch)",
        lesson["main"],
    )
    assert main.replace(config_class, "TrainConfig") == base["main"]
    # The DDP lines of 01 appear verbatim.
    source = path.read_text()
    for line in (
        "    dist.init_process_group(",
        '        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",',
        "    dist.destroy_process_group()",
        "    # Same initial weights on every rank",
        "    torch.manual_seed(cfg.seed)",
        '    device = torch.device("cuda", launch.gpu) if torch.cuda.is_available()',
        "    backend = choose_backend(device)",
        "    torch.manual_seed(cfg.seed + launch.rank)",
        "    dist.all_gather_object(checksums, parameter_checksum(model))",
    ):
        assert line in LESSON.read_text() and any(
            l.startswith(line) for l in source.splitlines()
        ), (script, line)
    assert (
        'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)' in source
    )


def test_a_drifted_copy_is_caught_and_its_added_lines_counted(tmp_path):
    """Negative control: a copy of 01 with a drifted evaluate() is caught; the lines a copy adds
    are what diff_count() counts (the budget's measure), a reworded message is not."""
    drifted = tmp_path / "train.py"
    drifted.write_text(LESSON.read_text().replace("model.eval()", "model.train(False)"))
    assert functions(drifted)["evaluate"] != functions(LESSON)["evaluate"]
    drifted.write_text(LESSON.read_text() + "\n".join(f"x_{i} = {i}" for i in range(7)) + "\n")
    assert diff_count(LESSON, drifted) == 7
    # the first word of 01's first printed f-string, reworded (whatever 01 prints)
    first_word = re.search(r'print\(\s*f"(\w+)', LESSON.read_text())[1]
    drifted.write_text(LESSON.read_text().replace(f'f"{first_word}', f'f"{first_word}x', 1))
    assert drifted.read_text() != LESSON.read_text() and diff_count(LESSON, drifted) == 0


def starts_a_process_group(path) -> bool:
    """Whether a script calls init_process_group (not only names it, as debugging/doctor.py)."""
    return any(
        isinstance(node, ast.Call) and ast.unparse(node.func).endswith("init_process_group")
        for node in ast.walk(ast.parse(path.read_text()))
    )


@pytest.mark.parametrize(
    "script",
    [p.relative_to(REPO).as_posix() for p in ALL_SCRIPTS if starts_a_process_group(p)],
)
def test_scripts_that_start_a_process_group_report_failures_with_record(script):
    """torchrun's summary shows a failing rank's exception
    only if main() is decorated with @record."""
    source = (REPO / script).read_text()
    tree = ast.parse(source)
    main = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert main and any(ast.unparse(d) == "record" for d in main[0].decorator_list), script
    assert "from torch.distributed.elastic.multiprocessing.errors import record" in source


PRIVATE_API = re.compile(r"(torch|dist|distributed_c10d|c10d|model|ddp)\._[a-z][a-z_]*")


def test_no_private_torch_api():
    found = []
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).glob("*.py")):
            for number, line in enumerate(lines(path), 1):
                code = line.split("#")[0]
                if PRIVATE_API.search(code):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []
    # the check can fail
    assert PRIVATE_API.search("store = dist.distributed_c10d._get_default_store()")


def loaders_forking_their_workers(path: Path) -> list[str]:
    """The DataLoader calls of `path` that may start workers (num_workers given) without the
    lessons' start method, multiprocessing_context=worker_start_method(...)."""
    found = []
    for call in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "DataLoader"):
            continue
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        if "num_workers" in keywords and not keywords.get("multiprocessing_context", "").startswith(
            "worker_start_method("
        ):
            found.append(f"{path.name}:{call.lineno}")
    return found


def test_loader_workers_start_from_forkserver_not_fork(tmp_path):
    """Every DataLoader with worker processes starts them with worker_start_method (common/data.py:
    fork() from a rank running gloo's threads can hang a worker; tests/test_data.py shows where
    the workers come from). The control: a call without it is found."""
    found = [
        f
        for folder in CODE_DIRS
        for p in (REPO / folder).glob("*.py")
        for f in loaders_forking_their_workers(p)
    ]
    assert found == []
    plain = tmp_path / "plain.py"
    plain.write_text("loader = DataLoader(data, batch_size=4, num_workers=cfg.num_workers)\n")
    assert len(loaders_forking_their_workers(plain)) == 1


def test_no_test_hooks_in_the_examples():
    for folder in CODE_DIRS:
        for path in (REPO / folder).glob("*.py"):
            text = path.read_text()
            assert "DDP_TEST_" not in text and "DDP_EXAMPLES_" not in text, path


def test_no_script_skips_interpreter_shutdown():
    """A copied script must end normally: os._exit skips atexit handlers and unflushed buffers
    (tests/test_clean_exit.py shows both complete). The test workers end the same way, but for
    the processes tests/warm_ranks.py forks: a forked child ends with os._exit (Python's docs, os),
    after the atexit handlers and a flush of its output."""
    workers = [
        p
        for p in (REPO / "tests").glob("*.py")
        if not p.name.startswith("test_") and p.name != "warm_ranks.py"
    ]
    # debugging/doctor.py stops the user's script after its last recorded step on purpose: the
    # script's own code after that (a collective in a finally, an atexit) would wait for ranks
    # already stopped
    doctor = REPO / "debugging" / "doctor.py"
    scripts = [p for folder in CODE_DIRS for p in (REPO / folder).glob("*.py") if p != doctor]
    scripts += workers
    assert len(scripts) > 30
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in scripts
        for number, line in enumerate(lines(path), 1)
        if re.search(r"\bos\._exit\(", line.split("#")[0])
    ]
    assert found == []


def unreleased_models(source: str) -> tuple[int, list[int]]:
    """How many destroy_process_group() calls the source makes, and the lines of those that follow
    anything but `del model` in a function that holds `model`."""
    destroys, problems = 0, []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef):
            continue
        blocks = [
            getattr(node, field)
            for node in ast.walk(function)
            for field in ("body", "orelse", "finalbody")
            if isinstance(getattr(node, field, None), list)
        ]
        holds_model = any(
            isinstance(n, ast.Name) and n.id == "model" and isinstance(n.ctx, ast.Store)
            for n in ast.walk(function)
        )
        for block in blocks:
            for index, statement in enumerate(block):
                if ast.unparse(statement) != "dist.destroy_process_group()":
                    continue
                destroys += 1
                before = ast.unparse(block[index - 1]) if index else ""
                if holds_model and before != "del model":
                    problems.append(statement.lineno)
    return destroys, problems


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.parent.name)
def test_each_lesson_releases_its_model_before_destroying_the_process_group(path):
    """The DDP model holds the process group; `del model` right before destroy_process_group()
    lets gloo's threads end there rather than at interpreter shutdown (debugging/README.md).
    A function that never holds `model` (04's train(): fit() returns without it) needs no del."""
    destroys, problems = unreleased_models(path.read_text())
    assert destroys >= 1 and problems == [], (path, problems)


def test_the_release_check_finds_a_missing_del():
    source = LESSON.read_text()
    assert source.count("    del model\n") == 1
    destroys, problems = unreleased_models(source.replace("    del model\n", ""))
    assert destroys == 1 and len(problems) == 1


@pytest.mark.parametrize("path", LESSONS + [BASELINE], ids=lambda p: p.parent.name + "/" + p.name)
def test_each_lesson_is_formatted_as_plainly_as_the_anchors(path):
    """At most about 50 characters per non-blank line on average, as pytorch/examples' and
    nanoGPT's training scripts (40-48): no keyword arguments folded six to a line. The formatter
    (`ruff format --check`, in .ci/run) keeps every line within 100 columns."""
    non_blank = [line for line in lines(path) if line.strip()]
    assert sum(map(len, non_blank)) / len(non_blank) <= 50
    assert max(map(len, lines(path))) <= 100


def test_no_python_line_is_over_100_columns():
    """`ruff check`'s E501 lets a line that is one long token (a string, a regex) pass; the
    project's limit has no such exception, in the tests too."""
    long = [
        f"{path.relative_to(REPO)}:{number}"
        for path in tracked_files("*.py")
        for number, line in enumerate(lines(path), 1)
        if len(line) > 100
    ]
    assert long == []


def code_lines(path: Path) -> int:
    """Lines that are neither blank, nor comments, nor docstrings."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(
            node
        ):
            docstrings |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_05s_train_is_about_as_long_as_01s_with_resume_and_save_in_their_own_functions():
    """05's topic lives in resume() and save_checkpoint() beside train(), which train() calls once
    before the loop and once in it, so train() reads like 01's (twice as long with both inline)."""
    lesson = functions(REPO / "05_checkpointing" / "train.py")
    length = {name: len(code.splitlines()) for name, code in lesson.items()}
    assert length["train"] <= 1.4 * len(functions(LESSON)["train"].splitlines())
    assert {"resume", "save_checkpoint"} <= lesson.keys()
    calls = re.findall(r"\b(resume|save_checkpoint)\(", lesson["train"])
    assert calls == ["resume", "save_checkpoint"]
