"""What a caller hands the runner and gets back: trajectory requests (`trajectory_requests`,
the one seeding convention), their results, and the submission a caller waits on, with its
report (`RunReport`: the finished trajectories and the forwards their rows took part in).

`runner.TrajectoryRunner` decodes the requests; nothing here steps a decoder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from store.base import NgramStore
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DrafterConfig
from tts_service.engine.decode import GenerationOutput, OnCommit
from tts_service.engine.metrics import ForwardStats, summarize
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import Drafter
from tts_service.engine.streams import new_run_nonce, row_salt


@dataclass(frozen=True)
class TrajectoryRequest:
    """One trajectory to decode: trajectory `index` of problem `problem_id`, seeded by
    `sampling.seed` (the host's convention: the problem's seed + index) and, where it drafts
    and samples, salted by `run_nonce` (`streams.row_salt`): the edges' requests come from
    `trajectory_requests`, which draws one per call; one built here keeps 0 (replay, the
    benchmarks, tests: deterministic), and the ledger refuses a key it repeats."""

    problem_id: str
    index: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    drafter: DrafterConfig
    store: NgramStore
    record: bool = False  # keep the target's top-k at every token (trajectory logs)
    on_commit: OnCommit | None = None  # sees every step's tokens; False cancels the row
    wrap: Callable[[Drafter], Drafter] | None = None  # around the row's drafter (calibration)
    run_nonce: int = 0  # `trajectory_requests` draws one per call; a repeat here is refused
    confidence: bool = False  # the target's confidence at every token, summarised at the end

    @property
    def salted(self) -> bool:
        """Whether its streams are salted: it drafts and it samples (a plain row drafts
        nothing, and under greedy no uniform decides anything)."""
        return self.drafter.kind != "plain" and self.sampling.temperature != 0

    def params(self) -> SamplingParams:
        """The engine's sampling parameters: a row that drafts and samples has its streams
        salted by its run, problem and index, so that no two rows whose drafters share state
        share uniforms."""
        if not self.salted:
            return SamplingParams.of(self.sampling)
        return SamplingParams.of(
            self.sampling, row_salt(self.run_nonce, self.problem_id, self.index)
        )


def trajectory_requests(
    problem_id: str,
    prompt_ids: list[int],
    indices: Iterable[int],
    sampling: SamplingConfig,
    drafter: DrafterConfig,
    store: NgramStore,
    record: bool = False,
    on_commit: Callable[[int], OnCommit | None] | None = None,
    confidence: bool = False,
) -> list[TrajectoryRequest]:
    """Trajectories `indices` of one problem, the one seeding convention: trajectory i samples
    with `sampling.seed + i`, its drafts verified under `sampling.run_nonce` (drawn here when
    None). `on_commit(i)` gives trajectory i's step callback."""
    nonce = new_run_nonce() if sampling.run_nonce is None else sampling.run_nonce
    return [
        TrajectoryRequest(
            problem_id,
            i,
            prompt_ids,
            sampling.model_copy(update={"seed": sampling.seed + i, "run_nonce": nonce}),
            drafter,
            store,
            record,
            None if on_commit is None else on_commit(i),
            run_nonce=nonce,
            confidence=confidence,
        )
        for i in indices
    ]


@dataclass(frozen=True)
class TrajectoryResult:
    request: TrajectoryRequest
    output: GenerationOutput
    top_ids: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None
    confidence: dict | None = None  # `aggregate.confidence.trajectory_confidence`'s


@dataclass
class RunReport:
    """One submission's finished trajectories (in the order they finished) and the forwards
    its rows took part in (`rows` per forward counts every row of the batch)."""

    results: list[TrajectoryResult] = field(default_factory=list)
    forwards: ForwardStats = field(default_factory=ForwardStats)
    wall_s: float = 0.0
    nodes_trace: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rows, nodes)
    explored_steps: int = 0  # steps that tried a tree the surface was unsure of
    cost_surface: str = "none"  # where the allocator's cost surface came from

    def summary(self) -> dict:
        out = summarize([r.output.stats for r in self.results], self.forwards, self.wall_s)
        out["speculation"] = self.speculation()
        return out

    def speculation(self) -> dict:
        """The allocator's decisions and their evidence: where its cost surface came from,
        how many of this run's steps drafted or explored, and nodes per row over time
        (`[t_s, rows, nodes]` at most 32 points, every change of rows or nodes kept first)."""
        trace = self.nodes_trace
        changes = [p for i, p in enumerate(trace) if i == 0 or p[1:] != trace[i - 1][1:]]
        if len(changes) > 32:
            changes = changes[:: -(-len(changes) // 32)]
        return {
            "cost_surface": self.cost_surface,
            "steps": len(trace),
            "drafted_steps": sum(1 for _, _, k in trace if k > 0),
            "explored_steps": self.explored_steps,
            "nodes_per_row": [list(p) for p in changes],
        }


class Submission:
    """Requests submitted together: their callbacks, results and counters."""

    def __init__(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None,
        skip: Callable[[TrajectoryRequest], bool] | None,
    ) -> None:
        self.requests = requests
        self.on_result = on_result
        self.skip = skip
        self.report = RunReport()
        self.pending = len(requests)  # neither finished nor skipped
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.done = threading.Event()
        if not requests:
            self.done.set()

    def skipped(self, req: TrajectoryRequest) -> bool:
        return self.skip is not None and self.skip(req)

    def settle(self, result: TrajectoryResult | None) -> None:
        """One request finished (with its result) or was skipped (None)."""
        if result is not None:
            self.report.results.append(result)
            if self.on_result is not None:
                self.on_result(result)
        self.pending -= 1
        if self.pending == 0:
            self.finish()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self.report.wall_s = time.perf_counter() - self.started
        self.done.set()

    def wait(self, timeout: float | None = None) -> RunReport:
        if not self.done.wait(timeout):
            raise TimeoutError("the runner did not finish in time")
        if self.error is not None:
            raise self.error
        return self.report
