"""Config `kind` -> drafter instance: the one place that knows every drafter class."""

from __future__ import annotations

from tts_service.config import (
    DrafterConfig,
    PlainDrafterConfig,
    PldDrafterConfig,
    RecyclingDrafterConfig,
)
from tts_service.drafters.base import DraftContext, Drafter, NodeTopK
from tts_service.drafters.pld import PromptLookupDrafter
from tts_service.drafters.recycling import TokenRecyclingDrafter
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


class NoDrafter:
    """Verifies the root only: plain decoding through the speculative engine."""

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def draft(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.root_only(ctx.tokens[-1])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        pass


def build_drafter(cfg: DrafterConfig, vocab_size: int) -> Drafter:
    match cfg:
        case PlainDrafterConfig():
            return NoDrafter()
        case PldDrafterConfig():
            return PromptLookupDrafter(cfg)
        case RecyclingDrafterConfig():
            return TokenRecyclingDrafter(cfg, vocab_size)
    raise ValueError(f"unknown drafter kind {cfg.kind!r}")
