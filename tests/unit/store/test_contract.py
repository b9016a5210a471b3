"""The `NgramStore` contract (`test_contract_*`) run over every backend: in-process, tiered,
Redis, tiered over Redis, and a Redis Cluster. The Redis ones use the session's private
redis-server or cluster (skipped where they are not installed)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence

import pytest

from store.base import NgramEntry, NgramRow, NgramStore
from store.config import StoreConfig
from store.factory import open_store
from store.memory import TieredStore
from store.redis_store import FLUSH_ROWS, RedisLogitNgramStore


class Backend:
    """Opens stores on one backend through the factory, and reads back what they share."""

    def __init__(self, url: str | None, tiered: bool) -> None:
        self.url = url  # None: in-process
        self.tiered = tiered
        self.cfg = StoreConfig()

    def _open(self, scope: str) -> NgramStore:
        return open_store(self.cfg, self.url, scope, uuid.uuid4().hex)  # tests never share

    def open(self, **cfg) -> NgramStore:
        """A fresh store over fresh scopes (tiered: a problem over a new global scope)."""
        self.cfg = StoreConfig(**cfg)
        problem = self._open("problem")
        return TieredStore(problem, self._open("global")) if self.tiered else problem

    def reader(self, store: NgramStore) -> NgramStore:
        """Another store over what `store` shares: an in-process store is its own reader, a
        Redis one gets a new connection to its scope, a tiered one is followed by the next
        problem over the same global scope."""
        if isinstance(store, TieredStore):
            return TieredStore(self._open("problem"), self.reader(store.global_))
        if isinstance(store, RedisLogitNgramStore):
            return open_store(self.cfg, self.url, store.scope.scope, store.scope.scope_id)
        return store


@pytest.fixture(params=["memory", "tiered", "redis", "tiered-redis", "redis-cluster"])
def backend(request) -> Backend:
    url = None
    if request.param == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    elif "redis" in request.param:
        url = request.getfixturevalue("redis_server").url
    return Backend(url, tiered=request.param.startswith("tiered"))


def _fetched(store: NgramStore, context: Sequence[int]) -> NgramEntry | None:
    """A lookup once the store has fetched: over Redis a cold key comes with the next round
    trip (lookups never wait on the network)."""
    store.lookup(context)
    store.flush()
    return store.lookup(context)


def _readers(
    backend: Backend, store: NgramStore
) -> list[Callable[[Sequence[int]], NgramEntry | None]]:
    """Both ways a store's writes are read: by the writer itself (what drafting sees, from
    its local state) and, after `flush()`, by another reader of what it shares."""
    store.flush()
    reader = backend.reader(store)
    return [store.lookup, lambda context: _fetched(reader, context)]


def test_contract_lookup_tries_the_longest_order_first(backend):
    store = backend.open()
    store.add([NgramRow((1, 2, 3, 4), (7,), (1.0,))])
    store.add([NgramRow((9, 3, 4), (8,), (1.0,))])  # 1-gram (4,) and 2-gram (3, 4) now mixed
    for lookup in _readers(backend, store):
        assert lookup([0, 1, 2, 3, 4]).ids == (7,)  # the 4-gram wins: "not the mixed 2-gram"
        hit = lookup([5, 9, 3, 4])
        assert hit.ids == (8,) and hit.order == 3  # 4-gram (5, 9, 3, 4) unknown; 3-gram matches
        hit = lookup([6, 3, 4])
        assert hit.order == 2 and set(hit.ids) == {7, 8} and hit.count == 2
        assert lookup([4]).order == 1
        assert lookup([42]) is None and lookup([]) is None


def test_contract_a_row_fills_orders_1_to_max_order_of_its_context(backend):
    store = backend.open(max_order=3)
    store.add([NgramRow((1, 2, 3, 4, 5), (6,), (1.0,)), NgramRow((7,), (8,), (1.0,))])
    for lookup in _readers(backend, store):
        assert lookup([1, 2, 3, 4, 5]).order == 3  # no 4- or 5-gram above max_order
        assert lookup([9, 4, 5]).order == 2 and lookup([5]).order == 1
        assert lookup([8, 7]).order == 1  # a short row fills only its own orders


def test_contract_repeats_merge_as_the_count_weighted_mean(backend):
    store = backend.open()
    store.add([NgramRow((1, 2), (5, 6), (0.75, 0.25))])
    store.add([NgramRow((1, 2), (6, 7), (0.5, 0.5))])
    store.add([NgramRow((1, 2), (7,), (1.0,))])  # 2/3 * old + 1/3 * new
    for lookup in _readers(backend, store):
        hit = lookup([1, 2])
        assert hit.ids == (7, 5, 6) and hit.count == 3  # 5 and 6 tie: lower id first
        assert hit.probs == pytest.approx((0.5, 0.25, 0.25), abs=1e-12)


def test_contract_entries_keep_the_topk_ids(backend):
    store = backend.open(topk=3)
    store.add([NgramRow((1,), (10, 11, 12, 13, 14), (0.1, 0.3, 0.2, 0.2, 0.2))])
    for lookup in _readers(backend, store):
        hit = lookup([1])
        assert hit.ids == (11, 12, 13) and hit.probs == pytest.approx((0.3, 0.2, 0.2))


def test_contract_flush_pushes_what_add_left_queued(backend):
    """One Redis round trip carries at most FLUSH_ROWS rows; `flush()` pushes the rest. Over
    "tiered-redis" this is issue 18: TieredStore did not forward the flush, so with a global
    scope a store an actor dropped kept its queued writes to itself."""
    store = backend.open()
    store.flush()  # nothing queued: harmless
    rows = [NgramRow((t,), (1,), (1.0,)) for t in range(FLUSH_ROWS + 10)]
    store.add(rows)
    store.flush()
    tiers = [store.problem, store.global_] if isinstance(store, TieredStore) else [store]
    for tier in tiers:
        reader = backend.reader(tier)
        assert all(_fetched(reader, row.context) is not None for row in rows[-10:])


def test_contract_the_least_recently_updated_entries_are_evicted(backend):
    store = backend.open(max_order=1, max_entries=2)
    for t, token in ((1, 9), (2, 9), (1, 8), (3, 9)):  # 1 is fresh again; 3 evicts 2
        store.add([NgramRow((t,), (token,), (1.0,))])
    store.flush()
    reader = backend.reader(store)  # the writer's own cache may hold an evicted key a while
    assert _fetched(reader, [2]) is None
    assert _fetched(reader, [1]).count == 2 and _fetched(reader, [3]) is not None


def test_contract_stats_are_a_json_report(backend):
    store = backend.open()
    store.add([NgramRow((1, 2), (3,), (1.0,))])
    store.lookup([1, 2])
    store.lookup([7])
    assert json.loads(json.dumps(store.stats()))


@pytest.mark.parametrize("backend", ["memory", "redis"], indirect=True)
def test_contract_clear_forgets_the_scope(backend):
    store = backend.open()
    store.add([NgramRow((1, 2), (3,), (1.0,))])
    store.clear()
    for lookup in _readers(backend, store):
        assert lookup([1, 2]) is None and lookup([2]) is None


@pytest.mark.parametrize("backend", ["tiered", "tiered-redis"], indirect=True)
def test_contract_tiered_store_prefers_the_problem_scope_and_writes_both(backend):
    first = backend.open()
    first.global_.add([NgramRow((5,), (1,), (1.0,))])
    assert first.lookup([5]).ids == (1,)  # the global scope answers a fresh problem
    first.add([NgramRow((5,), (2,), (1.0,))])
    assert first.lookup([5]).ids == (2,)  # problem scope first
    first.clear()  # forgets the problem scope only
    assert set(first.lookup([5]).ids) == {1, 2}
    first.flush()
    second = backend.reader(first)  # next problem: the global scope persists
    assert set(_fetched(second, [5]).ids) == {1, 2}


def test_contract_a_verify_key_is_claimed_once_wherever_the_scope_is_read(backend):
    """`claim` / `confirmed`: a key is fresh once through any store over the same scope
    (another connection, the next problem over a shared global tier). A process refuses its own
    second claim at once; another process's is answered by the server in the background."""
    store = backend.open()
    assert store.claim(11) and store.claim(12)
    assert not store.claim(11)
    store.flush()
    assert store.confirmed(11) is True and store.confirmed(12) is True
    assert store.confirmed(99) is None  # never claimed
    reader = backend.reader(store)
    fresh_12, fresh_13 = reader.claim(12), reader.claim(13)
    reader.flush()
    assert not fresh_12 or reader.confirmed(12) is False  # refused at once, or by the server
    assert fresh_13 and reader.confirmed(13) is True
    fresh_13 = store.claim(13)
    store.flush()
    assert not fresh_13 or store.confirmed(13) is False
