"""The command lines the documentation shows a user: every ``python launch.py ...``,
``torchrun ... launch.py ...`` and ``python recipes/<name>.py ...`` in the README's and docs/'s
fenced code blocks and inline code, and in the comments of conf/ files.

A line is the text a user would paste: continuation backslashes joined, a leading ``$ `` prompt
and a trailing ``# comment`` removed, and for a chained line (``... && python launch.py``) the
part that runs titan_hydra. tests/test_readme_commands.py runs each one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
# A command of ours: optional VAR=value prefixes, then python launch.py / recipes/x.py, or torchrun.
COMMAND = re.compile(r"(?:[A-Z_]+=\S+\s+)*(?:python3? (?:launch\.py|recipes/\w+\.py)|torchrun .*?launch\.py)(?=\s|$)")


# What the docs write for things of the user's own (a run they trained, a tokenizer they have),
# and the name of the fixture each stands for in the tests.
PLACEHOLDERS = [
    (r"outputs/<date>/<time>/checkpoint/step-\d+", "flux_step"),
    (r"outputs/<date>/<time>|<run dir>", "flux_run"),
    (r"outputs/(?:\.\.\.|<run>)/checkpoint/step-\d+", "llm_step"),
    (r"multirun/<date>/<time>|<multirun dir>|<dir>", "sweep"),
    (r"/path/to/tokenizer_dir|<dir with tokenizer.json>", "tokenizer"),
]
UNKNOWN_PLACEHOLDER = re.compile(r"<[^<>]+>|\.\.\.")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, for failure messages
    line: str  # the command as a user pastes it

    def concrete(self, paths: dict[str, str]) -> DocCommand:
        """The line with each placeholder replaced by its fixture's path; a placeholder nobody
        knows fails here, so a new one is given a fixture (or the line made concrete)."""
        line = self.line
        for pattern, key in PLACEHOLDERS:
            if re.search(pattern, line):
                line = re.sub(pattern, paths[key], line)
        left = UNKNOWN_PLACEHOLDER.search(" ".join(shlex.split(line, comments=True)))
        assert left is None, f"{self.where}: no fixture for {left.group(0)!r} in: {self.line}"
        return DocCommand(self.where, line)

    @property
    def argv(self) -> list[str]:
        """The line as the shell splits it (comments dropped), without leading VAR=value words."""
        words = shlex.split(self.line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        return words

    @property
    def env(self) -> dict[str, str]:
        words = shlex.split(self.line, comments=True)
        env = {}
        for word in words:
            if not re.fullmatch(r"[A-Z_]+=\S*", word):
                break
            key, value = word.split("=", 1)
            env[key] = value
        return env

    @property
    def program(self) -> str:
        """``launch.py`` or ``recipes/<name>.py``."""
        return next(w for w in self.argv if w.endswith(".py"))

    @property
    def args(self) -> list[str]:
        """The words after the program; an optional word the docs bracket (``[key=value]``) is given."""
        argv = self.argv
        words = argv[argv.index(self.program) + 1:]
        return [w[1:-1] if re.fullmatch(r"\[[\w.]+=[^\[\]]*\]", w) else w for w in words]


def _command_in(text: str) -> str | None:
    """The titan_hydra command in one (joined) line of text, or None."""
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:]
    for part in text.split("&&"):
        match = COMMAND.search(part)
        if match:
            return part[match.start():].strip()
    return None


def _joined(lines: list[str]) -> list[tuple[int, str]]:
    """(index of first line, text) with backslash continuations joined."""
    out, start, buf = [], 0, ""
    for i, line in enumerate(lines):
        if not buf:
            start = i
        if buf:
            line = line.lstrip()
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1].rstrip() + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def markdown_commands(path: Path) -> list[DocCommand]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT)
    found, spans = [], []
    for block in FENCE.finditer(text):
        spans.append(block.span())
        first = text.count("\n", 0, block.start(1)) + 1
        for i, line in _joined(block.group(1).splitlines()):
            cmd = _command_in(line)
            if cmd:
                found.append(DocCommand(f"{rel}:{first + i}", cmd))
    prose_text = text  # inline code outside the fenced blocks (blanked out, line breaks kept)
    for a, b in spans:
        prose_text = prose_text[:a] + re.sub(r"[^\n]", " ", prose_text[a:b]) + prose_text[b:]
    for match in INLINE.finditer(prose_text):
        cmd = _command_in(match.group(1))
        if cmd:
            found.append(DocCommand(f"{rel}:{prose_text.count(chr(10), 0, match.start()) + 1}", cmd))
    return found


def conf_commands(conf: Path = ROOT / "conf") -> list[DocCommand]:
    """Commands in conf/ comments: inline code, or the rest of a ``#   python ...`` line (with
    ``#``-prefixed backslash continuations)."""
    found = []
    for path in sorted(conf.rglob("*.yaml")):
        rel = path.relative_to(ROOT)
        comments = [(i, line.split("#", 1)[1] if "#" in line else None)
                    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines())]
        i = 0
        while i < len(comments):
            n, comment = comments[i]
            i += 1
            if comment is None:
                continue
            while comment.rstrip().endswith("\\") and i < len(comments) and comments[i][1] is not None:
                comment = comment.rstrip()[:-1] + " " + comments[i][1].strip()
                i += 1
            inline = [m.group(1) for m in INLINE.finditer(comment)]
            for text in inline or [comment]:
                cmd = _command_in(text)
                if cmd:
                    cmd = cmd.split("  (", 1)[0].rstrip(" .,;")  # trailing prose after the command
                    found.append(DocCommand(f"{rel}:{n + 1}", cmd))
    return found


def all_commands() -> list[DocCommand]:
    return [c for path in SOURCES for c in markdown_commands(path)] + conf_commands()


def unique(commands: list[DocCommand]) -> list[DocCommand]:
    """One command per distinct line (the same words in several places run once), its ``where``
    naming every place."""
    first: dict[tuple[str, ...], DocCommand] = {}
    for cmd in commands:
        key = tuple(cmd.argv)
        seen = first.get(key)
        first[key] = cmd if seen is None else DocCommand(f"{seen.where}, {cmd.where}", seen.line)
    return list(first.values())


def tiered(commands: list[DocCommand], ident) -> list:
    """The lines as pytest parameters: README's and conf/'s stay in CI's gate, docs/'s are
    ``extended`` (docs/testing.md#tiers: the gate is kept under CI's time budget; the docs' lines
    run in the full suite)."""
    def gate(c: DocCommand) -> bool:
        return any(w.strip().startswith(("README.md", "conf/")) for w in c.where.split(","))

    return [pytest.param(c, id=ident(c), marks=() if gate(c) else pytest.mark.extended) for c in commands]
