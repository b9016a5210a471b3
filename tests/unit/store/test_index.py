"""The store's compiled mirror (`store.index`) and its hash tables (`store.hashtable`): every
lookup returns what the dict store returns, bit for bit, through merges, evictions and
clears."""

from __future__ import annotations

import random

import numpy as np

from store.base import NgramRow
from store.hashtable import (
    delete_ngram,
    find_ngram,
    find_pair,
    insert_ngram,
    insert_pair,
    new_table,
    room,
)
from store.index import StoreArrays, StoreIndex
from store.memory import InMemoryNgramStore


def _rows(rng: random.Random, n: int) -> list[NgramRow]:
    rows = []
    for _ in range(n):
        ctx = tuple(rng.randrange(6) for _ in range(rng.randrange(0, 7)))
        k = rng.randrange(1, 11)
        ids = tuple(rng.sample(range(30), k))
        # ties (0.5, 0.25) and zeros exercise the tie-break and the cut
        probs = tuple(rng.choice([0.5, 0.25, 0.0, rng.random()]) for _ in range(k))
        rows.append(NgramRow(ctx, ids, probs))
    return rows


def test_the_index_returns_the_dict_stores_entries_through_merges_and_evictions():
    for max_entries in (1_000_000, 40):
        rng = random.Random(max_entries)
        store = InMemoryNgramStore(max_entries=max_entries)
        store.add(_rows(rng, 20))  # entries before the index exists are loaded
        index = store.compiled()
        for _ in range(150):
            store.add(_rows(rng, rng.randrange(1, 8)))
        contexts = [
            tuple(rng.randrange(6) for _ in range(rng.randrange(0, 7))) for _ in range(2000)
        ]
        for ctx in contexts:
            assert index.lookup(ctx) == store.lookup(ctx), ctx
        assert len(store._entries) <= max_entries
        if max_entries == 40:
            assert store.stats()["evictions"] > 100


def test_lookups_before_and_after_the_index_are_counted_in_the_stores_stats():
    rows = _rows(random.Random(3), 30)
    plain, indexed = InMemoryNgramStore(), InMemoryNgramStore()
    plain.add(rows)
    indexed.add(rows)
    contexts = [(1, 2, 3), (4,), (5, 5, 5, 5, 5), ()]
    for ctx in contexts:
        plain.lookup(ctx)
        indexed.lookup(ctx)
    index = indexed.compiled()
    assert index is not None
    for ctx in contexts:
        plain.lookup(ctx)
        index.lookup(ctx)  # a kernel's lookup
    assert indexed.stats() == plain.stats()


def test_the_merge_kernels_tuple_is_laid_out_as_store_arrays():
    """`add_rows` and `_load_one` unpack the index's arrays in `StoreArrays`' order."""
    index = StoreIndex(max_order=4, topk=3, max_entries=10)
    index.add([NgramRow((1, 2), (5,), (1.0,))])
    written = index._written()
    assert len(written) == len(StoreArrays._fields)
    assert all(a is getattr(index, f) for a, f in zip(written, StoreArrays._fields, strict=True))


def test_a_summing_store_keeps_no_index():
    assert InMemoryNgramStore(merge="sum").compiled() is None


def test_clear_empties_the_index_and_keeps_the_counts_as_the_dict_store_does():
    rows = _rows(random.Random(1), 10)
    store, plain = InMemoryNgramStore(), InMemoryNgramStore()
    store.add(rows)
    plain.add(rows)
    index = store.compiled()
    assert index is not None and store.stats()["entries"] > 0
    for s in (store, plain):
        s.lookup((1, 2, 3))
        s.clear()
    assert store.stats() == plain.stats()
    assert store.stats()["entries"] == 0 and store.items() == []
    store.add([NgramRow((1, 2), (7,), (1.0,))])
    assert store.lookup((9, 1, 2)) == index.lookup((9, 1, 2)) is not None


def test_the_ngram_table_finds_inserts_and_forgets_deleted_keys_across_rehashes():
    rng = np.random.default_rng(0)
    tab, kt = new_table(4), np.zeros((600, 13), np.int64)
    model: dict[tuple[int, ...], int] = {}
    used = 0
    for s in range(600):
        n = int(rng.integers(1, 13))
        key = rng.integers(0, 5, n)
        if find_ngram(tab, kt, key, n, n) >= 0:
            continue
        tab = room(tab, kt, used, 1)
        insert_ngram(tab, kt, key, n, n, s)
        used += 1
        model[tuple(key.tolist())] = s
        if s % 7 == 0:  # delete an earlier key
            victim = next(iter(model))
            delete_ngram(tab, kt, model.pop(victim))
    assert len(tab) > 16  # it grew
    for key, s in model.items():
        arr = np.array(key, np.int64)
        assert find_ngram(tab, kt, arr, len(arr), len(arr)) == s
    for _ in range(300):
        n = int(rng.integers(1, 13))
        key = rng.integers(0, 5, n)
        want = model.get(tuple(key.tolist()), -1)
        assert find_ngram(tab, kt, key, n, n) == want


def test_the_pair_table_maps_pairs_to_slots():
    tab, pk = new_table(4), np.zeros((200, 2), np.int64)
    for s in range(200):
        tab = room(tab, pk, s, 1, pairs=True)
        insert_pair(tab, pk, s // 10, s % 10 * 3, s)
    assert [find_pair(tab, pk, s // 10, s % 10 * 3) for s in range(200)] == list(range(200))
    assert find_pair(tab, pk, 3, 1) == -1
