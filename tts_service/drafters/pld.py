"""Prompt Lookup Decoding (Saxena 2023): a deterministic chain copied from the latest earlier
occurrence of the context's suffix n-gram, longest n first, over prompt + generated text."""

from __future__ import annotations

from tts_service.config import PldDrafterConfig
from tts_service.drafters.base import DraftContext, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


class PromptLookupDrafter:
    def __init__(self, cfg: PldDrafterConfig) -> None:
        if cfg.min_ngram > cfg.max_ngram:
            raise ValueError("pld: min_ngram must be <= max_ngram")
        self.cfg = cfg
        self._orders = range(cfg.max_ngram, cfg.min_ngram - 1, -1)
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> latest end position
        self._indexed = 0  # n-grams ending before this position are indexed

    def start(self, prompt_ids: list[int]) -> None:
        self._last_end.clear()
        self._indexed = 0

    def _index(self, tokens: list[int]) -> None:
        # index n-grams ending at positions < len-1, so each has a continuation and the
        # current suffix never matches itself
        for end in range(self._indexed, len(tokens) - 1):
            for n in self._orders:
                if end + 1 >= n:
                    self._last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def draft(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        self._index(tokens)
        budget = min(self.cfg.num_draft_tokens, ctx.max_nodes)
        for n in self._orders:
            if len(tokens) < n or budget < 1:
                break
            end = self._last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return DraftTree.chain(tokens[-1], tokens[end + 1 : end + 1 + budget])
        return DraftTree.root_only(tokens[-1])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        """PLD learns only from committed text, which `draft` indexes."""
