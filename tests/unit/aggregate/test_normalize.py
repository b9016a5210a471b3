"""Normalisation: identical answers, differently spaced, map to one string."""

from __future__ import annotations

import pytest

from tts_service.aggregate.normalize import normalize_code, normalize_math


@pytest.mark.parametrize(
    "raw, norm",
    [
        (r"$\frac{1}{2}$", r"\frac{1}{2}"),
        ("  42. ", "42"),
        ("1,  2", "1, 2"),
        (r"2\pi   r", r"2\pi r"),  # the space ends `\pi`: `\pir` would be another command
    ],
)
def test_normalize_math(raw, norm):
    assert normalize_math(raw) == norm


def test_normalize_code_ignores_comments_and_layout():
    a = "def f(x):\n    # double it\n    return 2 * x   \n\n"
    b = "def f(x):\n    return 2 * x  # doubled\n"
    assert normalize_code(a) == normalize_code(b) == "def f(x):\n    return 2 * x"
    assert normalize_code("s = 'x #fff'  # colour") == "s = 'x #fff'"  # `#` in a string stays
