"""Math equivalence: whether two answers denote the same value (`\\frac{1}{2}`, `0.5`, `1/2`).

Normalised strings first, then exact rationals in-process, then sympy, which runs in a child
process with a timeout because it can hang (or exhaust memory) on adversarial model output such
as `9^9^9^9`. sympy is imported in the child, never here, so the CPU-side aggregator stays light
and importable without the GPU stack.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
import subprocess
import sys
from collections.abc import Callable
from fractions import Fraction

from tts_service.aggregate.extract import _match_brace
from tts_service.aggregate.normalize import normalize_math

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
