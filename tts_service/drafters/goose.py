"""Goose: anisotropic spine trees (docs/design.md, "Goose").

A deep **spine** of context-matched tokens (prompt lookup over n in {3, 4, 5}, up to 20 tokens)
carries wide **branches** of Token-Recycling successors: the spine is accepted far more often
per token (median 0.21 vs 0.033 in the paper), so it gets depth and the transition candidates
get width. Per step (the paper's Algorithms 1 and 2):

* a long match (>= `bypass_len`) or one that two n-gram lengths agree on is drafted as a
  plain chain (the bypass);
* otherwise the spine gets `min(m, B·r)` nodes (r from the running spine acceptance p̂_s), the
  root `(B-1-b_s)(1-ρ)` successor branches, the spine nodes the rest under a 1/i harmonic
  decay, and branch leaves extend breadth-first through the table to depth D (score >= 0.01);
* with no match and no successors the step verifies the root alone.

Every forward's distributions, at accepted *and* rejected nodes, refresh the successor table
(the paper's aggressive harvesting). All drafts are deterministic, and the spine child is each
spine node's first child: greedy verification prefers it, and under sampling the
sample-and-match rule tries it first, then the branches, with the shared residual.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from tts_service.config import StrictConfig
from tts_service.drafters.matching import ExactMatchIndex
from tts_service.drafters.spec import DrafterSpec, Method, Shared
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, TreeBuilder
from tts_service.engine.verify import Acceptance

BIGRAM_CAPACITY = 200_000


class GooseDrafterConfig(StrictConfig):
    """Goose (anisotropic spine trees): a context-match spine with Token Recycling branches."""

    kind: Literal["goose"] = "goose"
    num_nodes: int = Field(59, ge=1, le=1024, description="Draft nodes (the paper's B = 60).")
    max_depth: int = Field(6, ge=1, le=64, description="Branch depth from the branching point.")
    k: int = Field(10, ge=1, le=10, description="Successors kept per token.")
    ngram_orders: tuple[int, ...] = Field((3, 4, 5), description="Context-match n-gram lengths.")
    max_spine: int = Field(20, ge=1, le=256, description="Longest spine continuation.")
    bypass_len: int = Field(8, ge=1, description="A match this long is drafted as a chain.")
    spine_branch_ratio: float = Field(0.5, ge=0, le=1, description="ρ: spine vs root branches.")
    min_score: float = Field(0.01, ge=0, le=1, description="Successors below this are pruned.")
    ema: float = Field(0.3, gt=0, le=1, description="Smoothing of the spine acceptance p̂_s.")
    initial_spine_rate: float = Field(0.3, ge=0, le=1)

    @field_validator("ngram_orders")
    @classmethod
    def _orders(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or min(v) < 1 or max(v) > 16:
            raise ValueError("n-gram lengths must be in 1..16")
        return v


class AdjacencyTable:
    """Top-k successors per token and per token pair (a bounded LRU dict): the pair is looked up
    first, the single token second (Goose's two tiers). Plain dicts of lists: a lookup is on
    drafting's critical path and costs no tensor op."""

    def __init__(self, vocab_size: int, k: int) -> None:
        self.k = k
        self.vocab_size = vocab_size
        self.unigram: dict[int, tuple[list[int], list[float]]] = {}
        self.bigram: OrderedDict[tuple[int, int], tuple[list[int], list[float]]] = OrderedDict()

    def update(self, prev: list[int], tokens: list[int], ids: np.ndarray, probs: np.ndarray):
        """Row i: the target's top-k after `tokens[i]`, preceded by `prev[i]` (-1: none)."""
        k = min(self.k, ids.shape[1])
        rows = zip(prev, tokens, ids[:, :k].tolist(), probs[:, :k].tolist(), strict=True)
        for p, t, i, q in rows:
            if not 0 <= t < self.vocab_size:
                raise IndexError(f"token {t} outside the vocabulary of {self.vocab_size}")
            self.unigram[t] = (i, q)
            if p >= 0:
                self.bigram[(p, t)] = (i, q)
                self.bigram.move_to_end((p, t))
        while len(self.bigram) > BIGRAM_CAPACITY:
            self.bigram.popitem(last=False)

    def successors(self, prev: int, token: int) -> list[tuple[int, float]]:
        """(id, score) best first; empty if the token was never seen."""
        hit = self.bigram.get((prev, token))
        if hit is None:
            hit = self.unigram.get(token)
        return list(zip(*hit, strict=True)) if hit is not None else []


def spine_tree_budget(
    budget: int, match_len: int, ratio: float, rho: float
) -> tuple[int, int, list[int]]:
    """Goose's split of `budget` draft nodes (B = budget + 1 with the root): spine nodes
    b_s = min(m, floor(B·r)), root branches b_r = floor((B-1-b_s)(1-ρ)), and the spine-level
    budget b_b shared by spine node i as floor(b_b · (1/i) / H(b_s)). What the widths leave
    goes to the breadth-first extension."""
    b_s = min(match_len, math.floor((budget + 1) * ratio))
    b_r = math.floor((budget - b_s) * (1 - rho))
    b_b = budget - b_s - b_r
    harmonic = sum(1 / j for j in range(1, b_s + 1))
    return b_s, b_r, [math.floor(b_b * (1 / i) / harmonic) for i in range(1, b_s + 1)]


class GooseDrafter(Drafter):
    def __init__(self, cfg: GooseDrafterConfig, table: AdjacencyTable) -> None:
        self.cfg = cfg
        self.table = table  # shared across trajectories: the hot start
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self.index = ExactMatchIndex(self.cfg.ngram_orders)
        self.doc = self.index.new_doc()
        self.spine_rate = self.cfg.initial_spine_rate  # p̂_s
        self._spine: tuple[int, ...] = ()  # last tree's spine nodes, depth order
        self._root_prev = -1

    def spine_ratio(self) -> float:
        """The paper's tiers: r = 0.15 / 0.30 / 0.50 as p̂_s < 0.2 / < 0.4 / >= 0.4."""
        return 0.15 if self.spine_rate < 0.2 else 0.30 if self.spine_rate < 0.4 else 0.50

    def draft(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        self.index.sync(self.doc, tokens)
        self._root_prev = tokens[-2] if len(tokens) > 1 else -1
        budget = min(self.cfg.num_nodes, ctx.max_nodes)  # draft nodes; B counts the root too
        matches = self.index.matches(self.doc, self.cfg.max_spine)
        spine = list(matches[0].continuation) if matches else []
        agree = sum(m.continuation[0] == spine[0] for m in matches) if spine else 0
        builder = TreeBuilder(tokens[-1])
        if spine and (len(spine) >= self.cfg.bypass_len or agree >= 2):  # bypass: a chain
            self._spine = tuple(self._lay_spine(builder, spine[:budget]))
            return builder.build()
        self._spine = tuple(self._spine_tree(builder, spine, budget))
        return builder.build()

    def _lay_spine(self, builder: TreeBuilder, spine: list[int]) -> list[int]:
        nodes, parent = [], 0
        for token in spine:
            parent = builder.add(parent, token)
            nodes.append(parent)
        return nodes

    def _branch(self, builder: TreeBuilder, node: int, width: int, skip: int | None) -> list[int]:
        """Attach the node's best `width` successors (score >= min_score, not `skip`)."""
        if width <= 0:
            return []
        prev = builder.tokens[builder.parents[node]] if node else self._root_prev
        out = []
        for token, score in self.table.successors(prev, builder.tokens[node]):
            if len(out) == width:
                break
            if score >= self.cfg.min_score and token != skip:
                out.append(builder.add(node, token))
        return out

    def _spine_tree(self, builder: TreeBuilder, match: list[int], budget: int) -> list[int]:
        """BUILDSPINETREE: spine, root branches, harmonic spine branches, BFS extension."""
        b_s, b_r, widths = spine_tree_budget(
            budget, len(match), self.spine_ratio(), self.cfg.spine_branch_ratio
        )
        spine = self._lay_spine(builder, match[:b_s])
        depth_of = dict.fromkeys(self._branch(builder, 0, b_r, match[0] if b_s else None), 1)
        for i, (node, width) in enumerate(zip(spine, widths, strict=True), start=1):
            nxt = match[i] if i < b_s else None
            for leaf in self._branch(builder, node, width, nxt):
                depth_of[leaf] = 1
        queue = list(depth_of)  # BFS over branch nodes; depth counted from the branching point
        while queue and len(builder) - 1 < budget:
            node = queue.pop(0)
            if depth_of[node] >= self.cfg.max_depth:
                continue
            parent_token = builder.tokens[builder.parents[node]]
            succ = self.table.successors(parent_token, builder.tokens[node])
            if not succ:
                continue
            width = 2 if succ[0][1] >= 0.5 else 1  # confidence-aware: a peaked node gets two
            room = budget - (len(builder) - 1)
            for child in self._branch(builder, node, min(width, room), None):
                depth_of[child] = depth_of[node] + 1
                queue.append(child)
        return spine

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        if topk.has(0):
            prev = tokens[-2] if len(tokens) > 1 else -1
            self.table.update([prev], [tokens[-1]], topk.ids[:1], topk.probs[:1])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        nodes = [v for v in range(tree.size) if topk.has(v)]
        prev = [tree.tokens[tree.parents[v]] if v else self._root_prev for v in nodes]
        self.table.update(prev, [tree.tokens[v] for v in nodes], topk.ids[nodes], topk.probs[nodes])
        if self._spine:
            on_spine = 0
            for a, s in zip(acc.path, self._spine, strict=False):
                if a != s:
                    break
                on_spine += 1
            rate = on_spine / len(self._spine)
            self.spine_rate = (1 - self.cfg.ema) * self.spine_rate + self.cfg.ema * rate


SUCCESSORS: Shared[GooseDrafterConfig, AdjacencyTable] = Shared(
    "goose.successors",
    "model",
    lambda cfg, vocab: AdjacencyTable(vocab, cfg.k),
    key=lambda cfg: cfg.k,
)
"""The successor table, one per loaded model and width: the hot start."""

SPEC = DrafterSpec(
    GooseDrafterConfig,
    lambda cfg, env: GooseDrafter(cfg, env.shared(SUCCESSORS, cfg)),
    methods=(Method("goose", "Goose: context-match spine with successor branches"),),
    size_field="num_nodes",
    shared=(SUCCESSORS,),
)
