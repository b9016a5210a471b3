"""GTCP: dynamic trees over STAND's logit n-gram store, grown best first for as long as the
measured verify cost pays for the next node (docs/design.md, "GT sizing and GTCP").

A node's α̂ is the product of the stored draft probabilities along its path; expansion stops
when no larger tree could beat the current expected rate. Under sampling, which children a node
gets is decided before they are drawn (slot j of a node is scored by the node's j-th best
stored probability), and children are drawn in Gumbel order, so each is a draw without
replacement from the snapshot `q`, as the RRS verifier requires.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from store.base import NgramStore
from tts_service.config import StrictConfig
from tts_service.drafters.gumbel import GumbelNoise, gumbel_top_k
from tts_service.drafters.spec import DrafterSpec, Method
from tts_service.drafters.store_feed import feed_root, feed_store
from tts_service.engine.cost import VerifyCostSource, worth_growing
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, SparseDist, TreeBuilder
from tts_service.engine.verify import Acceptance


class GtcpDrafterConfig(StrictConfig):
    """GTCP: dynamic trees over STAND's store, as large as the measured verify cost pays for."""

    kind: Literal["gtcp"] = "gtcp"
    max_nodes: int = Field(128, ge=1, le=1024, description="Hard cap on draft nodes.")
    stochastic: bool = Field(True, description="Gumbel-ordered children; False: top-k.")
    harvest_rejected: bool = False
    noise_buffer: int = Field(4096, ge=16)


@dataclass(frozen=True)
class _Plan:
    """An opened node: its children in drawing order, the normalised stored q, and q's
    probabilities best first (slot j's score, fixed before child j is drawn)."""

    drawn: list[int]
    q: dict[int, float]
    ranked: list[float]


class GtTreeDrafter(Drafter):
    """Dynamic best-first trees over the logit n-gram store, sized by the GT rule."""

    def __init__(
        self, cfg: GtcpDrafterConfig, store: NgramStore, cost: VerifyCostSource, seed: int = 0
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.cost = cost
        self.noise = GumbelNoise(cfg.noise_buffer, seed)
        self._tails: list[tuple[int, ...]] = []

    def start(self, prompt_ids: list[int]) -> None:
        """Trajectories share the store; nothing is per-trajectory."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        order = self.store.max_order
        cost = None if ctx.fill else self.cost.at(len(ctx.tokens))
        limit = min(self.cfg.max_nodes, ctx.max_nodes)
        stochastic = self.cfg.stochastic and not ctx.greedy
        builder = TreeBuilder(ctx.tokens[-1])
        self._tails = [tuple(ctx.tokens[-order:])]
        alpha = [1.0]
        plans: dict[int, _Plan] = {}
        heap: list[tuple[float, int, int]] = []  # (-α̂ of the slot, node, child rank)

        def open_node(node: int) -> None:
            entry = self.store.lookup(self._tails[node])
            if entry is None:
                return
            cands = [(i, p) for i, p in zip(entry.ids, entry.probs, strict=True) if p > 0]
            if not cands:
                return
            ids, probs = [i for i, _ in cands], [p for _, p in cands]
            if stochastic:  # the whole Gumbel order at once: any prefix is a valid draw
                drawn = gumbel_top_k(ids, probs, len(ids), self.noise.take(len(ids)))
                builder.set_q(node, SparseDist(entry.ids, entry.probs))
            else:
                drawn = ids
            scale = sum(probs)
            q = {i: p / scale for i, p in cands}
            plans[node] = _Plan(drawn, q, sorted(q.values(), reverse=True))
            heapq.heappush(heap, (-alpha[node] * plans[node].ranked[0], node, 0))

        open_node(0)
        expected = 1.0
        while heap and len(builder) - 1 < limit:
            neg, node, rank = heapq.heappop(heap)
            size = len(builder)
            if cost is not None and not worth_growing(cost, size, expected, -neg, limit + 1):
                break
            plan = plans[node]
            token = plan.drawn[rank]
            child = builder.add(node, token, sampled=stochastic)
            self._tails.append((*self._tails[node], token)[-order:])
            alpha.append(alpha[node] * plan.q[token])
            expected += alpha[child]
            if rank + 1 < len(plan.drawn):
                heapq.heappush(heap, (-alpha[node] * plan.ranked[rank + 1], node, rank + 1))
            open_node(child)
        return builder.build()

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        feed_store(self.store, self._tails, tree, acc, topk, self.cfg.harvest_rejected)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        feed_root(self.store, tokens, topk)


SPEC = DrafterSpec(
    GtcpDrafterConfig,
    lambda cfg, env: GtTreeDrafter(
        cfg, env.need_store(cfg.kind), env.need_cost(cfg.kind), env.seed
    ),
    methods=(Method("gtcp", "GTCP: dynamic best-first trees over the store, GT-sized"),),
    size_field="max_nodes",
    needs_cost=True,
    uses_store=True,
)
