"""Benchmark graders on the shipped fixtures and realistic model output: the last box, the
final answer line, the last code block, output comparison, and an item's row with its votes."""

from __future__ import annotations

import json

import pytest

from tts_service.tasks import grading
from tts_service.tasks.grading import (
    MAX_VALUE_BYTES,
    grade,
    grade_item,
    json_depth,
    stdout_matches,
    value_matches,
)
from tts_service.tasks.loaders import FIXTURES_DIR
from tts_service.tasks.prompts import LETTERS
from tts_service.tasks.sandbox import Limits

SOLUTIONS = json.loads((FIXTURES_DIR / "lcb_reference_solutions.json").read_text())


REASONING = (
    "We need the remainder of $2^{10}$ modulo $1000$. First, $2^{10} = 1024$. "
    "Hmm, let me double-check: $2^5 = 32$ and $32^2 = 1024$. An intermediate guess of "
    "\\boxed{1024} is not reduced yet. Since $1024 - 1000 = 24$, the remainder is "
    "$\\boxed{24}$.\n\n**Final Answer**\n\\[\n\\boxed{\\dfrac{48}{2}}\n\\]"
)


def test_math_grading_on_a_long_trace_uses_the_last_box_and_equivalence(items):
    item = items["aime24"][0]
    result = grade(item, REASONING)
    assert result.answer == "\\frac{48}{2}" and result.correct  # as math-verify normalised it
    assert not grade(item, REASONING.replace("{48}{2}", "{48}{3}")).correct
    assert grade(item, "I think it is 24.").answer == "24"  # no box: the last number
    assert grade(item, "I could not finish the").answer is None


def test_choice_grading_reads_the_final_answer_line(items):
    item = items["gpqa"][0]
    wrong = next(x for x in LETTERS if x != item.answer)
    text = (
        f"Option {wrong} looks tempting because the answer: {wrong} appears in a textbook, "
        "but using h = g t^2 / 2 gives t = 2 s.\n\n"
        f"Answer: {item.answer}"
    )
    assert grade(item, text).correct
    assert not grade(item, f"Answer: **{wrong}**").correct


def test_code_grading_runs_the_last_block_after_prose(items):
    item = next(i for i in items["lcb"] if i.id == "abc900_c")
    text = (
        "Kadane's algorithm works here. A first attempt:\n```python\nprint(0)\n```\n"
        "That ignores the input. The full solution:\n\n```python\n"
        + SOLUTIONS["abc900_c"]
        + "```\nThis runs in O(N)."
    )
    result = grade(item, text, Limits(timeout_s=4))
    assert result.correct and [c.reason for c in result.cases] == ["passed"] * 4
    buggy = text.replace("max(x, cur + x)", "cur + x")
    result = grade(item, buggy, Limits(timeout_s=4))
    assert not result.correct and result.cases[-1].reason == "wrong_answer"
    assert len(result.cases) < len(item.tests)  # stops at the first failure


@pytest.mark.parametrize("qid", ["abc900_f", "3902", "3906"])
def test_reference_solutions_pass_every_fixture_test(items, qid):
    item = next(i for i in items["lcb"] if i.id == qid)
    assert grade(item, f"```python\n{SOLUTIONS[qid]}```", Limits(timeout_s=4)).correct


def test_output_comparison_rules():
    assert stdout_matches("3 \n4\n\n", "3\n4")
    assert stdout_matches("0.3333333\n", "0.33333333")
    assert not stdout_matches("3\n", "3\n4\n")
    assert value_matches("[1, 2]", "[1,2]") and value_matches("2.5000001", "2.5")
    assert not value_matches("1", "true") and not value_matches(None, "1")


def test_an_item_row_grades_every_trajectory_and_the_votes(items):
    item = items["aime24"][0]
    texts = ["\\boxed{25}", "\\boxed{24}", "\\boxed{25}", "no answer"]
    records = [
        {
            "index": i,
            "text": t,
            "finish_reason": "stop",
            "stats": {"new_tokens": 10, "target_forwards": 5, "wall_s": 0.5},
        }
        for i, t in enumerate(texts)
    ]
    row = grade_item(item, records[::-1])  # records arrive in finish order
    assert row["correct"] == [False, True, False, False]
    assert row["maj_correct"] == {"1": False, "2": False, "4": False}  # 25 wins 2:1
    assert row["stats"] == {"new_tokens": 40, "target_forwards": 20, "wall_s": 2.0}
    assert row["vote"]["no_answer"] == 1 and row["id"] == item.id


def test_a_code_item_row_runs_each_distinct_program_once(items, monkeypatch):
    import tts_service.tasks.grading as grading

    item = next(i for i in items["lcb"] if i.id == "abc900_a")
    calls = []
    real = grading.run_tests
    monkeypatch.setattr(grading, "run_tests", lambda *a: calls.append(1) or real(*a))
    program = f"```python\n{SOLUTIONS['abc900_a']}```"
    same = f"```python\n# sum them\n{SOLUTIONS['abc900_a']}```"
    records = [
        {
            "index": i,
            "text": t,
            "finish_reason": "stop",
            "stats": {"new_tokens": 1, "target_forwards": 1, "wall_s": 0.1},
        }
        for i, t in enumerate([program, same])
    ]
    row = grade_item(item, records)
    assert row["correct"] == [True, True] and len(calls) == 1
    assert row["trajectories"][0]["tests"] == {"passed": 4, "total": 4}


NESTED = "[" * 200_000 + "]" * 200_000
STATS = {"new_tokens": 1, "target_forwards": 1, "wall_s": 0.1}


def test_a_returned_value_too_deep_or_too_large_is_a_wrong_answer_not_a_crash():
    assert not value_matches(NESTED, "[]")  # was a RecursionError out of the grader
    assert not value_matches("[" * 101 + "]" * 101, "[]")
    assert value_matches("[" * 100 + "]" * 100, "[" * 100 + "]" * 100)
    assert json_depth('["[[[", {"a": [1]}]', 10) == 3  # brackets inside strings do not count
    assert not value_matches("1" * (MAX_VALUE_BYTES + 1), "1")


def test_a_program_returning_a_value_deeper_than_the_parser_fails_its_case(items):
    item = next(i for i in items["lcb"] if i.func_name == "twoSum")
    program = (
        "```python\nimport os\nprint('[' * 200000 + ']' * 200000, flush=True)\nos._exit(0)\n```"
    )
    result = grade(item, program, Limits(timeout_s=4))
    assert not result.correct and result.cases[-1].reason == "wrong_answer"


def test_a_trajectory_the_grader_cannot_grade_is_counted_wrong_and_the_item_row_is_written(
    items, monkeypatch
):
    item = items["aime24"][0]
    records = [
        {"index": i, "text": t, "finish_reason": "stop", "stats": STATS}
        for i, t in enumerate(["\\boxed{24}", "\\boxed{24}", "\\boxed{24}"])
    ]
    real = grading.grade

    def breaks_on_the_second(item, text, limits=None):
        breaks_on_the_second.calls += 1
        if breaks_on_the_second.calls == 2:
            raise RecursionError("maximum recursion depth exceeded")
        return real(item, text, limits)

    breaks_on_the_second.calls = 0
    monkeypatch.setattr(grading, "grade", breaks_on_the_second)
    row = grade_item(item, records)
    assert row["correct"] == [True, False, True] and row["grader_errors"] == 1
    assert (
        row["trajectories"][1]["grader_error"] == "RecursionError: maximum recursion depth exceeded"
    )
    assert row["maj_correct"]["3"]
    failed = grade_item(item, records, failure="ValueError: boom")
    assert failed["correct"] == [False] * 3 and failed["grader_errors"] == 3


def test_an_item_row_is_written_even_from_records_missing_their_counters(items):
    """The failure row of jobs.evaluate: records cut short still give one row per trajectory."""
    item = items["aime24"][0]
    row = grade_item(item, [{"index": 1, "text": "\\boxed{24}"}, {"text": "x"}], failure="boom")
    assert row["correct"] == [False, False] and row["grader_errors"] == 2
    assert row["stats"] == {"new_tokens": 0, "target_forwards": 0, "wall_s": 0}
