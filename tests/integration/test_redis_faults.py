"""Exactly once, or reported lost (issue 16): the Redis store against a hung server (SIGSTOP),
a crash (kill -9) and a full one (maxmemory), each a real redis-server on a loopback port.

What was stored is read from the data, not from the store's counters: every row adds 1 to the
count `_n` of exactly one 1-gram key (its context's last token).
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from store.local_server import LocalRedisServer
from store.redis_client import scope_stats
from store.redis_store import RedisLogitNgramStore, RedisScope
from tests.conftest import ngram_steps

ROWS = 3  # rows per decoding step
TIMEOUT_S = 0.3  # the client's socket timeout: a hung server times a round trip out fast


def _store(url: str, scope_id: str, **kw) -> RedisLogitNgramStore:
    """A store that retries at every step, over a client that gives up after `TIMEOUT_S`."""
    client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    return RedisLogitNgramStore(client, RedisScope("problem", scope_id), **{"retry_s": 0.0, **kw})


def _stored(url: str, scope_id: str) -> int:
    """Rows stored in the scope: the sum of its 1-gram counts."""
    client = redis.Redis.from_url(url)
    return sum(
        int(client.hget(key, "_n"))
        for key in client.scan_iter(match=f"tts:{{problem:{scope_id}}}:1:*", count=1000)
    )


def _drain(store: RedisLogitNgramStore) -> None:
    """Flush until the queue is empty (the test's own bounded wait)."""
    deadline = time.monotonic() + 10
    while store.stats()["pending_updates"] and time.monotonic() < deadline:
        store.flush()


def _settle(url: str, store: RedisLogitNgramStore) -> None:
    """Wait until the server has read every connection the store gave up on, so that the
    batches left in their sockets have run (or never will)."""
    store.client.connection_pool.disconnect()
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while client.info("clients")["connected_clients"] > 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_batch_that_timed_out_on_a_hung_server_is_stored_once():
    """SIGSTOP: every round trip times out, and its batch waits in the server's socket; each
    retry sends it again. When the server resumes, all copies run: one may apply."""
    steps = ngram_steps(0, 12)
    with LocalRedisServer() as server:
        store = _store(server.url, "sigstop")
        for step in steps[:4]:
            store.add(step)
        server.send_signal(signal.SIGSTOP)
        try:
            for step in steps[4:8]:
                store.add(step)  # times out: queued, and retried with the next step
        finally:
            server.send_signal(signal.SIGCONT)
        for step in steps[8:]:
            store.add(step)
        _drain(store)
        _settle(server.url, store)
        s = store.stats()
        assert s["errors"] == 4 and s["reconnects"] == 1 and s["pending_updates"] == 0
        assert _stored(server.url, "sigstop") == s["flushed_updates"] == ROWS * len(steps)
        prefix = store.scope.prefix
        assert scope_stats(redis.Redis.from_url(server.url), prefix)["applied_updates"] == ROWS * 12


def test_a_batch_that_landed_just_before_a_kill_9_is_not_stored_again(tmp_path):
    """The batch times out on a hung server, runs when it resumes, and the server dies before
    the retry: the restarted server (AOF) must remember that the batch is in."""
    steps = ngram_steps(1, 8)
    server = LocalRedisServer(data_dir=tmp_path / "aof", appendonly=True).start()
    try:
        store = _store(server.url, "kill9")
        for step in steps[:3]:
            store.add(step)
        server.send_signal(signal.SIGSTOP)
        try:
            store.add(steps[3])  # times out
        finally:
            server.send_signal(signal.SIGCONT)
        _settle(server.url, store)
        assert _stored(server.url, "kill9") == 4 * ROWS  # the timed-out batch ran
        server.kill()
        server = LocalRedisServer(data_dir=tmp_path / "aof", port=server.port, appendonly=True)
        server.start()
        for step in steps[4:]:
            store.add(step)  # the first resends the timed-out batch
        _drain(store)
        s = store.stats()
        assert s["pending_updates"] == 0
        assert _stored(server.url, "kill9") == s["flushed_updates"] == ROWS * len(steps)
        assert s["duplicate_updates"] == ROWS
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_a_full_server_refuses_updates_loudly_or_evicts_old_ones(policy, capsys):
    """maxmemory with room for about half the run: `noeviction` refuses writes, and what is
    refused until close is reported lost; `volatile-lru` (recommended) refuses nothing."""
    steps = ngram_steps(2, 300)
    with LocalRedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("maxmemory-policy", policy)
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 600_000)
        store = _store(server.url, policy, close_timeout_s=0.2, retry_s=0.2)
        for step in steps:
            store.add(step)
        store.close()
        s = store.stats()
        err = capsys.readouterr().err
        applied = scope_stats(admin, store.scope.prefix)["applied_updates"]
        assert applied == s["flushed_updates"]  # stored == flushed
        assert s["flushed_updates"] + s["lost_updates"] == ROWS * len(steps)
        assert s["pending_updates"] == 0
        if policy == "noeviction":
            assert s["lost_updates"] > 0 and s["errors"] > 0
            assert _stored(server.url, policy) == applied  # nothing evicted, nothing doubled
            assert f"LOST {s['lost_updates']} updates" in err and "volatile-lru" in err
        else:
            assert s["lost_updates"] == 0 and s["errors"] == 0 and "LOST" not in err
            assert admin.info("stats")["evicted_keys"] > 0


def test_close_waits_a_bounded_time_for_a_hung_server_and_reports_the_loss(capsys):
    """A server hung for longer than `close_timeout_s`: close returns in about that time plus
    one socket timeout, and says how many updates never got in."""
    with LocalRedisServer() as server:
        store = _store(server.url, "hung", close_timeout_s=0.5)
        store.add(ngram_steps(3, 1)[0])
        server.send_signal(signal.SIGSTOP)
        try:
            store.add(ngram_steps(4, 1)[0])
            start = time.monotonic()
            store.close()
            took = time.monotonic() - start
        finally:
            server.send_signal(signal.SIGCONT)
        s = store.stats()
        assert took < 0.5 + 2 * TIMEOUT_S
        assert s["lost_updates"] == ROWS and s["pending_updates"] == 0
        assert f"LOST {ROWS} updates of {store.scope.prefix}" in capsys.readouterr().err
