"""The `NgramStore` seam, its row types, and STAND's merge rule (a pure function).

STAND (Song et al. 2025) keeps, for every 1- to 4-gram of context, the
target's next-token distribution compressed to its top-10 ids and probabilities plus a count.
A repeat merges as the running mean k/(k+1)·old + 1/(k+1)·new over the union of ids (absent ids
count as 0), cut back to the top 10. Lookup tries the longest order first.
See docs/design.md, "The logit n-gram store".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NgramEntry:
    """A stored next-token distribution (ids sorted by probability, descending)."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]
    count: int
    order: int = 0  # n-gram length it was found under (set by lookups)


@dataclass(frozen=True)
class NgramRow:
    """One observation: the target's distribution after `context` (its last <= 4 tokens)."""

    context: tuple[int, ...]
    ids: tuple[int, ...]
    probs: tuple[float, ...]


def _rank(pair: tuple[int, float]) -> tuple[float, int]:
    """Probability descending, then token id ascending (every backend's tie-break)."""
    return -pair[1], pair[0]


def merge(
    old: NgramEntry | None, ids: Sequence[int], probs: Sequence[float], topk: int, order: int = 0
) -> NgramEntry:
    """STAND's merge: count-weighted running mean over the union of ids, truncated to `topk`;
    `order` is the n-gram length the entry is stored under (what a lookup returns).

    Ties are broken by token id so every backend produces the same entry. It runs for every
    row and n-gram order of every step (auto's plain steps too), so it is kept lean.
    """
    if old is None:
        return _entry(sorted(zip(ids, probs, strict=True), key=_rank)[:topk], 1, order)
    k = old.count
    acc: dict[int, float] = {i: p * k / (k + 1) for i, p in zip(old.ids, old.probs, strict=True)}
    get = acc.get
    for i, p in zip(ids, probs, strict=True):
        acc[i] = get(i, 0.0) + p / (k + 1)
    return _entry(sorted(acc.items(), key=_rank)[:topk], k + 1, order)


def _entry(ranked: list[tuple[int, float]], count: int, order: int) -> NgramEntry:
    return NgramEntry(tuple([i for i, _ in ranked]), tuple([p for _, p in ranked]), count, order)


def mean_entry(count: int, sums: dict[int, float], topk: int, order: int = 0) -> NgramEntry | None:
    """The commutative form of the merge: per-id probability sums over `count` observations ->
    the mean distribution's top k (ties: lower id). Order-independent, so concurrent writers
    agree; it equals STAND's running mean without the intermediate truncations."""
    if count <= 0:
        return None
    pairs = sorted(((i, s / count) for i, s in sums.items()), key=lambda t: (-t[1], t[0]))[:topk]
    return NgramEntry(tuple(i for i, _ in pairs), tuple(p for _, p in pairs), count, order)


class NgramStore(Protocol):
    """A logit n-gram store. Implementations: `store.memory` (in-process, the reference, and
    `TieredStore`, a problem scope over a global one) and `store.redis_store` (shared).

    A scope is bounded (`StoreConfig.max_entries`): the least recently updated n-grams go first.
    """

    max_order: int

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        """The entry of the longest suffix of `context` (orders max_order..1) that is stored."""

    def add(self, rows: Sequence[NgramRow]) -> None:
        """Merge one decoding step's observations (every order 1..max_order of each row)."""

    def flush(self) -> None:
        """Push pending writes to where other readers see them (a no-op in-process; Redis
        sends a bounded batch per call, and never waits for a server that is down)."""

    def close(self) -> None:
        """The end of the store's life: push every pending write, waiting a bounded time
        (`StoreConfig.close_timeout_s`) for a backend that is down; writes that cannot be
        pushed are reported (stderr, `stats()["lost_updates"]`), never dropped silently.
        Whoever opens a store closes it; a tiered store closes its problem scope only (the
        global one outlives it). A closed store may still be used (Redis reconnects)."""

    def stats(self) -> dict:
        """Counters for the run's report (JSON-serialisable; the keys depend on the backend)."""

    def clear(self) -> None:
        """Forget this store's own scope (a tiered store keeps the shared global one)."""

    def claim(self, verify_key: int) -> bool:
        """Record that a row verified with `verify_key` (`streams.stream_seed`) drafts from and
        writes to this store; False if one already did as far as this process knows (then the
        row must not run: its drafts would depend on its own verifier's uniforms). A shared
        store checks the key with its server in the background (`confirmed`). Claims outlive
        `clear` in-process; in Redis they share the scope's keys and TTL."""

    def preclaim(self, verify_keys: Sequence[int]) -> None:
        """Announce keys rows will `claim` soon (the runner, as requests arrive), so that a
        shared store's answer is in by their first draft; claims nothing (in-process: no-op)."""

    def confirmed(self, verify_key: int) -> bool | None:
        """Whether a claimed key is fresh wherever the scope is read: True, False (another
        process claimed it first), or None while that is not known (a server that has not
        answered yet, or is down). A row drafts only once True (`drafters.registry`)."""
