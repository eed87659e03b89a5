"""``eventkv --help`` and every command's and sub-command's ``--help`` read cleanly at 80 columns.

typer (rich markup mode) prints a command's summary in its parent's command list as the first
paragraph of its help *with its line breaks kept*, and keeps the line breaks of the further
paragraphs on the command's own page: a paragraph hard-wrapped in the source shows as ragged lines.
So every paragraph of a command's help is one line in the source, and the rendered pages are checked
for lines wider than 80 characters and for wrapped lines that stop short (rich wraps greedily: a line
that could have taken the next line's first word was broken by hand).
"""

from __future__ import annotations

import inspect
import re

import pytest
import typer
from rich.text import Text
from typer import rich_utils
from typer.testing import CliRunner

from eventkv.cli import app

WIDTH = 80


def _is_group(cmd) -> bool:
    """Whether a (typer) click command is a group: one with sub-commands."""
    return isinstance(getattr(cmd, "commands", None), dict)


def _commands(group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """``(path, command)`` for ``group`` and every command and sub-command below it."""
    found = [(path, group)]
    if _is_group(group):
        for name, cmd in group.commands.items():
            found += _commands(cmd, (*path, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))
IDS = [" ".join(path) or "eventkv" for path, _ in COMMANDS]


def _paragraphs(cmd) -> list[str]:
    """The paragraphs of a command's help, as typer splits them (before a ``\\f``)."""
    text = inspect.cleandoc(cmd.help or "").partition("\f")[0]
    return [p for p in text.split("\n\n") if p.strip()]


def _plain(markup: str) -> str:
    """Rich markup as it prints, whitespace collapsed."""
    return " ".join(Text.from_markup(markup).plain.split())


@pytest.fixture
def render(monkeypatch):
    """``render(path)``: the ``--help`` page of ``eventkv PATH`` at 80 columns, without colour codes."""
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", WIDTH)  # typer reads TERMINAL_WIDTH once, at import
    monkeypatch.setattr(rich_utils, "FORCE_TERMINAL", False)  # CI variables would add colour codes
    runner = CliRunner()

    def run(path: tuple[str, ...]) -> str:
        env = {"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)}
        res = runner.invoke(app, [*path, "--help"], env=env, prog_name="eventkv")
        assert res.exit_code == 0, res.output
        return res.output

    return run


def _short_lines(lines: list[str]) -> list[str]:
    """The lines of one wrapped block that stop before the width the block shows it has: a line that,
    with a space and the next line's first word, would still fit."""
    width = max(len(line) for line in lines)
    return [line for line, nxt in zip(lines, lines[1:]) if len(line) + 1 + len(nxt.split()[0]) <= width]


def _command_rows(page: str) -> dict[str, list[str]]:
    """The rows of the page's Commands panel: command name -> its description's lines (stripped)."""
    rows: dict[str, list[str]] = {}
    inside, name, start = False, None, 0
    for line in page.splitlines():
        if line.startswith("╭─ Commands"):
            inside = True
        elif inside and line.startswith("╰"):
            break
        elif inside:
            body = line[1:-1]  # between the panel's borders
            m = re.match(r" (\S+)(\s+)\S", body)
            if m:
                name, start = m.group(1), m.end() - 1
                rows[name] = []
            assert name is not None, page
            rows[name].append(body[start:].rstrip())
    return rows


def _description(page: str) -> list[list[str]]:
    """The paragraphs (lists of lines, stripped) of the help text above the page's first panel."""
    lines = page.splitlines()
    usage = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:"))
    body = []
    for line in lines[usage + 1 :]:
        if line.startswith("╭"):
            break
        body.append(line.strip())
    paragraphs: list[list[str]] = [[]]
    for line in body:
        if line:
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


def test_every_command_is_checked():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"", "run donor-pair", "run patch", "memory eval", "models pull", "report", "sweep"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=IDS)
def test_help_fits_80_columns(render, path):
    page = render(path)
    wide = [line for line in page.splitlines() if len(line) > WIDTH]
    assert not wide, "\n".join(wide)


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=IDS)
def test_help_paragraphs_are_one_line_in_the_source(path, cmd):
    broken = [p for p in _paragraphs(cmd) if "\n" in p.strip()]
    assert not broken, f"eventkv {' '.join(path)}: write each help paragraph on one line: {broken}"
    params = [p for p in cmd.params if "\n" in (getattr(p, "help", None) or "")]
    assert not params, f"eventkv {' '.join(path)}: option help with a line break: {[p.name for p in params]}"


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=IDS)
def test_help_text_is_not_ragged(render, path):
    for paragraph in _description(render(path)):
        assert not _short_lines(paragraph), f"eventkv {' '.join(path)} --help: ragged lines:\n" + "\n".join(paragraph)


@pytest.mark.parametrize(
    "path,group",
    [(p, c) for p, c in COMMANDS if _is_group(c)],
    ids=[i for i, (_, c) in zip(IDS, COMMANDS) if _is_group(c)],
)
def test_command_list_shows_each_summary_whole(render, path, group):
    rows = _command_rows(render(path))
    assert set(rows) == set(group.commands)
    for name, lines in rows.items():
        first = _paragraphs(group.commands[name])[0]
        assert " ".join(" ".join(lines).split()) == _plain(first), f"eventkv {' '.join(path)}: summary of {name}"
        assert not _short_lines(lines), f"eventkv {' '.join(path)}: ragged summary of {name}:\n" + "\n".join(lines)
