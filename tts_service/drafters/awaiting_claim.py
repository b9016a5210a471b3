"""`AwaitingClaim`: a row whose verify key its shared store has not confirmed fresh yet decodes
plain steps until it has (docs/design.md, "Random streams").

A row may draft from a store only if no row verified with the same uniforms taught it: a key
claimed twice would make a draft depend on the numbers that verify it. A shared store answers a
claim in the background (`NgramStore.confirmed`), never on the step, so until it answers (or
while its server is down) the row takes plain steps: the root alone, learning nothing (what it
would write might be read by the row that claimed the key first). Exact by construction: a plain
step commits what the model samples. Once confirmed the row drafts; a key found taken keeps it
plain to its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from store.base import NgramStore
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


class AwaitingClaim(Drafter):
    """`inner` once `store` confirms `verify_key`; until then, plain steps."""

    def __init__(self, inner: Drafter, store: NgramStore, verify_key: int) -> None:
        self.inner, self.store, self.verify_key = inner, store, verify_key
        self.open = False
        self.drafted = False  # the tree being verified is the inner drafter's

    def _opened(self) -> bool:
        if not self.open:
            self.open = self.store.confirmed(self.verify_key) is True
        return self.open

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def grouped(self):
        self.drafted = self._opened()
        return self.inner.grouped() if self.drafted else None

    def draft(self, ctx: DraftContext) -> DraftTree:
        self.drafted = self._opened()
        return self.inner.draft(ctx) if self.drafted else DraftTree.root_only(ctx.tokens[-1])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        return self.inner.observe(tree, acc, topk) if self.drafted else None

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        self.drafted = False
        return self.inner.observe_root(tokens, topk) if self._opened() else None
