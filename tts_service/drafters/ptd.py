"""PTD: progressive tree drafting by input perturbation (docs/design.md, "PTD").

The target drafts for itself. A **perturbation tree** of tokens (random at first) rides along
in every verify forward, hung below the root; the target's argmax at each of its nodes becomes
that node's next child (at most `max_children` per node), so the tree grows one level per
forward. When it is deeper than `max_depth` (or at its node cap) it **steps**: the root's
earliest child becomes the root and every other branch is pruned. Every subtree of the
perturbation tree is merged into a **candidate pool** keyed by its root token (a trie union), and
the candidates filed under the current root token are drafted, in the same forward, as the tree
to verify.

Both trees are ordinary draft nodes to the engine (positions prefix + depth, ancestor-only
attention), so one forward does all three jobs; perturbation nodes may even be accepted, which
is lossless like any deterministic draft. Verification is greedy or sample-and-match, with the
bonus token from the residual (the fix of the paper's Algorithm 2;
docs/design.md, "Verification rules").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from tts_service.config import StrictConfig
from tts_service.drafters.spec import DrafterSpec, Method
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.streams import Stream, stream_seed
from tts_service.engine.tree import DraftTree, TreeBuilder
from tts_service.engine.verify import Acceptance

Trie = dict[int, "Trie"]


class PtdDrafterConfig(StrictConfig):
    """PTD: the target drafts for itself from a progressive perturbation tree."""

    kind: Literal["ptd"] = "ptd"
    max_depth: int = Field(6, ge=2, le=32, description="The perturbation tree steps past this.")
    max_children: int = Field(4, ge=1, le=16, description="Children per node (width limit).")
    perturbation_nodes: int = Field(16, ge=1, le=512, description="Perturbation tree size cap.")
    candidate_nodes: int = Field(16, ge=1, le=512, description="Candidate nodes verified.")


@dataclass
class _PNode:
    token: int
    children: list[int] = field(default_factory=list)  # in the order they were added


def merge_trie(into: Trie, other: Trie, depth: int) -> None:
    """PTD's M(T, T'): add T''s new children, recurse into shared ones (to `depth` levels)."""
    if depth <= 0:
        return
    for token, sub in other.items():
        merge_trie(into.setdefault(token, {}), sub, depth - 1)


class ProgressiveTree:
    """The perturbation tree: grows by the target's predictions, steps when too deep."""

    def __init__(self, tokens: list[int], max_children: int, max_depth: int, max_nodes: int):
        self.max_children, self.max_depth, self.max_nodes = max_children, max_depth, max_nodes
        self.nodes = [_PNode(tokens[0])]
        self.root = 0
        for t in tokens[1:]:
            self.nodes[0].children.append(len(self.nodes))
            self.nodes.append(_PNode(t))

    def order(self) -> list[tuple[int, int]]:
        """(node, parent node or -1) breadth first from the root: the live nodes."""
        out, queue = [], [(self.root, -1)]
        while queue:
            v, p = queue.pop(0)
            out.append((v, p))
            queue.extend((c, v) for c in self.nodes[v].children)
        return out

    def depth(self) -> int:
        def d(v: int) -> int:
            return 1 + max((d(c) for c in self.nodes[v].children), default=0)

        return d(self.root)

    def expand(self, predictions: dict[int, int]) -> None:
        """Every node gets its prediction as a new child (no duplicates, width and size capped),
        then the tree steps if it grew too deep, or full (a full tree would stop progressing)."""
        live = len(self.order())
        for v, token in predictions.items():
            node = self.nodes[v]
            if live >= self.max_nodes:
                break
            if len(node.children) < self.max_children and all(
                self.nodes[c].token != token for c in node.children
            ):
                node.children.append(len(self.nodes))
                self.nodes.append(_PNode(token))
                live += 1
        too_big = self.depth() > self.max_depth or live >= self.max_nodes
        if too_big and self.nodes[self.root].children:
            self.root = self.nodes[self.root].children[0]  # step: keep the earliest child's line
            self._compact()

    def _compact(self) -> None:
        """Drop pruned nodes so the node list stays as small as the live tree."""
        remap: dict[int, int] = {}
        kept: list[_PNode] = []
        for v, _ in self.order():
            remap[v] = len(kept)
            kept.append(self.nodes[v])
        for node in kept:
            node.children = [remap[c] for c in node.children]
        self.nodes, self.root = kept, 0

    def subtree(self, v: int) -> Trie:
        return {self.nodes[c].token: self.subtree(c) for c in self.nodes[v].children}


class PtdDrafter(Drafter):
    def __init__(self, cfg: PtdDrafterConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.rng = random.Random(stream_seed(seed, Stream.DRAFT))  # never the verifier's stream
        self.pool: dict[int, Trie] = {}
        self._perturb: dict[int, int] = {}  # last tree: tree node -> perturbation node
        self.tree = ProgressiveTree([0], cfg.max_children, cfg.max_depth, cfg.perturbation_nodes)

    def start(self, prompt_ids: list[int]) -> None:
        """T^0: a shallow tree of random tokens (drawn from the prompt's vocabulary)."""
        tokens = [self.rng.choice(prompt_ids) for _ in range(1 + self.cfg.max_children)]
        self.tree = ProgressiveTree(
            tokens, self.cfg.max_children, self.cfg.max_depth, self.cfg.perturbation_nodes
        )
        self.pool = {}

    def draft(self, ctx: DraftContext) -> DraftTree:
        builder = TreeBuilder(ctx.tokens[-1])
        room = ctx.max_nodes
        live = self.tree.order()
        # the perturbation tree keeps up to half the room, or it could starve and stop growing
        cand_room = min(self.cfg.candidate_nodes, room - min(len(live), (room + 1) // 2))
        # the candidate tree for the root token, breadth first, earliest-merged first
        queue = [(0, self.pool.get(ctx.tokens[-1], {}))]
        while queue and len(builder) - 1 < cand_room:
            node, trie = queue.pop(0)
            for token in list(trie)[: self.cfg.max_children]:
                if len(builder) - 1 >= cand_room:
                    break
                queue.append((builder.add(node, token), trie[token]))
        # the perturbation tree, hung below the root, after the candidates
        self._perturb = {}
        placed = {-1: 0}
        for v, parent in live:
            if len(builder) - 1 >= room:
                break
            placed[v] = builder.add(placed[parent], self.tree.nodes[v].token)
            self._perturb[placed[v]] = v
        return builder.build()

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        """PTD learns from its own perturbation nodes; a plain step sent none."""

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        predictions = {v: int(topk.ids[n, 0]) for n, v in self._perturb.items() if topk.has(n)}
        self.tree.expand(predictions)
        for v, _ in self.tree.order():  # harvest every subtree into the pool
            sub = self.tree.subtree(v)
            if sub:
                into = self.pool.setdefault(self.tree.nodes[v].token, {})
                merge_trie(into, sub, self.cfg.max_depth)


SPEC = DrafterSpec(
    PtdDrafterConfig,
    lambda cfg, env: PtdDrafter(cfg, env.seed),
    methods=(
        Method(
            "ptd",
            "PTD: the target drafts for itself by input perturbation",
            drafts_with_target=True,
        ),
    ),
)
