"""Majority vote over N trajectories' answers, the early-stop test on a running vote, and grading.

Answers are grouped into equivalence classes (normalised form; `math_equal` for math), so the
vote counts meanings rather than spellings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tts_service.aggregate.equivalence import math_equal
from tts_service.aggregate.extract import TASKS, Task
from tts_service.aggregate.normalize import normalize_answer, normalize_choice


@dataclass(frozen=True)
class Vote:
    """Outcome of a majority vote over N trajectories.

    `votes` is keyed by each class's canonical (normalised) representative in order of first
    appearance; `answer` is the winner as first written. `share` divides by all trajectories,
    including those without an answer, so a vote won by 2 of 10 reads as weak.
    """

    answer: str | None
    votes: dict[str, int]
    share: float
    num_trajectories: int
    num_no_answer: int
    winner_indices: tuple[int, ...]

    def to_dict(self) -> dict:
        """The vote as every report shows it (CLI, jobs, Serve)."""
        return {
            "answer": self.answer,
            "votes": self.votes,
            "share": self.share,
            "no_answer": self.num_no_answer,
            "winner_indices": list(self.winner_indices),
        }


@dataclass
class _Class:
    rep: str
    members: list[int]


def majority_vote(
    answers: Sequence[str | None],
    task: Task,
    tests_outcomes: Sequence[bool] | None = None,
    weights: Sequence[float] | None = None,
) -> Vote:
    """Group answers into equivalence classes and pick the largest (with `weights`, the class
    whose members' weights sum highest: a confidence-weighted vote, `aggregate.confidence`).

    Equivalence: math uses `math_equal` against each class representative (first match wins);
    choice and code compare normalised forms. For code, `tests_outcomes[i]` (if given) says
    whether trajectory i passed its tests; only passing ones vote. Answers that are None or
    normalise to empty count in `num_no_answer` and never win.

    Tie-break (deterministic): among classes with the most votes, the one whose first member
    appeared earliest wins.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
    if tests_outcomes is not None:
        if task != "code":
            raise ValueError("tests_outcomes only applies to task='code'")
        if len(tests_outcomes) != len(answers):
            raise ValueError(
                f"tests_outcomes has {len(tests_outcomes)} entries for {len(answers)} answers"
            )
    if weights is not None and len(weights) != len(answers):
        raise ValueError(f"weights has {len(weights)} entries for {len(answers)} answers")
    classes: list[_Class] = []
    by_rep: dict[str, _Class] = {}
    no_answer = 0
    for i, raw in enumerate(answers):
        key = normalize_answer(raw, task) if raw is not None else ""
        if not key:
            no_answer += 1
            continue
        if tests_outcomes is not None and not tests_outcomes[i]:
            continue
        cls = by_rep.get(key)
        if cls is None and task == "math":
            cls = next((c for c in classes if math_equal(c.rep, key)), None)
        if cls is None:
            cls = _Class(rep=key, members=[])
            classes.append(cls)
            by_rep[key] = cls
        cls.members.append(i)

    n = len(answers)
    votes = {c.rep: len(c.members) for c in classes}
    if not classes:
        return Vote(None, votes, 0.0, n, no_answer, ())
    size = (
        (lambda c: len(c.members))
        if weights is None
        else (lambda c: sum(weights[i] for i in c.members))
    )
    winner = max(classes, key=size)  # max keeps the earliest on ties
    first = answers[winner.members[0]]
    return Vote(first, votes, len(winner.members) / n, n, no_answer, tuple(winner.members))


def with_indices(vote: Vote, order: Sequence[int]) -> Vote:
    """`vote` over answers listed in `order` (their trajectory indices), its winners named by
    index rather than by position in the list."""
    winners = tuple(order[k] for k in vote.winner_indices)
    return Vote(
        vote.answer, vote.votes, vote.share, vote.num_trajectories, vote.num_no_answer, winners
    )


def leader_is_final(votes: dict[str, int], remaining: int) -> bool:
    """Whether the leader wins even if all `remaining` trajectories back the runner-up.

    Strict (`leader > runner_up + remaining`), so a possible tie does not stop sampling early.
    """
    if remaining < 0:
        raise ValueError(f"remaining must be >= 0, got {remaining}")
    counts = sorted(votes.values(), reverse=True)
    leader = counts[0] if counts else 0
    runner_up = counts[1] if len(counts) > 1 else 0
    return leader > runner_up + remaining


def is_correct(predicted: str | None, reference: str, task: Task) -> bool:
    """Grade a predicted answer against the reference; no answer is wrong.

    Raises:
        ValueError: for code (correctness there means running tests, not comparing text).
    """
    if task == "code":
        raise ValueError("is_correct does not support task='code'; run the tests instead")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {TASKS})")
    if predicted is None:
        return False
    if task == "math":
        return math_equal(predicted, reference)
    return normalize_choice(predicted) == normalize_choice(reference)
