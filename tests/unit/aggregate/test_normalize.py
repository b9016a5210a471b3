"""Normalisation: trivially different spellings of one answer map to one string."""

from __future__ import annotations

import pytest

from tts_service.aggregate.normalize import normalize_code, normalize_math


@pytest.mark.parametrize(
    "raw, norm",
    [
        (r"$\dfrac{1}{2}$", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"5\text{ cm}", "5cm"),
        ("1,000", "1000"),
        ("(1,000, 2)", "(1,000,2)"),  # a tuple, not a number: commas stay
        ("42.", "42"),
        (r"3\!\cdot\!4", r"3\cdot4"),
    ],
)
def test_normalize_math(raw, norm):
    assert normalize_math(raw) == norm


def test_normalize_code_ignores_comments_and_layout():
    a = "def f(x):\n    # double it\n    return 2 * x   \n\n"
    b = "def f(x):\n    return 2 * x  # doubled\n"
    assert normalize_code(a) == normalize_code(b) == "def f(x):\n    return 2 * x"
    assert normalize_code("s = 'x #fff'  # colour") == "s = 'x #fff'"  # `#` in a string stays
