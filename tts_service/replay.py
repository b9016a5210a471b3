"""Trajectory logs and offline replay: measure drafters on logged trajectories without the model.

Under greedy verification, and under sample-and-match verification of deterministic drafts, the
tokens a trajectory commits are exactly the logged trajectory. So a drafter's acceptance
length on a log can be computed exactly without the model: draft (deterministic mode), match
the tree against the true next tokens, commit matched + 1, then feed the drafter what the live
engine would have fed it at those committed positions (the logged top-k distributions). The
drafters are the live ones; replay only replaces the target forward.

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

import torch

from tts_service.drafters.base import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

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

    def to_json(self) -> str:
        data = {
            "prompt_id": self.prompt_id,
            "prompt_ids": self.prompt_ids,
            "responses": self.responses,
        }
        if self.top_ids is not None:
            data.update(top_ids=self.top_ids, top_probs=self.top_probs)
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
    return LoggedProblem(str(data["prompt_id"]), prompt, responses, top_ids, top_probs)


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


class TrajectoryRecorder:
    """Wraps a drafter and keeps the target's top-k at every committed position."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.top_ids: list[list[int]] = []
        self.top_probs: list[list[float]] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.top_ids, self.top_probs = [], []
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.inner.draft(ctx)

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        nodes = [0, *acc.path]  # the distributions the committed tokens were drawn from
        self.top_ids += topk.ids[nodes].tolist()
        self.top_probs += topk.probs[nodes].tolist()
        self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        self.top_ids += topk.ids[:1].tolist()
        self.top_probs += topk.probs[:1].tolist()
        self.inner.observe_root(tokens, topk)

    def rows(self, num_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """The rows of the generation's tokens (a stop may cut the last block)."""
        return self.top_ids[:num_tokens], self.top_probs[:num_tokens]


class LogWriter:
    """Appends one problem per line, flushed as it goes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, problem: LoggedProblem) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(problem.to_json() + "\n")


@dataclass
class ReplayReport:
    steps: int = 0
    tokens: int = 0
    tree_nodes: int = 0
    by_index: dict[int, list[int]] = field(default_factory=dict)  # index -> [tokens, steps]
    accepted_at_depth: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def add_step(self, index: int, nodes: int, accepted: int, committed: int) -> None:
        self.steps += 1
        self.tokens += committed
        self.tree_nodes += nodes
        slot = self.by_index.setdefault(index, [0, 0])
        slot[0] += committed
        slot[1] += 1
        self.accepted_at_depth.extend([0] * (accepted - len(self.accepted_at_depth)))
        for d in range(accepted):
            self.accepted_at_depth[d] += 1

    def to_dict(self) -> dict:
        return {
            "acceptance_length": round(self.tokens / self.steps, 4) if self.steps else 0.0,
            "steps": self.steps,
            "tokens": self.tokens,
            "mean_tree_nodes": round(self.tree_nodes / self.steps, 2) if self.steps else 0.0,
            "acceptance_length_by_index": [
                round(t / s, 4) for _, (t, s) in sorted(self.by_index.items())
            ],
            "acceptance_length_at_trajectory": {  # 1-based index within a problem
                str(i): round(t / s, 4)
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
    the live engine commits. Offline replay (`replay`) uses it without a model; the device
    benchmark's timing replay (`bench/device.py`, `BatchDecoder` rows with an oracle) uses it
    with real forwards, so a device's speed is measured with real trees and real acceptance."""

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
        ids = torch.zeros(tree.size, k, dtype=torch.long)
        probs = torch.zeros(tree.size, k, dtype=torch.float64)
        known: tuple[int, ...] = ()
        if problem.top_ids is not None:
            for j, v in enumerate(nodes):
                ids[v] = torch.tensor(problem.top_ids[r][position + j])
                probs[v] = torch.tensor(problem.top_probs[r][position + j], dtype=torch.float64)
            known = tuple(nodes)
        return acc, NodeTopK(ids, probs, known)


def _walk(
    drafter: Drafter, problem: LoggedProblem, r: int, report: ReplayReport, max_nodes: int
) -> None:
    prompt, resp = problem.prompt_ids, problem.responses[r]
    oracle = LoggedOracle(problem, r)
    drafter.start(list(prompt))
    tokens, pos = list(prompt), 0
    while pos < len(resp):
        tree = drafter.draft(DraftContext(tokens, len(prompt), max_nodes, greedy=True))
        acc, top = oracle(tree, pos)
        committed = list(acc.committed[: len(resp) - pos])
        drafter.observe(tree, acc, top)
        report.add_step(r, tree.size - 1, min(acc.num_accepted, len(committed)), len(committed))
        tokens += committed
        pos += len(committed)


def replay(
    problems: list[LoggedProblem],
    drafter_for: Callable[[int, int], Drafter],
    max_nodes: int = MAX_NODES,
) -> ReplayReport:
    """Replay every response of every problem in order. `drafter_for(problem_index, response)`
    returns the drafter of that trajectory (`replay_drafters`: one per trajectory over shared
    state, as the runner builds them); `max_nodes` caps every step's tree, as the engine does."""
    report = ReplayReport()
    start = time.perf_counter()
    for p_idx, problem in enumerate(problems):
        for r in range(len(problem.responses)):
            _walk(drafter_for(p_idx, r), problem, r, report, max_nodes)
    report.seconds = time.perf_counter() - start
    return report


def _max_id(problem: LoggedProblem) -> int:
    ids = [max(seq, default=0) for seq in (problem.prompt_ids, *problem.responses)]
    for response in problem.top_ids or []:
        ids += [max(row, default=0) for row in response]
    return max(ids)


def sized_fields(fields: dict, nodes: int) -> dict:
    """A method's drafter fields with its size field set to `nodes` (within the field's bound:
    PLD's chain is at most 64 tokens)."""
    from tts_service.config import DRAFTER_CONFIGS

    name = {"pld": "num_draft_tokens", "gtcp": "max_nodes"}.get(fields["kind"], "num_nodes")
    bound = DRAFTER_CONFIGS[fields["kind"]].model_fields[name].metadata
    return {**fields, name: min([nodes, *(m.le for m in bound if hasattr(m, "le"))])}


def replay_drafters(req, problems: list[LoggedProblem]) -> Callable[[int, int], Drafter]:
    """Drafters as the live service builds them (`Generator.row_drafter`): one per trajectory,
    seeded by its index, over the method's preset-free fields; successor tables shared by the
    whole log (the hot start), the store and the `problem` dict (spine index, GT statistics)
    by one problem's trajectories. GT sizing prices nodes with `GPU_LIKE_COST`
    (fixed, so replay stays model- and machine-free; on it GT keeps nearly every node that has
    paid, so the cap decides).

    Raises:
        ValidationError: a field the method does not take (`--tree` for PLD, say).
    """
    from pydantic import TypeAdapter

    from store.memory import InMemoryNgramStore
    from tts_service.config import DrafterConfig
    from tts_service.drafters.methods import method_drafter
    from tts_service.drafters.registry import DraftEnv, build_drafter
    from tts_service.engine.cost import GPU_LIKE_COST, CostModel

    fields = method_drafter(req.method, {})
    if req.nodes:
        fields = sized_fields(fields, req.nodes)
    if req.tree:
        fields["tree"] = req.tree
    cfg = TypeAdapter(DrafterConfig).validate_python(fields)
    vocab = req.vocab_size or 1 + max((_max_id(p) for p in problems), default=0)
    cost, generator = CostModel.fixed(GPU_LIKE_COST), {}
    per_problem: dict[int, tuple] = {}

    def drafter_for(p_idx: int, r: int) -> Drafter:
        if p_idx not in per_problem:
            per_problem.clear()  # the previous problem is done
            per_problem[p_idx] = (InMemoryNgramStore(), {})
        store, problem = per_problem[p_idx]
        return build_drafter(cfg, DraftEnv(vocab, store, r, cost, generator, problem))

    return drafter_for
