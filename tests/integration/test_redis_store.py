"""The Redis store (a local replica per process, replicated through the scope's log) against a
real redis-server started on a free loopback port."""

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
from store.redis_client import StoreUnavailableError
from store.redis_store import FLUSH_ROWS, RedisLogitNgramStore, RedisScope
from tests.conftest import logged_rows
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


def _all_contexts():
    return [
        tuple(c) for n in range(1, 5) for c in __import__("itertools").product(range(4), repeat=n)
    ]


def _assert_same(store, reference, contexts, exact: bool = True) -> None:
    """Every lookup as the reference's: ids, count and order (`exact`: the probabilities bit
    for bit; else the counts only, which do not depend on the order rows merged in)."""
    for ctx in contexts:
        got, want = store.lookup(ctx), reference.lookup(ctx)
        assert (got is None) == (want is None), ctx
        if want is not None:
            assert got.count == want.count and got.order == want.order, ctx
            if exact:
                assert got.ids == want.ids and got.probs == want.probs, ctx


def test_a_writer_s_replica_and_a_late_reader_s_equal_the_in_process_store(redis_server):
    """One writer: its own replica, and a process that opens the scope after it (replaying the
    log), hold exactly what the in-process store holds after the same rows."""
    writer = _store(redis_server.url, "roundtrip")
    reference = InMemoryNgramStore()
    for step in _rows(0, 40):
        writer.add(step)
        reference.add(step)
    _assert_same(writer, reference, _all_contexts())
    writer.flush()
    s = writer.stats()
    assert s["flushed_updates"] == 120 and s["pending_updates"] == 0 and not s["degraded"]
    late = _store(redis_server.url, "roundtrip")
    _assert_same(late, reference, _all_contexts())
    assert late.stats()["remote_updates"] == 120 and late.stats()["duplicate_updates"] == 0


def test_a_running_reader_merges_what_another_process_learns(redis_server):
    """Two stores open at once: what one learns reaches the other's replica through its reader
    thread (no call on the other's side but its next merge), with the lag measured at a
    step's merge."""
    a, b = _store(redis_server.url, "live"), _store(redis_server.url, "live")
    reference = InMemoryNgramStore()
    for step in _rows(1, 20):
        a.add(step)
        reference.add(step)
    a.flush()
    assert b.catch_up()
    _assert_same(b, reference, _all_contexts())
    assert b.stats()["remote_updates"] == 60 and b.stats()["lag_ms_p99"] is None  # no step yet
    a.add([NgramRow((2, 2), (9,), (1.0,))])
    a.flush()
    deadline = time.monotonic() + 5
    while not b._inbox and time.monotonic() < deadline:
        time.sleep(0.005)
    b.add([NgramRow((3, 3), (7,), (1.0,))])  # a step's merge: the other's rows first
    s = b.stats()
    assert s["remote_updates"] == 61 and s["lag_ms_p99"] is not None and s["lag_ms_p99"] < 5000
    b.flush()  # and back the other way
    assert a.catch_up() and a.lookup([3, 3]).count == reference.lookup([3, 3]).count + 1


def _writer(url: str, seed: int) -> None:
    store = _store(url, "concurrent")
    for step in _rows(seed, 30):
        store.add(step)
    store.close()


def test_concurrent_writers_reach_every_reader_once(redis_server):
    """Four processes write at once; a reader applies each of their rows exactly once: its
    counts (which do not depend on the order rows merged in) equal a sequential merge's."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(redis_server.url, seed)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    reference = InMemoryNgramStore()
    for seed in range(4):
        for step in _rows(seed, 30):
            reference.add(step)
    reader = _store(redis_server.url, "concurrent")
    _assert_same(reader, reference, _all_contexts(), exact=False)
    assert reader.stats()["remote_updates"] == 4 * 30 * 3
    assert logged_rows(redis_server.url, "concurrent") == (360, 360)


def test_the_log_is_capped_and_expires_and_a_late_reader_counts_what_was_trimmed(redis_server):
    url = redis_server.url
    scope = RedisScope("job", "capped", ttl_s=100, log_entries=100)
    store = RedisLogitNgramStore.connect(url, scope=scope, max_order=1)
    for t in range(600):
        store.add([NgramRow((t,), (1,), (1.0,))])
        store.flush()  # one entry each
    client = redis.Redis.from_url(url)
    assert 100 <= client.xlen(scope.log_key) < 300  # trimmed (approximately, as Redis does)
    assert 0 < client.ttl(scope.log_key) <= 100
    late = RedisLogitNgramStore.connect(url, scope=scope, max_order=1)
    s = late.stats()
    assert s["remote_updates"] == client.xlen(scope.log_key)
    assert s["missed_batches"] == 600 - s["remote_updates"]  # counted, never silent
    assert main(["store", "stats", "--scope", "job", "--id", "capped", "--store", url]) == 0
    assert main(["store", "clear", "--scope", "job", "--id", "capped", "--store", url]) == 0
    assert not list(client.scan_iter(match="tts:{job:capped}:*"))


def test_store_cli_reports_the_logs_of_every_scope(capsys):
    """`tts store stats` (default --scope all): every scope's log and claims."""
    with LocalRedisServer() as server:
        problem = _store(server.url, "p1")
        problem.add([NgramRow((1, 2), (3,), (1.0,))])
        problem.claim(5)
        problem.flush()
        job = RedisLogitNgramStore.connect(server.url, scope=RedisScope("job", "j/p"))
        job.add([NgramRow((4, 5, 6), (7,), (1.0,)), NgramRow((5, 6), (8,), (1.0,))])
        job.flush()
        assert main(["store", "stats", "--store", server.url]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["scopes"] == 2 and out["log_entries"] == 2 and out["claims"] == 1
        assert out["log_bytes"] > 0
        one = ["store", "stats", "--scope", "problem", "--id", "p1", "--store", server.url]
        assert main(one) == 0
        assert json.loads(capsys.readouterr().out)["log_entries"] == 1
    assert main(["store", "stats", "--store", "http://nope"]) == 2


def test_close_pushes_the_whole_queue_and_a_tiered_store_leaves_its_global_scope_open(
    redis_server,
):
    """`close` appends everything queued (in entries of at most FLUSH_ROWS rows). A tiered
    store closes its problem scope, not the global one, which the next problem shares."""
    url, cfg = redis_server.url, StoreConfig(ttl_s=100)
    problem, global_ = (open_store(cfg, url, s, f"close-{s}") for s in ("problem", "global"))
    store = TieredStore(problem, global_)
    store.add([NgramRow((t,), (1,), (1.0,)) for t in range(3 * FLUSH_ROWS)])
    store.close()
    s = store.stats()
    assert s["problem"]["flushed_updates"] == 3 * FLUSH_ROWS
    assert s["problem"]["pending_updates"] == 0 and s["problem"]["lost_updates"] == 0
    assert global_._threads  # still running: its owner closes it
    global_.close()
    assert global_.stats()["flushed_updates"] == 3 * FLUSH_ROWS
    assert logged_rows(url, "close-problem")[0] == 3 * FLUSH_ROWS
    assert logged_rows(url, "close-global", "global")[0] == 3 * FLUSH_ROWS


def test_unreachable_at_start_is_a_clear_error_or_a_counted_fallback():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        RedisLogitNgramStore.connect(url)
    store = RedisLogitNgramStore.connect(url, fallback=True)
    store.add([NgramRow((1,), (2,), (1.0,))])
    assert store.lookup([1]).ids == (2,)  # the local replica serves
    s = store.stats()
    assert s["degraded"] and s["fallbacks"] == 1 and s["pending_updates"] == 1
    store.close_timeout_s = 0.1
    store.close()


def test_redis_dying_and_coming_back_loses_no_update(tmp_path):
    server = LocalRedisServer(data_dir=tmp_path / "d").start()
    try:
        store = _store(server.url, "faults", retry_s=0.05)
        store.add([NgramRow((1,), (2,), (1.0,))])
        store.flush()
        server.kill()
        store.add([NgramRow((1,), (3,), (1.0,))])  # Redis is gone: no exception, no wait
        store.add([NgramRow((5,), (6,), (1.0,))])
        assert store.lookup([5]).ids == (6,)  # drafting goes on from the local replica
        deadline = time.monotonic() + 10
        while not store.stats()["degraded"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.stats()["pending_updates"] == 2
        server = LocalRedisServer(data_dir=tmp_path / "d", port=server.port).start()
        deadline = time.monotonic() + 10
        while store.stats()["pending_updates"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer retries on its own, every retry_s
        s = store.stats()
        assert not s["degraded"] and s["reconnects"] >= 1 and s["pending_updates"] == 0
        fresh = _store(server.url, "faults")
        assert fresh.lookup([5]).ids == (6,)
        assert fresh.lookup([1]).count == 1  # the server lost the first (no persistence) ...
        assert fresh.stats()["missed_batches"] == 1  # ... and a reader counts what it lacks
    finally:
        server.stop()


def test_persistence_lets_a_restarted_server_start_warm(tmp_path):
    server = LocalRedisServer(data_dir=tmp_path / "aof", appendonly=True).start()
    store = _store(server.url, "warm")
    store.add([NgramRow((7, 8), (9,), (1.0,))])
    store.close()
    server.stop()  # a clean shutdown, as a service restart does
    time.sleep(0.1)
    server = LocalRedisServer(data_dir=tmp_path / "aof", port=server.port, appendonly=True)
    server.start()
    try:
        assert _store(server.url, "warm").lookup([7, 8]).ids == (9,)
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


def test_the_compiled_drafters_draft_over_a_redis_store(redis_server):
    """One drafting stack: a Redis store is indexed like the in-process one (its local
    replica), so `stand` and `stand-dyn` run their compiled kernels over it."""
    from tts_service.drafters import stand, stand_dyn
    from tts_service.drafters.stand_config import StandDrafterConfig
    from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig

    store = _store(redis_server.url, "compiled")
    assert store.compiled() is store.index
    assert stand_dyn.compiled_applies(StandDynDrafterConfig(), store)
    assert stand.compiled_applies(StandDrafterConfig(), store)
