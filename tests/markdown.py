"""The READMEs' Markdown, read with markdown-it-py: fenced blocks and the markers above them,
sections, tables, sample-output blocks and the commands of the ```bash blocks (tests/README.md,
"README statements, samples and commands"). The prose tests read the READMEs through it, and
tests/readme_samples.py writes samples back."""

from __future__ import annotations

import functools
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

from tests.paths import REPO, tracked_files


@functools.cache
def _parse(text: str) -> list:
    """markdown-it-py's tokens of `text`."""
    return MarkdownIt("commonmark").enable("table").parse(text)


@dataclass(frozen=True)
class Block:
    info: str  # the fence's info string: "bash", "python", or "" for a sample output
    lines: tuple[str, ...]  # the lines between the fences, as written
    start: int  # the index of the opening fence's line in the text's lines
    marker: str = ""  # the HTML comment just above the fence, if any
    top: int = 0  # the index of the marker's first line, or of the fence's without one


def markdown_blocks(text: str) -> list[Block]:
    """The fenced code blocks of `text`, in order."""
    lines, tokens, blocks = text.splitlines(), _parse(text), []
    for i, token in enumerate(tokens):
        if token.type == "fence":
            above = tokens[i - 1] if i and tokens[i - 1].type == "html_block" else token
            marker = above.content if above is not token else ""
            body = tuple(lines[token.map[0] + 1 : token.map[1] - 1])
            blocks.append(Block(token.info.strip(), body, token.map[0], marker, above.map[0]))
    return blocks


def markdown_section(text: str, heading: str) -> str:
    """The text of the section whose heading line starts with `heading` (e.g. "## 3." or
    "## Output"), up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    headings = [(t.map[0], int(t.tag[1])) for t in _parse(text) if t.type == "heading_open"]
    first, level = next((n, lv) for n, lv in headings if lines[n].startswith(heading))
    end = next((n for n, lv in headings if n > first and lv <= level), len(lines))
    return "\n".join(lines[first:end])


def markdown_table(text: str, after: str) -> list[list[str]]:
    """The body rows, as cells of raw Markdown, of the first table after the first line that
    contains `after`."""
    first = next(i for i, line in enumerate(text.splitlines()) if after in line)
    rows, in_table = [], False
    for token in _parse(text):
        if token.type == "table_open" and token.map[0] >= first:
            in_table = True
        elif in_table and token.type == "tr_open":
            rows.append([])
        elif in_table and token.type == "inline":
            rows[-1].append(token.content)
        elif in_table and token.type == "table_close":
            return rows[1:]  # without the header row
    raise AssertionError(f"no table after {after!r}")


def markdown_links(text: str) -> list[str]:
    """The targets of the links of `text`, in order (a link inside code is no link)."""
    return [
        child.attrs["href"]
        for token in _parse(text)
        if token.type == "inline"
        for child in token.children
        if child.type == "link_open"
    ]


def markdown_headings(text: str) -> list[str]:
    """The headings of `text` as they render (code spans without their backticks)."""
    tokens = _parse(text)
    return [
        "".join(c.content for c in tokens[i + 1].children if c.type in ("text", "code_inline"))
        for i, token in enumerate(tokens)
        if token.type == "heading_open"
    ]


def sample_block(text: str, after: str) -> Block:
    """The first sample-output block (a fence without a language) after the first occurrence of
    the text `after`."""
    line = text[: text.index(after)].count("\n")
    return next(b for b in markdown_blocks(text) if b.start >= line and not b.info)


def readme_sample(readme: Path, after: str) -> list[str]:
    """The lines of `readme`'s sample_block after `after`."""
    return list(sample_block(Path(readme).read_text(), after).lines)


@dataclass(frozen=True)
class Command:
    text: str  # the command, whitespace-normalised, without its trailing comment
    source: str  # the command as written (continuation lines included, comment left out)
    comment: str  # its trailing `# ...` annotation, if any
    before: str  # the paragraph just above its ```bash block (and the block's marker)
    readme: str
    block: int  # the line number of its block's opening fence
    how: dict  # its entry in the marker above the block: {"run": {...}}, {"not-run": reason}...


def _split_comment(line: str) -> tuple[str, str]:
    """`cmd  # note` -> ("cmd", "note"): the first ` #` outside quotes starts the comment."""
    for match in re.finditer(r"(?:^|\s)#", line):
        try:
            shlex.split(line[: match.start()])
        except ValueError:  # inside a quote
            continue
        return line[: match.start()].rstrip(), line[match.end() :].strip()
    return line.rstrip(), ""


def markdown_commands(text: str, readme: str) -> list[Command]:
    """The commands of the ```bash blocks of one Markdown text, each with its entry in the marker
    above its block: an HTML comment `<!-- commands: ... -->` holding a YAML list with one entry a
    command (tests/README.md, "README statements, samples and commands"). A block without a marker,
    or with another number of entries than commands, fails."""
    commands, lines = [], text.splitlines()
    for block in markdown_blocks(text):
        if block.info != "bash":
            continue
        head = lines[: block.top]
        while head and not head[-1].strip():
            head.pop()
        before = " ".join(reversed(list(itertools.takewhile(str.strip, reversed(head)))))
        marker = block.marker.strip().removeprefix("<!--").removesuffix("-->").strip()
        entries = (yaml.safe_load(marker.removeprefix("commands:")) if marker else None) or []
        texts, pending = [], ""
        for line in block.lines:
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line
            source, comment = _split_comment(pending)
            try:  # a backslash continues the line; so does a quote left open
                complete = not source.endswith("\\") and shlex.split(source) is not None
            except ValueError:
                complete = False
            if complete:
                texts.append((" ".join(source.replace("\\\n", " ").split()), source, comment))
                pending = ""
        where = f"{readme}:{block.start + 1}"
        assert marker.startswith("commands:"), f"{where}: no <!-- commands: --> marker above"
        assert len(entries) == len(texts), f"{where}: {len(texts)} commands, marker {entries}"
        for (command, source, comment), how in zip(texts, entries):
            how = {how: None} if isinstance(how, str) else how
            commands.append(Command(command, source, comment, before, readme, block.start + 1, how))
    return commands


def readme_commands() -> list[Command]:
    """Every command of the ```bash blocks of the tracked Markdown files (markdown_commands)."""
    return [
        command
        for path in tracked_files("*.md")
        for command in markdown_commands(path.read_text(), path.relative_to(REPO).as_posix())
    ]


def readme_words(heading: str | None = None, path: Path = REPO / "README.md") -> str:
    """The top README (or one section of it) with its line breaks as spaces: what a prose check
    searches for a sentence that the Markdown may wrap anywhere."""
    text = path.read_text()
    return " ".join((markdown_section(text, heading) if heading else text).split())
