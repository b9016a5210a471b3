"""Exactly once, or reported lost: the Redis store against a hung server (SIGSTOP), a crash
(kill -9) and a full one (maxmemory), each a real redis-server on a loopback port.

What reached the log is read the way another process reads it (`tests.conftest.logged_rows`: a
store that opens the scope and replays its log), never from the writer's counters: each row adds
1 to exactly one 1-gram's count.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from store.local_server import LocalRedisServer
from store.redis_store import RedisLogitNgramStore, RedisScope
from tests.conftest import logged_rows, ngram_steps

ROWS = 3  # rows per decoding step
TIMEOUT_S = 0.3  # the client's socket timeout: a hung server times a round trip out fast


def _store(url: str, scope_id: str, **kw) -> RedisLogitNgramStore:
    """A store that retries at once, over a client that gives up after `TIMEOUT_S`."""
    client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    return RedisLogitNgramStore(client, RedisScope("problem", scope_id), **{"retry_s": 0.0, **kw})


def _drain(store: RedisLogitNgramStore) -> None:
    """Wait until the writer has appended everything queued (the test's own bounded wait)."""
    deadline = time.monotonic() + 10
    while store.stats()["pending_updates"] and time.monotonic() < deadline:
        store.flush()


def _settle(url: str, store: RedisLogitNgramStore) -> None:
    """Wait until the server has read every connection the store gave up on, so that the
    appends left in their sockets have run (or never will)."""
    store.client.connection_pool.disconnect()
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while client.info("clients")["connected_clients"] > 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def test_an_append_that_timed_out_on_a_hung_server_is_applied_once():
    """SIGSTOP: every append times out, and its copy waits in the server's socket; each retry
    sends another. When the server resumes, all copies land in the log: a reader applies one."""
    steps = ngram_steps(0, 12)
    with LocalRedisServer() as server:
        store = _store(server.url, "sigstop")
        for step in steps[:4]:
            store.add(step)
        _drain(store)
        server.send_signal(signal.SIGSTOP)
        try:
            for step in steps[4:8]:
                store.add(step)  # never waits: the writer's appends time out and are resent
            time.sleep(1.0)
        finally:
            server.send_signal(signal.SIGCONT)
        for step in steps[8:]:
            store.add(step)
        _drain(store)
        _settle(server.url, store)
        s = store.stats()
        assert s["errors"] >= 1 and s["reconnects"] >= 1 and s["pending_updates"] == 0
        assert s["flushed_updates"] == ROWS * len(steps)
        assert logged_rows(server.url, "sigstop") == (ROWS * 12, ROWS * 12)
        store.close()


def test_an_append_that_landed_just_before_a_kill_9_is_not_applied_again(tmp_path):
    """The append times out on a hung server, runs when it resumes, and the server dies before
    the retry; the restarted server (AOF) holds it, and the retry adds a copy that readers
    skip."""
    steps = ngram_steps(1, 8)
    server = LocalRedisServer(data_dir=tmp_path / "aof", appendonly=True).start()
    try:
        store = _store(server.url, "kill9", retry_s=5.0)  # one try while hung, then a wait
        for step in steps[:3]:
            store.add(step)
        _drain(store)
        server.send_signal(signal.SIGSTOP)
        try:
            store.add(steps[3])
            time.sleep(2 * TIMEOUT_S)  # its append timed out
        finally:
            server.send_signal(signal.SIGCONT)
        _settle(server.url, store)
        time.sleep(1.1)  # appendfsync everysec
        assert logged_rows(server.url, "kill9") == (4 * ROWS, 4 * ROWS)  # the append ran
        server.kill()
        server = LocalRedisServer(data_dir=tmp_path / "aof", port=server.port, appendonly=True)
        server.start()
        store.retry_s = 0.0
        for step in steps[4:]:
            store.add(step)  # the writer resends the timed-out batch first
        _drain(store)
        s = store.stats()
        assert s["pending_updates"] == 0 and s["flushed_updates"] == ROWS * len(steps)
        reader = RedisLogitNgramStore.connect(server.url, scope=RedisScope("problem", "kill9"))
        r = reader.stats()
        assert r["remote_updates"] == ROWS * len(steps) and r["duplicate_updates"] == ROWS
        store.close()
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_a_full_server_refuses_appends_loudly_or_evicts_old_logs(policy, capsys):
    """maxmemory with room for about half the run: `noeviction` refuses appends, and what is
    refused until close is reported lost; `volatile-lru` (recommended: every key of the store
    has a TTL) refuses nothing and evicts."""
    steps = ngram_steps(2, 3000)
    with LocalRedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("maxmemory-policy", policy)
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 600_000)
        store = _store(server.url, policy, close_timeout_s=0.5, retry_s=0.2)
        for i, step in enumerate(steps):
            store.add(step)
            if i % 100 == 0:
                store.flush()
        store.close()
        s = store.stats()
        err = capsys.readouterr().err
        assert s["flushed_updates"] + s["lost_updates"] == ROWS * len(steps)
        assert s["pending_updates"] == 0
        if policy == "noeviction":
            assert s["lost_updates"] > 0 and s["errors"] > 0
            applied, counted = logged_rows(server.url, policy)
            assert applied == counted == s["flushed_updates"]  # nothing evicted or doubled
            assert f"LOST {s['lost_updates']} updates" in err and "volatile-lru" in err
        else:
            assert s["lost_updates"] == 0 and "LOST" not in err
            assert admin.info("stats")["evicted_keys"] > 0


def test_close_waits_a_bounded_time_for_a_hung_server_and_reports_the_loss(capsys):
    """A server hung for longer than `close_timeout_s`: close returns in about that time plus
    one socket timeout, and says how many updates never got in."""
    with LocalRedisServer() as server:
        store = _store(server.url, "hung", close_timeout_s=0.5)
        store.add(ngram_steps(3, 1)[0])
        _drain(store)
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
