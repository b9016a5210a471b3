"""In-process logit n-gram store: the reference backend, and the local fallback of remote ones.

Bounded: at most `max_entries` n-grams over all orders; the least recently updated is evicted.
`merge="stand"` is STAND's rule exactly (running mean, truncated after every update);
`merge="sum"` keeps per-id sums and a count, the order-independent form the Redis store uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from store.base import NgramEntry, NgramRow, NgramStore, mean_entry, merge

if TYPE_CHECKING:
    from store.index import StoreIndex


class InMemoryNgramStore:
    def __init__(
        self,
        max_order: int = 4,
        topk: int = 10,
        max_entries: int = 1_000_000,
        merge: str = "stand",
    ) -> None:
        if not 1 <= max_order <= 8 or topk < 1 or max_entries < 1:
            raise ValueError("max_order must be in 1..8, topk and max_entries >= 1")
        if merge not in ("stand", "sum"):
            raise ValueError(f"merge must be 'stand' or 'sum', not {merge!r}")
        self.merge = merge
        self._sums: dict[tuple[int, ...], dict[int, float]] = {}  # merge="sum": id -> sum
        self.max_order = max_order
        self.topk = topk
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], NgramEntry] = OrderedDict()
        self._hits = [0] * (max_order + 1)  # [n]: lookups answered by an n-gram
        self._misses = 0
        self._evictions = 0
        self._index: StoreIndex | None = None
        self._claims: set[int] = set()

    def claim(self, verify_key: int) -> bool:
        fresh = verify_key not in self._claims
        self._claims.add(verify_key)
        return fresh

    def preclaim(self, verify_keys: Sequence[int]) -> None:
        """Claims are answered here, at once: nothing to announce."""

    def confirmed(self, verify_key: int) -> bool | None:
        """Claims are checked here, at once."""
        return True if verify_key in self._claims else None

    def compiled(self) -> StoreIndex | None:
        """This store as arrays (`store.index`), for compiled drafting; None with merge="sum".
        From the first call on the entries live there alone: `add` merges there (a kernel),
        `lookup` reads there, so the dict's Python merge is no longer paid."""
        if self._index is None and self.merge == "stand":
            from store.index import StoreIndex  # numba: only where a compiled drafter runs

            index = StoreIndex(self.max_order, self.topk, self.max_entries)
            index.load(self._entries.items())
            self._entries.clear()
            self._index = index
        return self._index

    def items(self) -> list[tuple[tuple[int, ...], NgramEntry]]:
        """Every (context, entry), least recently updated first."""
        if self._index is not None:
            return self._index.items()
        return list(self._entries.items())

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        if self._index is not None:
            return self._index.lookup(context)
        entries = self._entries
        for n in range(min(self.max_order, len(context)), 0, -1):
            hit = entries.get(tuple(context[-n:]))
            if hit is not None:  # stored with its order (`add`)
                self._hits[n] += 1
                return hit
        self._misses += 1
        return None

    def add(self, rows: Sequence[NgramRow]) -> None:
        if self._index is not None:
            self._index.add(rows)
            return
        entries = self._entries
        for row in rows:
            for n in range(1, min(self.max_order, len(row.context)) + 1):
                key = tuple(row.context[-n:])
                if self.merge == "stand":
                    entries[key] = merge(entries.get(key), row.ids, row.probs, self.topk, n)
                else:
                    sums = self._sums.setdefault(key, {})
                    for token, p in zip(row.ids, row.probs, strict=True):
                        sums[token] = sums.get(token, 0.0) + p
                    count = entries[key].count + 1 if key in entries else 1
                    entries[key] = mean_entry(count, sums, self.topk, n)
                entries.move_to_end(key)
        while len(entries) > self.max_entries:
            key, _ = entries.popitem(last=False)
            self._sums.pop(key, None)
            self._evictions += 1

    def flush(self) -> None:
        """Nothing is pending: writes land in `add`."""

    def close(self) -> None:
        """Nothing is pending."""

    def stats(self) -> dict:
        by_order = [0] * (self.max_order + 1)
        for key in self._entries:
            by_order[len(key)] += 1
        hits = [self._hits[n] for n in range(self.max_order + 1)]
        misses, evictions = self._misses, self._evictions
        if self._index is not None:  # what happened since the entries moved there
            counts = self._index.counts()
            by_order = [a + b for a, b in zip(by_order, counts["entries_by_order"], strict=True)]
            hits = [a + b for a, b in zip(hits, counts["hits_by_order"], strict=True)]
            misses += counts["misses"]
            evictions += counts["evictions"]
        orders = range(1, self.max_order + 1)
        return {
            "entries": sum(by_order),
            "entries_by_order": {str(n): by_order[n] for n in orders},
            "hits_by_order": {str(n): hits[n] for n in orders},
            "misses": misses,
            "evictions": evictions,
        }

    def clear(self) -> None:
        self._entries.clear()
        self._sums.clear()
        if self._index is not None:
            self._index.clear()


class TieredStore:
    """Problem scope over an optional global scope: writes go to both, reads prefer the problem.

    The global store persists across problems; the problem store is made fresh for each one.
    """

    def __init__(self, problem: NgramStore, global_: NgramStore) -> None:
        self.problem = problem
        self.global_ = global_
        self.max_order = problem.max_order

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        hit = self.problem.lookup(context)
        return hit if hit is not None else self.global_.lookup(context)

    def add(self, rows: Sequence[NgramRow]) -> None:
        self.problem.add(rows)
        self.global_.add(rows)

    def flush(self) -> None:
        self.problem.flush()
        self.global_.flush()

    def claim(self, verify_key: int) -> bool:
        """Claimed in both scopes: a global tier outlives the problems (and the runs) it
        teaches."""
        fresh = self.problem.claim(verify_key)
        return self.global_.claim(verify_key) and fresh

    def preclaim(self, verify_keys: Sequence[int]) -> None:
        self.problem.preclaim(verify_keys)
        self.global_.preclaim(verify_keys)

    def confirmed(self, verify_key: int) -> bool | None:
        """False if either scope found the key taken, None while either has not answered."""
        answers = (self.problem.confirmed(verify_key), self.global_.confirmed(verify_key))
        return False if False in answers else None if None in answers else True

    def close(self) -> None:
        """Close the problem scope only: the global one is shared by the next problems (and
        maybe other threads), and its owner closes it."""
        self.problem.close()

    def stats(self) -> dict:
        return {"problem": self.problem.stats(), "global": self.global_.stats()}

    def clear(self) -> None:
        self.problem.clear()
