"""Grade one trajectory against its item: is the answer it commits to correct?

- AIME: the answer math-verify extracts (the last `\\boxed{}` or "final answer is X", else
  "answer: X", else the last expression) against the reference by `aggregate.math_equal`
  (math-verify in a child process with a timeout).
- GPQA: the letter after the last `Answer:` against the shuffled correct letter.
- LiveCodeBench: the last fenced code block, run in the sandbox against the public, then the
  private tests, stopping at the first failure (as LiveCodeBench's own grader does). Output is
  compared line by line after stripping trailing whitespace, with numeric tokens equal within
  1e-6; functional results are compared as JSON values (floats within 1e-6, bool is not int).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from tts_service.aggregate import (
    Task,
    Vote,
    extract_answer,
    is_correct,
    majority_vote,
    normalize_code,
)
from tts_service.aggregate.confidence import aggregate_vote
from tts_service.tasks.items import EvalItem, TestCase
from tts_service.tasks.metrics import ks_for
from tts_service.tasks.sandbox import Limits, run_python

Reason = Literal[
    "passed", "wrong_answer", "timeout", "memory", "refused", "runtime_error", "grader_error"
]
MAX_VALUE_DEPTH = 100
"""The deepest returned JSON value compared; deeper is a wrong answer (a program's output must
not be able to exhaust the grader's stack)."""
MAX_VALUE_BYTES = 1 << 24


@dataclass(frozen=True)
class CaseResult:
    """One test case: passed, or why not. `detail` is in the evaluator's own words (at most an
    exception or refused operation's name from the sandbox), never what the program printed:
    that could be the contents of a file it read."""

    passed: bool
    reason: Reason
    detail: str = ""


@dataclass(frozen=True)
class Grade:
    """`answer` is what the trajectory committed to (for code, the program); `cases` are the
    code tests that ran, in order, up to the first failure."""

    answer: str | None
    correct: bool
    cases: tuple[CaseResult, ...] = ()

    def summary(self, num_tests: int) -> dict:
        """Small JSON for the item row: counts and the first failure."""
        failed = next((c for c in self.cases if not c.passed), None)
        out: dict = {"passed": sum(c.passed for c in self.cases), "total": num_tests}
        if failed is not None:
            out["failure"] = {"case": len(self.cases) - 1, "reason": failed.reason}
            out["failure"]["detail"] = failed.detail[:300]
        return out


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _close(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def stdout_matches(actual: str, expected: str) -> bool:
    """Same lines after stripping trailing whitespace; numeric tokens may differ by 1e-6."""
    got, want = _lines(actual), _lines(expected)
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(
            x == y or _close(x, y) for x, y in zip(gt, wt, strict=True)
        ):
            return False
    return True


def _difference(actual: str, expected: str) -> str:
    """Where a wrong output first differs, without quoting it."""
    got, want = _lines(actual), _lines(expected)
    if len(got) != len(want):
        return f"{len(got)} output lines, expected {len(want)}"
    line = next(i for i, (g, w) in enumerate(zip(got, want, strict=True), 1) if g != w)
    return f"output line {line} differs"


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def json_depth(text: str, limit: int) -> int:
    """The nesting depth of JSON `text` (brackets outside strings), counted up to `limit` + 1."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif ch in "]}":
            depth -= 1
    return deepest


def value_matches(actual_json: str | None, expected_json: str) -> bool:
    """A functional test's returned value (JSON, tuples already lists) against the expected.
    A value deeper than `MAX_VALUE_DEPTH` or longer than `MAX_VALUE_BYTES` does not match."""
    if actual_json is None or len(actual_json) > MAX_VALUE_BYTES:
        return False
    brackets = actual_json.count("[") + actual_json.count("{")
    if brackets > MAX_VALUE_DEPTH and json_depth(actual_json, MAX_VALUE_DEPTH) > MAX_VALUE_DEPTH:
        return False
    try:
        return _same_value(json.loads(actual_json), json.loads(expected_json))
    except (ValueError, RecursionError):
        return False


def run_case(code: str, case: TestCase, func_name: str | None, limits: Limits) -> CaseResult:
    if case.kind == "functional" and not func_name:
        return CaseResult(False, "runtime_error", "functional test without a func_name")
    result = run_python(code, case.input, func_name if case.kind == "functional" else None, limits)
    if result.status != "ok":
        return CaseResult(False, result.status, result.detail)
    if case.kind == "functional":
        if value_matches(result.value, case.output):
            return CaseResult(True, "passed")
        why = "no value returned" if result.value is None else "returned a different value"
        return CaseResult(False, "wrong_answer", why)
    if stdout_matches(result.stdout, case.output):
        return CaseResult(True, "passed")
    return CaseResult(False, "wrong_answer", _difference(result.stdout, case.output))


def run_tests(
    code: str, tests: tuple[TestCase, ...], func_name: str | None, limits: Limits
) -> tuple[CaseResult, ...]:
    """Run tests in order until the first failure."""
    results: list[CaseResult] = []
    for case in tests:
        results.append(run_case(code, case, func_name, limits))
        if not results[-1].passed:
            break
    return tuple(results)


def grade(item: EvalItem, text: str, limits: Limits | None = None) -> Grade:
    """Extract the trajectory's answer and grade it; no answer is wrong."""
    answer = extract_answer(text, item.answer_kind)
    if answer is None:
        return Grade(None, False)
    if item.task == "lcb":
        cases = run_tests(answer, item.tests, item.func_name, limits or Limits())
        correct = bool(item.tests) and len(cases) == len(item.tests) and cases[-1].passed
        return Grade(answer, correct, cases)
    assert item.answer is not None  # math and choice items always carry a reference
    return Grade(answer, is_correct(answer, item.answer, item.answer_kind))


def majority_correct(
    answers: list[str | None], correct: list[bool], kind: Task, ks: list[int]
) -> dict[int, bool]:
    """k -> whether the majority vote of the first k trajectories is correct."""
    return {k: vote_correct(majority_vote(answers[:k], kind), correct) for k in ks}


def vote_correct(vote: Vote, correct: list[bool]) -> bool:
    """Whether `vote` (winners by position in `correct`) is correct: members of a class are
    equivalent, so the vote is as correct as its first member; no winner is wrong."""
    return bool(vote.winner_indices) and correct[vote.winner_indices[0]]


def weighted_correct(
    answers: list[str | None], correct: list[bool], sure: list[dict] | None, kind: str
) -> dict[str, bool]:
    """Whether the confidence-weighted and the filtered votes of all N are correct (nothing
    without every trajectory's confidence): the same samples as maj@N, other votes."""
    if sure is None:
        return {}
    return {
        f"{name}_correct": vote_correct(aggregate_vote(name, answers, sure, kind), correct)
        for name in ("confidence", "filtered")
    }


def grader_error(answer: str | None, error: BaseException | str) -> Grade:
    """A trajectory the grader could not grade: wrong, with the reason kept."""
    why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return Grade(answer, False, (CaseResult(False, "grader_error", why[:300]),))


def grade_item(
    item: EvalItem, records: list[dict], limits: Limits | None = None, failure: str | None = None
) -> dict:
    """The item's JSONL row: every trajectory graded, the votes at each k, summed counters. An
    exception while grading one trajectory makes it wrong with reason `grader_error` (counted
    in the row's `grader_errors`), never the evaluation's end.

    Args:
        records: the item's trajectory records (`index`, `text`, `finish_reason`, `stats`).
        failure: grade nothing; every trajectory is a `grader_error` for this reason (the row
            of an item whose grading failed outside one trajectory, so a resume skips it).
    """
    records = sorted(
        ({**r, "index": r.get("index", i)} for i, r in enumerate(records)), key=lambda r: r["index"]
    )
    if failure is not None:
        grades = [grader_error(None, failure) for _ in records]
    else:
        grades = _grade_records(item, records, limits)
    correct = [g.correct for g in grades]
    answers = [g.answer for g in grades]
    vote = majority_vote(answers, item.answer_kind)
    trajectories = [_trajectory_row(item, rec, g) for rec, g in zip(records, grades, strict=True)]
    maj = majority_correct(answers, correct, item.answer_kind, ks_for(len(records)))
    sure = [r.get("confidence") for r in records]
    return {
        "id": item.id,
        "task": item.task,
        "reference": item.answer,
        "meta": item.meta,
        "vote": {"answer": vote.answer, "share": vote.share, "no_answer": vote.num_no_answer},
        "correct": correct,
        "maj_correct": {str(k): v for k, v in maj.items()},
        **weighted_correct(answers, correct, None if None in sure else sure, item.answer_kind),
        "trajectories": trajectories,
        "grader_errors": sum("grader_error" in t for t in trajectories),
        "stats": {
            k: sum(t[k] for t in trajectories) for k in ("new_tokens", "target_forwards", "wall_s")
        },
    }


def _grade_records(item: EvalItem, records: list[dict], limits: Limits | None) -> list[Grade]:
    """Every record graded in order; one that raises is a `grader_error`, and identical LCB
    programs are run once (their grade reused)."""
    by_program: dict[str, Grade] = {}
    grades = []
    for rec in records:
        try:
            answer = extract_answer(rec["text"], item.answer_kind)
        except Exception as e:  # noqa: BLE001 - one trajectory's text never ends the job
            grades.append(grader_error(None, e))
            continue
        try:
            key = normalize_code(answer) if item.task == "lcb" and answer is not None else None
        except Exception:  # noqa: BLE001 - unparseable code is graded, just not deduplicated
            key = None
        if key is not None and key in by_program:
            grades.append(by_program[key])
            continue
        try:
            grades.append(grade(item, rec["text"], limits))
        except Exception as e:  # noqa: BLE001 - nor does one program's output
            grades.append(grader_error(answer, e))
        if key is not None:
            by_program[key] = grades[-1]
    return grades


def _trajectory_row(item: EvalItem, rec: dict, g: Grade) -> dict:
    """One trajectory's entry in the item row: its answer, verdict and counters."""
    row = {"index": rec["index"], "answer": g.answer, "correct": g.correct}
    row["finish_reason"] = rec.get("finish_reason")
    stats = rec.get("stats") or {}  # a record cut short still gets its row
    row.update({k: stats.get(k, 0) for k in ("new_tokens", "target_forwards", "wall_s")})
    if item.task == "lcb":
        row["tests"] = g.summary(len(item.tests))
    if g.cases and g.cases[-1].reason == "grader_error":
        row["grader_error"] = g.cases[-1].detail
    return row
