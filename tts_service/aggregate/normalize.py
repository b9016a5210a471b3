"""Normalisation: one canonical string per answer, so trivially different spellings share a vote.

Cheap and in-process; it settles most equal pairs before `equivalence` has to reach for sympy.
"""

from __future__ import annotations

import re
import tokenize
from io import StringIO

from tts_service.aggregate.extract import TASKS, Task, _match_brace

_WRAPPERS = ("text", "textbf", "textrm", "mathrm", "mbox", "mathbf")
_WRAPPER_RE = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°")
_CMD_SPACE_RE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _unwrap(s: str) -> str:
    """`\\text{cm}` -> `cm` (innermost first is not needed: we rescan until none is left)."""
    while (m := _WRAPPER_RE.search(s)) is not None:
        end = _match_brace(s, m.end() - 1)
        if end is None:
            return s
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]
    return s


def normalize_math(s: str) -> str:
    """Canonical string for a math answer, so that trivially different spellings compare equal.

    Strips `$`, whitespace, `\\left`/`\\right`, thin spaces, a trailing `.`, degree marks and
    `\\text{}`-style wrappers; maps `\\dfrac`/`\\tfrac` to `\\frac`, `\\%` to `%` and drops
    thousands separators from plain numbers (`1,000` -> `1000`).
    """
    s = s.strip().replace("$", "")
    s = _unwrap(s)
    s = s.replace("\\left", "").replace("\\right", "")
    for thin in ("\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(thin, "")
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "%")
    # Keep one space where it terminates a command (`\pi r`), drop all other whitespace.
    s = _CMD_SPACE_RE.sub(lambda m: m.group(1) + "\0", s)
    s = re.sub(r"\s+", "", s).replace("\0", " ")
    s = s.rstrip(".")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s


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
