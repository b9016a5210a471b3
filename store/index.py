"""The in-process store as arrays, for compiled drafting: `InMemoryNgramStore`'s entries where
a numba kernel reads them without touching Python objects (docs/design.md, "The compiled
drafter").

`InMemoryNgramStore.compiled()` moves its entries here; from then on its `add` merges here (a
kernel), with the dict's rule (STAND's running mean, cut to the top k, ties to the lower id)
and its least recently updated eviction, so a lookup returns what the dict store would, bit
for bit (tests).
Entries live in fixed-width rows (`ids`, `probs`: `[slots, topk]`); an n-gram key (order,
token_1 .. token_8, -1 padded) in `keytok[slot]`, found through an open-addressing table
(`store.hashtable`); the LRU order is a doubly linked list over the slots (`prev`, `nxt`),
evicted slots are reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
from numba import njit

from store.base import NgramEntry, NgramRow
from store.hashtable import delete_ngram, find_ngram, insert_ngram, new_table, room

HEAD, TAIL, FRESH, FREE, ENTRIES, EVICTIONS, MISSES, DELETED = range(8)  # `meta` fields
META = 8  # then hits by order: meta[META + n]


class StoreArrays(NamedTuple):
    """One store's arrays as a kernel takes them (`StoreIndex.arrays()`: made at each call, as
    an `add` may reallocate them)."""

    tab: np.ndarray  # the n-gram table (`store.hashtable`): key -> slot
    keytok: np.ndarray  # [slots, 9]: each slot's key
    ids: np.ndarray  # [slots, topk]: each entry's ids, by probability descending
    probs: np.ndarray  # [slots, topk]
    nids: np.ndarray  # [slots]: ids kept
    count: np.ndarray  # [slots]: observations merged
    prev: np.ndarray  # [slots]: the LRU list, least recently updated first
    nxt: np.ndarray  # [slots]: likewise; a free slot's next free one
    meta: np.ndarray  # HEAD .. DELETED, then hits by order
    max_order: int


class NewRows(NamedTuple):
    """Observations to merge as arrays (`StoreIndex.add_arrays`): row r's context right-aligned
    in `ctx[r]` (`clen[r]` tokens), its `n[r]` ids and probabilities in `ids[r]`, `probs[r]`."""

    ctx: np.ndarray  # [R, max_order], -1 padded
    clen: np.ndarray  # [R]
    ids: np.ndarray  # [R, width]
    probs: np.ndarray  # [R, width]
    n: np.ndarray  # [R]


@njit(cache=True)
def lookup_slot(store: StoreArrays, ctx: np.ndarray, end: int, max_order: int) -> tuple[int, int]:
    """(slot, order) of the longest stored suffix of `ctx[:end]` of at most `max_order` tokens,
    (-1, 0) if none; counted as `InMemoryNgramStore.lookup` counts."""
    meta = store.meta
    for n in range(min(max_order, end), 0, -1):
        s = find_ngram(store.tab, store.keytok, ctx, end, n)
        if s >= 0:
            meta[META + n] += 1
            return s, n
    meta[MISSES] += 1
    return -1, 0


@njit(cache=True)
def _unlink(prev, nxt, meta, s: int) -> None:
    p, q = prev[s], nxt[s]
    if p >= 0:
        nxt[p] = q
    else:
        meta[HEAD] = q
    if q >= 0:
        prev[q] = p
    else:
        meta[TAIL] = p


@njit(cache=True)
def _append(prev, nxt, meta, s: int) -> None:
    prev[s], nxt[s] = meta[TAIL], -1
    if meta[TAIL] >= 0:
        nxt[meta[TAIL]] = s
    else:
        meta[HEAD] = s
    meta[TAIL] = s


@njit(cache=True)
def _ranked_into(ids, probs, s: int, cand_ids, cand_p, m: int, topk: int) -> int:
    """Sort the m candidates by (probability descending, id ascending), stably, and keep the
    first `topk` in row `s`; returns how many."""
    for i in range(1, m):
        ci, cp = cand_ids[i], cand_p[i]
        j = i - 1
        while j >= 0 and (cand_p[j] < cp or (cand_p[j] == cp and cand_ids[j] > ci)):
            cand_ids[j + 1], cand_p[j + 1] = cand_ids[j], cand_p[j]
            j -= 1
        cand_ids[j + 1], cand_p[j + 1] = ci, cp
    n = min(m, topk)
    for j in range(n):
        ids[s, j], probs[s, j] = cand_ids[j], cand_p[j]
    return n


@njit(cache=True)
def _new_slot(store: StoreArrays) -> int:
    """A free slot (an evicted one first), taken."""
    meta = store.meta
    if meta[FREE] >= 0:
        s = meta[FREE]
        meta[FREE] = store.nxt[s]
    else:
        s = meta[FRESH]
        meta[FRESH] += 1
    return s


@njit(cache=True)
def _insert(store: StoreArrays, rows: NewRows, r: int, n: int, cand_ids, cand_p) -> None:
    """Row r's n-gram seen first: its top k, count 1, the most recently updated."""
    m = 0
    for j in range(rows.n[r]):
        cand_ids[m], cand_p[m] = rows.ids[r, j], rows.probs[r, j]
        m += 1
    s = _new_slot(store)
    insert_ngram(store.tab, store.keytok, rows.ctx[r], rows.ctx.shape[1], n, s)
    store.nids[s] = _ranked_into(store.ids, store.probs, s, cand_ids, cand_p, m, store.ids.shape[1])
    store.count[s] = 1
    store.meta[ENTRIES] += 1
    _append(store.prev, store.nxt, store.meta, s)


@njit(cache=True)
def _merge(store: StoreArrays, rows: NewRows, r: int, s: int, cand_ids, cand_p) -> None:
    """Row r merged into slot `s`'s entry (STAND's running mean), now the most recently
    updated."""
    k = store.count[s]
    m = store.nids[s]
    for j in range(m):  # the old mean, weighted k / (k + 1)
        cand_ids[j], cand_p[j] = store.ids[s, j], store.probs[s, j] * k / (k + 1)
    for j in range(rows.n[r]):  # the new row, weighted 1 / (k + 1), over the union of ids
        tok, p = rows.ids[r, j], rows.probs[r, j]
        at = -1
        for i in range(m):
            if cand_ids[i] == tok:
                at = i
                break
        if at < 0:
            cand_ids[m], cand_p[m] = tok, 0.0 + p / (k + 1)
            m += 1
        else:
            cand_p[at] = cand_p[at] + p / (k + 1)
    store.nids[s] = _ranked_into(store.ids, store.probs, s, cand_ids, cand_p, m, store.ids.shape[1])
    store.count[s] = k + 1
    if store.meta[TAIL] != s:
        _unlink(store.prev, store.nxt, store.meta, s)
        _append(store.prev, store.nxt, store.meta, s)


@njit(cache=True)
def _evict(store: StoreArrays, max_entries: int) -> None:
    """The least recently updated entries past `max_entries` go; their slots are freed."""
    meta = store.meta
    while meta[ENTRIES] > max_entries:
        s = meta[HEAD]
        _unlink(store.prev, store.nxt, meta, s)
        delete_ngram(store.tab, store.keytok, s)
        store.keytok[s, 0] = 0  # a free slot
        meta[DELETED] += 1
        store.nxt[s] = meta[FREE]
        meta[FREE] = s
        meta[ENTRIES] -= 1
        meta[EVICTIONS] += 1


@njit(cache=True)
def add_rows(store: StoreArrays, rows: NewRows, max_entries: int) -> None:
    """`InMemoryNgramStore.add` (merge="stand") over arrays: every order of every row, then
    the least recently updated entries past `max_entries` go. The caller made room for
    `rows × max_order` new slots."""
    width = rows.ctx.shape[1]
    cand_ids = np.empty(store.ids.shape[1] + rows.ids.shape[1], np.int64)
    cand_p = np.empty(store.ids.shape[1] + rows.ids.shape[1], np.float64)
    for r in range(rows.ctx.shape[0]):
        for n in range(1, min(store.max_order, rows.clen[r]) + 1):
            s = find_ngram(store.tab, store.keytok, rows.ctx[r], width, n)
            if s < 0:
                _insert(store, rows, r, n, cand_ids, cand_p)
            else:
                _merge(store, rows, r, s, cand_ids, cand_p)
    _evict(store, max_entries)


class StoreIndex:
    """The arrays of one store (module docstring). `arrays()` is what a kernel takes."""

    def __init__(self, max_order: int, topk: int, max_entries: int, slots: int = 1024) -> None:
        self.max_order, self.topk, self.max_entries = max_order, topk, max_entries
        self.meta = np.zeros(META + 9, np.int64)
        self.clear(slots)

    def clear(self, slots: int = 1024) -> None:
        """Forget every entry; the lookup and eviction counts stay, as the dict store's do."""
        self.tab = new_table(slots)
        self.meta[[HEAD, TAIL, FREE]] = -1
        self.meta[[FRESH, ENTRIES, DELETED]] = 0
        self._alloc(slots, keep=False)

    def _alloc(self, slots: int, keep: bool = True) -> None:
        old = getattr(self, "ids", None) if keep else None
        fields = {
            "ids": np.zeros((slots, self.topk), np.int64),
            "probs": np.zeros((slots, self.topk), np.float64),
            "nids": np.zeros(slots, np.int64),
            "count": np.zeros(slots, np.int64),
            "keytok": np.zeros((slots, 9), np.int64),
            "prev": np.full(slots, -1, np.int64),
            "nxt": np.full(slots, -1, np.int64),
        }
        for name, arr in fields.items():
            if old is not None:
                cur = getattr(self, name)
                arr[: cur.shape[0]] = cur
            setattr(self, name, arr)

    def arrays(self) -> StoreArrays:
        """What a kernel reads and merges into."""
        return StoreArrays(
            self.tab, self.keytok, self.ids, self.probs, self.nids, self.count,
            self.prev, self.nxt, self.meta, self.max_order,
        )  # fmt: skip

    def _room(self, new: int) -> None:
        """Slots and table room for `new` more keys."""
        need = int(self.meta[FRESH]) + new
        if need > self.ids.shape[0]:
            self._alloc(max(need, 2 * self.ids.shape[0]))
        used = int(self.meta[ENTRIES] + self.meta[DELETED])
        tab = room(self.tab, self.keytok, used, new)
        if tab is not self.tab:
            self.tab, self.meta[DELETED] = tab, 0

    def add(self, rows: Sequence[NgramRow]) -> None:
        """Merge rows exactly as `InMemoryNgramStore.add` does."""
        if not rows:
            return
        width = max(len(r.ids) for r in rows)
        ctx = np.full((len(rows), self.max_order), -1, np.int64)
        clen = np.zeros(len(rows), np.int64)
        row_ids = np.zeros((len(rows), width), np.int64)
        row_p = np.zeros((len(rows), width), np.float64)
        row_n = np.zeros(len(rows), np.int64)
        for r, row in enumerate(rows):
            c = row.context[-self.max_order :]
            if c:
                ctx[r, self.max_order - len(c) :] = c
            clen[r], row_n[r] = len(row.context), len(row.ids)
            row_ids[r, : len(row.ids)] = row.ids
            row_p[r, : len(row.probs)] = row.probs
        self.add_arrays(ctx, clen, row_ids, row_p, row_n)

    def add_arrays(self, ctx, clen, row_ids, row_p, row_n) -> None:
        """`add` of rows already as arrays: contexts right-aligned in `[R, max_order]`."""
        self._room(len(ctx) * self.max_order)
        add_rows(self.arrays(), NewRows(ctx, clen, row_ids, row_p, row_n), self.max_entries)

    def load(self, entries: Iterable[tuple[tuple[int, ...], NgramEntry]]) -> None:
        """Take a store's entries, least recently updated first, as they are."""
        for key, entry in entries:
            ctx = np.array(key, np.int64)[None]
            ids = np.array(entry.ids, np.int64)[None]
            probs = np.array(entry.probs, np.float64)[None]
            self._room(1)
            _load_one(self.arrays(), ctx[0], ids[0], probs[0], entry.count)

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        """What a kernel's lookup finds, as the dict store returns it (tests, reports)."""
        ctx = np.array(list(context), np.int64)
        s, n = lookup_slot(self.arrays(), ctx, len(ctx), self.max_order)
        if s < 0:
            return None
        k = int(self.nids[s])
        ids, probs = self.ids[s, :k].tolist(), self.probs[s, :k].tolist()
        return NgramEntry(tuple(ids), tuple(probs), int(self.count[s]), n)

    def counts(self) -> dict:
        """Entries by order, lookups answered by order ([n], n = 0..max_order), misses and
        evictions (`InMemoryNgramStore.stats` adds what it counted before the index)."""
        orders = self.keytok[: self.meta[FRESH], 0]
        by_order = np.bincount(orders, minlength=self.max_order + 1)
        by_order[0] = 0  # free slots
        return {
            "entries_by_order": by_order.tolist(),
            "hits_by_order": self.meta[META : META + self.max_order + 1].tolist(),
            "misses": int(self.meta[MISSES]),
            "evictions": int(self.meta[EVICTIONS]),
        }

    def items(self) -> list[tuple[tuple[int, ...], NgramEntry]]:
        """Every (context, entry), least recently updated first (the LRU list's order)."""
        out = []
        s = int(self.meta[HEAD])
        while s >= 0:
            n, k = int(self.keytok[s, 0]), int(self.nids[s])
            entry = NgramEntry(
                tuple(self.ids[s, :k].tolist()),
                tuple(self.probs[s, :k].tolist()),
                int(self.count[s]),
                n,
            )
            out.append((tuple(self.keytok[s, 1 : 1 + n].tolist()), entry))
            s = int(self.nxt[s])
        return out


@njit(cache=True)
def _load_one(store: StoreArrays, ctx, row_ids, row_p, k: int) -> None:
    """One entry taken as it is (`StoreIndex.load`): the most recently updated."""
    s = store.meta[FRESH]
    store.meta[FRESH] += 1
    insert_ngram(store.tab, store.keytok, ctx, len(ctx), len(ctx), s)
    m = min(len(row_ids), store.ids.shape[1])
    for j in range(m):
        store.ids[s, j], store.probs[s, j] = row_ids[j], row_p[j]
    store.nids[s], store.count[s] = m, k
    store.meta[ENTRIES] += 1
    _append(store.prev, store.nxt, store.meta, s)
