"""Answer extraction, equivalence and voting: what best-of-N counts as "the same answer"."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tts_service.aggregate import (
    Vote,
    extract_answer,
    is_correct,
    leader_is_final,
    majority_vote,
    math_equal,
    normalize_code,
    normalize_math,
)

# ------------------------------------------------------------------------------------ extraction

MATH_OUTPUT = r"""We need $\frac{a}{b}$ with $a=1$, $b=2$. A first guess was $\boxed{\frac{1}{3}}$,
but recomputing the ratio gives

$$\boxed{\frac{1}{2}}$$

so the probability is one half."""


def test_boxed_nested_braces():
    assert extract_answer(r"The answer is $\boxed{\frac{1}{2}}$.", "math") == r"\frac{1}{2}"
    assert extract_answer(r"Thus $\boxed{{a}+{b}}$.", "math") == "{a}+{b}"
    assert extract_answer(r"\boxed{\sqrt{\frac{3}{4}}}", "math") == r"\sqrt{\frac{3}{4}}"
    assert extract_answer(r"So \fbox{x^{2}+1} holds", "math") == "x^{2}+1"


def test_last_box_wins():
    assert extract_answer(MATH_OUTPUT, "math") == r"\frac{1}{2}"


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 12.",
        r"Final: \boxed{\frac{1}{2}",  # truncated generation: unbalanced
        r"\boxed{3} and then \boxed{\frac{1}{2}",  # the last box is unbalanced
    ],
)
def test_boxed_missing_or_unbalanced(text):
    assert extract_answer(text, "math") is None


@pytest.mark.parametrize(
    "text, letter",
    [
        ("Option C fits the data best.\n\nAnswer: C", "C"),
        ("Eliminating A and B leaves one choice.\nAnswer: (C)", "C"),
        ("So the correct option is the third.\n\nAnswer: **c**", "C"),
        ("answer:c)", "C"),
        ("**Answer:** J", "J"),
        ("Answer: B\nWait, I mis-read the table.\nAnswer: (D)", "D"),
    ],
)
def test_choice_extraction(text, letter):
    assert extract_answer(text, "choice") == letter


@pytest.mark.parametrize(
    "text",
    [
        "I think it is C but I am not sure.",
        "Answer: K",  # outside A-J
        "The answer: a careful look at the options shows nothing.",
    ],
)
def test_choice_absent(text):
    assert extract_answer(text, "choice") is None


CODE_OUTPUT = """First a naive attempt:

```python
def solve(n):
    return sum(range(n))
```

That is off by one. Fixed:

```python
def solve(n):
    # include n itself
    return sum(range(n + 1))
```
"""


def test_code_last_block():
    assert extract_answer(CODE_OUTPUT, "code") == (
        "def solve(n):\n    # include n itself\n    return sum(range(n + 1))"
    )
    assert extract_answer("```\nprint(1)\n```", "code") == "print(1)"  # no language tag


@pytest.mark.parametrize(
    "text", ["no code here", "```python\ndef f():\n    pass\n", "```python\n\n```"]
)
def test_code_absent(text):
    assert extract_answer(text, "code") is None


def test_unknown_task_raises():
    with pytest.raises(ValueError):
        extract_answer("Answer: C", "essay")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- normalisation


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


# ----------------------------------------------------------------------------------- equivalence


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
    ],
)
def test_math_equal(a, b):
    assert math_equal(a, b)
    assert math_equal(b, a)


@pytest.mark.parametrize("a, b", [("x+1", "x+2"), ("0.333", r"\frac{1}{3}"), ("2", r"\sqrt{2}")])
def test_math_not_equal(a, b):
    assert not math_equal(a, b)


def test_pathological_sympy_input_times_out():
    start = time.monotonic()
    assert math_equal("9^9^9^9", "1", timeout_s=2) is False
    assert time.monotonic() - start < 10


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
    assert math_equal(garbage, "1", timeout_s=2) is False  # type: ignore[arg-type]


def test_model_output_is_not_executed(tmp_path: Path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert math_equal(payload, "0", timeout_s=2) is False
    assert not marker.exists()


# ---------------------------------------------------------------------------------------- voting


def test_vote_groups_equivalent_math_answers():
    answers = ["0.5", r"\frac{1}{3}", r"\frac{1}{2}", "1/2", r"\frac{1}{3}"]
    vote = majority_vote(answers, "math")
    assert vote.answer == "0.5"  # winner in the form of its first occurrence
    assert vote.votes == {"0.5": 3, r"\frac{1}{3}": 2}
    assert vote.winner_indices == (0, 2, 3)
    assert vote.share == pytest.approx(3 / 5)


def test_vote_counts_missing_answers():
    vote = majority_vote(["C", None, "c", None, "B"], "choice")
    assert vote == Vote(
        answer="C",
        votes={"C": 2, "B": 1},
        share=2 / 5,  # trajectories without an answer stay in the denominator
        num_trajectories=5,
        num_no_answer=2,
        winner_indices=(0, 2),
    )


def test_vote_all_missing():
    vote = majority_vote([None, None, None], "math")
    assert vote.answer is None and vote.share == 0 and vote.votes == {}
    assert vote.num_no_answer == 3 and vote.num_trajectories == 3
    assert majority_vote([], "choice").answer is None


def test_vote_tie_goes_to_first_appearance():
    assert majority_vote(["B", "A", "A", "B"], "choice").answer == "B"
    assert majority_vote(["A", "B", "B", "A"], "choice").answer == "A"
    assert majority_vote([None, "7", "3", "3", "7"], "math").answer == "7"


def test_vote_groups_code_by_normalised_form():
    v1 = "def f(x):\n    return x * 2"
    v1_commented = "def f(x):\n    # twice\n    return x * 2   \n"
    v2 = "def f(x):\n    return x + x"
    vote = majority_vote([v2, v1, v1_commented, None], "code")
    assert vote.answer == v1 and vote.winner_indices == (1, 2)
    assert vote.votes == {v2: 1, v1: 2} and vote.num_no_answer == 1


def test_vote_code_only_passing_trajectories_vote():
    good = "def f(x):\n    return x * 2"
    bad = "def f(x):\n    return x ** 2"
    answers = [bad, bad, bad, good, None]
    vote = majority_vote(answers, "code", tests_outcomes=[False, False, False, True, True])
    assert vote.answer == good and vote.votes == {good: 1} and vote.winner_indices == (3,)
    assert vote.share == pytest.approx(1 / 5) and vote.num_no_answer == 1
    assert majority_vote([bad], "code", tests_outcomes=[False]).answer is None
    with pytest.raises(ValueError):
        majority_vote([bad, good], "code", tests_outcomes=[True])
    with pytest.raises(ValueError):
        majority_vote(["A"], "choice", tests_outcomes=[True])


def test_vote_from_raw_model_outputs():
    outputs = [MATH_OUTPUT, r"It is $\boxed{0.5}$.", "I could not finish the", r"\boxed{2}"]
    vote = majority_vote([extract_answer(o, "math") for o in outputs], "math")
    assert vote.answer == r"\frac{1}{2}" and vote.votes[r"\frac{1}{2}"] == 2
    assert vote.num_no_answer == 1


# ------------------------------------------------------------------------------ early stop, grade


@pytest.mark.parametrize(
    "votes, remaining, final",
    [
        ({"A": 5, "B": 2}, 2, True),
        ({"A": 5, "B": 2}, 3, False),  # 5 vs 2+3 would tie: not final
        ({"A": 3}, 2, True),  # the runner-up may be a class not seen yet
        ({"A": 3}, 3, False),
        ({"A": 2, "B": 2}, 0, False),  # already a tie
        ({"A": 1, "B": 0}, 0, True),
        ({}, 0, False),
    ],
)
def test_leader_is_final(votes, remaining, final):
    assert leader_is_final(votes, remaining) is final


def test_is_correct():
    assert is_correct(r"\dfrac{1}{2}", "0.5", "math")
    assert not is_correct("0.4", "0.5", "math")
    assert not is_correct(None, "0.5", "math")
    assert is_correct("c", "C", "choice")
    assert not is_correct("B", "C", "choice")
    with pytest.raises(ValueError):
        is_correct("print(1)", "print(1)", "code")
