"""Drafters' shared pieces: static tree shapes (`ShapedTree`, `shape_prefix`) and the plain
method (`NoDrafter`, `PlainDrafterConfig`, its `SPEC`). The seam the engine asks drafters
through (`Drafter`, `DraftContext`, `NodeTopK`, `Deferred`, grouped drafting) is the engine's:
`tts_service/engine/seam.py`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tts_service.config import StrictConfig
from tts_service.drafters.spec import DrafterSpec, Method
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, TreeShape
from tts_service.engine.verify import Acceptance


@dataclass(frozen=True)
class ShapedTree:
    """A tree drafted over a static shape, with the shape node of every tree node."""

    tree: DraftTree
    shape_ids: tuple[int, ...]  # tree node -> shape node; -1 for a node off the shape (spine)


class StaticTreeDrafter(Drafter, Protocol):
    """A drafter over a static tree shape (STAND, Token Recycling). GT sizing and calibration
    choose which shape nodes to draft and learn, per shape node, how often each is accepted."""

    shape: TreeShape
    num_nodes: int  # the configured cap: the shape's first `num_nodes` nodes

    def draft_subtree(self, ctx: DraftContext, keep: Container[int]) -> ShapedTree:
        """Draft only the shape nodes in `keep` (closed under parents and earlier siblings)."""


def shape_prefix(drafter: StaticTreeDrafter, ctx: DraftContext) -> range:
    """The shape nodes a plain `draft` offers: the first ones the step's budget allows."""
    return range(1, min(drafter.num_nodes, ctx.max_nodes, drafter.shape.num_nodes) + 1)


class NoDrafter(Drafter):
    """Verifies the root only: plain decoding through the speculative engine."""

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def draft(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.root_only(ctx.tokens[-1])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        pass

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        pass


class PlainDrafterConfig(StrictConfig):
    """No drafting: every step verifies the root only (plain decoding through the engine)."""

    kind: Literal["plain"] = "plain"


SPEC = DrafterSpec(
    PlainDrafterConfig,
    lambda cfg, env: NoDrafter(),
    methods=(Method("plain", "plain decoding through the engine (the baseline)"),),
)
