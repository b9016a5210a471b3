"""Benchmark prompts: GPQA's seeded shuffle, recorded per item, and every task asking for the
format it is graded on."""

from __future__ import annotations

from tts_service.tasks.loaders import load_rows
from tts_service.tasks.prompts import LETTERS, gpqa_item


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
