"""STAND + spine: STAND's stochastic branches hanging off a spine copied from an exact match in
this problem's earlier trajectories or this one (docs/design.md, "STAND with a spine").

Best-of-N trajectories of one problem restate the same equations and code verbatim. When the
context's suffix matches somewhere in the problem's trajectories under at least `min_match`
tokens, and the store agrees on the first spine token (it is among the stored top
`consensus_k` at the root, Goose's consensus adapted), the continuation is laid as a spine of
one-hot drafts and the rest of the budget grows STAND subtrees below the spine nodes,
front-loaded by a 1/(i+1) decay (Goose Prop. 2 puts the optimum near the root). Otherwise the
step is a plain STAND tree.

Verification is the mixed rule: the spine child is every spine node's first child, a
one-hot draft accepted with p(x_s); the sampled branches were drawn from q without x_s, which
is what the verifier's renormalised proposal (tried siblings removed) is. See
docs/design.md, "Verification rules".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from store.base import NgramStore
from tts_service.drafters.matching import ExactMatchIndex
from tts_service.drafters.spec import DrafterSpec, Method, Shared
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

SPINE_ORDERS = (8, 6, 5, 4, 3, 2)  # StandSpineDrafterConfig.min_match is 2..8


class StandSpineDrafterConfig(StandDrafterConfig):
    """STAND's branches off a spine copied from an exact match in the problem's trajectories."""

    kind: Literal["stand_spine"] = "stand_spine"  # type: ignore[assignment]
    min_match: int = Field(4, ge=2, le=8, description="Shortest suffix match that lays a spine.")
    max_spine: int = Field(8, ge=1, le=64, description="Longest spine copied.")
    spine_share: float = Field(0.5, gt=0, le=1, description="At most this share of the nodes.")
    consensus_k: int = Field(
        3, ge=1, le=10, description="The spine's first token must be in the store's top k."
    )

    @field_validator("sizing")
    @classmethod
    def _fixed_only(cls, v: str) -> str:
        if v != "fixed":
            raise ValueError("stand_spine trees are sized by num_nodes (use gtcp for GT sizing)")
        return v


def spine_budget(num_nodes: int, spine_len: int, share: float) -> tuple[int, list[int]]:
    """(spine nodes, branch nodes per spine position 0..m-1) for a tree of `num_nodes`."""
    m = min(spine_len, max(1, math.floor(num_nodes * share)))
    branches = num_nodes - m
    weights = [1 / (i + 1) for i in range(m)]
    alloc = [math.floor(branches * w / sum(weights)) for w in weights]
    alloc[0] += branches - sum(alloc)
    return m, alloc


class StandSpineDrafter(Drafter):
    def __init__(
        self,
        cfg: StandSpineDrafterConfig,
        store: NgramStore,
        index: ExactMatchIndex,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.stand = StandDrafter(cfg, store, seed)
        self.index = index  # shared by the problem's trajectories
        self.doc = -1
        self.spine_steps = 0  # steps that drafted a spine (for reports)

    def start(self, prompt_ids: list[int]) -> None:
        self.doc = self.index.new_doc()

    def _spine(self, ctx: DraftContext) -> list[int]:
        self.index.sync(self.doc, ctx.tokens)
        matches = self.index.matches(self.doc, self.cfg.max_spine)
        if not matches or matches[0].order < self.cfg.min_match:
            return []
        spine = list(matches[0].continuation)
        root = self.stand.store.lookup(ctx.tokens[-self.stand.store.max_order :])
        if root is not None and spine[0] not in root.ids[: self.cfg.consensus_k]:
            return []
        return spine

    def draft(self, ctx: DraftContext) -> DraftTree:
        num = min(self.cfg.num_nodes, ctx.max_nodes, self.stand.shape.num_nodes)
        spine = self._spine(ctx) if num > 0 else []
        if not spine:
            return self.stand.draft(ctx)
        self.spine_steps += 1
        stochastic = self.cfg.stochastic and not ctx.greedy
        s = self.stand
        builder = s.new_tree(ctx)
        m, alloc = spine_budget(num, len(spine), self.cfg.spine_share)
        nodes = [0]
        for token in spine[:m]:
            nodes.append(s.hang(builder, nodes[-1], token))
        for i, width in enumerate(alloc):
            s.grow(builder, nodes[i], range(1, width + 1), stochastic, exclude=spine[i])
        return builder.build()

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred:
        return self.stand.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred:
        return self.stand.observe_root(tokens, topk)


SPINE_INDEX: Shared[StandSpineDrafterConfig, ExactMatchIndex] = Shared(
    "stand_spine.index", "problem", lambda cfg, vocab: ExactMatchIndex(SPINE_ORDERS)
)
"""The exact-match index over one problem's trajectories (the spines' source)."""

SPEC = DrafterSpec(
    StandSpineDrafterConfig,
    lambda cfg, env: StandSpineDrafter(
        cfg, env.need_store(cfg.kind), env.shared(SPINE_INDEX, cfg), env.seed
    ),
    methods=(Method("stand+spine", "STAND branches off an exact-match spine"),),
    size_field="num_nodes",
    uses_store=True,
    shared=(SPINE_INDEX,),
)
