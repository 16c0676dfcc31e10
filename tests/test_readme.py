"""The README documents every command and every flag its `--help` has, and names no flag a command
lacks: the flags of each command, from its own argument parser, against the README's text."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from pi0align.cli.main import COMMANDS, build_parser

README = (REPO / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags(command: str) -> set[str]:
    parser, _ = build_parser([command])
    sub = parser._subparsers._group_actions[0].choices[command]
    return {option for action in sub._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def _section(command: str) -> str:
    """From the README's first mention of the command (`pi0align CMD`, or a table row `| `CMD`) to
    the next heading."""
    start = re.search(rf"`pi0align {re.escape(command)}\b|^\| `{re.escape(command)}\b", README, re.MULTILINE)
    assert start, f"the README never names `pi0align {command}`"
    end = README.find("\n## ", start.start())
    return README[start.start(): end if end != -1 else len(README)]


def _named(command: str) -> set[str]:
    """The flags the README's tables give the command: the flags cell of its row in a table of
    commands (`| `CMD …` | flags | exit |`), and the first cell of each row of the flag table under
    its own heading (`| flags | what |`)."""
    cells = [row.split("|")[2] for row in re.findall(rf"^\| `{re.escape(command)}\b.*$", README, re.MULTILINE)]
    heading = re.search(rf"^## `pi0align {re.escape(command)}`.*$", README, re.MULTILINE)
    if heading:
        end = README.find("\n## ", heading.end())
        table = re.search(r"^\| flags \| what \|\n\|---\|---\|\n((?:\|.*\n)+)", README[heading.end(): end],
                          re.MULTILINE)
        cells += [row.split("|")[1] for row in table.group(1).splitlines()] if table else []
    return {flag for cell in cells for flag in FLAG.findall(cell)}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_a_command_is_in_the_readme(command):
    section = _section(command)
    missing = sorted(flag for flag in _flags(command) if f"`{flag}" not in section)
    assert not missing, f"pi0align {command}: flags its --help has and the README does not: {missing}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_readme_names_no_flag_a_command_lacks(command):
    unknown = sorted(_named(command) - _flags(command))
    assert not unknown, f"pi0align {command}: the README's tables give it flags it does not have: {unknown}"


def test_the_flag_tables_are_read():
    """The reverse check reads something: the tables of run, attach, compare and the set-up commands."""
    assert {"--dump-steps", "--resume"} <= _named("run") and "--model-attr" in _named("attach")
    assert "--noise" in _named("compare") and "--save-baseline" in _named("check")
