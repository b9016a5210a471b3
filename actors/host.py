"""`RunnerHost`: one loaded model and its one runner, and what every edge does around them.

`tts solve`, a Serve replica and a generator actor (a job's) each hold one host. It opens the
problems' stores (Redis when configured, so that every process of a job shares them), builds
the seeded requests (`trajectory.trajectory_requests`), chooses how steps are sized (the learned
cost surface; a fixed token budget on a tensor-parallel leader, whose forwards this process
cannot time alone), and runs them: in the caller's thread, or in a thread of its own that
concurrent callers share (`threaded`). The edges only validate, call it and format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from store.base import NgramStore
from store.config import StoreConfig
from store.factory import open_global_store, open_problem_store
from store.memory import InMemoryNgramStore
from tts_service import startup
from tts_service.config import SamplingConfig, default_max_rows
from tts_service.drafters.registry import DrafterConfig
from tts_service.engine import collector
from tts_service.engine.decode import GenerationOutput
from tts_service.engine.scoring import TokenLogprobs, score_tokens
from tts_service.engine.warmup import compiled, describe, warm_shapes, warm_up
from tts_service.runner import Admission, RunnerLoop, TrajectoryRunner
from tts_service.solve import Skip
from tts_service.timing import phase
from tts_service.trajectory import (
    RunReport,
    TrajectoryRequest,
    TrajectoryResult,
    trajectory_requests,
)

if TYPE_CHECKING:
    from tts_service.engine.batch import BatchDecoder
    from tts_service.generation import Generator


class RunnerHost:
    """`tp_decoder`: a tensor-parallel leader's decoder (`actors.tp`), whose steps share
    `token_budget` out over the rows. `admission`: which waiting request joins next (default
    FIFO: jobs, `tts solve`; Serve passes its fair policy). `max_rows` unset: the
    device's default (16 on a CPU, 64 on a GPU). `warm`: open the cost surface now, not at
    the first step that may draft (a replica waiting for requests)."""

    def __init__(
        self,
        generator: Generator,
        store: StoreConfig | None = None,
        store_url: str | None = None,
        max_rows: int | None = None,
        admission: Admission | None = None,
        tp_decoder: BatchDecoder | None = None,
        threaded: bool = False,
        warm: bool = False,
    ) -> None:
        self.generator = generator
        self.store_cfg = store or StoreConfig()
        self.store_url = store_url
        self.max_rows = max_rows or default_max_rows(str(generator.loaded.device))
        if tp_decoder is not None:
            self.runner = TrajectoryRunner(
                generator, self.max_rows, "fixed", admission=admission, decoder=tp_decoder
            )
        else:
            if warm:  # the cost surface's prior (or the one on disk) before the first request
                generator.surface(self.max_rows)
            self.runner = TrajectoryRunner(generator, self.max_rows, admission=admission)
            self._warm_forward(warm)
        self.loop = RunnerLoop(self.runner) if threaded else None
        self.global_store = open_global_store(self.store_cfg, store_url)  # across problems
        self.scratch = InMemoryNgramStore()  # single generations' (`generate`)
        startup.settle()  # the process is up: what it made so far is frozen out of the collector
        collector.widen()  # and its passes run in the forwards' shadow (`engine.collector`)

    def _warm_forward(self, warm: bool) -> None:
        """Compile and capture the forward now (`engine.warmup`), saying so: for a server
        (`warm`), and always when the forward is compiled (the compile is paid anyway; this
        way before decoding, announced; where it runs CUDA graphs, they are captured too)."""
        decoder = self.runner.decoder
        if not (warm or compiled(decoder)):
            return
        shapes = warm_shapes(decoder, self.max_rows)
        if shapes:
            with phase(f"[tts] {describe(decoder, len(shapes))}", "[tts] forward ready"):
                warm_up(decoder, shapes)

    # -- stores ---------------------------------------------------------------------------
    def rows_running(self) -> int:
        """Rows in the runner's batch now (read from another thread: a moment's snapshot)."""
        return len(self.runner.decoder.active)

    def progress(self) -> dict[str, int]:
        """Rows decoding, and tokens, forwards and rows a forward summed since the host started
        (another thread's read: a moment's snapshot, for a job's heartbeat)."""
        decoder, f = self.runner.decoder, self.runner.decoder.forwards
        return {
            "rows": len(decoder.active),
            "tokens": f.new_tokens,
            "forwards": f.forwards,
            "row_forwards": f.row_forwards,
        }

    def problem_store(self, scope_id: str) -> NgramStore:
        """The store a problem's trajectories share, read before the global scope.

        Raises:
            StoreUnavailableError: Redis does not answer.
        """
        return open_problem_store(self.store_cfg, self.store_url, scope_id, self.global_store)

    def close(self) -> None:
        """The host's end: the global store pushes what it queued (a bounded wait)."""
        if self.global_store is not None:
            self.global_store.close()

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Skip | None = None,
    ) -> RunReport:
        """Decode `requests` (beside other callers' when threaded)."""
        target = self.loop or self.runner
        return target.run(requests, on_result, skip)

    def trajectories(
        self,
        problem_id: str,
        prompt_ids: list[int],
        indices: Sequence[int],
        sampling: SamplingConfig,
        drafter: DrafterConfig,
        store: NgramStore,
        record: bool = False,
        on_commit: Callable[[int, Sequence[int]], bool] | None = None,
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Skip | None = None,
        confidence: bool = False,
    ) -> RunReport:
        """Trajectories `indices` of one problem (seeds: `sampling.seed + i`), their results in
        index order; `on_commit(i, tokens)` sees trajectory i's steps."""
        per_problem = None
        if on_commit is not None:
            per_problem = lambda _p, i, tokens: on_commit(i, tokens)  # noqa: E731
        return self.problems(
            [(problem_id, prompt_ids, store)],
            indices,
            sampling,
            drafter,
            record,
            per_problem,
            on_result,
            skip,
            confidence,
        )

    def problems(
        self,
        problems: Sequence[tuple[str, list[int], NgramStore]],
        indices: Sequence[int],
        sampling: SamplingConfig,
        drafter: DrafterConfig,
        record: bool = False,
        on_commit: Callable[[int, int, Sequence[int]], bool] | None = None,
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Skip | None = None,
        confidence: bool = False,
    ) -> RunReport:
        """Trajectories `indices` of every (problem id, prompt ids, store) in one submission,
        so they share the batch; results in (problem, index) order; `on_commit(p, i, tokens)`
        sees trajectory i of problem p's steps; with `confidence`, each result's."""
        requests: list[TrajectoryRequest] = []
        position: dict[int, int] = {}  # id of a request -> its problem's position
        for p, (problem_id, prompt_ids, store) in enumerate(problems):
            per_index = None
            if on_commit is not None:
                per_index = lambda i, p=p: lambda tokens: on_commit(p, i, tokens)  # noqa: E731
            mine = trajectory_requests(
                problem_id,
                prompt_ids,
                indices,
                sampling,
                drafter,
                store,
                record,
                per_index,
                confidence,
            )
            position.update((id(r), p) for r in mine)
            requests += mine
        report = self.run(requests, on_result, skip)
        report.results.sort(key=lambda r: (position[id(r.request)], r.request.index))
        return report

    def score(self, ids: Sequence[int], start: int, top: int) -> TokenLogprobs:
        """The target's logprobs of `ids[start:]` with `top` alternatives at each
        (`engine.scoring`): a chunk of the forward at a time, each between two of the runner's
        steps when threaded."""
        model = self.generator.loaded.model
        if self.loop is None:
            return score_tokens(model, ids, start, top)
        return score_tokens(model, ids, start, top, run=self.loop.between_steps)

    def generate(
        self,
        prompt_ids: list[int],
        drafter: DrafterConfig,
        sampling: SamplingConfig,
        on_commit: Callable[[Sequence[int]], bool] | None = None,
    ) -> GenerationOutput:
        """One generation (`tts generate`): one row, drafting from this host's scratch store
        (and what the model's drafters share: the successor tables carry over);
        `on_commit(tokens)` sees its steps."""
        steps = None if on_commit is None else lambda _i: on_commit
        report = self.run(
            trajectory_requests(
                "generate", prompt_ids, [0], sampling, drafter, self.scratch, on_commit=steps
            )
        )
        return report.results[0].output
