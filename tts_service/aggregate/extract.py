"""Extraction: the answer a trajectory commits to, read from its raw text.

Also home to the task kinds every later stage shares, so the modules depend on each other in
one direction only: extract <- normalize <- equivalence <- vote.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from tts_service.aggregate import mathverify

Task = Literal["math", "choice", "code"]
TASKS: tuple[Task, ...] = ("math", "choice", "code")

EXTRACT_TIMEOUT_S = 5.0
_CHOICE_RE = re.compile(
    r"(?:answer|choice)\s*\**\s*(?:[:：]|(?P<is>is\b:?))[\s*(\[{\"'“‘]*(?P<letter>[a-j])(?![\w'’])",
    re.IGNORECASE,
)
_FENCE_RE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


@functools.lru_cache(maxsize=1024)
def _extract_math(text: str) -> str | None:
    """Cached: the pool re-reads every finished trajectory each time one more finishes (a
    timeout is cached too, so a pathological text costs one timeout per process)."""
    return mathverify.extract(text, EXTRACT_TIMEOUT_S)


def _extract_choice(text: str) -> str | None:
    for m in reversed(list(_CHOICE_RE.finditer(text))):
        letter = m["letter"]
        # "answer: a careful look", "the answer is I think": an article or pronoun, not a pick.
        prose = re.match(r"\s+[a-z]", text[m.end() :]) is not None
        if (prose and (letter.islower() or letter == "I")) or (m["is"] and letter.islower()):
            continue
        return letter.upper()
    return None


def extract_answer(text: str, task: Task) -> str | None:
    """The answer a trajectory commits to, or None when it never commits to one.

    math: what math-verify extracts (in a child process; None after `EXTRACT_TIMEOUT_S`): the
    last `\\boxed{}` or "final answer is X" first, then "answer: X", then the last LaTeX or
    plain expression in the text, as math-verify normalised it (`\\dfrac` -> `\\frac`,
    units dropped). Text with no number or formula has no answer.
    choice: upper-cased letter A-J of the last `Answer:`, `answer is` or `choice is` followed
    by one, tolerating `(C)`, `**C**`, `"C"` and lower case after a colon.
    code: body of the last fenced block (empty counts as none).
    """
    if task == "math":
        return _extract_math(text)
    if task == "choice":
        return _extract_choice(text)
    if task == "code":
        blocks = _FENCE_RE.findall(text)
        if not blocks or not blocks[-1].strip():
            return None
        return blocks[-1].rstrip("\n")
    raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
