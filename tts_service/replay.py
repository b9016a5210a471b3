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

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tts_service.drafters.base import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

MAX_NODES = 1024


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
    """All valid problems of a log plus one message per skipped line.

    Raises:
        LogFormatError: on the first bad line when `strict`.
    """
    problems, errors = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
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


def _walk(drafter: Drafter, problem: LoggedProblem, r: int, report: ReplayReport) -> None:
    prompt, resp = problem.prompt_ids, problem.responses[r]
    oracle = LoggedOracle(problem, r)
    drafter.start(list(prompt))
    tokens, pos = list(prompt), 0
    while pos < len(resp):
        tree = drafter.draft(DraftContext(tokens, len(prompt), MAX_NODES, greedy=True))
        acc, top = oracle(tree, pos)
        committed = list(acc.committed[: len(resp) - pos])
        drafter.observe(tree, acc, top)
        report.add_step(r, tree.size - 1, min(acc.num_accepted, len(committed)), len(committed))
        tokens += committed
        pos += len(committed)


def replay(problems: list[LoggedProblem], drafter_for: Callable[[int], Drafter]) -> ReplayReport:
    """Replay every response of every problem in order. `drafter_for(problem_index)` returns the
    drafter to use (a new STAND drafter per problem, the same Token Recycling drafter for all)."""
    report = ReplayReport()
    start = time.perf_counter()
    for p_idx, problem in enumerate(problems):
        drafter = drafter_for(p_idx)
        for r in range(len(problem.responses)):
            _walk(drafter, problem, r, report)
    report.seconds = time.perf_counter() - start
    return report


def _max_id(problem: LoggedProblem) -> int:
    ids = [max(seq, default=0) for seq in (problem.prompt_ids, *problem.responses)]
    for response in problem.top_ids or []:
        ids += [max(row, default=0) for row in response]
    return max(ids)


def replay_drafters(req, problems: list[LoggedProblem]) -> Callable[[int], Drafter]:
    """Drafters as the live service keeps them: PLD and Token Recycling once for the whole log
    (the recycling table's hot start), STAND over a fresh store per problem."""
    from store.memory import InMemoryNgramStore
    from tts_service.config import PldDrafterConfig, RecyclingDrafterConfig, StandDrafterConfig
    from tts_service.drafters.registry import DraftEnv, build_drafter

    size = {"num_nodes": req.nodes} if req.nodes else {}
    tree = {"tree": req.tree} if req.tree else {}
    if req.method == "pld":
        cfg = PldDrafterConfig(**({"num_draft_tokens": req.nodes} if req.nodes else {}))
    elif req.method == "recycle":
        cfg = RecyclingDrafterConfig(**size, **tree)
    else:
        cfg = StandDrafterConfig(**size, **tree)
    vocab = req.vocab_size or 1 + max((_max_id(p) for p in problems), default=0)
    if req.method != "stand":
        shared = build_drafter(cfg, DraftEnv(vocab))
        return lambda _: shared
    return lambda i: build_drafter(cfg, DraftEnv(vocab, InMemoryNgramStore(), seed=i))
