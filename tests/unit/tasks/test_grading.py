"""Benchmark loaders, prompts and graders on the shipped fixtures and realistic model output."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from tts_service.tasks.grading import grade, grade_item, stdout_matches, value_matches
from tts_service.tasks.items import TASK_NAMES
from tts_service.tasks.loaders import (
    FIXTURES_DIR,
    DatasetUnavailable,
    decode_tests,
    lcb_release_files,
    load_rows,
)
from tts_service.tasks.prompts import LETTERS, build_items, gpqa_item
from tts_service.tasks.sandbox import Limits

SOLUTIONS = json.loads((FIXTURES_DIR / "lcb_reference_solutions.json").read_text())


@pytest.fixture(scope="module")
def items():
    return {t: build_items(t, load_rows(t, "fixtures"), run_seed=0) for t in TASK_NAMES}


def test_fixtures_load_in_each_datasets_own_schema(items):
    rows = load_rows("lcb", "fixtures")
    assert {"question_content", "starter_code", "private_test_cases", "metadata"} <= set(rows[0])
    assert {"Question", "Correct Answer", "Record ID"} <= set(load_rows("gpqa", "fixtures")[0])
    assert {"id", "problem", "solution", "answer", "url", "year"} <= set(
        load_rows("aime24", "fixtures")[0]
    )
    assert all(len(items[t]) >= 10 for t in TASK_NAMES)
    kinds = {c.kind for item in items["lcb"] for c in item.tests}
    assert kinds == {"stdin", "functional"}
    # the private tests are stored in the real compressed encoding
    assert not rows[0]["private_test_cases"].lstrip().startswith("[")


def test_decoding_plain_json_and_the_compressed_encoding():
    cases = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    text = json.dumps(cases)
    real = base64.b64encode(zlib.compress(pickle.dumps(text))).decode()
    assert decode_tests(text) == decode_tests(real) == cases
    assert decode_tests(base64.b64encode(zlib.compress(text.encode())).decode()) == cases
    assert decode_tests("") == []


def test_decoding_refuses_a_pickle_that_needs_a_global():
    class Evil:
        def __reduce__(self):
            return (print, ("this would run",))

    blob = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(ValueError, match="refusing to load global"):
        decode_tests(blob)
    with pytest.raises(ValueError, match="undecodable"):
        decode_tests("not base64 at all!")


def test_release_tags_resolve_to_the_scripts_files():
    assert lcb_release_files("release_v1") == ["test.jsonl"]
    assert lcb_release_files("release_v5")[-1] == "test5.jsonl"
    assert len(lcb_release_files("release_latest")) == 6
    assert lcb_release_files("v2_v3") == ["test2.jsonl", "test3.jsonl"]
    with pytest.raises(ValueError, match="unknown LiveCodeBench release"):
        lcb_release_files("release_v9")


@pytest.mark.parametrize("task", TASK_NAMES)
def test_an_unreachable_hub_says_how_to_get_the_data(task, monkeypatch):
    import datasets

    asked = []

    def unreachable(*args, **kwargs):
        asked.append((args, kwargs))
        raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DatasetUnavailable) as err:
        load_rows(task, "hub")
    message = str(err.value)
    assert "--data-files" in message and "HF_TOKEN" in message and "--data fixtures" in message
    assert {"aime24": "aime_2024", "gpqa": "gpqa", "lcb": "code_generation_lite"}[task] in message
    if task == "lcb":  # the release's files, read by the JSON builder
        assert asked[0][1]["data_files"][-1].endswith("code_generation_lite/test5.jsonl")
    if task == "gpqa":
        assert asked[0][0] == ("Idavidrein/gpqa", "gpqa_diamond")


def test_a_gated_dataset_without_a_token_is_a_clear_error(monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def gated(*args, **kwargs):
        raise DatasetNotFoundError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub.")

    monkeypatch.setattr(datasets, "load_dataset", gated)
    with pytest.raises(DatasetUnavailable, match="gated dataset.*accepting the dataset's terms"):
        load_rows("gpqa", "hub")


def test_local_files_must_exist_and_carry_the_fields(tmp_path):
    with pytest.raises(DatasetUnavailable, match="no such file"):
        load_rows("aime24", "files", [tmp_path / "missing.jsonl"])
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "q", "answer": "1"}\n')
    with pytest.raises(DatasetUnavailable, match="lack the aime24 field"):
        load_rows("aime24", "files", [wrong])
    copy = tmp_path / "copy.jsonl"
    copy.write_text((FIXTURES_DIR / "aime24.jsonl").read_text())
    assert len(load_rows("aime24", "files", [copy])) == 12


def test_gpqa_shuffle_is_seeded_per_item_and_recorded():
    row = load_rows("gpqa", "fixtures")[0]
    a, b, other = gpqa_item(row, 0), gpqa_item(row, 0), gpqa_item(row, 1)
    assert a == b
    letter = a.meta["correct_letter"]
    assert a.answer == letter and f"{letter}) {row['Correct Answer']}" in a.prompt
    assert a.meta["order"][LETTERS.index(letter)] == 0 and sorted(a.meta["order"]) == [0, 1, 2, 3]
    assert other.meta["shuffle_seed"] != a.meta["shuffle_seed"]
    assert "Answer: X" in a.prompt


def test_the_correct_letter_is_not_always_the_same(items):
    assert len({item.answer for item in items["gpqa"]}) > 1


def test_prompts_ask_for_the_graded_format(items):
    assert all("\\boxed{}" in i.prompt for i in items["aime24"])
    lcb = {i.id: i for i in items["lcb"]}
    assert "class Solution" in lcb["3901"].prompt and lcb["3901"].func_name == "twoSum"
    assert "standard input" in lcb["abc900_a"].prompt and lcb["abc900_a"].func_name is None
    assert all("```python" in i.prompt for i in items["lcb"])


REASONING = (
    "We need the remainder of $2^{10}$ modulo $1000$. First, $2^{10} = 1024$. "
    "Hmm, let me double-check: $2^5 = 32$ and $32^2 = 1024$. An intermediate guess of "
    "\\boxed{1024} is not reduced yet. Since $1024 - 1000 = 24$, the remainder is "
    "$\\boxed{24}$.\n\n**Final Answer**\n\\[\n\\boxed{\\dfrac{48}{2}}\n\\]"
)


def test_math_grading_on_a_long_trace_uses_the_last_box_and_equivalence(items):
    item = items["aime24"][0]
    result = grade(item, REASONING)
    assert result.answer == "\\dfrac{48}{2}" and result.correct
    assert not grade(item, REASONING.replace("{48}{2}", "{48}{3}")).correct
    assert grade(item, "I think it is 24.").answer is None  # no box: no answer


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
