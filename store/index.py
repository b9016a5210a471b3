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


@njit(cache=True)
def lookup_slot(tab, keytok, meta, ctx: np.ndarray, end: int, max_order: int) -> tuple[int, int]:
    """(slot, order) of the longest stored suffix of `ctx[:end]`, (-1, 0) if none; counted as
    `InMemoryNgramStore.lookup` counts."""
    for n in range(min(max_order, end), 0, -1):
        s = find_ngram(tab, keytok, ctx, end, n)
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


class StoreArrays(NamedTuple):
    """What a merge writes of an index (`StoreIndex`'s arrays over `slots` slots), in kernel
    order: `tab` the n-gram table (`store.hashtable`: slot ids); `ids` `[slots, topk]` int64
    and `probs` `[slots, topk]` float64 each entry's top k, `nids` `[slots]` how many are real;
    `count` `[slots]` the rows merged into it; `keytok` `[slots, 9]` its key (order, tokens, -1
    padded; order 0: a free slot); `prev` / `nxt` `[slots]` the LRU list's links (`nxt` also
    chains the free slots); `meta` the counters (`HEAD` .. `DELETED`, then hits by order)."""

    tab: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    nids: np.ndarray
    count: np.ndarray
    keytok: np.ndarray
    prev: np.ndarray
    nxt: np.ndarray
    meta: np.ndarray


class MergedRows(NamedTuple):
    """Rows to merge (`StoreIndex.add_arrays`), in kernel order: `ctx` `[R, max_order]` int64
    each row's context right-aligned, -1 padded; `clen` `[R]` its whole length; `ids` `[R, W]`
    int64 and `probs` `[R, W]` float64 its distribution, of which `n` `[R]` are real."""

    ctx: np.ndarray
    clen: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    n: np.ndarray


@njit(cache=True)
def _new_slot(nxt, meta) -> int:
    """A slot for a new entry: the last freed one, else the next fresh one."""
    if meta[FREE] >= 0:
        s = meta[FREE]
        meta[FREE] = nxt[s]
    else:
        s = meta[FRESH]
        meta[FRESH] += 1
    return s


@njit(cache=True)
def _union(row_ids, row_p, r: int, k_new: int, k: int, m: int, cand_ids, cand_p) -> int:
    """Row `r`'s first `k_new` (id, p) added to the `m` candidates at weight 1 / (k + 1), over
    the union of ids (STAND's running mean after `k` rows); returns how many candidates."""
    for j in range(k_new):
        tok, p = row_ids[r, j], row_p[r, j]
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
    return m


@njit(cache=True)
def _evict(tab, keytok, prev, nxt, meta, max_entries: int) -> None:
    """The least recently updated entries past `max_entries` go; their slots are freed."""
    while meta[ENTRIES] > max_entries:
        s = meta[HEAD]
        _unlink(prev, nxt, meta, s)
        delete_ngram(tab, keytok, s)
        keytok[s, 0] = 0  # a free slot
        meta[DELETED] += 1
        nxt[s] = meta[FREE]
        meta[FREE] = s
        meta[ENTRIES] -= 1
        meta[EVICTIONS] += 1


@njit(cache=True)
def add_rows(store, rows, max_order: int, max_entries: int):
    """`InMemoryNgramStore.add` (merge="stand") over arrays (`store`: `StoreArrays`, `rows`:
    `MergedRows`, as plain tuples): every order of every row, then the least recently updated
    entries past `max_entries` go. The caller made room for `rows × max_order` new slots.
    Unpacked once here: its helpers take arrays (a tuple unpacked per key counts a reference
    to each of its arrays, which made merges 1.4-2.4x slower)."""
    tab, ids, probs, nids, count, keytok, prev, nxt, meta = store
    ctx, clen, row_ids, row_p, row_n = rows
    topk = ids.shape[1]
    width = ctx.shape[1]
    cand_ids = np.empty(topk + row_ids.shape[1], np.int64)
    cand_p = np.empty(topk + row_ids.shape[1], np.float64)
    for r in range(ctx.shape[0]):
        k_new = row_n[r]
        for n in range(1, min(max_order, clen[r]) + 1):
            s = find_ngram(tab, keytok, ctx[r], width, n)
            if s < 0:  # first sight: its top k, count 1
                m = 0
                for j in range(k_new):
                    cand_ids[m], cand_p[m] = row_ids[r, j], row_p[r, j]
                    m += 1
                s = _new_slot(nxt, meta)
                insert_ngram(tab, keytok, ctx[r], width, n, s)
                nids[s] = _ranked_into(ids, probs, s, cand_ids, cand_p, m, topk)
                count[s] = 1
                meta[ENTRIES] += 1
                _append(prev, nxt, meta, s)
                continue
            k = count[s]
            m = nids[s]
            for j in range(m):  # the old mean, weighted k / (k + 1)
                cand_ids[j], cand_p[j] = ids[s, j], probs[s, j] * k / (k + 1)
            m = _union(row_ids, row_p, r, k_new, k, m, cand_ids, cand_p)  # the new row
            nids[s] = _ranked_into(ids, probs, s, cand_ids, cand_p, m, topk)
            count[s] = k + 1
            if meta[TAIL] != s:
                _unlink(prev, nxt, meta, s)
                _append(prev, nxt, meta, s)
    _evict(tab, keytok, prev, nxt, meta, max_entries)


@njit(cache=True)
def _load_one(store, ctx, row_ids, row_p, k: int) -> None:
    """One stored entry (key `ctx`, its top k and count `k`) into the next fresh slot
    (`StoreArrays`, a plain tuple), at the LRU list's tail."""
    tab, ids, probs, nids, count, keytok, prev, nxt, meta = store
    s = meta[FRESH]
    meta[FRESH] += 1
    insert_ngram(tab, keytok, ctx, len(ctx), len(ctx), s)
    m = min(len(row_ids), ids.shape[1])
    for j in range(m):
        ids[s, j], probs[s, j] = row_ids[j], row_p[j]
    nids[s], count[s] = m, k
    meta[ENTRIES] += 1
    _append(prev, nxt, meta, s)


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

    def arrays(self) -> tuple:
        """What a drafting kernel reads (a plain tuple): (tab, keytok, ids, probs, nids, count,
        meta, max_order)."""
        return (
            self.tab, self.keytok, self.ids, self.probs, self.nids, self.count, self.meta,
            self.max_order,
        )  # fmt: skip

    def _written(self) -> tuple:
        """The index's arrays as it is now, as the plain tuple a kernel takes, in `StoreArrays`'
        order (built as a tuple: a `StoreArrays` converted costs 0.3 us more a call)."""
        return (
            self.tab, self.ids, self.probs, self.nids, self.count, self.keytok,
            self.prev, self.nxt, self.meta,
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
        """`add` of rows already as arrays: contexts right-aligned in `[R, max_order]`; built
        for this call (a replica keeps them for its log: `store.redis_store.ReplicaIndex`)."""
        self._room(len(ctx) * self.max_order)
        rows = (ctx, clen, row_ids, row_p, row_n)  # `MergedRows`' order
        add_rows(self._written(), rows, self.max_order, self.max_entries)

    def load(self, entries: Iterable[tuple[tuple[int, ...], NgramEntry]]) -> None:
        """Take a store's entries, least recently updated first, as they are."""
        for key, entry in entries:
            ctx = np.array(key, np.int64)[None]
            ids = np.array(entry.ids, np.int64)[None]
            probs = np.array(entry.probs, np.float64)[None]
            self._room(1)
            _load_one(self._written(), ctx[0], ids[0], probs[0], entry.count)

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        """What a kernel's lookup finds, as the dict store returns it (tests, reports)."""
        ctx = np.array(list(context), np.int64)
        s, n = lookup_slot(self.tab, self.keytok, self.meta, ctx, len(ctx), self.max_order)
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
