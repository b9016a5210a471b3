"""The Redis store against a real redis-server started on a free loopback port."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import socket
import time

import pytest
import redis

from store.base import NgramRow
from store.config import StoreConfig
from store.factory import open_store
from store.local_server import LocalRedisServer, RedisServerError, free_port
from store.memory import InMemoryNgramStore, TieredStore
from store.redis_client import StoreUnavailableError, scope_stats
from store.redis_store import FLUSH_ROWS, RedisLogitNgramStore, RedisScope
from tts_service.cli import main


def _rows(seed: int, steps: int, per_step: int = 3) -> list[list[NgramRow]]:
    """Overlapping contexts (a small alphabet) and > 10 ids per key, so truncation matters."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(per_step):
            ctx = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 6)))
            ids = rng.sample(range(30), 10)
            probs = sorted((rng.random() for _ in ids), reverse=True)
            total = sum(probs)
            step.append(NgramRow(ctx, tuple(ids), tuple(p / total for p in probs)))
        out.append(step)
    return out


def _store(url: str, scope_id: str, **kw) -> RedisLogitNgramStore:
    return RedisLogitNgramStore.connect(url, scope=RedisScope("problem", scope_id), **kw)


def _read_through(store: RedisLogitNgramStore, context):
    """A cold lookup misses (no network wait), the next round trip fetches it."""
    store.lookup(context)
    store.flush()
    return store.lookup(context)


def _assert_same(redis_store, reference: InMemoryNgramStore, contexts) -> None:
    for ctx in contexts:
        got, want = _read_through(redis_store, ctx), reference.lookup(ctx)
        assert (got is None) == (want is None), ctx
        if want is not None:
            assert got.ids == want.ids and got.count == want.count and got.order == want.order
            assert got.probs == pytest.approx(want.probs, abs=1e-9)


def _all_contexts():
    return [
        tuple(c) for n in range(1, 5) for c in __import__("itertools").product(range(4), repeat=n)
    ]


def test_round_trip_merge_and_lookup_equal_the_in_process_store(redis_server):
    writer = _store(redis_server.url, "roundtrip")
    reference = InMemoryNgramStore(merge="sum")
    for step in _rows(0, 40):
        writer.add(step)
        reference.add(step)
    _assert_same(_store(redis_server.url, "roundtrip"), reference, _all_contexts())
    assert writer.stats()["round_trips"] == 41 and not writer.stats()["degraded"]  # warm + 40


def _writer(url: str, seed: int) -> None:
    store = _store(url, "concurrent")
    for step in _rows(seed, 30):
        store.add(step)


def test_concurrent_writers_equal_a_sequential_merge(redis_server):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(redis_server.url, seed)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    reference = InMemoryNgramStore(merge="sum")
    for seed in range(4):
        for step in _rows(seed, 30):
            reference.add(step)
    _assert_same(_store(redis_server.url, "concurrent"), reference, _all_contexts())


def test_ttl_cap_stats_and_clear(redis_server):
    url = redis_server.url
    store = RedisLogitNgramStore.connect(
        url, scope=RedisScope("job", "capped", ttl_s=100, max_entries=5), max_order=1
    )
    for t in range(9):
        store.add([NgramRow((t,), (1,), (1.0,))])
    client = redis.Redis.from_url(url)
    keys = [k for k in client.scan_iter(match="tts:{job:capped}:1:*")]
    assert len(keys) == 5  # the oldest four were evicted
    assert 0 < client.ttl(keys[0]) <= 100
    assert main(["store", "stats", "--scope", "job", "--id", "capped", "--store", url]) == 0
    assert main(["store", "clear", "--scope", "job", "--id", "capped", "--store", url]) == 0
    assert not list(client.scan_iter(match="tts:{job:capped}:*"))


def test_store_cli_reports_counts(redis_server, capsys):
    url = redis_server.url
    store = _store(url, "cli")
    store.add([NgramRow((1, 2), (3,), (1.0,))])
    assert main(["store", "stats", "--scope", "problem", "--id", "cli", "--store", url]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entries"] == 2 and out["entries_by_order"] == {"1": 1, "2": 1}
    assert main(["store", "stats", "--store", "http://nope"]) == 2


def test_store_cli_stats_of_every_scope_count_every_scope(capsys):
    """`tts store stats` defaults to --scope all: the keys of every scope count."""
    with LocalRedisServer() as server:
        _store(server.url, "p1").add([NgramRow((1, 2), (3,), (1.0,))])
        job = RedisLogitNgramStore.connect(server.url, scope=RedisScope("job", "j/p"))
        job.add([NgramRow((4, 5, 6), (7,), (1.0,)), NgramRow((5, 6), (8,), (1.0,))])
        assert main(["store", "stats", "--store", server.url]) == 0
        out = json.loads(capsys.readouterr().out)
    assert out["entries"] == 2 + 3 and out["entries_by_order"] == {"1": 2, "2": 2, "3": 1}
    assert out["applied_updates"] == 3


def test_close_pushes_the_whole_queue_and_a_tiered_store_leaves_its_global_scope_open(
    redis_server,
):
    """`add` pushes one batch of FLUSH_ROWS rows; `close` pushes the rest. A tiered store
    closes its problem scope, not the global one, which the next problem shares.
    The counters have no TTL while a writer may still write, and the scope's once it closed."""
    url, cfg = redis_server.url, StoreConfig(ttl_s=100)
    problem, global_ = (open_store(cfg, url, s, f"close-{s}") for s in ("problem", "global"))
    store = TieredStore(problem, global_)
    store.add([NgramRow((t,), (1,), (1.0,)) for t in range(3 * FLUSH_ROWS)])
    client = redis.Redis.from_url(url)
    applied = problem.scope.meta_keys[1]
    assert client.ttl(applied) == -1  # a writer is active: never evicted
    store.close()
    s = store.stats()
    assert (
        s["problem"]["flushed_updates"] == 3 * FLUSH_ROWS and s["problem"]["pending_updates"] == 0
    )
    assert s["global"]["flushed_updates"] == FLUSH_ROWS  # add's batch: the rest waits
    assert scope_stats(client, problem.scope.prefix)["applied_updates"] == 3 * FLUSH_ROWS
    assert 0 < client.ttl(applied) <= 100
    global_.close()
    assert global_.stats()["flushed_updates"] == 3 * FLUSH_ROWS
    assert s["problem"]["lost_updates"] == global_.stats()["lost_updates"] == 0


def test_unreachable_at_start_is_a_clear_error_or_a_counted_fallback():
    from store.local_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        RedisLogitNgramStore.connect(url)
    store = RedisLogitNgramStore.connect(url, fallback=True)
    store.add([NgramRow((1,), (2,), (1.0,))])
    assert store.lookup([1]).ids == (2,)  # served from the local cache
    s = store.stats()
    assert s["degraded"] and s["fallbacks"] == 1 and s["pending_updates"] == 1


def test_redis_dying_and_coming_back_loses_no_update(tmp_path):
    server = LocalRedisServer(data_dir=tmp_path / "d").start()
    try:
        store = _store(server.url, "faults", retry_s=0.0)
        store.add([NgramRow((1,), (2,), (1.0,))])
        server.kill()
        store.add([NgramRow((1,), (3,), (1.0,))])  # Redis is gone: no exception
        store.add([NgramRow((5,), (6,), (1.0,))])
        assert store.stats()["degraded"] and store.stats()["pending_updates"] == 2
        assert store.lookup([5]).ids == (6,)  # drafting goes on from the local cache
        server = LocalRedisServer(data_dir=tmp_path / "d", port=server.port).start()
        store.flush()  # reconnects and flushes the queue
        s = store.stats()
        assert not s["degraded"] and s["reconnects"] == 1 and s["pending_updates"] == 0
        fresh = _store(server.url, "faults")
        assert _read_through(fresh, [5]).ids == (6,)
        assert _read_through(fresh, [1]).count == 1  # the update made while Redis was down
    finally:
        server.stop()


def test_persistence_lets_a_restarted_server_start_warm(tmp_path):
    server = LocalRedisServer(data_dir=tmp_path / "aof", appendonly=True).start()
    _store(server.url, "warm").add([NgramRow((7, 8), (9,), (1.0,))])
    server.stop()  # a clean shutdown, as a service restart does
    time.sleep(0.1)
    server = LocalRedisServer(data_dir=tmp_path / "aof", port=server.port, appendonly=True)
    server.start()
    try:
        assert _read_through(_store(server.url, "warm"), [7, 8]).ids == (9,)
    finally:
        server.stop()


def test_a_server_whose_port_was_taken_meanwhile_starts_on_a_fresh_one(tmp_path):
    """Another process may bind the port between its choice and redis-server's start (CI saw it
    on a cluster node); the server then moves to a fresh port, and a fixed port says why not."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken, free_port()])
    try:
        with LocalRedisServer(pick_port=lambda: next(picks)) as server:
            assert server.port != taken
            assert redis.Redis(port=server.port).ping()
        with pytest.raises(RedisServerError, match=f"port {taken} exited.*(in use|bind)"):
            LocalRedisServer(data_dir=tmp_path / "d", port=taken).start()
    finally:
        squatter.close()
    # the port's holder is another redis-server, which answers pings: not taken for ours
    with LocalRedisServer() as other:
        picks = iter([other.port, free_port()])
        with LocalRedisServer(pick_port=lambda: next(picks)) as server:
            assert server.port != other.port and server.proc is not None
            assert server.proc.poll() is None
            pid = redis.Redis(port=server.port).info("server")["process_id"]
            assert pid == server.proc.pid
