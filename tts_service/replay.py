"""Trajectory logs and offline replay: measure drafters on logged trajectories without the model.

Under greedy verification, and under sample-and-match verification of deterministic drafts, the
tokens a trajectory commits are exactly the logged trajectory. So a drafter's acceptance
length on a log can be computed exactly without the model: draft (deterministic mode), match
the tree against the true next tokens, commit matched + 1, then feed the drafter what the live
engine would have fed it at those committed positions (the logged top-k distributions). The
drafters are the live ones and so is the loop: replay runs the one runner
(`runner.TrajectoryRunner`) over a decoder whose acceptance follows the log (`LoggedDecoder`);
it only replaces the target forward.

Log format (JSON Lines, one problem per line):
    {"prompt_id": str, "prompt_ids": [int], "responses": [[int]],
     "top_ids": [[[int] * k] per position] per response,      (optional)
     "top_probs": [[[float] * k] per position] per response}  (optional)
`top_*[r][t]` is the target's top-k next-token distribution (after temperature) from which
token t of response r was drawn.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from store.base import NgramStore
from store.memory import InMemoryNgramStore
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DrafterConfig, RowDrafters, method_drafter
from tts_service.engine.acceptance import Verified
from tts_service.engine.allocate import SlotStats
from tts_service.engine.batch import BatchDecoder, Row, StepObserver
from tts_service.engine.cost import GPU_LIKE_COST, CostModel
from tts_service.engine.decode import GenerationOutput, GenerationResult, OnCommit, StopRule
from tts_service.engine.kv import fill_holes
from tts_service.engine.metrics import ForwardStats, GenerationStats, acceptance_length
from tts_service.engine.options import DecoderOptions
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import DeferredObservations, DraftContext, Drafter, NodeTopK, draft_all
from tts_service.engine.surface import CostSurface
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance
from tts_service.generation import Generator
from tts_service.models import LoadedModel
from tts_service.runner import TrajectoryRow, TrajectoryRunner
from tts_service.solve import SolveResult
from tts_service.trajectory import TrajectoryRequest

MAX_NODES = 1024
TRAJECTORY_INDICES = (1, 2, 4, 8, 16)  # the per-index breakdown: does the store help later ones?


class LogFormatError(ValueError):
    """A malformed log line; the message starts with its line number."""


@dataclass(frozen=True)
class LoggedProblem:
    prompt_id: str
    prompt_ids: list[int]
    responses: list[list[int]]
    top_ids: list[list[list[int]]] | None = None
    top_probs: list[list[list[float]]] | None = None
    confidence: list[dict] | None = None  # per response, `aggregate.confidence`'s summary

    def to_json(self) -> str:
        data = {
            "prompt_id": self.prompt_id,
            "prompt_ids": self.prompt_ids,
            "responses": self.responses,
        }
        if self.top_ids is not None:
            data.update(top_ids=self.top_ids, top_probs=self.top_probs)
        if self.confidence is not None:
            data["confidence"] = self.confidence
        return json.dumps(data)


def _int_list(value: object, what: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise ValueError(f"{what} must be a list of integers")
    bad = [x for x in value if x < 0 or (vocab_size is not None and x >= vocab_size)]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary")
    return value


def parse_line(line: str, vocab_size: int | None = None) -> LoggedProblem:
    """Validate one log line. Raises ValueError saying what is wrong."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg})") from e
    if not isinstance(data, dict):
        raise ValueError("a line must be a JSON object")
    missing = [k for k in ("prompt_id", "prompt_ids", "responses") if k not in data]
    if missing:
        raise ValueError(f"missing field {missing[0]!r}")
    prompt = _int_list(data["prompt_ids"], "prompt_ids", vocab_size)
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    if not isinstance(data["responses"], list):
        raise ValueError("responses must be a list of token id lists")
    responses = [
        _int_list(r, f"responses[{i}]", vocab_size) for i, r in enumerate(data["responses"])
    ]
    top_ids, top_probs = data.get("top_ids"), data.get("top_probs")
    if (top_ids is None) != (top_probs is None):
        raise ValueError("top_ids and top_probs come together")
    if top_ids is not None:
        if len(top_ids) != len(responses) or len(top_probs) != len(responses):
            raise ValueError("top_ids/top_probs need one entry per response")
        for r, resp in enumerate(responses):
            ids, probs = top_ids[r], top_probs[r]
            if len(ids) != len(resp) or len(probs) != len(resp):
                raise ValueError(f"top_ids[{r}]/top_probs[{r}] need one row per token")
            for t, (i_row, p_row) in enumerate(zip(ids, probs, strict=True)):
                _int_list(i_row, f"top_ids[{r}][{t}]", vocab_size)
                if not isinstance(p_row, list) or len(p_row) != len(i_row):
                    raise ValueError(f"top_probs[{r}][{t}] is ragged against top_ids")
    confidence = data.get("confidence")
    if confidence is not None and (
        not isinstance(confidence, list) or len(confidence) != len(responses)
    ):
        raise ValueError("confidence needs one entry per response")
    return LoggedProblem(str(data["prompt_id"]), prompt, responses, top_ids, top_probs, confidence)


def read_log(
    path: Path, vocab_size: int | None = None, strict: bool = False
) -> tuple[list[LoggedProblem], list[str]]:
    """All valid problems of a log (`.gz`: gzip-compressed) plus one message per skipped line.

    Raises:
        LogFormatError: on the first bad line when `strict`.
    """
    problems, errors = [], []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            problems.append(parse_line(line, vocab_size))
        except ValueError as e:
            if strict:
                raise LogFormatError(f"{path}:{lineno}: {e}") from e
            errors.append(f"{path}:{lineno}: {e}")
    return problems, errors


class LogWriter:
    """Appends one problem per line, flushed as it goes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, problem: LoggedProblem) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(problem.to_json() + "\n")


def logged_problem(prompt_ids: list[int], result: SolveResult) -> LoggedProblem:
    """One solved problem as a line of a trajectory log (`top_*` when every trajectory was
    recorded)."""
    trajs = result.trajectories
    recorded = all(t.top_ids is not None for t in trajs)
    sure = all(t.confidence is not None for t in trajs)
    return LoggedProblem(
        result.problem_id,
        list(prompt_ids),
        [list(t.output.token_ids) for t in trajs],
        [t.top_ids for t in trajs] if recorded else None,  # type: ignore[misc]
        [t.top_probs for t in trajs] if recorded else None,  # type: ignore[misc]
        [t.confidence for t in trajs] if sure else None,  # type: ignore[misc]
    )


@dataclass
class ReplayReport:
    steps: int = 0
    tokens: int = 0
    tree_nodes: int = 0
    by_index: dict[int, list[int]] = field(default_factory=dict)  # index -> [tokens, steps]
    accepted_at_depth: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, index: int, stats: GenerationStats) -> None:
        """One replayed trajectory: response `index` of its problem."""
        self.steps += stats.target_forwards
        self.tokens += stats.new_tokens
        self.tree_nodes += stats.tree_nodes
        slot = self.by_index.setdefault(index, [0, 0])
        slot[0] += stats.new_tokens
        slot[1] += stats.target_forwards
        self._add_depths(stats.accepted_at_depth)

    def merge(self, other: ReplayReport) -> None:
        """Another replay's report pooled into this one (problems replayed separately)."""
        self.steps += other.steps
        self.tokens += other.tokens
        self.tree_nodes += other.tree_nodes
        self.seconds += other.seconds
        for index, (tokens, steps) in other.by_index.items():
            slot = self.by_index.setdefault(index, [0, 0])
            slot[0] += tokens
            slot[1] += steps
        self._add_depths(other.accepted_at_depth)

    def _add_depths(self, depth: Sequence[int]) -> None:
        self.accepted_at_depth.extend([0] * (len(depth) - len(self.accepted_at_depth)))
        for d, c in enumerate(depth):
            self.accepted_at_depth[d] += c

    def to_dict(self) -> dict:
        return {
            "acceptance_length": round(acceptance_length(self.tokens, self.steps), 4),
            "steps": self.steps,
            "tokens": self.tokens,
            "mean_tree_nodes": round(self.tree_nodes / self.steps, 2) if self.steps else 0.0,
            "acceptance_length_by_index": [
                round(acceptance_length(t, s), 4) for _, (t, s) in sorted(self.by_index.items())
            ],
            "acceptance_length_at_trajectory": {  # 1-based index within a problem
                str(i): round(acceptance_length(t, s), 4)
                for i in TRAJECTORY_INDICES
                if i - 1 in self.by_index
                for t, s in [self.by_index[i - 1]]
            },
            "accepted_at_depth": self.accepted_at_depth,
            "seconds": round(self.seconds, 3),
        }


def _match(tree: DraftTree, truth: list[int]) -> list[int]:
    """The deepest root path whose tokens equal `truth`'s prefix (children tried in order)."""
    node, path = 0, []
    while len(path) < len(truth):
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == truth[len(path)]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


class LoggedOracle:
    """Acceptance that follows logged response `r` of a problem: the deepest tree path that
    matches the logged next tokens, then the logged token after it; the drafter observes the
    logged top-k at the committed positions. Under greedy verification this is exactly what
    the live engine commits. Offline replay (`replay`, `LoggedDecoder`) uses it without a
    model; the device benchmark's timing replay (`bench/device.py`, `LoggedBatchDecoder`) with
    real forwards, so a device's speed is measured with real trees and real acceptance."""

    def __init__(self, problem: LoggedProblem, r: int) -> None:
        self.problem, self.r = problem, r
        self.response = problem.responses[r]

    def __call__(self, tree: DraftTree, position: int) -> tuple[Acceptance, NodeTopK]:
        resp, problem, r = self.response, self.problem, self.r
        path = _match(tree, resp[position:])
        committed = resp[position : position + len(path) + 1]
        bonus = committed[-1] if len(committed) > len(path) else -1  # -1: the response ended
        acc = Acceptance(tuple(path), tuple(tree.tokens[v] for v in path), bonus)
        nodes = [0, *path][: len(committed)]
        k = len(problem.top_ids[r][0]) if problem.top_ids and resp else 1
        ids = np.zeros((tree.size, k), np.int64)
        probs = np.zeros((tree.size, k), np.float64)
        known: tuple[int, ...] = ()
        if problem.top_ids is not None:
            for j, v in enumerate(nodes):
                ids[v] = problem.top_ids[r][position + j]
                probs[v] = problem.top_probs[r][position + j]
            known = tuple(nodes)
        return acc, NodeTopK(ids, probs, known)


class LoggedDecoder:
    """The runner's decoder over a trajectory log (`runner.StepDecoder`): each step drafts
    every row's tree and takes its acceptance from the row's logged response (no model, no
    forward). Rows are matched to responses by their request: problem `str(i)` of `problems`,
    response `index`."""

    def __init__(self, problems: Sequence[LoggedProblem]) -> None:
        self.problems = problems
        self.active: list[Row] = []
        self.joining: list[Row] = []  # rows join at once: no prompt to prefill
        self.forwards = ForwardStats()
        self.oracles: dict[int, LoggedOracle] = {}  # id(row) -> its response's oracle
        self.deferred = DeferredObservations()  # run after the next drafts

    graph_tokens = None  # no forwards, no graphs
    last_step_steady = True
    prefill_limit = 1
    prefill_s_per_token = None

    @property
    def context_len(self) -> int:
        return max((len(r.tokens) for r in self.active), default=0)

    def stop_rule(self, cfg: SamplingParams, on_commit: OnCommit | None = None) -> StopRule:
        return StopRule(cfg, (), None, on_commit)

    def join(self, rows: list[Row]) -> None:
        for row in rows:
            req = cast(TrajectoryRow, row).request
            self.oracles[id(row)] = LoggedOracle(self.problems[int(req.problem_id)], req.index)
            row.drafter.start(row.tokens)
        self.active.extend(rows)

    def admit(self, rows: list[Row]) -> None:
        self.join(rows)

    def prefill(self, tokens: int | None = None) -> list[Row]:
        return []

    def drop(self, rows: list[Row]) -> None:
        if rows:
            self.deferred.run()
        gone = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.active) if id(r) not in gone]
        self.active = [self.active[b] for b in fill_holes(keep)]  # the engine's order

    def reset(self) -> None:
        self.drop(list(self.active))
        self.oracles.clear()

    def step(
        self, max_nodes: int, observe: StepObserver | None = None, fill: bool = False
    ) -> list[Row]:
        """Every row drafts (deterministically) and commits what its response says; what the
        drafters defer of observing runs after the next step's drafts, as in the engine."""
        batch, total, nodes, width = list(self.active), 0, 0, 1
        ctxs = [DraftContext(r.tokens, len(r.prompt_ids), max_nodes, True, fill) for r in batch]
        trees = draft_all([row.drafter for row in batch], ctxs)
        self.deferred.run()  # where the engine's forward would be
        for row, tree in zip(batch, trees, strict=True):
            acc, top = self.oracles[id(row)](tree, len(row.rule.out))
            committed, acc = row.commit(tree, acc)
            self.deferred.add(row.drafter.observe(tree, acc, top))
            if observe is not None:
                observe(row, tree, acc)
            total, nodes, width = total + committed, nodes + tree.size - 1, max(width, tree.size)
        finished = [r for r in batch if r.rule.finish is not None]
        self.drop(finished)
        for row in finished:
            del self.oracles[id(row)]
        if not self.active:
            self.deferred.run()
        self.forwards.record(len(batch), width, nodes, total, 0.0, 0.0)
        return finished


class LoggedBatchDecoder(BatchDecoder):
    """Timing replay (`bench/device.py`): real batched forwards, acceptance from the log, so a
    device is timed on real trees with real acceptance. Rows are matched to responses by their
    request, as `LoggedDecoder` matches them."""

    def __init__(self, problems: Sequence[LoggedProblem], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.problems = problems
        self.oracles: dict[int, LoggedOracle] = {}

    def admit(self, rows: list[Row]) -> None:
        for row in rows:
            req = cast(TrajectoryRow, row).request
            self.oracles[id(row)] = LoggedOracle(self.problems[int(req.problem_id)], req.index)
        super().admit(rows)

    def drop(self, rows: list[Row]) -> None:
        super().drop(rows)
        for row in rows:
            self.oracles.pop(id(row), None)

    def step(
        self, max_nodes: int, observe: StepObserver | None = None, fill: bool = False
    ) -> list[Row]:
        finished = super().step(max_nodes, observe, fill)
        for row in finished:
            del self.oracles[id(row)]
        return finished

    def verify(self, batch, trees, logits, tb, static=None) -> list[Verified]:
        # the device's work, timed; the log decides
        super().verify(batch, trees, logits, tb, static)
        return [
            Verified(*self.oracles[id(row)](tree, len(row.rule.out)))
            for row, tree in zip(batch, trees, strict=True)
        ]


class TimedTarget(Generator):
    """The runner's model for timing replay: a loaded model (random weights will do, no
    tokenizer) whose decoder takes acceptance from a log (`LoggedBatchDecoder`); drafters, α̂,
    the cost surface and the allocator are the live service's (`Generator`)."""

    def __init__(self, loaded: LoadedModel, problems: Sequence[LoggedProblem]) -> None:
        super().__init__(loaded)
        self.problems = problems

    def new_decoder(self) -> LoggedBatchDecoder:
        loaded = self.loaded
        return LoggedBatchDecoder(
            self.problems,
            loaded.model,
            loaded.eos_token_ids,
            options=DecoderOptions(
                cuda_graphs=loaded.cuda_graphs, graph_acceptance=loaded.graph_acceptance
            ),
        )

    def output(self, res: GenerationResult) -> GenerationOutput:
        return GenerationOutput("", res.token_ids, res.finish_reason, res.stats)


class LoggedTarget:
    """The runner's model over a trajectory log (`runner.RunnerModel`): drafters as the live
    service builds them (`Generator.row_drafter`), successor tables shared by the whole log
    (the hot start), the store and the `problem` state by one problem's trajectories. GT
    sizing prices nodes with `GPU_LIKE_COST` (fixed, so replay stays model- and machine-free;
    on it GT keeps nearly every node that has paid, so the cap decides)."""

    fixed_batch_cost = None

    def __init__(self, problems: Sequence[LoggedProblem], vocab_size: int | None = None) -> None:
        self.problems = problems
        self.vocab = vocab_size or 1 + max((_max_id(p) for p in problems), default=0)
        self.drafters = RowDrafters(self.vocab, CostModel.fixed(GPU_LIKE_COST))
        self.slots = SlotStats()

    def new_decoder(self) -> LoggedDecoder:
        return LoggedDecoder(self.problems)

    def check_fits(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        pass  # a logged trajectory fitted when it was decoded

    def kv_room(self, lengths: Sequence[int]) -> bool:
        return True  # no cache

    def row_drafter(self, cfg: DrafterConfig, store: NgramStore, params: SamplingParams) -> Drafter:
        return self.drafters.build(cfg, store, params)

    def slot_stats(self, cfg: DrafterConfig) -> SlotStats:
        return self.slots

    def surface(self, max_rows: int = 1) -> CostSurface:
        raise NotImplementedError("replay steps are sized by a fixed budget")

    def output(self, res: GenerationResult) -> GenerationOutput:
        return GenerationOutput("", res.token_ids, res.finish_reason, res.stats)


def logged_requests(
    problems: Sequence[LoggedProblem],
    cfg: DrafterConfig,
    wrap: Callable[[Drafter], Drafter] | None = None,
    new_store: Callable[[], NgramStore] = InMemoryNgramStore,
) -> list[TrajectoryRequest]:
    """One greedy request per non-empty logged response, as long as the response (problem i is
    `str(i)`, response r its index and seed); a problem's requests share one store, made by
    `new_store`."""
    requests = []
    for i, problem in enumerate(problems):
        store = new_store()
        for r, response in enumerate(problem.responses):
            if not response:
                continue
            greedy = SamplingConfig(
                temperature=0.0, max_new_tokens=len(response), seed=r, ignore_eos=True
            )
            req = TrajectoryRequest(str(i), r, problem.prompt_ids, greedy, cfg, store, wrap=wrap)
            requests.append(req)
    return requests


def replay(
    problems: Sequence[LoggedProblem],
    cfg: DrafterConfig,
    max_nodes: int = MAX_NODES,
    vocab_size: int | None = None,
    wrap: Callable[[Drafter], Drafter] | None = None,
    new_store: Callable[[], NgramStore] = InMemoryNgramStore,
) -> ReplayReport:
    """Replay every response of every problem, one after another (each drafts from what the
    earlier ones of its problem stored, as `max_rows = 1` runs live), through the one runner
    over the log; `max_nodes` caps every step's tree, as the engine does. `wrap` wraps every
    trajectory's drafter (tree calibration's counters); `new_store` makes each problem's store
    (a `TieredStore` over a global one, as `store.global_scope` does)."""
    target = LoggedTarget(problems, vocab_size)
    runner = TrajectoryRunner(target, 1, "fixed", token_budget=max_nodes + 1)
    start = time.perf_counter()
    run = runner.run(logged_requests(problems, cfg, wrap, new_store))
    report = ReplayReport(seconds=time.perf_counter() - start)
    for res in sorted(run.results, key=lambda x: (int(x.request.problem_id), x.request.index)):
        report.add(res.request.index, res.output.stats)
    return report


def _max_id(problem: LoggedProblem) -> int:
    ids = [max(seq, default=0) for seq in (problem.prompt_ids, *problem.responses)]
    for response in problem.top_ids or []:
        ids += [max(row, default=0) for row in response]
    return max(ids)


def sized_fields(fields: dict, nodes: int) -> dict:
    """A method's drafter fields with its size field (`registry.size_field`) set to `nodes`
    (within the field's bound: PLD's chain is at most 64 tokens); unchanged for a kind without
    one (plain: the replay's node cap is all there is)."""
    from tts_service.drafters.registry import DRAFTER_CONFIGS, size_field

    name = size_field(fields["kind"])
    if name is None:
        return dict(fields)
    bound = DRAFTER_CONFIGS[fields["kind"]].model_fields[name].metadata
    return {**fields, name: min([nodes, *(m.le for m in bound if hasattr(m, "le"))])}


def replay_config(req) -> DrafterConfig:
    """The drafter config a `tts replay` request names: the method's preset-free fields, sized
    by `req.nodes`, on `req.tree`.

    Raises:
        ValidationError: a field the method does not take (`--tree` for PLD, say).
    """
    from pydantic import TypeAdapter

    fields = method_drafter(req.method, {})
    if req.nodes:
        fields = sized_fields(fields, req.nodes)
    if req.tree:
        fields["tree"] = req.tree
    return TypeAdapter(DrafterConfig).validate_python(fields)
