"""Best-of-N for one or many problems: N trajectories per problem, sharing the problem's store,
all decoded by the one trajectory runner.

Trajectory i of a problem samples with seed `seed + i`; every trajectory of a run has the run's
nonce (`SamplingConfig.run_nonce`, drawn here when none is given), recorded in the output so
that the run can be reproduced. With `max_rows = 1` trajectories run
one after another, so the i-th drafts from everything the earlier ones stored (STAND's
setting); with more rows they decode continuously batched, a finished row's slot going to the
next waiting trajectory of the same problem or the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from store.base import NgramStore
from tts_service.aggregate import extract_answer
from tts_service.aggregate.confidence import labelled_vote
from tts_service.aggregate.early_stop import EarlyStop
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DrafterConfig
from tts_service.engine.decode import GenerationOutput, OnCommit
from tts_service.engine.metrics import acceptance_length
from tts_service.engine.streams import new_run_nonce
from tts_service.generation import Generator
from tts_service.runner import TrajectoryRunner
from tts_service.trajectory import (
    RunReport,
    TrajectoryRequest,
    TrajectoryResult,
    trajectory_requests,
)

Skip = Callable[[TrajectoryRequest], bool]


class Runs(Protocol):
    """What runs the requests: a `TrajectoryRunner`, its thread (`RunnerLoop`) or a host."""

    def run(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Skip | None = None,
    ) -> RunReport: ...


@dataclass(frozen=True)
class Trajectory:
    index: int
    seed: int
    output: GenerationOutput
    top_ids: list[list[int]] | None = None  # per token: the target's top-k (when logging)
    top_probs: list[list[float]] | None = None
    run_nonce: int | None = None  # what salted its verify stream (None: plain decoding)
    confidence: dict | None = None  # `aggregate.confidence.trajectory_confidence`'s, if asked

    def to_dict(self) -> dict:
        out = {"index": self.index, "seed": self.seed, **self.output.to_dict()}
        if self.confidence is not None:
            out["confidence"] = self.confidence
        return out if self.run_nonce is None else {"run_nonce": self.run_nonce, **out}


@dataclass(frozen=True)
class ProblemInput:
    """One problem to solve: its id, prompt tokens and the store its trajectories share
    (`solve_problems` closes it when they are done, so its stats say what was lost)."""

    problem_id: str
    prompt_ids: list[int]
    store: NgramStore


@dataclass
class SolveResult:
    """One problem's trajectories (by index) and its store's statistics; with early stop, the
    N asked for and whether the vote was decided before all of them finished."""

    problem_id: str = "q0"
    trajectories: list[Trajectory] = field(default_factory=list)
    store_stats: dict = field(default_factory=dict)
    n: int | None = None

    @property
    def stopped_early(self) -> bool:
        """Whether its vote was decided before all of the N asked for had finished."""
        return self.n is not None and len(self.trajectories) < self.n

    def vote(self, task: str, aggregate: str = "majority") -> dict:
        """The vote `aggregate` names over the trajectories' answers (`labelled_vote`);
        stopped early, what was decoded of the N asked for."""
        answers = [extract_answer(t.output.text, task) for t in self.trajectories]
        order = [t.index for t in self.trajectories]
        sure = [t.confidence for t in self.trajectories]
        out = labelled_vote(aggregate, answers, sure, order, task)
        if self.n is not None:
            out |= {"decoded": len(self.trajectories), "n": self.n}
            out["stopped_early"] = self.stopped_early
        return out

    def to_dict(self, task: str | None = None, aggregate: str = "majority") -> dict:
        tokens = sum(t.output.stats.new_tokens for t in self.trajectories)
        forwards = sum(t.output.stats.target_forwards for t in self.trajectories)
        out = {
            "id": self.problem_id,
            "trajectories": [t.to_dict() for t in self.trajectories],
            "stats": {
                "num_trajectories": len(self.trajectories),
                "new_tokens": tokens,
                "row_forwards": forwards,
                "acceptance_length": round(acceptance_length(tokens, forwards), 4),
                "acceptance_length_by_index": [
                    round(t.output.stats.acceptance_length, 4) for t in self.trajectories
                ],
                "store": self.store_stats,
            },
        }
        if task is not None:
            out.update(self.vote(task, aggregate))
        return out


@dataclass
class SolveRun:
    """Every problem of one run, and the run's own counters (real wall time, forwards)."""

    problems: list[SolveResult]
    report: RunReport
    run_nonce: int | None = None  # what its drafting rows were salted with

    def stats(self) -> dict:
        return self.report.summary()

    def to_dict(self, task: str | None = None, aggregate: str = "majority") -> dict:
        return {
            "run_nonce": self.run_nonce,
            "problems": [p.to_dict(task, aggregate) for p in self.problems],
            "stats": self.stats(),
        }


def solve_problems(
    runner: Runs,
    problems: Sequence[ProblemInput],
    n: int,
    drafter: DrafterConfig,
    sampling: SamplingConfig,
    on_trajectory: Callable[[str, Trajectory], None] | None = None,
    record: bool = False,
    on_commit: OnCommit | None = None,
    skip: Skip | None = None,
    early_stop: EarlyStop | None = None,
    confidence: bool = False,
) -> SolveRun:
    """Run `n` trajectories of every problem through `runner`, problem after problem in the
    queue; `on_trajectory(problem_id, trajectory)` sees each one as it finishes. With
    `early_stop` (over the same `n`), a problem whose vote is decided stops its other rows;
    with `confidence`, each trajectory says how sure the target was (`aggregate.confidence`)."""
    if n < 1:
        raise ValueError("n must be >= 1")
    if early_stop is not None and early_stop.n != n:
        raise ValueError(f"early_stop is over n = {early_stop.n}, not {n}")
    asked = n if early_stop is not None else None  # stopped early: what was decoded of it
    results = {p.problem_id: SolveResult(p.problem_id, n=asked) for p in problems}
    if len(results) != len(problems):
        raise ValueError("problem ids must be unique")
    each = None if on_commit is None else (lambda _i: on_commit)
    if sampling.run_nonce is None:  # one nonce for the run, recorded with it
        sampling = sampling.model_copy(update={"run_nonce": new_run_nonce()})
    requests = [
        req
        for p in problems
        for req in trajectory_requests(
            p.problem_id,
            p.prompt_ids,
            range(n),
            sampling,
            drafter,
            p.store,
            record,
            each,
            confidence,
        )
    ]

    collect = collector(results, early_stop, on_trajectory)
    try:
        report = runner.run(requests, collect, early_stop.skipping(skip) if early_stop else skip)
    finally:  # the stores' final flush, whether the run finished or failed
        for p in problems:
            p.store.close()
    for p in problems:
        res = results[p.problem_id]
        res.trajectories.sort(key=lambda t: t.index)
        res.store_stats = p.store.stats()
    salted = drafter.kind != "plain" and not sampling.greedy  # else nothing uses the nonce
    nonce = sampling.run_nonce if salted else None
    return SolveRun([results[p.problem_id] for p in problems], report, nonce)


def collector(
    results: dict[str, SolveResult],
    early_stop: EarlyStop | None,
    on_trajectory: Callable[[str, Trajectory], None] | None,
) -> Callable[[TrajectoryResult], None]:
    """The runner's result callback: each finished trajectory into its problem's result, seen
    by `early_stop` (which may decide the problem) and `on_trajectory`."""

    def collect(res: TrajectoryResult) -> None:
        req = res.request
        nonce = req.run_nonce if req.salted else None
        traj = Trajectory(
            req.index,
            req.sampling.seed,
            res.output,
            res.top_ids,
            res.top_probs,
            nonce,
            confidence=res.confidence,
        )
        results[req.problem_id].trajectories.append(traj)
        if early_stop is not None:
            early_stop.note(req.problem_id, req.index, res.output.text)
        if on_trajectory is not None:
            on_trajectory(req.problem_id, traj)

    return collect


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
