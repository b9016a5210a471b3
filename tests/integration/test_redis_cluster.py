"""The store on a real Redis Cluster of 3 masters and 3 replicas (redis-server processes on
loopback ports, started here and stopped by PID): a scope's keys stay in one slot, counts are
exact, a best-of-4 solve equals the in-process store's, and two masters killed mid-run one after
the other are taken over by their replicas with nothing lost silently or applied twice."""

from __future__ import annotations

import shutil
import time

import pytest
import redis
from redis.cluster import RedisCluster

from store.base import NgramRow
from store.config import StoreConfig
from store.factory import open_problem_store, open_store, problem_id
from store.local_server import LocalRedisCluster
from store.memory import InMemoryNgramStore
from store.redis_client import StoreUnavailableError, client_from_url, scope_stats
from store.redis_store import RedisLogitNgramStore, RedisScope
from tests.conftest import logged_rows, ngram_steps

pytestmark = pytest.mark.skipif(
    shutil.which("redis-cli") is None or shutil.which("redis-server") is None,
    reason="redis-server and redis-cli not installed (apt-get install -y redis-server)",
)


@pytest.fixture(scope="module")
def cluster():
    with LocalRedisCluster(masters=3, replicas=1) as c:
        yield c


def _stored(url: str, scope_id: str) -> int:
    """Rows in a scope's log, as a process that opens it now applies them (each once: the
    sum of the 1-gram counts agrees)."""
    applied, counted = logged_rows(url, scope_id)
    assert applied == counted
    return applied


def _drain_and_close(store: RedisLogitNgramStore) -> dict:
    """Flush until nothing is pending (a bounded wait), close; the stats before closing."""
    deadline = time.monotonic() + 30
    while store.stats()["pending_updates"] and time.monotonic() < deadline:
        store.flush()
        time.sleep(0.1)
    stats = store.stats()
    store.close()
    return stats


def test_a_scope_lives_in_one_slot_and_its_counts_are_exact(cluster):
    store = open_store(StoreConfig(), cluster.url, "problem", "one-slot")
    assert isinstance(store, RedisLogitNgramStore) and isinstance(store.client, RedisCluster)
    steps = ngram_steps(0, 20)
    for step in steps:
        store.add(step)
    client = client_from_url(cluster.url)
    prefix = store.scope.prefix
    store.claim(3)
    store.flush()
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    assert len(keys) == 2  # the log and the claims
    slots = {client.keyslot(k) for k in keys}
    assert len(slots) == 1  # every key of the problem in one slot
    stats = store.stats()
    sent = sum(len(s) for s in steps)
    assert stats["flushed_updates"] == sent and stats["lost_updates"] == 0
    assert _stored(cluster.url, "one-slot") == sent
    assert scope_stats(client, prefix)["log_entries"] >= 1
    other = RedisScope("problem", "another").prefix
    assert len({client.keyslot(f"{other}x"), next(iter(slots))}) == 2  # scopes spread out


def test_lookups_see_what_another_store_wrote(cluster):
    writer = open_store(StoreConfig(), cluster.url, "problem", "shared")
    writer.add([NgramRow((1, 2, 3, 4), (7, 8), (0.75, 0.25))])
    writer.close()
    reader = open_store(StoreConfig(), cluster.url, "problem", "shared")  # replays the log
    entry = reader.lookup((9, 2, 3, 4))
    assert entry is not None and entry.ids == (7, 8) and entry.order == 3
    reader.clear()
    reader.close()
    assert not list(client_from_url(cluster.url).scan_iter(match="tts:{problem:shared}*"))


@pytest.mark.slow
def test_best_of_4_greedy_through_the_cluster_equals_the_in_process_store(cluster, smollm2):
    from tts_service.config import SamplingConfig
    from tts_service.drafters.stand_config import StandDrafterConfig
    from tts_service.solve import solve

    question = "List the even numbers from 2 to 20, then add them up step by step."
    ids = smollm2.encode(question, chat=True)
    greedy, stand = SamplingConfig(temperature=0, max_new_tokens=40), StandDrafterConfig()
    expect = solve(smollm2, ids, 4, stand, greedy, InMemoryNgramStore()).problems[0]
    store = open_problem_store(StoreConfig(), cluster.url, problem_id(ids))
    got = solve(smollm2, ids, 4, stand, greedy, store).problems[0]
    assert [t.output.token_ids for t in got.trajectories] == [
        t.output.token_ids for t in expect.trajectories
    ]
    stats = got.store_stats  # what went through the cluster, all of it stored
    assert stats["backend"] == "redis" and stats["round_trips"] > 0
    assert stats["flushed_updates"] > 0 and stats["lost_updates"] == 0


def _write_until(store: RedisLogitNgramStore, steps: list, done, what: str) -> None:
    """Add a step every 50 ms (a decoding step's pace) until `done()` (at most 30 s)."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        store.add(steps.pop(0))
        time.sleep(0.05)


def test_two_masters_killed_mid_run_are_replaced_and_nothing_is_lost_silently(cluster):
    """kill -9 of the master that owns the problem's slot, its replica takes over; the killed
    node comes back as the new master's replica, and that master is killed too. The store
    degrades, retries, and every row is stored exactly once or counted lost (asynchronous
    replication cannot lose an acknowledged row: a round trip counts only once a replica holds
    it, and the writer counts the replicas again as they come back)."""
    scope = RedisScope("problem", "failover")
    client = client_from_url(cluster.url)
    store = RedisLogitNgramStore(client, scope, retry_s=0.0)
    store._count_replicas()
    assert store._replicas == 1
    written = ngram_steps(1, 400)
    steps = list(written)
    owner = lambda: cluster.master_of(scope.log_key)  # noqa: E731
    first = owner()
    for _ in range(20):
        store.add(steps.pop(0))
    first.kill()
    _write_until(store, steps, lambda: owner().port != first.port, "the first failover")
    second = owner()
    first.start()  # back as the new master's replica
    cluster.wait_ok(nodes=[first])
    _write_until(store, steps, lambda: store._replicas == 1, "the writer to see the replica")
    second.kill()
    _write_until(store, steps, lambda: owner().port != second.port, "the second failover")
    for _ in range(20):
        store.add(steps.pop(0))
    stats = _drain_and_close(store)
    assert stats["errors"] >= 2 and stats["reconnects"] >= 2  # it failed over twice
    stored, lost = _stored(cluster.url, "failover"), stats["lost_updates"]
    sent = sum(len(s) for s in written[: len(written) - len(steps)])
    assert stored + lost == sent  # each row applied exactly once, or counted lost
    assert lost == 0  # the queue held everything until a replica took over
    second.start()  # the cluster whole again for the next test
    cluster.wait_ok()


def test_a_cluster_url_that_does_not_answer_is_a_clear_error():
    from store.redis_client import ping

    with pytest.raises(StoreUnavailableError, match="Redis"):
        ping("redis+cluster://127.0.0.1:9,127.0.0.1:10")
    with pytest.raises(ValueError, match="host:port"):
        client_from_url("redis+cluster://nohostport")
    assert isinstance(client_from_url("redis://127.0.0.1:9/0"), redis.Redis)


def test_the_problem_s_slot_resharded_mid_run_is_followed(cluster):
    """The problem's slot migrates to another master while the store writes (CLUSTER SETSLOT
    MIGRATING/IMPORTING, MIGRATE, then SETSLOT NODE): writes meanwhile are answered ASK or
    TRYAGAIN, then MOVED; the store retries, relearns the slots and ends with every row stored
    exactly once on the new owner."""
    scope = RedisScope("problem", "reshard")
    store = RedisLogitNgramStore(client_from_url(cluster.url), scope, retry_s=0.0)
    store._replicas = store._count_replicas()
    steps = ngram_steps(5, 40)
    for step in steps[:10]:
        store.add(step)
    key = scope.log_key
    source = cluster.master_of(key)
    masters = {cluster.master_of(f"{{k{i}}}").port for i in range(64)} - {source.port}
    target = next(n for n in cluster.live() if n.port == min(masters))
    src, dst = redis.Redis(port=source.port), redis.Redis(port=target.port)
    slot = src.execute_command("CLUSTER KEYSLOT", key)
    src_id, dst_id = (c.execute_command("CLUSTER MYID").decode() for c in (src, dst))
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 10_000)
    src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    for step in steps[10:20]:  # the slot half moved
        store.add(step)
    for node in cluster.live():  # the move completes: every master learns the owner
        client = redis.Redis(port=node.port)
        if client.info("replication")["role"] == "master":
            client.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    for step in steps[20:]:
        store.add(step)
    stats = _drain_and_close(store)
    assert cluster.master_of(key).port == target.port
    assert stats["errors"] >= 1  # it was redirected, and followed
    sent = sum(len(s) for s in steps)
    assert _stored(cluster.url, "reshard") == sent == stats["flushed_updates"]
    assert stats["lost_updates"] == 0


def test_a_cluster_down_at_start_is_a_local_store_until_it_answers():
    """`fallback`: a cluster that does not answer at start leaves the store degraded, drafting
    from its local cache; once the cluster is up, the next retry connects and flushes."""
    later = LocalRedisCluster(masters=3, replicas=1)  # its ports chosen, nothing started
    store = open_store(StoreConfig(fallback=True), later.url, "problem", "late")
    steps = ngram_steps(7, 10)
    store.add(steps[0])
    assert store.stats()["degraded"] and store.stats()["fallbacks"] == 1
    assert store.lookup(steps[0][0].context) is not None  # the local cache serves
    with later:
        store.retry_s = 0.0
        for step in steps[1:]:
            store.add(step)
        stats = _drain_and_close(store)
        assert not stats["degraded"] and stats["reconnects"] == 1
        sent = sum(len(s) for s in steps)
        assert _stored(later.url, "late") == sent
    with pytest.raises(StoreUnavailableError):  # without fallback: a clear error at once
        open_store(StoreConfig(), later.url, "problem", "late")
