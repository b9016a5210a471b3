"""The one trajectory runner: the only code in the service that steps a batch decoder (the
engine's unit tests and `bench/device.py` step one directly). Every path decodes here:
`tts solve` and `tts generate` (plain included), the generator actor, Serve, evaluation, tree
calibration, tensor-parallel ranks and trajectory replay (over a decoder whose acceptance
follows a log, `tts_service.replay`).

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
actor's concurrent calls, Serve's concurrent requests) share its forwards. The requests, their
results and the submission a caller waits on are `tts_service.trajectory`'s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, cast, get_args

from store.base import NgramStore
from tts_service.aggregate.confidence import token_confidences, trajectory_confidence
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DrafterConfig
from tts_service.engine.allocate import DraftCost, SlotStats, SpeculationPlanner, StepCost
from tts_service.engine.batch import Row, StepObserver
from tts_service.engine.decode import GenerationOutput, GenerationResult, OnCommit, StopRule
from tts_service.engine.metrics import ForwardStats
from tts_service.engine.prefill import chunk_tokens
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import Deferred, DraftContext, Drafter, DraftGroup, NodeTopK
from tts_service.engine.streams import verify_key
from tts_service.engine.surface import CostSurface
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance
from tts_service.trajectory import RunReport, Submission, TrajectoryRequest, TrajectoryResult

MAX_NODES = 64  # the most draft nodes a row may get in one step

T = TypeVar("T")
Speculation = Literal["cost", "fixed"]
"""How a runner sizes its trees: on the cost surface each step, or the drafter's fixed size."""


class RunnerModel(Protocol):
    """What the runner asks of the model it decodes with: `generation.Generator` (a loaded
    model), or replay's `LoggedTarget` (a trajectory log)."""

    fixed_batch_cost: StepCost | None  # a fixed step cost instead of the learned surface

    def new_decoder(self) -> StepDecoder:
        """The batch decoder the runner steps when none is given."""

    def check_fits(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        """Raise ValueError when the request cannot run (too long for the context, or for the
        KV cache alone)."""

    def kv_room(self, lengths: Sequence[int]) -> bool:
        """Whether rows of these lengths (prompt + new tokens) fit the KV cache together."""

    def row_drafter(self, cfg: DrafterConfig, store: NgramStore, params: SamplingParams) -> Drafter:
        """A fresh drafter for one row, sharing what its model and problem share."""

    def slot_stats(self, cfg: DrafterConfig) -> SlotStats:
        """The allocator's acceptance statistics of one drafter config."""

    def surface(self, max_rows: int = 1) -> CostSurface:
        """The step cost surface the allocator prices trees on."""

    def output(self, res: GenerationResult) -> GenerationOutput:
        """The finished row as the edges report it (its text)."""


class StepDecoder(Protocol):
    """A batch of rows stepped together: `engine.batch.BatchDecoder` (one forward per step),
    or replay's decoder (acceptance from a log)."""

    active: list[Row]
    joining: list[Row]  # admitted, their prompts still prefilling (`engine.prefill`)
    prefill_limit: int  # the most prompt tokens one prefill forward runs
    prefill_s_per_token: float | None  # the last prefill chunk's rate (None: none ran yet)
    forwards: ForwardStats
    graph_tokens: int | None  # the largest step replayed as a CUDA graph (None: no graphs)
    last_step_steady: bool  # the last step ran as its shape keeps running (its time teaches)

    @property
    def context_len(self) -> int: ...

    def stop_rule(self, cfg: SamplingParams, on_commit: OnCommit | None = None) -> StopRule: ...

    def admit(self, rows: list[Row]) -> None:
        """Queue rows to join once their prompts are prefilled (`prefill`)."""

    def prefill(self, tokens: int | None = None) -> list[Row]:
        """Run about `tokens` tokens of the waiting prompts' prefill; returns the rows that
        joined the batch."""

    def drop(self, rows: list[Row]) -> None: ...

    def reset(self) -> None:
        """Drop every row, and whatever a failed join had added with no row to drop."""

    def step(
        self, max_nodes: int, observe: StepObserver | None = None, fill: bool = False
    ) -> list[Row]: ...


@dataclass(eq=False, kw_only=True)
class TrajectoryRow(Row):
    """A request's row in the batch: whose it is, and the allocator's statistics of its
    drafter (looked up once: the allocator reads them every step)."""

    submission: Submission
    request: TrajectoryRequest
    slots: SlotStats
    # its last step drafted: its drafter's index has caught up with its tokens (a first tree
    # step indexes the prompt, one after plain steps every token they committed)
    drafted: bool = False


Waiting = Sequence[tuple["Submission", TrajectoryRequest]]


class Admission(Protocol):
    """Which waiting request joins the batch next."""

    def __call__(self, waiting: Waiting, rows: Sequence[TrajectoryRow], full: bool) -> int | None:
        """The index in `waiting` of the request that joins next, or None (none does now).
        `rows`: the batch's rows, those joining at this step included; `full`: no row is free."""


def fifo(waiting: Waiting, rows: Sequence[TrajectoryRow], full: bool) -> int | None:
    """Submission order, into free rows only (jobs, `tts solve`: throughput)."""
    return None if full or not waiting else 0


def fair_admission(waiting: Waiting, rows: Sequence[TrajectoryRow], full: bool) -> int | None:
    """Serve's admission: the next row goes to the waiting submission holding the fewest rows,
    and a submission holding none may join a full batch, so a short request never waits
    behind a long one."""
    held = Counter(id(r.submission) for r in rows)
    best, fewest, seen = None, 0, set()
    for i, (sub, _) in enumerate(waiting):  # each submission's oldest request
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        rows = held[id(sub)]
        if (not full or rows == 0) and (best is None or rows < fewest):
            best, fewest = i, rows
    return best


def nodes_per_row(token_budget: int, active_rows: int) -> int:
    """Draft nodes each row may send: a fixed token budget shared out, root included."""
    return max(0, token_budget // max(active_rows, 1) - 1)


class TrajectoryRecorder(Drafter):
    """Wraps a drafter and keeps, at every committed position, the target's token confidence
    (`aggregate.confidence`: -mean log p of its top k, from the distributions the verifier
    already holds) and, with `keep_topk`, the top-k itself (the trajectory log's
    `top_ids`/`top_probs`)."""

    def __init__(self, inner: Drafter, keep_topk: bool = True) -> None:
        self.inner, self.keep_topk = inner, keep_topk
        self.top_ids: list[list[int]] = []
        self.top_probs: list[list[float]] = []
        self.confidences: list[float] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.top_ids, self.top_probs, self.confidences = [], [], []
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.inner.draft(ctx)

    def grouped(self) -> tuple[DraftGroup, object] | None:
        """The inner drafter's group, if it drafts in one (`engine.seam.draft_all`)."""
        return self.inner.grouped()

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        self._keep(topk, [0, *acc.path])  # the distributions the committed tokens came from
        return self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        self._keep(topk, [0])
        return self.inner.observe_root(tokens, topk)

    def _keep(self, topk: NodeTopK, nodes: list[int]) -> None:
        probs = topk.probs[nodes]
        self.confidences += token_confidences(probs)
        if self.keep_topk:
            self.top_ids += topk.ids[nodes].tolist()
            self.top_probs += probs.tolist()

    def rows(self, num_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """The rows of the generation's tokens (a stop may cut the last block)."""
        return self.top_ids[:num_tokens], self.top_probs[:num_tokens]

    def confidence(self, num_tokens: int) -> dict[str, float | int]:
        """The trajectory's confidences over its `num_tokens` tokens."""
        return trajectory_confidence(self.confidences[:num_tokens])


class TrajectoryRunner:
    """Continuous batching over one model (`RunnerModel`: a loaded `Generator`, or a log).

    `speculation="cost"` sizes every step's trees on the generator's cost surface (learned
    from every step, `engine.surface`) or its fixed `batch_cost`; `"fixed"` shares a constant
    `token_budget` per forward out over the rows (tensor-parallel ranks, whose forwards this
    process cannot time alone).

    `admission` picks which waiting request joins next: `fifo` (the default) fills free rows in
    submission order (jobs: throughput); Serve passes its own policy.

    `decoder`: the batch decoder to step (a tensor-parallel leader's, `engine.tp`; replay's);
    default the model's own."""

    def __init__(
        self,
        generator: RunnerModel,
        max_rows: int,
        speculation: Speculation = "cost",
        token_budget: int = 64,
        admission: Admission | None = None,
        decoder: StepDecoder | None = None,
    ) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if speculation not in get_args(Speculation):
            raise ValueError(f"speculation must be 'cost' or 'fixed', not {speculation!r}")
        self.admission = admission or fifo
        self.generator = generator
        self.max_rows = max_rows
        self.speculation = speculation
        self.token_budget = token_budget
        self.decoder = decoder or generator.new_decoder()
        self.queue: deque[tuple[Submission, TrajectoryRequest]] = deque()
        self.start = time.perf_counter()
        self.planner: SpeculationPlanner | None = None  # at the first step that may draft
        self.draft_cost = DraftCost()  # what the planner prices a drafted node at

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
        """Queue requests behind those already waiting; `tick` decodes them. Their verify keys
        are announced to their stores now (`NgramStore.preclaim`), in the caller's thread, so
        that a shared store's answer is in by their first draft."""
        keys: dict[int, tuple[NgramStore, list[int]]] = {}
        for r in requests:
            params = r.params()
            key = verify_key(params.seed, params.salt)
            if key is not None:
                keys.setdefault(id(r.store), (r.store, []))[1].append(key)
        for store, claims in keys.values():
            store.preclaim(claims)
        sub = Submission(requests, on_result, skip)
        self.queue.extend((sub, r) for r in requests)
        return sub

    @property
    def idle(self) -> bool:
        return not self.queue and not self.decoder.active and not self.decoder.joining

    def fail(self, error: BaseException) -> None:
        """Everything running or waiting ends with `error` (the engine failed)."""
        subs = {id(s): s for s, _ in self.queue}
        subs |= {id(r.submission): r.submission for r in self._rows() + self._joining()}
        self.queue.clear()
        self.decoder.reset()
        for sub in subs.values():
            sub.finish(error)

    # -- one step -----------------------------------------------------------------------
    def tick(self) -> None:
        """Drop skipped rows, admit waiting requests into free rows, run a chunk of the
        admitted prompts' prefill, then one step of the rows decoding."""
        decoder = self.decoder
        dropped = [r for r in self._rows() + self._joining() if self._gone(r)]
        decoder.drop(list(dropped))
        for row in dropped:
            self._leave(row, None)
        self._admit()
        self._prefill()
        if not decoder.active:
            return
        nodes = self._nodes()
        batch = self._rows()
        before = decoder.forwards.forwards
        # an exploring step must run the size it explores: GT-sized drafters fill it
        fill = nodes > 0 and self.planner is not None and self.planner.last_explored
        finished = cast(list[TrajectoryRow], decoder.step(nodes, self._observe, fill))
        self._account(batch, nodes, decoder.forwards, before)
        for row in finished:
            self._leave(row, None if row.error is not None else self._result(row))
        if self.planner is not None and self.planner.surface is not None:
            self.planner.surface.save(every_s=0.0 if self.idle else 30.0)

    def _admit(self) -> None:
        """Fill free rows from the queue (`admission`): their rows start joining."""
        joining: list[TrajectoryRow] = []
        while (i := self._next(joining)) is not None:
            sub, req = self.queue[i]
            if not self._kv_room(req, joining):  # it waits for rows to leave
                break
            del self.queue[i]
            if sub.skipped(req) or sub.error is not None:
                sub.settle(None)
                continue
            try:
                joining.append(self._row(sub, req))
            except Exception as e:  # this request cannot run (too long): its submission fails
                sub.finish(e)
        if joining:
            try:
                self.decoder.admit(list(joining))
            except BaseException as e:  # their submissions are in neither the queue nor the batch
                for sub in {id(r.submission): r.submission for r in joining}.values():
                    sub.finish(e)
                raise

    def _prefill(self) -> None:
        """Run the next chunk of the admitted prompts' prefill: all the decoder's chunk while
        no row decodes, else what costs about one of their steps (`engine.prefill`), so the
        rows decoding wait at most about a step more for a long prompt."""
        decoder, waiting = self.decoder, self._joining()
        if not waiting:
            return
        step_s = decoder.forwards.last_forward_s if decoder.active else None
        tokens = chunk_tokens(step_s, decoder.prefill_s_per_token, decoder.prefill_limit)
        subs = {id(r.submission): r.submission for r in waiting}
        t0 = time.perf_counter()
        try:
            decoder.prefill(tokens)
        except BaseException as e:  # the prompts' own failure (out of memory): theirs alone
            for sub in subs.values():
                sub.finish(e)
            raise
        for sub in subs.values():
            sub.report.forwards.prefill_s += time.perf_counter() - t0

    @staticmethod
    def _gone(row: TrajectoryRow) -> bool:
        """Whether a running row leaves before the next step: skipped (early stop, a client
        gone), failed itself (`Row.error`), or its submission failed through another row."""
        sub = row.submission
        return row.error is not None or sub.error is not None or sub.skipped(row.request)

    @staticmethod
    def _leave(row: TrajectoryRow, result: TrajectoryResult | None) -> None:
        """A row left the batch: a row that failed fails its submission alone (the request it
        belongs to), every other row goes on; else it settles (with its result, or None)."""
        if row.error is not None:
            row.submission.finish(row.error)
        row.submission.settle(result)

    def _rows(self) -> list[TrajectoryRow]:
        """The batch's rows (the runner joins only its own)."""
        return cast(list[TrajectoryRow], list(self.decoder.active))

    def _kv_room(self, req: TrajectoryRequest, joining: list[TrajectoryRow]) -> bool:
        """Whether `req` fits the KV cache beside the rows running, prefilling and joining now,
        each at its longest (the cache is dense: every row as long as the longest). A request
        alone always may (`check_fits` refused one too big alone)."""
        rows = (*self._rows(), *self._joining(), *joining)
        if not rows:
            return True
        lengths = [len(r.prompt_ids) + r.cfg.max_new_tokens for r in rows]
        return self.generator.kv_room([*lengths, len(req.prompt_ids) + req.sampling.max_new_tokens])

    def _joining(self) -> list[TrajectoryRow]:
        """The rows admitted whose prompts are still prefilling."""
        return cast(list[TrajectoryRow], list(self.decoder.joining))

    def _next(self, joining: list[TrajectoryRow]) -> int | None:
        """The queue index of the request that joins next, or None."""
        if not self.queue:
            return None
        rows = (*self._rows(), *self._joining(), *joining)
        return self.admission(self.queue, rows, len(rows) >= self.max_rows)

    def _account(
        self, batch: list[TrajectoryRow], nodes: int, f: ForwardStats, before: int
    ) -> None:
        """Teach the cost surface the step's time, and credit the step to every submission
        with a row in it."""
        if f.forwards == before:
            return
        rows, width = f.trace[-1]
        if nodes > 0 and all(r.drafted for r in batch):  # no row's drafter catching up
            self.draft_cost.record(f.last_draft_s, nodes * len(batch))
        for r in batch:
            r.drafted = nodes > 0
        planner = self.planner
        # the step that captured its bucket's CUDA graph (warm-ups, the capture) is not its cost
        if planner is not None and planner.surface is not None and self.decoder.last_step_steady:
            planner.surface.record(rows, width, f.last_context, f.last_forward_s)
        explored = planner is not None and planner.last_explored
        t = round(time.perf_counter() - self.start, 4)
        subs = {id(r.submission): r.submission for r in batch}
        for sub in subs.values():
            mine = [r for r in batch if r.submission is sub]
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

    def _row(self, sub: Submission, req: TrajectoryRequest) -> TrajectoryRow:
        gen = self.generator
        gen.check_fits(req.prompt_ids, req.sampling)
        params = req.params()
        drafter = gen.row_drafter(req.drafter, req.store, params)
        if req.wrap is not None:
            drafter = req.wrap(drafter)
        if req.record or req.confidence:
            drafter = TrajectoryRecorder(drafter, keep_topk=req.record)
        return TrajectoryRow(
            list(req.prompt_ids),
            drafter,
            params,
            self.decoder.stop_rule(params, req.on_commit),
            submission=sub,
            request=req,
            slots=gen.slot_stats(req.drafter),
        )

    def _nodes(self) -> int:
        rows = self._rows()
        if self.speculation == "fixed":
            return nodes_per_row(self.token_budget, len(rows))
        if all(r.request.drafter.kind == "plain" for r in rows):
            return 0
        if self.planner is None:
            gen, cap = self.generator, self.decoder.graph_tokens
            self.planner = (
                SpeculationPlanner(fixed=gen.fixed_batch_cost, max_nodes=MAX_NODES)
                if gen.fixed_batch_cost is not None
                else SpeculationPlanner(
                    surface=gen.surface(self.max_rows), max_nodes=MAX_NODES, max_step_tokens=cap
                )
            )
        stats = [r.slots for r in rows]
        for s in {id(s): s for s in stats}.values():
            s.tick()
        return self.planner.plan(self.decoder.context_len, stats, self.draft_cost.per_node)

    def _observe(self, row: Row, tree: DraftTree, acc: Acceptance) -> None:
        if self.speculation == "cost":
            cast(TrajectoryRow, row).slots.record(tree, acc)

    def _result(self, row: TrajectoryRow) -> TrajectoryResult:
        req = row.request
        out = self.generator.output(row.result())
        recorder = row.drafter
        if not isinstance(recorder, TrajectoryRecorder):
            return TrajectoryResult(req, out)
        tokens = len(out.token_ids)
        confidence = recorder.confidence(tokens) if req.confidence else None
        if not req.record:
            return TrajectoryResult(req, out, confidence=confidence)
        return TrajectoryResult(req, out, *recorder.rows(tokens), confidence=confidence)


class RunnerLoop:
    """One `TrajectoryRunner` stepping in a daemon thread: `submit` from any thread, then
    `wait` on the submission. Requests of concurrent submissions share the batch."""

    def __init__(self, runner: TrajectoryRunner) -> None:
        self.runner = runner
        self._lock = threading.Condition()
        self._callers = 0  # threads waiting for `_lock`: let in before the next step
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tts-runner", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The loop's lock, between two steps. A caller blocked during a step goes in before
        the next one: the stepping thread used to release the lock and retake it before a woken
        caller could run, and on a busy CPU a request waited 62 forwards (4.7 s) to join."""
        with self._count_lock:
            self._callers += 1
        with self._lock:
            with self._count_lock:
                self._callers -= 1
            try:
                yield
            finally:
                self._lock.notify()

    def submit(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> Submission:
        with self._turn():
            return self.runner.submit(requests, on_result, skip)

    def run(
        self,
        requests: list[TrajectoryRequest],
        on_result: Callable[[TrajectoryResult], None] | None = None,
        skip: Callable[[TrajectoryRequest], bool] | None = None,
    ) -> RunReport:
        return self.submit(requests, on_result, skip).wait()

    def between_steps(self, work: Callable[[], T]) -> T:
        """Run `work` in the caller's thread while the loop waits between two steps: another
        forward on the same model (scoring) never overlaps a step or a CUDA graph capture."""
        with self._turn():
            return work()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.runner.idle or self._callers:
                    self._lock.wait()
                try:
                    self.runner.tick()
                except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
                    self.runner.fail(e)
