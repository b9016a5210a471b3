"""Answer extraction, equivalence and majority voting for best-of-N trajectories.

Best-of-N only helps if answers that mean the same thing are counted together: `\\frac{1}{2}`,
`0.5` and `1/2` must share one vote. Cheap string normalisation settles most pairs; the rest go
to sympy, which runs in a child process with a timeout because it can hang (or exhaust memory)
on adversarial model output such as `9^9^9^9`.

Stdlib + sympy only (sympy is imported in the child, never here), so the CPU-side aggregator
stays light and importable without the GPU stack.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
import subprocess
import sys
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from io import StringIO
from typing import Literal

Task = Literal["math", "choice", "code"]
TASKS: tuple[Task, ...] = ("math", "choice", "code")

__all__ = [
    "TASKS",
    "Task",
    "Vote",
    "extract_answer",
    "is_correct",
    "leader_is_final",
    "majority_vote",
    "math_equal",
    "normalize_answer",
    "normalize_choice",
    "normalize_code",
    "normalize_math",
]

# --------------------------------------------------------------------------------- extraction

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


# ------------------------------------------------------------------------------ normalisation

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


# ------------------------------------------------------------------------- LaTeX -> sympy text


class _Unsupported(ValueError):
    """The LaTeX uses something the small converter does not handle: not comparable."""


_FUNCS = {"sin": "sin", "cos": "cos", "tan": "tan", "ln": "log", "log": "log", "exp": "exp"}
_ALLOWED_NAMES = frozenset({"sqrt", "pi", "oo", *_FUNCS.values()})
_MAX_EXPR_LEN = 500


def _arg(s: str, i: int) -> tuple[str, int]:
    """One macro argument at `i`: a `{...}` group, a `\\command` or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise _Unsupported("missing argument")
    if s[i] == "{":
        end = _match_brace(s, i)
        if end is None:
            raise _Unsupported("unbalanced braces")
        return s[i + 1 : end], end + 1
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+", s[i:])
        if m is None:
            raise _Unsupported("bad command argument")
        return m.group(0), i + len(m.group(0))
    return s[i], i + 1


_PLAIN = {"{": "(", "}": ")", "^": "**", "%": "/100"}  # LaTeX -> sympy, one character


def _convert(s: str) -> str:
    """Translate the common LaTeX forms into sympy's Python-like syntax (raises _Unsupported)."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+|.)", s[i:])
            assert m is not None  # a backslash always matches `\\.` unless it ends the string
            name = m.group(1)
            i += len(m.group(0))
            if name == "frac":
                num, i = _arg(s, i)
                den, i = _arg(s, i)
                out.append(f"(({_convert(num)})/({_convert(den)}))")
            elif name == "sqrt":
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise _Unsupported("unclosed root index")
                    index = _convert(s[i + 1 : close])
                    body, i = _arg(s, close + 1)
                    out.append(f"(({_convert(body)})**(1/({index})))")
                else:
                    body, i = _arg(s, i)
                    out.append(f" sqrt({_convert(body)})")
            elif name in ("cdot", "times"):
                out.append("*")
            elif name == "div":
                out.append("/")
            elif name == "pi":
                out.append(" pi ")
            elif name == "infty":
                out.append(" oo ")
            elif name in _FUNCS:
                out.append(f" {_FUNCS[name]} ")
            elif name == "%":
                out.append("/100")
            else:
                raise _Unsupported(f"unsupported command \\{name}")
        else:
            out.append(_PLAIN.get(c, c))
            i += 1
    return "".join(out)


def _split_names(expr: str) -> str:
    """Split letter runs that are not known functions into single-letter symbols (`xy` -> x y).

    Only whitelisted names and one-letter symbols reach sympy's parser, which uses `eval`: no
    builtin, attribute or dunder can be spelled by model output.
    """

    def repl(m: re.Match[str]) -> str:
        word = m.group(0)
        return f" {word} " if word in _ALLOWED_NAMES else " " + " ".join(word) + " "

    return re.sub(r"[A-Za-z]+", repl, expr)


def _to_sympy_text(s: str) -> str | None:
    """Sympy-parsable text for a normalised answer, or None when it is not safely convertible."""
    if len(s) > _MAX_EXPR_LEN:
        return None
    try:
        expr = _convert(s)
    except (_Unsupported, RecursionError):
        return None
    expr = _split_names(expr)
    # Only arithmetic characters; every `.` must start digits, so no attribute access.
    if not re.fullmatch(r"[0-9A-Za-z+\-*/(). ]*", expr) or re.search(r"\.(?!\d)", expr):
        return None
    depth = 0
    for c in expr:  # unbalanced parentheses cannot parse: skip the sympy child
        depth += (c == "(") - (c == ")")
        if depth < 0:
            return None
    if depth:
        return None
    return expr if expr.strip() else None


# ------------------------------------------------------------------------ exact rational path

_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_EXPONENT = 64
_MAX_BITS = 1 << 16


def _rational(node: ast.AST) -> Fraction:
    """Exact value of a purely numeric expression; raises ValueError on anything else.

    Settles `\\frac{1}{2}` vs `0.5` vs `10.0` in-process, without paying for a sympy child.
    """
    if isinstance(node, ast.Expression):
        return _rational(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _rational(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _rational(node.left), _rational(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
                raise ValueError("non-integer or huge exponent")
            size = max(left.numerator.bit_length(), left.denominator.bit_length())
            if size * abs(int(right)) > _MAX_BITS:
                raise ValueError("power too large")  # nested powers could still explode
            return left ** int(right)
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ValueError("unsupported operator")
        return op(left, right)
    raise ValueError("not a number")


def _try_rational(expr: str) -> Fraction | None:
    """`_rational` of the text, or None if it is not a plain number expression."""
    try:
        return _rational(ast.parse(expr.strip(), mode="eval"))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError):
        return None


# --------------------------------------------------------------------------- sympy in a child

_SYMPY_CHILD = r"""
import json, sys
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
except Exception:
    pass
from sympy import Symbol, simplify, sqrt, pi, oo, log, sin, cos, tan, exp
from sympy.parsing.sympy_parser import (
    parse_expr, standard_transformations, implicit_multiplication_application)
a, b = json.load(sys.stdin)
names = {c: Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
names.update(sqrt=sqrt, pi=pi, oo=oo, log=log, sin=sin, cos=cos, tan=tan, exp=exp)
tr = standard_transformations + (implicit_multiplication_application,)
ea = parse_expr(a, local_dict=dict(names), transformations=tr)
eb = parse_expr(b, local_dict=dict(names), transformations=tr)
print("1" if simplify(ea - eb) == 0 else "0")
"""


def _sympy_equal(a: str, b: str, timeout_s: float) -> bool:
    """`simplify(a - b) == 0` in a fresh interpreter, killed after `timeout_s` seconds.

    A subprocess (not a thread) because sympy cannot be interrupted and may hang or allocate
    without bound; `-I` keeps the working directory off its import path.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _SYMPY_CHILD],
            input=json.dumps([a, b]),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    return proc.returncode == 0 and proc.stdout.strip() == "1"


@functools.lru_cache(maxsize=8192)
def _math_equal_cached(a: str, b: str, timeout_s: float) -> bool:
    """Equivalence of two normalised answers (ordered pair, so the cache is symmetric)."""
    if a == b:
        return True
    ea, eb = _to_sympy_text(a), _to_sympy_text(b)
    if ea is None or eb is None:
        return False
    ra, rb = _try_rational(ea), _try_rational(eb)
    if ra is not None and rb is not None:
        return ra == rb
    return _sympy_equal(ea, eb, timeout_s)


def math_equal(a: str, b: str, timeout_s: float = 5.0) -> bool:
    """Whether two math answers denote the same value; never raises.

    Equal normalised strings, then exact rational arithmetic, then sympy's `simplify(a-b)==0`
    in a child process limited to `timeout_s`. Unparseable input, a timeout or any error means
    False. Results are cached (a timeout under load is cached as False too).
    """
    try:
        na, nb = normalize_math(a), normalize_math(b)
        if na == nb:
            return True
        first, second = sorted((na, nb))
        return _math_equal_cached(first, second, float(timeout_s))
    except Exception:
        return False


# ------------------------------------------------------------------------------------- voting


@dataclass(frozen=True)
class Vote:
    """Outcome of a majority vote over N trajectories.

    `votes` is keyed by each class's canonical (normalised) representative in order of first
    appearance; `answer` is the winner as first written. `share` divides by all trajectories,
    including those without an answer, so a vote won by 2 of 10 reads as weak.
    """

    answer: str | None
    votes: dict[str, int]
    share: float
    num_trajectories: int
    num_no_answer: int
    winner_indices: tuple[int, ...]


@dataclass
class _Class:
    rep: str
    members: list[int]


def majority_vote(
    answers: Sequence[str | None],
    task: Task,
    tests_outcomes: Sequence[bool] | None = None,
) -> Vote:
    """Group answers into equivalence classes and pick the largest.

    Equivalence: math uses `math_equal` against each class representative (first match wins);
    choice and code compare normalised forms. For code, `tests_outcomes[i]` (if given) says
    whether trajectory i passed its tests; only passing ones vote. Answers that are None or
    normalise to empty count in `num_no_answer` and never win.

    Tie-break (deterministic): among classes with the most votes, the one whose first member
    appeared earliest wins.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
    if tests_outcomes is not None:
        if task != "code":
            raise ValueError("tests_outcomes only applies to task='code'")
        if len(tests_outcomes) != len(answers):
            raise ValueError(
                f"tests_outcomes has {len(tests_outcomes)} entries for {len(answers)} answers"
            )
    classes: list[_Class] = []
    by_rep: dict[str, _Class] = {}
    no_answer = 0
    for i, raw in enumerate(answers):
        key = normalize_answer(raw, task) if raw is not None else ""
        if not key:
            no_answer += 1
            continue
        if tests_outcomes is not None and not tests_outcomes[i]:
            continue
        cls = by_rep.get(key)
        if cls is None and task == "math":
            cls = next((c for c in classes if math_equal(c.rep, key)), None)
        if cls is None:
            cls = _Class(rep=key, members=[])
            classes.append(cls)
            by_rep[key] = cls
        cls.members.append(i)

    n = len(answers)
    votes = {c.rep: len(c.members) for c in classes}
    if not classes:
        return Vote(None, votes, 0.0, n, no_answer, ())
    winner = max(classes, key=lambda c: len(c.members))  # max keeps the earliest on ties
    first = answers[winner.members[0]]
    return Vote(first, votes, len(winner.members) / n, n, no_answer, tuple(winner.members))


def leader_is_final(votes: dict[str, int], remaining: int) -> bool:
    """Whether the leader wins even if all `remaining` trajectories back the runner-up.

    Strict (`leader > runner_up + remaining`), so a possible tie does not stop sampling early.
    """
    if remaining < 0:
        raise ValueError(f"remaining must be >= 0, got {remaining}")
    counts = sorted(votes.values(), reverse=True)
    leader = counts[0] if counts else 0
    runner_up = counts[1] if len(counts) > 1 else 0
    return leader > runner_up + remaining


def is_correct(predicted: str | None, reference: str, task: Task) -> bool:
    """Grade a predicted answer against the reference; no answer is wrong.

    Raises:
        ValueError: for code (correctness there means running tests, not comparing text).
    """
    if task == "code":
        raise ValueError("is_correct does not support task='code'; run the tests instead")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
    if predicted is None:
        return False
    if task == "math":
        return math_equal(predicted, reference)
    return normalize_choice(predicted) == normalize_choice(reference)
