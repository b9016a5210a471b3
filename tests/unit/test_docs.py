"""The docs are references that cannot drift from the code: the README fits on a few screens,
every relative link (and its #anchor) resolves, and every `tts COMMAND --flag` shown in a code
block is a flag that command takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tts_service.cli import COMMANDS, make_parser

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    fenced, found = False, set()
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def code_lines(page: Path) -> list[str]:
    fenced, lines = False, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line)
    return lines


def test_the_readme_fits_on_a_few_screens():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        missing = anchor and file.suffix == ".md" and anchor not in anchors(file)
        if not file.exists() or missing:
            broken.append(target)
    assert not broken, broken


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its sub-commands' parsers."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found


def flags_by_command() -> dict[str, set[str]]:
    parser = make_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: options(subs.choices[name]) for name in COMMANDS}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_tts_flag_shown_is_one_the_command_takes(page):
    known, unknown = flags_by_command(), []
    for line in code_lines(page):
        for command, rest in re.findall(r"(?:^|[\s/])tts (\S+)([^|;&#]*)", line):
            if command.startswith("-"):
                continue
            assert command in known, f"{page.name}: tts {command}"
            own = rest.split(" -- ")[0]  # after `--`: a job's entrypoint and its own flags
            flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", own)
            unknown += [f"tts {command} {f}" for f in flags if f not in known[command]]
    assert not unknown, unknown
