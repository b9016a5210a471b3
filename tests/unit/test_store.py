"""The logit n-gram store: STAND's merge rule and the lookup fallback, exactly, on hand-made data.
Every backend will run `test_contract_*` (the Redis store joins later)."""

from __future__ import annotations

import pytest

from store.base import NgramEntry, NgramRow, merge
from store.memory import InMemoryNgramStore, TieredStore


def test_merge_first_observation_sorts_and_truncates():
    e = merge(None, [5, 6, 7], [0.2, 0.5, 0.3], topk=2)
    assert e == NgramEntry((6, 7), (0.5, 0.3), 1)


def test_merge_is_the_count_weighted_running_mean_over_the_union():
    old = NgramEntry((1, 2), (0.6, 0.4), count=3)
    # new = 3/4 * old + 1/4 * incoming, absent ids count as 0
    e = merge(old, [2, 9], [0.8, 0.2], topk=10)
    expect = {1: 0.6 * 0.75, 2: 0.4 * 0.75 + 0.8 * 0.25, 9: 0.2 * 0.25}
    assert e.count == 4
    assert e.ids == (2, 1, 9)  # 0.5, 0.45, 0.05
    assert e.probs == pytest.approx([expect[i] for i in e.ids], abs=1e-15)


def test_merge_truncates_back_to_topk_with_deterministic_ties():
    old = NgramEntry((1, 2, 3), (0.4, 0.3, 0.3), count=1)
    e = merge(old, [4, 5], [0.6, 0.4], topk=3)
    # halves: 1: .2, 2: .15, 3: .15, 4: .3, 5: .2 -> 4, then 1 and 5 tie at .2 (lower id first)
    assert e.ids == (4, 1, 5) and e.count == 2


@pytest.fixture(params=["memory"])
def store(request):
    return InMemoryNgramStore(max_order=4, topk=10)


def test_contract_lookup_tries_the_longest_order_first(store):
    store.add([NgramRow((1, 2, 3, 4), (7,), (1.0,))])
    store.add([NgramRow((9, 3, 4), (8,), (1.0,))])  # 1-gram (4,) and 2-gram (3, 4) now mixed
    assert store.lookup([0, 1, 2, 3, 4]).ids == (7,)  # the 4-gram wins: "not the mixed 2-gram"
    hit = store.lookup([5, 9, 3, 4])
    assert hit.ids == (8,) and hit.order == 3  # 4-gram (5, 9, 3, 4) unknown; 3-gram matches
    hit = store.lookup([6, 3, 4])
    assert hit.order == 2 and set(hit.ids) == {7, 8} and hit.count == 2
    assert store.lookup([4]).order == 1
    assert store.lookup([42]) is None and store.lookup([]) is None


def test_contract_rows_shorter_than_max_order_fill_only_their_orders(store):
    store.add([NgramRow((3,), (1,), (1.0,))])
    assert store.stats()["entries_by_order"] == {"1": 1, "2": 0, "3": 0, "4": 0}
    assert store.lookup([8, 3]).order == 1


def test_contract_stats_and_clear(store):
    store.add([NgramRow((1, 2), (3,), (1.0,)), NgramRow((2, 3), (4,), (1.0,))])
    store.lookup([1, 2])
    store.lookup([7])
    s = store.stats()
    assert s["entries"] == 4 and s["hits_by_order"]["2"] == 1 and s["misses"] == 1
    store.clear()
    assert store.stats()["entries"] == 0 and store.lookup([1, 2]) is None


def test_memory_store_evicts_the_least_recently_updated():
    s = InMemoryNgramStore(max_order=1, max_entries=2)
    s.add([NgramRow((1,), (9,), (1.0,))])
    s.add([NgramRow((2,), (9,), (1.0,))])
    s.add([NgramRow((1,), (8,), (1.0,))])  # 1 is fresh again
    s.add([NgramRow((3,), (9,), (1.0,))])  # evicts 2
    assert s.lookup([2]) is None and s.lookup([1]) is not None and s.lookup([3]) is not None
    assert s.stats()["evictions"] == 1 and s.stats()["entries"] == 2


def test_tiered_store_prefers_the_problem_scope_and_writes_both():
    glob = InMemoryNgramStore()
    glob.add([NgramRow((5,), (1,), (1.0,))])
    first = TieredStore(InMemoryNgramStore(), glob)
    assert first.lookup([5]).ids == (1,)  # the global scope answers a fresh problem
    first.add([NgramRow((5,), (2,), (1.0,))])
    assert first.lookup([5]).ids == (2,)  # problem scope first
    second = TieredStore(InMemoryNgramStore(), glob)  # next problem: global persists
    assert set(second.lookup([5]).ids) == {1, 2}


def test_bad_store_arguments():
    with pytest.raises(ValueError):
        InMemoryNgramStore(max_order=0)


def test_factory_global_scope_is_shared_by_the_problems_that_ask_for_it():
    from store.factory import open_global_store, open_problem_store
    from tts_service.config import StoreConfig

    assert open_global_store(StoreConfig(), None) is None  # off by default
    cfg = StoreConfig(global_scope=True)
    glob = open_global_store(cfg, None)
    first = open_problem_store(cfg, None, "p1", glob)
    first.add([NgramRow((4,), (8,), (1.0,))])
    second = open_problem_store(cfg, None, "p2", glob)
    assert second.lookup([4]).ids == (8,)  # learned by p1, read through the global scope
    assert open_problem_store(cfg, None, "p3").lookup([4]) is None  # no global: nothing
