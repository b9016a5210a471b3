"""The exact early stop of a best-of-N vote in flight: once the leader is ahead of the runner-up
by more than the trajectories still running, nothing they could answer changes the winner, so
they stop (docs/design.md, "Early stop"). Trajectories without an answer do not vote; a
possible tie keeps decoding. The voted answer is the one all N would give, for any equivalence
that groups answers transitively (normalised strings: choice, code, and math answers
`math_equal` groups alike; `tests/unit/aggregate/test_early_stop.py`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tts_service.aggregate.extract import Task, extract_answer
from tts_service.aggregate.vote import Vote, leader_is_final, majority_vote, with_indices

IDLE_S = 1.0  # how long the deciding thread waits for another answer before it ends


def decided_vote(
    answers: Mapping[int, str | None],
    n: int,
    task: Task,
    tests: Mapping[int, bool] | None = None,
) -> Vote | None:
    """The vote over the finished trajectories' `answers` (index -> answer, in index order) if
    no outcome of the `n - len(answers)` still running can change its winner, else None. Its
    `winner_indices` are trajectory indices. `tests` (code): whether each passed its tests;
    only those that did vote."""
    if len(answers) > n:
        raise ValueError(f"{len(answers)} answers for n = {n}")
    order = sorted(answers)
    passed = None if tests is None else [tests[i] for i in order]
    vote = majority_vote([answers[i] for i in order], task, passed)
    if vote.answer is None or not leader_is_final(vote.votes, n - len(answers)):
        return None
    return with_indices(vote, order)


class EarlyStop:
    """One run's problems' votes as their trajectories finish, and the runner's skip test
    (`stopped`): a decided problem's rows leave the batch at the next step and their slots go
    to whatever waits. `finished` decides at once (a job's driver, tests); `note` hands the
    answer's extraction and the vote to a thread of its own, so that a runner never waits for
    them (math-verify runs in a child process: milliseconds a call, its start ~0.35 s), and
    the decision lands a step or two later (rows finished meanwhile are kept: exact still).
    Thread-safe."""

    def __init__(self, n: int, task: Task, in_thread: bool = True) -> None:
        self.n, self.task, self.in_thread = n, task, in_thread
        self.answers: dict[str, dict[int, str | None]] = {}
        self.decided: dict[str, Vote] = {}
        self._lock = threading.Lock()
        self._todo: queue.SimpleQueue[tuple[str, int, str]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def finished(self, problem_id: str, index: int, text: str) -> bool:
        """Trajectory `index` of `problem_id` finished with `text`: True if this decides the
        problem's vote (its other rows should stop)."""
        answer = extract_answer(text, self.task)
        with self._lock:
            if problem_id in self.decided:
                return False
            got = self.answers.setdefault(problem_id, {})
            got[index] = answer
            vote = decided_vote(got, self.n, self.task)
            if vote is not None and len(got) < self.n:
                self.decided[problem_id] = vote
                return True
            return False

    def note(self, problem_id: str, index: int, text: str) -> None:
        """`finished`, in the early stop's own thread (`in_thread`; else at once: tests that
        need the decision before the next step)."""
        if not self.in_thread:
            self.finished(problem_id, index, text)
            return
        with self._lock:
            self._todo.put((problem_id, index, text))
            if self._worker is None:
                self._worker = threading.Thread(target=self._decide, name="tts-vote", daemon=True)
                self._worker.start()

    def _decide(self) -> None:
        """Decide what `note` queued; end once idle for `IDLE_S` (a server makes one early stop
        a request: none of their threads outlives its work)."""
        while True:
            try:
                item = self._todo.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._todo.empty():
                        self._worker = None
                        return
                continue
            self.finished(*item)

    def stopped(self, problem_id: str) -> bool:
        return problem_id in self.decided

    def skipping(self, skip: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
        """A runner's skip test: a decided problem's rows (a `trajectory.TrajectoryRequest`'s
        `problem_id`), and whatever `skip` skips."""
        return lambda req: self.stopped(req.problem_id) or (skip is not None and skip(req))

    def noting(self, on_result: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """A runner's result callback: `note` sees each trajectory (a
        `trajectory.TrajectoryResult`), then `on_result` if given."""

        def note(res: Any) -> None:
            self.note(res.request.problem_id, res.request.index, res.output.text)
            if on_result is not None:
                on_result(res)

        return note
