"""Answer extraction: which answer a raw trajectory commits to, if any."""

from __future__ import annotations

import pytest

from tts_service.aggregate.extract import extract_answer

MATH_OUTPUT = r"""We need $\frac{a}{b}$ with $a=1$, $b=2$. A first guess was $\boxed{\frac{1}{3}}$,
but recomputing the ratio gives

$$\boxed{\frac{1}{2}}$$

so the probability is one half."""


def test_boxed_nested_braces():
    assert extract_answer(r"The answer is $\boxed{\frac{1}{2}}$.", "math") == r"\frac{1}{2}"
    assert extract_answer(r"Thus $\boxed{{a}+{b}}$.", "math") == "{a}+{b}"
    assert extract_answer(r"\boxed{\sqrt{\frac{3}{4}}}", "math") == r"\sqrt{\frac{3}{4}}"


def test_last_box_wins():
    assert extract_answer(MATH_OUTPUT, "math") == r"\frac{1}{2}"


@pytest.mark.parametrize(
    "text, answer",
    [
        ("The final answer is 32.", "32"),  # SmolLM2's own words (issue 17)
        ("17 + 15 = 32\n\nSo the final answer is 32.", "32"),
        ("The answer is 12.", "12"),
        ("Answer: 1,000 dollars", "1000"),
        ("7 + 5 = 12", "12"),  # no anchor: the last expression
        (r"So $x = 5$.", "x = 5"),
    ],
)
def test_plain_text_answers(text, answer):
    assert extract_answer(text, "math") == answer


@pytest.mark.parametrize(
    "text", ["", "I could not finish the", "I'm sorry, I can't help with that."]
)
def test_math_answer_missing(text):
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
        ("The answer is B.", "B"),
        ("So the correct answer is (C) 7.", "C"),
        ('The answer is "D"', "D"),
        ("The correct choice is B) 2", "B"),
        ("The answer is D. The answer is a solid answer.", "D"),
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
        "The answer is a guess at best.",
        "The answer is I think not listed.",
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
