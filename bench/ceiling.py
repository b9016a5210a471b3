"""The acceptance no lossless drafter can beat: the target's own most probable k-node tree.

Under any lossless verification a draft node is accepted at most as often as the target's
sample starts with the node's path (the committed tokens are distributed as the target's), so
a tree of k draft nodes commits on average at most 1 + Σ P(path) over its nodes, and the best
k-node tree is the k most probable continuations. Rule (b) (sample-and-match over
deterministic drafts) reaches that bound exactly with that tree. So a drafter that knew the
target's distribution at every context, hypothetical ones included, and drafted its most
probable tree would commit exactly this; no drafter (store, model or oracle) commits more.

This computes that tree with the real target at each position of logged trajectories, by
best-first search over path probabilities, forwarding the nodes whose distributions the
search needs (a tree forward over the trajectory's KV cache per round), and reports per node
cap: the expected tokens per forward over the positions (`expected`), and the tokens per
forward a replay of the log commits with that tree at every step (`replayed`: the deepest
tree path matching the logged next tokens, plus one, as `tts replay` counts; comparable to
`bench/replay_table.py`'s figures).

    python -m bench.ceiling --log bench/trajectories-unseen-math-science-smollm2.jsonl.gz \\
        --temperature 1.0 --trajectories 0 4 --max-tokens 256 --out runs/ceiling.jsonl

The log's top-k distributions must be the model's at `--temperature`: every position is
checked against them, and a mismatch stops the run (a wrong temperature or model).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.config import ModelConfig
from tts_service.engine.sampling import SamplingParams, target_probs
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, pack
from tts_service.engine.verify import Acceptance
from tts_service.models import load_model
from tts_service.replay import (
    LoggedProblem,
    LoggedTarget,
    logged_requests,
    read_log,
    replay_config,
)
from tts_service.runner import TrajectoryRunner

Path_ = tuple[int, ...]
Expand = Callable[[list[Path_]], list[torch.Tensor]]
"""The target's next-token distribution (`[V]`) after each path (tokens after the root)."""

LOG_TOLERANCE = 2e-3  # the model's p against the log's top-k, per probability


@dataclass(frozen=True)
class BestTree:
    """The k most probable continuations, most probable first (a prefix comes before its
    extensions), and how many distributions the search forwarded."""

    paths: list[Path_]
    probs: list[float]
    forwarded: int

    def expected(self, k: int) -> float:
        """Tokens a step commits on average with the first `k` of them drafted."""
        return 1.0 + sum(self.probs[:k])

    def matched(self, k: int, truth: Sequence[int]) -> int:
        """Draft tokens a step commits when the target's sample is `truth`: the longest of
        the first `k` paths that is a prefix of it."""
        return max((len(p) for p in self.paths[:k] if tuple(truth[: len(p)]) == p), default=0)


def best_tree(root: torch.Tensor, expand: Expand, k: int) -> BestTree:
    """The `k` most probable continuations under the target, by best-first search.

    A continuation is only as probable as its prefix, so the k most probable form a tree. Only
    a node's top-k children can enter it, and a node's children only if they could beat the
    k-th node: so every selected node but the last needs its distribution, and the search
    forwards those it does not know yet, all at once, until none is missing."""
    known: dict[Path_, torch.Tensor] = {(): root}
    forwarded = 0
    while True:
        heap: list[tuple[float, int, Path_]] = []
        for path, p in known.items():
            prob = path_prob(known, path)
            top = torch.topk(p, min(k, p.shape[-1]))
            for q, x in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if q > 0:
                    heap.append((-prob * q, len(path) + 1, (*path, x)))
        chosen = heapq.nsmallest(k, heap)
        need = [path for _, _, path in chosen[:-1] if path not in known]
        if not need:
            return BestTree([c[2] for c in chosen], [-c[0] for c in chosen], forwarded)
        known.update(zip(need, expand(need), strict=True))
        forwarded += len(need)


def path_prob(known: dict[Path_, torch.Tensor], path: Path_) -> float:
    """P(path) under the target: the product of each token's p after its prefix."""
    prob = 1.0
    for i, x in enumerate(path):
        prob *= float(known[path[:i]][x])
    return prob


class TrajectoryTarget:
    """The target over one logged trajectory, under the engine's invariant: the KV cache holds
    the context but its last token, the root (`token`), and `root` is p after it. `expand`
    forwards hypothetical continuations as one tree (`engine.tree.pack`; its writes are
    dropped); `advance` commits the logged token."""

    def __init__(self, model: PreTrainedModel, cfg: SamplingParams, prompt: Sequence[int]):
        self.model, self.cfg = model, cfg
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens in the cache
        p = self._forward(DraftTree.chain(prompt[0], list(prompt[1:])), keep=len(prompt) - 1)
        self.token, self.root = prompt[-1], p[-1]

    @torch.inference_mode()
    def _forward(self, tree: DraftTree, keep: int = 0) -> torch.Tensor:
        """p after each of `tree`'s nodes (`[n, V]`; its root is the cache's next token); the
        cache keeps the first `keep` of them (a chain's) and drops the rest."""
        ids, pos, mask = pack(tree, self.length, self.model.dtype, self.model.device)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.length += keep
        self.cache.crop(self.length - self.cache.get_seq_length())  # negative: tokens to drop
        return target_probs(out.logits[0], self.cfg)

    def expand(self, paths: list[Path_]) -> list[torch.Tensor]:
        nodes = sorted({p[:i] for p in paths for i in range(1, len(p) + 1)}, key=len)
        index = {(): 0} | {p: i + 1 for i, p in enumerate(nodes)}
        tree = DraftTree(
            (self.token, *(p[-1] for p in nodes)),
            (-1, *(index[p[:-1]] for p in nodes)),
            (False,) * (len(nodes) + 1),
            (None,) * (len(nodes) + 1),
        )
        probs = self._forward(tree)
        return [probs[index[p]] for p in paths]

    def advance(self, token: int) -> None:
        self.root = self._forward(DraftTree.chain(self.token, [token]), keep=1)[1]
        self.token = token


def check_log(p: torch.Tensor, ids: Sequence[int], probs: Sequence[float], where: str) -> None:
    """The model's `p` must be the log's at its top-k ids (else wrong model or temperature)."""
    worst = max(abs(float(p[i]) - q) for i, q in zip(ids, probs, strict=True))
    if worst > LOG_TOLERANCE:
        raise SystemExit(
            f"{where}: the model's p differs from the log's by {worst:.4f}: "
            "is --temperature the log's, and the model the one that made it?"
        )


def trajectory(
    model: PreTrainedModel,
    cfg: SamplingParams,
    problem: LoggedProblem,
    r: int,
    max_tokens: int,
    caps: Sequence[int],
) -> dict:
    """One trajectory's best trees at each position, and per node cap the expected and
    replayed tokens per forward."""
    response = problem.responses[r][:max_tokens]
    target = TrajectoryTarget(model, cfg, problem.prompt_ids)
    k = max(caps)
    expected = {c: 0.0 for c in caps}
    matched: dict[int, list[int]] = {c: [] for c in caps}
    forwarded = 0
    for t, token in enumerate(response):
        if problem.top_ids is not None and problem.top_probs is not None:
            check_log(target.root, problem.top_ids[r][t], problem.top_probs[r][t], f"{r}:{t}")
        tree = best_tree(target.root, target.expand, k)
        forwarded += tree.forwarded
        for c in caps:
            expected[c] += tree.expected(c)
            matched[c].append(tree.matched(c, response[t:]))
        target.advance(token)
    n = len(response)
    out = {"problem": problem.prompt_id, "trajectory": r, "positions": n, "forwarded": forwarded}
    for c in caps:
        steps, t = 0, 0
        while t < n:  # the replay: each step commits the matched drafts and one more
            t += matched[c][t] + 1
            steps += 1
        out[f"expected_{c}"] = expected[c] / max(n, 1)
        out[f"replayed_{c}"] = n / max(steps, 1)
        out[f"steps_{c}"] = steps
    return out


class StepCounter(Drafter):
    """A trajectory's drafter, unchanged, that books each step's root position (response
    tokens committed before it) and the tokens it committed."""

    def __init__(self, inner: Drafter, steps: list[tuple[int, int]]) -> None:
        self.inner, self.steps, self.position = inner, steps, 0

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        self.position = len(ctx.tokens) - ctx.prompt_len
        return self.inner.draft(ctx)

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        self.steps.append((self.position, len(acc.committed)))
        return self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        self.steps.append((len(tokens), 1))
        return self.inner.observe_root(tokens, topk)


def method_on_sample(
    problems: Sequence[LoggedProblem],
    method: str,
    cap: int,
    trajectories: Sequence[int],
    max_tokens: int,
) -> float:
    """`method`'s tokens per forward at `cap` nodes on the ceiling's positions: the whole log
    replayed as `tts replay` does (every trajectory feeding the store), counting only the
    steps of `trajectories` rooted in their first `max_tokens` tokens, as the ceiling's
    replay counts them (the last step's tokens cut at `max_tokens`)."""
    cfg = replay_config(SimpleNamespace(method=method, nodes=cap, tree=None))
    booked: dict[tuple[str, int], list[tuple[int, int]]] = {}
    requests = []
    for req in logged_requests(problems, cfg):
        if req.index in trajectories:
            steps = booked.setdefault((req.problem_id, req.index), [])
            req = replace(req, wrap=lambda d, steps=steps: StepCounter(d, steps))
        requests.append(req)
    runner = TrajectoryRunner(LoggedTarget(problems), 1, "fixed", token_budget=cap + 1)
    runner.run(requests)
    tokens = forwards = 0
    for steps in booked.values():
        for position, committed in steps:
            if position < max_tokens:
                tokens += min(committed, max_tokens - position)
                forwards += 1
    return tokens / max(forwards, 1)


def summary(records: Sequence[dict], caps: Sequence[int]) -> dict:
    """Over all trajectories: expected per position, replayed as committed tokens over steps."""
    n = sum(r["positions"] for r in records)
    out: dict = {"trajectories": len(records), "positions": n}
    for c in caps:
        out[f"expected_{c}"] = round(
            sum(r[f"expected_{c}"] * r["positions"] for r in records) / max(n, 1), 3
        )
        out[f"replayed_{c}"] = round(n / max(sum(r[f"steps_{c}"] for r in records), 1), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="trajectory log with top-k")
    ap.add_argument("--temperature", type=float, required=True, help="the log's")
    ap.add_argument("--trajectories", type=int, nargs="+", default=[0], help="indices per problem")
    ap.add_argument("--max-tokens", type=int, default=256, help="positions per trajectory")
    ap.add_argument(
        "--nodes", type=int, nargs="+", default=[2, 4, 8], help="draft nodes, as replay's caps"
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--methods", nargs="*", default=["stand-dyn"], help="replayed on the same positions"
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON Lines, one per trajectory")
    args = ap.parse_args(argv)
    if args.temperature <= 0 or min(args.nodes) < 1:
        ap.error("--temperature must be > 0 and every --nodes at least 1")
    torch.set_grad_enabled(False)
    loaded = load_model(ModelConfig(name=args.model))
    cfg = SamplingParams(temperature=args.temperature)
    problems, _ = read_log(args.log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    with args.out.open("w") as f:
        for problem in problems:
            for r in args.trajectories:
                if r >= len(problem.responses):
                    continue
                t0 = time.perf_counter()
                rec = trajectory(loaded.model, cfg, problem, r, args.max_tokens, args.nodes)
                rec["seconds"] = round(time.perf_counter() - t0, 1)
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(json.dumps(rec), file=sys.stderr, flush=True)
        total = {"summary": summary(records, args.nodes), "log": str(args.log)}
        total["temperature"] = args.temperature
        sample = [r for r in args.trajectories]
        for method in args.methods:
            total[method] = {
                str(c): round(method_on_sample(problems, method, c, sample, args.max_tokens), 3)
                for c in args.nodes
            }
        f.write(json.dumps(total) + "\n")
    print(json.dumps(total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
