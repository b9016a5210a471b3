"""Token Recycling (Luo et al. 2024): an adjacency table of each token's top-k successors,
overwritten from the target's distributions at every tree node of every forward (accepted and
rejected), drafted over a static template tree. The table persists across trajectories
(the paper's hot start)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from tts_service.config import Sizing, StrictConfig, TreeName, resolve_tree_path
from tts_service.drafters.base import ShapedTree, shape_prefix
from tts_service.drafters.gt import GT_STATS, gt_sized
from tts_service.drafters.spec import DrafterSpec, Method, Shared
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, TreeBuilder, load_tree_shape
from tts_service.engine.verify import Acceptance

if TYPE_CHECKING:  # torch where a table is made: the CLI's parser imports this module
    import torch


class RecyclingDrafterConfig(StrictConfig):
    """Token Recycling (Luo et al. 2024): top-k successor table refreshed from every forward."""

    kind: Literal["recycling"] = "recycling"
    k: int = Field(8, ge=1, le=10, description="Successors kept per token (table width).")
    tree: TreeName = Field(
        "recycling-80", description="Tree shape: a name in configs/trees or a path."
    )
    num_nodes: int = Field(
        16, ge=1, le=1024, description="Use the first N nodes (BFS) of the tree."
    )
    sizing: Sizing = "fixed"


class TokenRecyclingDrafter(Drafter):
    def __init__(
        self, cfg: RecyclingDrafterConfig, vocab_size: int, table: torch.Tensor | None = None
    ) -> None:
        self.cfg = cfg
        self.shape = load_tree_shape(resolve_tree_path(cfg.tree))
        self.num_nodes = cfg.num_nodes
        # may be shared: batch rows and trajectories write one table
        self.table = empty_successors(cfg, vocab_size) if table is None else table

    def start(self, prompt_ids: list[int]) -> None:
        """Hot start: the table carries over from earlier trajectories."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.draft_subtree(ctx, shape_prefix(self, ctx)).tree

    def draft_subtree(self, ctx: DraftContext, keep: Container[int]) -> ShapedTree:
        """Draft only the shape nodes in `keep` (closed under parents and earlier siblings)."""
        shape = self.shape
        builder = TreeBuilder(ctx.tokens[-1])
        placed = [0] + [-1] * shape.num_nodes  # template node -> tree node (-1: pruned)
        rows: dict[int, list[int]] = {}
        shape_ids = [0]
        for i in range(1, len(shape.parents)):
            parent = placed[shape.parents[i]]
            if parent < 0 or i not in keep:
                continue
            token = builder.tokens[parent]
            row = rows.get(token)
            if row is None:
                row = rows[token] = self.table[token].tolist()
            candidate = row[shape.ranks[i]] if shape.ranks[i] < len(row) else -1
            if candidate >= 0:
                placed[i] = builder.add(parent, candidate)
                shape_ids.append(i)
        return ShapedTree(builder.build(), tuple(shape_ids))

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        import torch

        if topk.has(0):
            k = min(self.cfg.k, topk.ids.shape[1])
            self.table[tokens[-1], :k] = torch.from_numpy(topk.ids[0, :k])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        import torch

        k = min(self.cfg.k, topk.ids.shape[1])
        rows = list(range(tree.size)) if topk.known is None else list(topk.known)
        at = torch.tensor([tree.tokens[v] for v in rows], dtype=torch.long)
        self.table[at, :k] = torch.from_numpy(topk.ids[rows, :k])


def empty_successors(cfg: RecyclingDrafterConfig, vocab_size: int) -> torch.Tensor:
    """`[V, k]` successor ids, -1 where none is known yet."""
    import torch

    return torch.full((vocab_size, cfg.k), -1, dtype=torch.long)


SUCCESSORS: Shared[RecyclingDrafterConfig, torch.Tensor] = Shared(
    "recycling.successors",
    "model",
    empty_successors,
    key=lambda cfg: cfg.k,
)
"""The successor table, one per loaded model and width: the hot start."""

_GT_CAP = MappingProxyType({"sizing": "gt", "num_nodes": 80})  # the whole tree is the cap

SPEC = DrafterSpec(
    RecyclingDrafterConfig,
    lambda cfg, env: gt_sized(
        TokenRecyclingDrafter(cfg, env.vocab_size, env.shared(SUCCESSORS, cfg)), cfg, env
    ),
    methods=(
        Method("recycle", "Token Recycling: successor table over a static tree"),
        Method("recycle-gt", "Token Recycling, GT-sized by the measured cost", _GT_CAP),
    ),
    size_field="num_nodes",
    needs_cost=True,
    shared=(SUCCESSORS, GT_STATS),
)
