"""Exact-match lookup over token documents: the spine source of Goose and of STAND + spine.

Every n-gram (n in `orders`) of every document maps to its latest occurrence, so a lookup of
the current suffix is one dict probe per order and its continuation is copied from the
document it was found in. Goose indexes one document (prompt + this trajectory, like PLD);
STAND + spine indexes one document per trajectory of a problem, so a spine can be copied from
an earlier trajectory (docs/design.md, "STAND with a spine").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    """The suffix matched under an n-gram of length `order`; `continuation` follows it."""

    order: int
    continuation: tuple[int, ...]


class ExactMatchIndex:
    """`max_tokens` bounds memory (a few n-gram entries per indexed token): past it, the
    documents of finished trajectories are dropped and only open ones are re-indexed."""

    def __init__(self, orders: Sequence[int], max_tokens: int = 1 << 17) -> None:
        if not orders or min(orders) < 1:
            raise ValueError("orders: at least one n-gram length >= 1")
        self.orders = sorted(set(orders), reverse=True)
        self.max_tokens = max_tokens
        self.size = 0  # tokens indexed over all documents
        self.docs: list[list[int]] = []
        self._indexed: list[int] = []  # per doc: n-grams ending before this are indexed
        self._last: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (doc, end)

    def new_doc(self) -> int:
        self.docs.append([])
        self._indexed.append(0)
        return len(self.docs) - 1

    def sync(self, doc: int, tokens: Sequence[int]) -> None:
        """`tokens` is the document so far (it only ever grows); index what is new.

        N-grams ending at the last token are left for later: each indexed n-gram has a
        continuation, and the current suffix never matches itself.
        """
        d = self.docs[doc]
        if self.size + len(tokens) - len(d) > self.max_tokens and self.size > len(d):
            self._forget(keep=doc)
        self.size += len(tokens) - len(d)
        d.extend(tokens[len(d) :])
        for end in range(self._indexed[doc], len(d) - 1):
            for n in self.orders:
                if end + 1 >= n:
                    self._last[tuple(d[end + 1 - n : end + 1])] = (doc, end)
        self._indexed[doc] = max(self._indexed[doc], len(d) - 1)

    def _forget(self, keep: int) -> None:
        """Drop every document but `keep` (ids stay valid; the dropped ones read as empty)."""
        self._last.clear()
        for i in range(len(self.docs)):
            if i != keep:
                self.docs[i] = []
            self._indexed[i] = 0
        self.size = len(self.docs[keep])

    def matches(self, doc: int, max_len: int) -> list[Match]:
        """Every order's match of `doc`'s suffix, longest first (continuations non-empty)."""
        d = self.docs[doc]
        out = []
        for n in self.orders:
            if len(d) < n:
                continue
            hit = self._last.get(tuple(d[-n:]))
            if hit is not None:
                src, end = hit
                cont = tuple(self.docs[src][end + 1 : end + 1 + max_len])
                if cont:
                    out.append(Match(n, cont))
        return out


class SuffixCounts:
    """Next-token counts after every n-gram (n in `orders`) of a problem's documents: the
    trajectories of one problem (each with its prompt), like SuffixDecoding's suffix tree cut
    at fixed depths. A lookup gives the longest stored suffix and how often each token followed
    it, so a continuation shared by many trajectories outweighs one seen once.

    `max_tokens` bounds memory as in `ExactMatchIndex`: past it, finished documents are
    dropped and the counts rebuilt from the open one."""

    def __init__(self, orders: Sequence[int], max_tokens: int = 1 << 17) -> None:
        if not orders or min(orders) < 1:
            raise ValueError("orders: at least one n-gram length >= 1")
        self.orders = sorted(set(orders), reverse=True)
        self.max_tokens = max_tokens
        self.size = 0
        self.docs: list[list[int]] = []
        self._indexed: list[int] = []  # per doc: n-grams ending before this are counted
        self._next: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> token -> count

    def new_doc(self) -> int:
        self.docs.append([])
        self._indexed.append(0)
        return len(self.docs) - 1

    def sync(self, doc: int, tokens: Sequence[int]) -> None:
        """`tokens` is the document so far (it only ever grows); count what is new."""
        d = self.docs[doc]
        if self.size + len(tokens) - len(d) > self.max_tokens and self.size > len(d):
            self._next.clear()
            for i in range(len(self.docs)):
                self.docs[i] = d if i == doc else []
                self._indexed[i] = 0
            self.size = len(d)
        self.size += len(tokens) - len(d)
        d.extend(tokens[len(d) :])
        for end in range(self._indexed[doc], len(d) - 1):
            token = d[end + 1]
            for n in self.orders:
                if end + 1 >= n:
                    counts = self._next.setdefault(tuple(d[end + 1 - n : end + 1]), {})
                    counts[token] = counts.get(token, 0) + 1
        self._indexed[doc] = max(self._indexed[doc], len(d) - 1)

    def lookup(self, context: Sequence[int]) -> tuple[int, dict[int, int]]:
        """(n, token -> count) for the longest counted suffix of `context`; (0, {}) if none."""
        for n in self.orders:
            if len(context) >= n:
                counts = self._next.get(tuple(context[-n:]))
                if counts:
                    return n, counts
        return 0, {}
