"""The exact early stop: over random answers and finishing orders, a vote stopped as soon as it
is decided names the winner all N would have named; no-answer trajectories never decide it, a
possible tie keeps decoding, N = 1 decides nothing early."""

from __future__ import annotations

import random

import pytest

from tts_service.aggregate import majority_vote, normalize_answer
from tts_service.aggregate.early_stop import EarlyStop, decided_vote

TEXTS = {  # an answer as a trajectory writes it, per task
    "math": lambda a: f"... so we get \\boxed{{{'ABCD'.index(a) * 7}}}.",
    "choice": lambda a: f"... so the answer is: Answer: {a}",
    "code": lambda a: f"```python\nprint({a!r})\n```",
}


def _answers(rng: random.Random, n: int, kinds: int) -> list[str | None]:
    """n answers over `kinds` values, skewed (a likely leader), some without an answer."""
    values = "ABCD"[:kinds]
    weights = [2**-k for k in range(kinds)]
    return [None if rng.random() < 0.2 else rng.choices(values, weights)[0] for _ in range(n)]


def _stopped_run(task: str, answers: list[str | None], order: list[int]) -> tuple[dict, bool]:
    """Finish trajectories in `order` until EarlyStop says the vote is decided: what finished
    (index -> answer) and whether it stopped early."""
    stop = EarlyStop(len(answers), task)
    finished = {}
    for i in order:
        text = TEXTS[task](answers[i]) if answers[i] is not None else "I am not sure."
        finished[i] = answers[i]
        if stop.finished("p", i, text):
            return finished, True
    return finished, False


@pytest.mark.parametrize(("task", "runs"), [("choice", 400), ("code", 400), ("math", 40)])
def test_a_vote_stopped_early_names_the_full_vote_s_winner(task, runs):
    rng = random.Random(7)
    stopped = 0
    for _ in range(runs):
        n = rng.randint(1, 16)
        answers = _answers(rng, n, rng.randint(1, 4))
        order = rng.sample(range(n), n)
        texts = [TEXTS[task](a) if a is not None else "I am not sure." for a in answers]
        full = majority_vote([_extract(t, task) for t in texts], task)
        finished, early = _stopped_run(task, answers, order)
        stopped += early
        if not early:
            assert len(finished) == n
            continue
        assert len(finished) < n and full.answer is not None
        kept = [_extract(texts[i], task) for i in sorted(finished)]
        part = majority_vote(kept, task)
        assert normalize_answer(part.answer, task) == normalize_answer(full.answer, task)
    assert stopped > runs // 4  # the property was exercised, not vacuous


def _extract(text: str, task: str) -> str | None:
    from tts_service.aggregate import extract_answer

    return extract_answer(text, task)


def test_the_strict_rule_and_its_edges():
    assert decided_vote({}, 1, "choice") is None  # N = 1: nothing to decide early
    assert decided_vote({0: "A"}, 1, "choice") is not None  # all in: the vote itself
    assert decided_vote({0: "A", 1: "A"}, 3, "choice") is not None  # 2 > 0 + 1
    assert decided_vote({0: "A", 1: "B", 2: "A"}, 4, "choice") is None  # 2 = 1 + 1: a tie
    assert decided_vote({0: None, 1: None, 2: None}, 4, "choice") is None  # no answers
    assert decided_vote({3: "A", 5: "A", 6: "A", 9: "B"}, 6, "choice") is None  # 3 = 1 + 2
    vote = decided_vote({3: "A", 5: "A", 6: "A", 9: "B"}, 5, "choice")
    assert vote is not None and vote.winner_indices == (3, 5, 6)  # by trajectory index
    with pytest.raises(ValueError, match="answers for n"):
        decided_vote({0: "A", 1: "A"}, 1, "choice")


def test_failed_tests_do_not_vote_for_code():
    """Code votes count only trajectories whose tests passed: a failing one is no answer."""
    answers = {0: "print(1)", 1: "print(1)", 2: "print(1)", 3: "print(2)"}
    assert decided_vote(answers, 5, "code") is not None  # 3 > 1 + 1
    tests = {0: True, 1: False, 2: True, 3: True}
    assert decided_vote(answers, 5, "code", tests) is None  # 2 = 1 + 1: undecided


def test_early_stop_decides_each_problem_once_and_is_the_runner_s_skip_test():
    stop = EarlyStop(3, "choice")
    assert not stop.finished("p", 0, TEXTS["choice"]("A"))
    assert not stop.stopped("p")
    assert stop.finished("p", 2, TEXTS["choice"]("A"))  # 2 > 0 + 1
    assert stop.stopped("p") and not stop.stopped("q")
    assert not stop.finished("p", 1, TEXTS["choice"]("B"))  # already decided
    assert not EarlyStop(2, "choice").finished("q", 0, "no answer here")


def test_the_deciding_thread_ends_when_idle_and_comes_back(monkeypatch):
    """A server makes one early stop a request: its thread must not outlive the work."""
    import time

    from tts_service.aggregate import early_stop

    monkeypatch.setattr(early_stop, "IDLE_S", 0.05)
    stop = EarlyStop(3, "choice")
    stop.note("p", 0, TEXTS["choice"]("A"))
    stop.note("p", 1, TEXTS["choice"]("A"))
    deadline = time.monotonic() + 5
    while not stop.stopped("p") or stop._worker is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop.note("q", 0, TEXTS["choice"]("B"))  # a new thread for new work
    stop.note("q", 1, TEXTS["choice"]("B"))
    while not stop.stopped("q"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
