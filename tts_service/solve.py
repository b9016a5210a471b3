"""Best-of-N for one or many problems: N trajectories per problem, sharing the problem's store,
all decoded by the one trajectory runner.

Trajectory i of a problem samples with seed `seed + i`. With `max_rows = 1` trajectories run
one after another, so the i-th drafts from everything the earlier ones stored (STAND's
setting); with more rows they decode continuously batched, a finished row's slot going to the
next waiting trajectory of the same problem or the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from store.base import NgramStore
from tts_service.aggregate import extract_answer, majority_vote
from tts_service.config import DrafterConfig, SamplingConfig
from tts_service.engine.decode import OnCommit
from tts_service.generation import GenerationOutput, Generator
from tts_service.replay import LoggedProblem
from tts_service.runner import RunReport, TrajectoryRequest, TrajectoryResult, TrajectoryRunner


@dataclass(frozen=True)
class Trajectory:
    index: int
    seed: int
    output: GenerationOutput
    top_ids: list[list[int]] | None = None  # per token: the target's top-k (when logging)
    top_probs: list[list[float]] | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, **self.output.to_dict()}


@dataclass(frozen=True)
class ProblemInput:
    """One problem to solve: its id, prompt tokens and the store its trajectories share
    (`solve_problems` closes it when they are done, so its stats say what was lost)."""

    problem_id: str
    prompt_ids: list[int]
    store: NgramStore


@dataclass
class SolveResult:
    """One problem's trajectories (by index) and its store's statistics."""

    problem_id: str = "q0"
    trajectories: list[Trajectory] = field(default_factory=list)
    store_stats: dict = field(default_factory=dict)

    def vote(self, task: str) -> dict:
        """The aggregator's majority vote over the trajectories' answers."""
        vote = majority_vote([extract_answer(t.output.text, task) for t in self.trajectories], task)
        return {
            "answer": vote.answer,
            "votes": vote.votes,
            "share": vote.share,
            "no_answer": vote.num_no_answer,
            "winner_indices": list(vote.winner_indices),
        }

    def logged(self, prompt_id: str, prompt_ids: list[int]) -> LoggedProblem:
        """This problem as one line of a trajectory log (see `tts_service.replay`)."""
        recorded = all(t.top_ids is not None for t in self.trajectories)
        return LoggedProblem(
            prompt_id,
            list(prompt_ids),
            [list(t.output.token_ids) for t in self.trajectories],
            [t.top_ids for t in self.trajectories] if recorded else None,
            [t.top_probs for t in self.trajectories] if recorded else None,
        )

    def to_dict(self, task: str | None = None) -> dict:
        tokens = sum(t.output.stats.new_tokens for t in self.trajectories)
        forwards = sum(t.output.stats.target_forwards for t in self.trajectories)
        out = {
            "id": self.problem_id,
            "trajectories": [t.to_dict() for t in self.trajectories],
            "stats": {
                "num_trajectories": len(self.trajectories),
                "new_tokens": tokens,
                "row_forwards": forwards,
                "acceptance_length": round(tokens / forwards, 4) if forwards else 0.0,
                "acceptance_length_by_index": [
                    round(t.output.stats.acceptance_length, 4) for t in self.trajectories
                ],
                "store": self.store_stats,
            },
        }
        if task is not None:
            out.update(self.vote(task))
        return out


@dataclass
class SolveRun:
    """Every problem of one run, and the run's own counters (real wall time, forwards)."""

    problems: list[SolveResult]
    report: RunReport

    def stats(self) -> dict:
        return self.report.summary()

    def to_dict(self, task: str | None = None) -> dict:
        return {
            "problems": [p.to_dict(task) for p in self.problems],
            "stats": self.stats(),
        }


def solve_problems(
    runner: TrajectoryRunner,
    problems: Sequence[ProblemInput],
    n: int,
    drafter: DrafterConfig,
    sampling: SamplingConfig,
    on_trajectory: Callable[[str, Trajectory], None] | None = None,
    record: bool = False,
    on_commit: OnCommit | None = None,
    skip: Callable[[TrajectoryRequest], bool] | None = None,
) -> SolveRun:
    """Run `n` trajectories of every problem through `runner`, problem after problem in the
    queue; `on_trajectory(problem_id, trajectory)` sees each one as it finishes."""
    if n < 1:
        raise ValueError("n must be >= 1")
    results = {p.problem_id: SolveResult(p.problem_id) for p in problems}
    if len(results) != len(problems):
        raise ValueError("problem ids must be unique")
    requests = [
        TrajectoryRequest(
            p.problem_id,
            i,
            p.prompt_ids,
            sampling.model_copy(update={"seed": sampling.seed + i}),
            drafter,
            p.store,
            record,
            on_commit,
        )
        for p in problems
        for i in range(n)
    ]

    def collect(res: TrajectoryResult) -> None:
        req = res.request
        traj = Trajectory(req.index, req.sampling.seed, res.output, res.top_ids, res.top_probs)
        results[req.problem_id].trajectories.append(traj)
        if on_trajectory is not None:
            on_trajectory(req.problem_id, traj)

    try:
        report = runner.run(requests, collect, skip)
    finally:  # the stores' final flush, whether the run finished or failed
        for p in problems:
            p.store.close()
    for p in problems:
        res = results[p.problem_id]
        res.trajectories.sort(key=lambda t: t.index)
        res.store_stats = p.store.stats()
    return SolveRun([results[p.problem_id] for p in problems], report)


def solve(
    generator: Generator,
    prompt_ids: list[int],
    n: int,
    drafter: DrafterConfig,
    sampling: SamplingConfig,
    store: NgramStore,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    record: bool = False,
    max_rows: int = 1,
    on_commit: OnCommit | None = None,
) -> SolveRun:
    """One problem's `n` trajectories, `max_rows` of them decoding at a time."""
    runner = TrajectoryRunner(generator, max_rows)
    cb = None if on_trajectory is None else (lambda _pid, t: on_trajectory(t))
    return solve_problems(
        runner,
        [ProblemInput("q0", list(prompt_ids), store)],
        n,
        drafter,
        sampling,
        cb,
        record,
        on_commit,
    )
