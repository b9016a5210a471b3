"""Config `kind` -> drafter instance: the one place that knows every drafter class."""

from __future__ import annotations

from store.base import NgramStore
from tts_service.config import (
    DrafterConfig,
    PlainDrafterConfig,
    PldDrafterConfig,
    RecyclingDrafterConfig,
    StandDrafterConfig,
)
from tts_service.drafters.base import DraftContext, Drafter, NodeTopK
from tts_service.drafters.pld import PromptLookupDrafter
from tts_service.drafters.recycling import TokenRecyclingDrafter
from tts_service.drafters.stand import StandDrafter
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


def build_drafter(
    cfg: DrafterConfig, vocab_size: int, store: NgramStore | None = None, seed: int = 0
) -> Drafter:
    """Build the drafter for `cfg`. STAND needs the `store` its trajectories share."""
    match cfg:
        case PlainDrafterConfig():
            return NoDrafter()
        case PldDrafterConfig():
            return PromptLookupDrafter(cfg)
        case RecyclingDrafterConfig():
            return TokenRecyclingDrafter(cfg, vocab_size)
        case StandDrafterConfig():
            if store is None:
                raise ValueError("the stand drafter needs a logit n-gram store")
            return StandDrafter(cfg, store, seed)
    raise ValueError(f"unknown drafter kind {cfg.kind!r}")
