"""Math equivalence: whether two answers denote the same value (`\\frac{1}{2}`, `0.5`, `1/2`).

Equal normalised strings settle most pairs in-process; the rest go to HuggingFace's
math-verify (numbers, LaTeX, sets, intervals, equations, units), which runs in a child process
killed after a timeout (see `mathverify`).
"""

from __future__ import annotations

import functools

from tts_service.aggregate import mathverify
from tts_service.aggregate.normalize import normalize_math


@functools.lru_cache(maxsize=8192)
def _math_equal_cached(a: str, b: str, timeout_s: float) -> bool:
    """Equivalence of an ordered pair of normalised answers, so the relation is symmetric."""
    return mathverify.equal(a, b, timeout_s)


def math_equal(a: str, b: str, timeout_s: float = 5.0) -> bool:
    """Whether two math answers denote the same value; never raises on model output.

    Equal normalised strings, else math-verify's `verify` limited to `timeout_s`. Unparseable
    input, a timeout or any error means False. Results are cached (a timeout under load is
    cached as False too, so a pathological answer costs one timeout per process).

    Raises:
        RuntimeError: if math-verify's child process cannot start (not installed).
    """
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    na, nb = normalize_math(a), normalize_math(b)
    if na == nb:
        return bool(na)
    first, second = sorted((na, nb))
    return _math_equal_cached(first, second, float(timeout_s))
