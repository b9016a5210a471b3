"""Extraction: the answer a trajectory commits to, read from its raw text.

Also home to what every later stage shares: the task kinds and LaTeX brace matching (which
normalisation and the LaTeX converter reuse), so the modules depend on each other in one
direction only: extract <- normalize <- equivalence <- vote.
"""

from __future__ import annotations

import re
from typing import Literal

Task = Literal["math", "choice", "code"]
TASKS: tuple[Task, ...] = ("math", "choice", "code")

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_CHOICE_RE = re.compile(r"answer\s*\**\s*[:：][\s*(\[{]*([a-j])(?![\w'’])", re.IGNORECASE)
_FENCE_RE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


def _match_brace(s: str, open_idx: int) -> int | None:
    """Index of the `}` closing the `{` at `open_idx`, by brace counting; None if unbalanced.

    Escaped braces (`\\{`, `\\}`) are literal set-notation braces and do not count.
    """
    depth = 0
    i = open_idx
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`/`\\fbox{...}`: the final box is the model's answer."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    start = matches[-1].end() - 1
    end = _match_brace(text, start)
    return None if end is None else text[start + 1 : end].strip()


def extract_answer(text: str, task: Task) -> str | None:
    """The answer a trajectory commits to, or None when it never commits to one.

    math: content of the last `\\boxed{}`/`\\fbox{}` (None if absent or unbalanced).
    choice: upper-cased letter A-J of the last `Answer:` that is followed by one, tolerating
    `(C)`, `**C**` and lower case. code: body of the last fenced block (empty counts as none).
    """
    if task == "math":
        return _extract_boxed(text)
    if task == "choice":
        for m in reversed(list(_CHOICE_RE.finditer(text))):
            # A lower-case letter followed by a word is prose ("answer: a careful ..."), not a pick.
            if m.group(1).islower() and re.match(r"\s+[a-z]", text[m.end() :]):
                continue
            return m.group(1).upper()
        return None
    if task == "code":
        blocks = _FENCE_RE.findall(text)
        if not blocks or not blocks[-1].strip():
            return None
        return blocks[-1].rstrip("\n")
    raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
