"""The values every task module shares: an evaluation item and a code test case.

An item is one benchmark question made ready for the model: the prompt it is asked, the
reference the grader needs, and whatever was decided while building it (GPQA's choice order),
so that a run can be audited and repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tts_service.aggregate import Task

TaskName = Literal["aime24", "gpqa", "lcb"]
TASK_NAMES: tuple[TaskName, ...] = ("aime24", "gpqa", "lcb")
TASK_ALIASES: dict[str, TaskName] = {
    "gpqa_diamond": "gpqa",  # lm-eval's group
    "gpqa_diamond_zeroshot": "gpqa",
    "gpqa_diamond_cot_zeroshot": "gpqa",
    "gpqa_diamond_generative_n_shot": "gpqa",
    "gpqa:diamond": "gpqa",  # lighteval's
    "livecodebench": "lcb",
    "lcb:codegeneration": "lcb",  # lighteval's
}
"""lm-eval / lighteval spellings `--tasks` also accepts (a lighteval spec `suite|task|k|t`
names its task second: `lighteval|aime24|0|0`)."""


def task_name(spelled: str) -> TaskName | None:
    """Our name for a task spelled as we, lm-eval or lighteval spell it; None if unknown."""
    name = spelled.strip()
    if name.count("|") == 3:  # lighteval's suite|task|few-shot|truncate
        name = name.split("|")[1]
    if name in TASK_NAMES:
        return name  # type: ignore[return-value]
    return TASK_ALIASES.get(name)


ANSWER_KIND: dict[TaskName, Task] = {"aime24": "math", "gpqa": "choice", "lcb": "code"}
"""How `tts_service.aggregate` extracts and votes on each task's answers."""


@dataclass(frozen=True)
class TestCase:
    """One LiveCodeBench test: `stdin` feeds `input` to the program and compares its output;
    `functional` passes the JSON lines of `input` as arguments to `Solution().<func_name>`."""

    __test__ = False  # a value, not a pytest test class

    input: str
    output: str
    kind: Literal["stdin", "functional"]


@dataclass(frozen=True)
class EvalItem:
    """One question as asked: `prompt` is the user message (the actor applies the chat template).

    `answer` is the reference for math (the number) and GPQA (the letter after shuffling); code
    items carry `tests` (public first, then private) and, for functional tests, `func_name`.
    `meta` records choices made while building the item, e.g. GPQA's permutation and seed.
    """

    id: str
    task: TaskName
    prompt: str
    answer: str | None = None
    tests: tuple[TestCase, ...] = ()
    func_name: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def answer_kind(self) -> Task:
        return ANSWER_KIND[self.task]
