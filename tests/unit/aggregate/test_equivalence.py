"""Math equivalence: equal values compare equal, and model output can neither hang nor run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tts_service.aggregate.equivalence import math_equal


@pytest.mark.parametrize(
    "a, b",
    [
        (r"\frac{1}{2}", "0.5"),
        (r"\frac{1}{2}", "1/2"),
        (r"\dfrac12", "0.5"),
        ("10", "10.0"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        (r"\frac{\pi}{2}", r"\pi/2"),
        (r"50\%", r"\frac{1}{2}"),
        # what the hand-written converter got wrong (issue 17)
        ("033", "33"),  # AIME answers are zero-padded
        ("x=5", "5"),
        (r"3\text{ cm}", "3"),
        (r"\{1,2\}", r"\{2,1\}"),
        (r"\log_2 8", "3"),
        ("1.5e3", "1500"),
        ("$1,000$", "1000"),
        (r"90^\circ", "90"),
        (r"\left( 1, 2 \right)", "(1,2)"),
    ],
)
def test_math_equal(a, b):
    assert math_equal(a, b)
    assert math_equal(b, a)


@pytest.mark.parametrize(
    "a, b",
    [("x+1", "x+2"), ("0.333", r"\frac{1}{3}"), ("2", r"\sqrt{2}"), ("33", "34"), ("", "")],
)
def test_math_not_equal(a, b):
    assert not math_equal(a, b)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "}{",
        r"\boxed{",
        r"\frac{1}",
        "1/0",
        "((((((",
        r"\undefinedmacro{3}",
        "x" * 5000,
        "🙂",
        "\x00\\",
        None,
    ],
)
def test_math_equal_never_raises(garbage):
    assert math_equal(garbage, "1", timeout_s=5) is False  # type: ignore[arg-type]


def test_model_output_is_not_executed(tmp_path: Path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert math_equal(payload, "0", timeout_s=5) is False
    assert not marker.exists()
