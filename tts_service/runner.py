"""The one trajectory runner: every edge (CLI `solve`, the generator actor, Serve, evaluation)
decodes its trajectories here.

Trajectory requests wait in a queue; up to `max_rows` of them decode together in one batch
(`engine.batch.BatchDecoder`). When a row finishes, the next waiting trajectory joins at the
next step, its prompt prefilled into the shared cache, from the same problem or the next one.
Rows of one problem share that problem's store. Each step, the cost-aware allocator
(`engine.allocate`) gives every row the number of draft nodes that maximises expected tokens
per second on this device, priced by the cost surface that every step's timing refines
(`engine.surface`); where trees do not pay, the step is plain decoding. With `max_rows = 1`
trajectories run one after another, each drafting from everything the earlier ones stored
(STAND's setting).

`TrajectoryRunner.run` decodes one list of requests in the caller's thread. `RunnerLoop` keeps
one batch running in a thread of its own, so that requests submitted from several threads (an
actor's concurrent calls, Serve's concurrent requests) share its forwards.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from store.base import NgramStore
from tts_service.config import DrafterConfig, SamplingConfig
from tts_service.engine.allocate import SlotStats, SpeculationPlanner
from tts_service.engine.batch import BatchDecoder, Row
from tts_service.engine.decode import OnCommit
from tts_service.engine.metrics import ForwardStats, GenerationStats
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance
from tts_service.generation import GenerationOutput, Generator
from tts_service.replay import TrajectoryRecorder

MAX_NODES = 64  # the most draft nodes a row may get in one step


@dataclass(frozen=True)
class TrajectoryRequest:
    """One trajectory to decode: trajectory `index` of problem `problem_id`, seeded by
    `sampling.seed` (the caller's convention: the problem's seed + index)."""

    problem_id: str
    index: int
    prompt_ids: list[int]
    sampling: SamplingConfig
    drafter: DrafterConfig
    store: NgramStore
    record: bool = False  # keep the target's top-k at every token (trajectory logs)
    on_commit: OnCommit | None = None  # sees every step's tokens; False cancels the row


@dataclass(frozen=True)
class TrajectoryResult:
    request: TrajectoryRequest
    output: GenerationOutput
    top_ids: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None


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


def summarize(rows: Sequence[GenerationStats], forwards: ForwardStats, wall_s: float) -> dict:
    """The one report of a run that every edge prints (CLI, job summary, Serve, evaluation).

    `target_forwards` counts forwards of the device (a 4-row step is one); `acceptance_length`
    is committed tokens per row-forward (plain decoding: 1.0); `tokens_per_s` is all new
    tokens over the real elapsed time."""
    new_tokens = sum(r.new_tokens for r in rows)
    row_forwards = sum(r.target_forwards for r in rows)
    depth: list[int] = []
    for r in rows:
        for d, c in enumerate(r.accepted_at_depth):
            depth += [0] * (d + 1 - len(depth))
            depth[d] += c
    return {
        "num_trajectories": len(rows),
        "new_tokens": new_tokens,
        "target_forwards": forwards.forwards,
        "row_forwards": row_forwards,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(new_tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "mean_rows_per_forward": round(forwards.mean_rows_per_forward, 3),
        "acceptance_length": round(new_tokens / row_forwards, 4) if row_forwards else 0.0,
        "tree_nodes": sum(r.tree_nodes for r in rows),
        "accepted_at_depth": depth,
        "draft_s": round(forwards.draft_s, 4),
        "forward_s": round(forwards.forward_s, 4),
        "observe_s": round(forwards.observe_s, 4),
        "prefill_s": round(forwards.prefill_s, 4),
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


class TrajectoryRunner:
    """Continuous batching over one `Generator` (one model on one device).

    `speculation="cost"` sizes every step's trees on the generator's cost surface (learned
    from every step, `engine.surface`) or its fixed `batch_cost`; `"fixed"` shares a constant
    `token_budget` per forward out over the rows (tensor-parallel ranks, whose forwards this
    process cannot time alone).

    `admission="fifo"` fills free rows in submission order (jobs: throughput); `"fair"` (Serve)
    gives the next free row to the submission holding the fewest rows, and lets a submission
    holding none join a full batch, so a short request never waits behind a long one.

    `decoder`: the batch decoder to step (a tensor-parallel leader's, `engine.tp`); default one
    over the generator's model."""

    def __init__(
        self,
        generator: Generator,
        max_rows: int,
        speculation: str = "cost",
        token_budget: int = 64,
        admission: str = "fifo",
        decoder: BatchDecoder | None = None,
    ) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if speculation not in ("cost", "fixed"):
            raise ValueError(f"speculation must be 'cost' or 'fixed', not {speculation!r}")
        if admission not in ("fifo", "fair"):
            raise ValueError(f"admission must be 'fifo' or 'fair', not {admission!r}")
        self.admission = admission
        self.generator = generator
        self.max_rows = max_rows
        self.speculation = speculation
        self.token_budget = token_budget
        gen = generator
        self.decoder = decoder or BatchDecoder(
            gen.loaded.model,
            gen.loaded.eos_token_ids,
            gen.decode,
            cuda_graphs=gen.loaded.cuda_graphs,
        )
        self.queue: deque[tuple[Submission, TrajectoryRequest]] = deque()
        self.start = time.perf_counter()
        self.planner: SpeculationPlanner | None = None  # at the first step that may draft

    # -- one call, in this thread --------------------------------------------------------
    def run(
        self,
        requests: Iterable[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> RunReport:
        """Decode every request; `on_result` sees each trajectory as it finishes.

        `skip(request)` is asked before a request joins and, for running rows, before every
        step: True drops it without a result (early stop of its problem, a client gone)."""
        sub = self.submit(list(requests), on_result, skip)
        try:
            while not sub.done.is_set():
                self.tick()
        except BaseException as e:
            self.fail(e)
            raise
        return sub.wait()

    def submit(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> Submission:
        """Queue requests behind those already waiting; `tick` decodes them."""
        sub = Submission(requests, on_result, skip)
        self.queue.extend((sub, r) for r in requests)
        return sub

    @property
    def idle(self) -> bool:
        return not self.queue and not self.decoder.active

    def fail(self, error: BaseException) -> None:
        """Everything running or waiting ends with `error` (the engine failed)."""
        subs = {id(s): s for s, _ in self.queue}
        subs |= {id(r.tag[0]): r.tag[0] for r in self.decoder.active}
        self.queue.clear()
        self.decoder.drop(list(self.decoder.active))
        for sub in subs.values():
            sub.finish(error)

    # -- one step -----------------------------------------------------------------------
    def tick(self) -> None:
        """Drop skipped rows, fill free rows from the queue, run one step."""
        decoder = self.decoder
        dropped = [r for r in decoder.active if r.tag[0].skipped(r.tag[1])]
        decoder.drop(dropped)
        for row in dropped:
            row.tag[0].settle(None)
        joining: list[Row] = []
        while (i := self._next(joining)) is not None:
            sub, req = self.queue[i]
            del self.queue[i]
            if sub.skipped(req):
                sub.settle(None)
                continue
            try:
                joining.append(self._row(sub, req))
            except Exception as e:  # this request cannot run (too long): its submission fails
                sub.finish(e)
        if joining:
            t0 = time.perf_counter()
            decoder.join(joining)
            for sub in {id(r.tag[0]): r.tag[0] for r in joining}.values():
                sub.report.forwards.prefill_s += time.perf_counter() - t0
        if not decoder.active:
            return
        nodes = self._nodes()
        batch = list(decoder.active)
        before = decoder.forwards.forwards
        finished = decoder.step(nodes, observe=self._observe)
        self._account(batch, nodes, decoder.forwards, before)
        for row in finished:
            row.tag[0].settle(self._result(row))
        if self.planner is not None and self.planner.surface is not None:
            self.planner.surface.save(every_s=0.0 if self.idle else 30.0)

    def _next(self, joining: list[Row]) -> int | None:
        """The queue index of the request that joins next, or None."""
        full = len(self.decoder.active) + len(joining) >= self.max_rows
        if not self.queue or (full and self.admission == "fifo"):
            return None
        if self.admission == "fifo":
            return 0
        held = Counter(id(r.tag[0]) for r in (*self.decoder.active, *joining))
        best, fewest, seen = None, 0, set()
        for i, (sub, _) in enumerate(self.queue):  # each submission's oldest request
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            rows = held[id(sub)]
            if (not full or rows == 0) and (best is None or rows < fewest):
                best, fewest = i, rows
        return best

    def _account(self, batch: list[Row], nodes: int, f: ForwardStats, before: int) -> None:
        """Teach the cost surface the step's time, and credit the step to every submission
        with a row in it."""
        if f.forwards == before:
            return
        rows, width = f.trace[-1]
        planner = self.planner
        if planner is not None and planner.surface is not None:
            planner.surface.record(rows, width, f.last_context, f.last_forward_s)
        explored = planner is not None and planner.last_explored
        t = round(time.perf_counter() - self.start, 4)
        subs = {id(r.tag[0]): r.tag[0] for r in batch}
        for sub in subs.values():
            mine = [r for r in batch if r.tag[0] is sub]
            sub.report.forwards.record(
                rows,
                width,
                nodes * len(mine),
                0,
                f.last_draft_s,
                f.last_forward_s,
                f.last_observe_s,
                f.last_context,
            )
            sub.report.nodes_trace.append((t, rows, nodes))
            sub.report.explored_steps += explored
            if planner is not None:
                sub.report.cost_surface = planner.source

    def _row(self, sub: Submission, req: TrajectoryRequest) -> Row:
        gen = self.generator
        gen.check_fits(req.prompt_ids, req.sampling)
        drafter = gen.row_drafter(req.drafter, req.store, req.sampling.seed)
        if req.record:
            drafter = TrajectoryRecorder(drafter)
        slots = gen.slot_stats(req.drafter)  # looked up once: the allocator reads it every step
        return self.decoder.new_row(
            req.prompt_ids, drafter, req.sampling, req.on_commit, tag=(sub, req, slots)
        )

    def _nodes(self) -> int:
        rows = self.decoder.active
        if self.speculation == "fixed":
            return max(0, self.token_budget // len(rows) - 1)
        if all(r.tag[1].drafter.kind == "plain" for r in rows):
            return 0
        if self.planner is None:
            gen = self.generator
            self.planner = (
                SpeculationPlanner(fixed=gen.fixed_batch_cost, max_nodes=MAX_NODES)
                if gen.fixed_batch_cost is not None
                else SpeculationPlanner(surface=gen.surface(self.max_rows), max_nodes=MAX_NODES)
            )
        f = self.decoder.forwards
        per_node = f.draft_s / f.draft_nodes if f.draft_nodes else 0.0
        stats: list[SlotStats] = [r.tag[2] for r in rows]
        for s in {id(s): s for s in stats}.values():
            s.tick()
        return self.planner.plan(self.decoder.context_len, stats, per_node)

    def _observe(self, row: Row, tree: DraftTree, acc: Acceptance) -> None:
        if self.speculation == "cost":
            row.tag[2].record(tree, acc)

    def _result(self, row: Row) -> TrajectoryResult:
        req = row.tag[1]
        out = self.generator.output(row.result())
        if isinstance(row.drafter, TrajectoryRecorder):
            ids, probs = row.drafter.rows(len(out.token_ids))
            return TrajectoryResult(req, out, ids, probs)
        return TrajectoryResult(req, out)


class RunnerLoop:
    """One `TrajectoryRunner` stepping in a daemon thread: `submit` from any thread, then
    `wait` on the submission. Requests of concurrent submissions share the batch."""

    def __init__(self, runner: TrajectoryRunner) -> None:
        self.runner = runner
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tts-runner", daemon=True)
        self._thread.start()

    def submit(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> Submission:
        with self._lock:
            sub = self.runner.submit(requests, on_result, skip)
            self._lock.notify()
        return sub

    def run(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> RunReport:
        return self.submit(requests, on_result, skip).wait()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.runner.idle:
                    self._lock.wait()
                try:
                    self.runner.tick()
                except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
                    self.runner.fail(e)
