"""Prompt Lookup Decoding (Saxena 2023): a deterministic chain copied from the latest earlier
occurrence of the context's suffix n-gram, longest n first, over prompt + generated text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from tts_service.config import StrictConfig
from tts_service.drafters.matching import ExactMatchIndex
from tts_service.drafters.spec import DrafterSpec, Method
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


class PldDrafterConfig(StrictConfig):
    """Prompt Lookup Decoding (Saxena 2023): copy the continuation of the latest n-gram match."""

    kind: Literal["pld"] = "pld"
    max_ngram: int = Field(3, ge=1, le=8, description="Longest suffix n-gram tried first.")
    min_ngram: int = Field(1, ge=1, le=8, description="Shortest suffix n-gram tried last.")
    num_draft_tokens: int = Field(6, ge=1, le=64, description="Chain length drafted per step.")


class PromptLookupDrafter(Drafter):
    def __init__(self, cfg: PldDrafterConfig) -> None:
        if cfg.min_ngram > cfg.max_ngram:
            raise ValueError("pld: min_ngram must be <= max_ngram")
        self.cfg = cfg
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self._index = ExactMatchIndex(range(self.cfg.min_ngram, self.cfg.max_ngram + 1))
        self._doc = self._index.new_doc()

    def draft(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        self._index.sync(self._doc, tokens)
        budget = min(self.cfg.num_draft_tokens, ctx.max_nodes)
        if len(tokens) < self.cfg.max_ngram:  # shorter than the longest n-gram: no draft
            return DraftTree.root_only(tokens[-1])
        matches = self._index.matches(self._doc, budget)
        if not matches:
            return DraftTree.root_only(tokens[-1])
        return DraftTree.chain(tokens[-1], list(matches[0].continuation))

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        """PLD learns only from committed text, which `draft` indexes."""

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        """Likewise: the next `draft` indexes what was committed meanwhile."""


SPEC = DrafterSpec(
    PldDrafterConfig,
    lambda cfg, env: PromptLookupDrafter(cfg),
    methods=(Method("pld", "Prompt Lookup Decoding: copy after the latest n-gram match"),),
    size_field="num_draft_tokens",
)
