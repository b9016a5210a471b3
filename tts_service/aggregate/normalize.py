"""Normalisation: one canonical string per answer, so identical answers share a vote cheaply.

In-process string work only. For math it is only the identity fast path (and the vote's class
key); `equivalence` (math-verify) decides which spellings mean the same value.
"""

from __future__ import annotations

import re
import tokenize
from io import StringIO

from tts_service.aggregate.extract import TASKS, Task


def normalize_math(s: str) -> str:
    """`s` without `$`, a trailing `.` and outer whitespace; inner whitespace runs become one
    space (a space can end a LaTeX command: `\\pi r` is not `\\pir`)."""
    return " ".join(s.replace("$", "").split()).rstrip(".").strip()


def normalize_choice(s: str) -> str:
    """Upper-case letter, with stray `(`, `)`, `*`, `.` and spaces removed (`(c)` -> `C`)."""
    return s.strip().strip("()*. \t\n").upper()


def _comment_cols(code: str) -> dict[int, int] | None:
    """Line (0-based) -> column where its `#` comment starts, via the Python tokenizer.

    None if the code does not tokenize as Python (then a cruder rule is used).
    """
    cols: dict[int, int] = {}
    try:
        for tok in tokenize.generate_tokens(StringIO(code).readline):
            if tok.type == tokenize.COMMENT:
                cols[tok.start[0] - 1] = tok.start[1]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return cols


def normalize_code(s: str) -> str:
    """Code with comments, blank lines and trailing whitespace removed.

    Programs that differ only in commentary or layout are the same vote. The tokenizer keeps
    `#` inside string literals intact; non-Python code falls back to stripping `#` that starts
    a line or follows whitespace.
    """
    lines = s.splitlines()
    cols = _comment_cols(s)
    out: list[str] = []
    for i, line in enumerate(lines):
        if cols is not None:
            if i in cols:
                line = line[: cols[i]]
        else:
            line = re.sub(r"(^|\s)#.*$", "", line)
        line = line.rstrip()
        if line.strip():
            out.append(line)
    return "\n".join(out)


def normalize_answer(answer: str, task: Task) -> str:
    """Task-specific canonical form; answers with equal forms always share a vote."""
    if task == "math":
        return normalize_math(answer)
    if task == "choice":
        return normalize_choice(answer)
    if task == "code":
        return normalize_code(answer)
    raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
