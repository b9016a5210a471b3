"""The shared store: an in-process index every process drafts from, kept in step with the
other processes' through a replication log in Redis (docs/store.md).

Each store holds a local replica (`ReplicaIndex`, a `store.index.StoreIndex`: the compiled
drafters read its arrays) and merges what its rows learn into it at once, exactly as the
in-process store does. What it learns is appended to the scope's log (`store.redis_log`, one
Redis Stream per scope) by a writer thread, and what the other processes append comes back
through a reader thread blocked on the log; the decode thread merges it into the replica at its
next merge (the step's deferred observation). The step never waits on the network.

Exactly once. A batch goes in the log as (writer id, number); the writer resends it until the
server acknowledges it (and, on a cluster node with replicas, until a replica holds it: WAIT),
so a retried append may be logged twice; every reader applies a writer's numbers in order and
skips one it has applied. A reader counts every row it applied from others (`remote_updates`),
every copy it skipped (`duplicate_updates`) and every batch a trimmed log no longer held when it
read (`missed_batches`).

Keys: `tts:{<scope>:<scope_id>}:log` (the Stream, capped at `RedisScope.log_entries` entries,
trimmed approximately, with the scope's TTL) and `..:_claims` (a Set of verify keys). The braces
are a Redis Cluster hash tag: a scope's keys live on one node.

Faults. If Redis goes away the replica keeps drafting and learning, the writer queues (bounded,
`max_pending` rows: past it the oldest are dropped and counted in `lost_updates`) and retries
every `retry_s`; the reader resumes from the last entry it read. A late reader (an actor opening
a problem in flight) replays the log from its start. Replicas agree up to the order rows merge
in: STAND's running mean truncates after every update, so two replicas that merged the same rows
in a different order may differ in the tail of an entry (drafting quality only: a draft never
changes what is committed).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import redis
from redis.cluster import RedisCluster

from store.base import NgramEntry, NgramRow
from store.index import StoreIndex
from store.redis_client import ERRORS, Client, StoreUnavailableError, client_from_url, delete_scope
from store.redis_log import LogRows, concat_rows, decode_rows, encode_rows

log = logging.getLogger(__name__)

FLUSH_ROWS = 4096  # rows per appended entry: a long outage's queue drains in bounded entries
WAIT_MS = 50  # how long a cluster append waits for a replica to hold it (Redis WAIT)
RECOUNT_S = 1.0  # how often the writer asks a cluster node how many replicas it has
READ_COUNT = 256  # entries per read
BLOCK_MS = 1000  # how long the reader's XREAD waits for a new entry
LINGER_S = 0.002  # how long the writer, woken by a row, waits for the step's other rows


@dataclass(frozen=True)
class RedisScope:
    """Where a scope's log lives and how long: `scope` is job, problem or global."""

    scope: str = "problem"
    scope_id: str = "default"
    ttl_s: int | None = 24 * 3600
    max_entries: int = 1_000_000  # the local replica's n-gram cap (least recently updated go)
    log_entries: int = 100_000  # the log's cap (entries, one a writer's round trip)

    @property
    def prefix(self) -> str:
        return f"tts:{{{self.scope}:{self.scope_id}}}:"  # a cluster hash tag: one slot

    @property
    def log_key(self) -> str:
        return f"{self.prefix}log"

    @property
    def claims_key(self) -> str:
        return f"{self.prefix}_claims"


@dataclass(frozen=True)
class Batch:
    """Rows appended as one log entry, numbered once and resent unchanged until acknowledged."""

    seq: int
    rows: int
    learned_at: float
    data: bytes


class ReplicaIndex(StoreIndex):
    """A `StoreIndex` whose own merges are also queued for the log, and which first merges what
    the log brought from the others (on the thread that merges: the decode thread)."""

    def __init__(self, owner: RedisLogitNgramStore, max_order: int, topk: int, cap: int) -> None:
        super().__init__(max_order, topk, cap)
        self.owner = owner

    def add_arrays(self, ctx, clen, row_ids, row_p, row_n) -> None:
        """Merge, and queue for the log: the arrays are handed over (every caller builds them
        for this call: `StoreIndex.add`, `drafters.store_feed.feed_index`)."""
        self.owner.merge_remote(drafting=True)
        super().add_arrays(ctx, clen, row_ids, row_p, row_n)
        self.owner.queue(LogRows(ctx, clen, row_ids, row_p, row_n))

    def merge(self, rows: LogRows) -> None:
        """Rows another process learned: merged here, never logged again."""
        super().add_arrays(*rows)


class RedisLogitNgramStore:
    """`NgramStore` over Redis: a local replica, replicated through the scope's log."""

    def __init__(
        self,
        client: Client | None,
        scope: RedisScope = RedisScope(),
        max_order: int = 4,
        topk: int = 10,
        max_pending: int = 100_000,
        retry_s: float = 1.0,
        close_timeout_s: float = 5.0,
        connect: Callable[[], Client] | None = None,
    ) -> None:
        if client is None and connect is None:
            raise ValueError("a client, or how to connect one")
        self.client = client  # None: not connected yet (`connect` makes it at a retry)
        self._connect = connect
        self.scope = scope
        self.max_order, self.topk = max_order, topk
        self.max_pending, self.retry_s = max_pending, retry_s
        self.close_timeout_s = close_timeout_s
        self.index = ReplicaIndex(self, max_order, topk, scope.max_entries)
        self._queued: deque[tuple[LogRows, float]] = deque()  # learned here, not yet in a batch
        self._queued_rows = 0
        self._unacked: list[Batch] = []  # appended, not acknowledged: resent as they are
        self._inbox: deque[tuple[LogRows, float]] = deque()  # read, not yet merged
        self._writer = uuid.uuid4().hex.encode()
        self._seq = 0
        self._seen: dict[bytes, int] = {}  # writer id -> last batch number applied
        self._last_id = b"0-0"  # the last log entry read
        self._claims: dict[int, bool | None] = {}  # verify key -> the server's answer
        self._claimed: set[int] = set()  # keys a row of this process claimed
        self._urgent = False  # claims wait for no linger
        self._unsent_claims: list[int] = []
        self._replicas = 0  # a cluster node's replicas: appends wait until one holds them
        self._recount_at = 0.0  # when the writer counts them again (monotonic)
        self._refused: Exception | None = None  # the last round trip's first refusal
        self._lock = threading.Lock()  # the writer's state: queue, batches, claims
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._degraded_since: float | None = None
        self._last_error = ""
        self._reported_lost = 0
        self._lags: deque[float] = deque(maxlen=10_000)  # ms, learned elsewhere -> merged here
        self._counts = dict(
            round_trips=0,
            errors=0,
            fallbacks=0,
            reconnects=0,
            flushed_updates=0,  # acknowledged: in the log (on a replica too, on a cluster)
            lost_updates=0,  # will never be logged: dropped from the full queue, or at close
            replication_waits=0,  # appends no replica held in time: resent
            remote_updates=0,  # rows other processes learned, merged here
            duplicate_updates=0,  # copies of a batch already applied, skipped
            missed_batches=0,  # batches the log no longer held when this reader came
            bad_entries=0,  # log entries that were not a batch of rows (skipped)
            unchecked_claims=0,  # claims the server has not answered yet (rows plain until)
            refused_claims=0,  # claims the server found taken (those rows decode plain)
        )

    # -- construction ------------------------------------------------------------------
    @classmethod
    def connect(cls, url: str, fallback: bool = False, **kw) -> RedisLogitNgramStore:
        """Connect, ping and replay the scope's log (a late joiner drafts from what the others
        learned from its first step). Raises StoreUnavailableError unless `fallback` (then the
        store starts degraded, drafting from its replica, and says so in logs and stats; it
        connects at the first retry that answers)."""
        try:
            client = client_from_url(url)
        except ERRORS as e:  # a cluster answers its slots as the client is made
            if not fallback:
                raise StoreUnavailableError(f"cannot reach the Redis Cluster at {url}: {e}") from e
            log.warning("Redis at %s unreachable (%s): using the local store until it is", url, e)
            store = cls(None, connect=lambda: client_from_url(url), **kw)
            store._degrade()
            return store.start()
        store = cls(client, **kw)
        try:
            store.node().ping()
            store._count_replicas()
            while store._read(block_ms=None) == READ_COUNT:
                pass
            store.merge_remote()  # nobody drafts from it yet: the history is there at once
        except ERRORS as e:
            if not fallback:
                raise StoreUnavailableError(f"cannot reach Redis at {url}: {e}") from e
            log.warning("Redis at %s unreachable (%s): using the local store until it is", url, e)
            store._degrade()
        return store.start()

    def start(self) -> RedisLogitNgramStore:
        """Start the writer and reader threads (again after `close`: each pair has its own
        stop event, so a reader still blocked from before never reads beside the new one)."""
        stop = self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._write_loop, args=(stop,), name="tts-store-writer"),
            threading.Thread(target=self._read_loop, args=(stop,), name="tts-store-reader"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        return self

    def node(self) -> redis.Redis:
        """The connection that serves this scope's keys: the server itself, or on a cluster
        the node that owns the scope's slot now (as the client last learned the slots)."""
        if self.client is None:  # a cluster unreachable at start: connect now, or raise
            self.client = self._connect()  # type: ignore[misc]
            self._count_replicas()
        if not isinstance(self.client, RedisCluster):
            return self.client
        owner = self.client.get_node_from_key(self.scope.log_key)
        return self.client.get_redis_connection(owner)

    def _reroute(self) -> None:
        """After a failed round trip on a cluster: learn the slots again (a failover or a
        resharding may have moved the scope's), and how many replicas the owner has now."""
        if isinstance(self.client, RedisCluster):
            try:
                self.client.nodes_manager.initialize()
                self._count_replicas()
            except ERRORS as e:  # no node answers yet: the next retry asks again
                log.info("Redis Cluster slots not refreshed: %s", e)

    def _count_replicas(self) -> None:
        """The replicas of the scope's node on a cluster (0 for one server: appends are as safe
        as that server's persistence, and WAIT would only add its timeout). The writer counts
        again every `RECOUNT_S`: a master restarted after its failover rejoins as a replica."""
        self._recount_at = time.monotonic() + RECOUNT_S
        if isinstance(self.client, RedisCluster):
            self._replicas = int(self.node().info("replication").get("connected_slaves", 0))

    # -- NgramStore ----------------------------------------------------------------------
    def compiled(self) -> StoreIndex:
        """The local replica, where the compiled drafters read (`store.indexed.IndexedStore`)."""
        return self.index

    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        self.merge_remote()
        return self.index.lookup(context)

    def add(self, rows: Sequence[NgramRow]) -> None:
        """Merge a step's rows into the replica now; the log gets them in the background."""
        self.index.add(rows)

    def flush(self) -> None:
        """Merge what the log brought, and have the writer append what is queued, waiting for
        it a bounded time (`retry_s`; never for a server known to be down). For tests and
        reports: the step never calls it."""
        self.merge_remote()
        if self._degraded_since is not None:
            return
        self._wake.set()
        deadline = time.monotonic() + self.retry_s
        while self._owed() and self._degraded_since is None and time.monotonic() < deadline:
            time.sleep(0.002)
        self.merge_remote()

    def catch_up(self, timeout_s: float = 5.0) -> bool:
        """Wait (at most `timeout_s`) until the reader has read the log as far as it reaches
        now, and merge it; False if it could not. For tests and benchmarks."""
        try:
            last = self.node().xrevrange(self.scope.log_key, count=1)
        except ERRORS:
            return False
        if last:
            target = _stream_id(last[0][0])
            deadline = time.monotonic() + timeout_s
            while _stream_id(self._last_id) < target:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        self.merge_remote()
        return True

    def close(self) -> None:
        """Append every queued row, retrying for up to `close_timeout_s`; what is still not
        acknowledged then is lost: counted in `lost_updates` and reported on stderr. The
        threads stop; the store stays usable (`start` again, as `add` does)."""
        deadline = time.monotonic() + self.close_timeout_s
        while self._owed() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)
        self._stop.set()
        self._wake.set()
        writer = self._threads[0] if self._threads else None
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=5.0)  # a round trip in flight: at most a socket timeout
        self._threads = []  # the reader stops at its next wake (its stop event is set)
        self._counts["lost_updates"] += self._drop_queued()
        self._report_lost()
        if self.client is not None:
            self.client.close()

    def stats(self) -> dict:
        counts = self.index.counts()
        orders = range(1, self.max_order + 1)
        lags = sorted(self._lags)
        return {
            "backend": "redis",
            "scope": self.scope.scope,
            "scope_id": self.scope.scope_id,
            "degraded": self._degraded_since is not None,
            "entries": sum(counts["entries_by_order"]),
            "entries_by_order": {str(n): counts["entries_by_order"][n] for n in orders},
            "hits_by_order": {str(n): counts["hits_by_order"][n] for n in orders},
            "misses": counts["misses"],
            "evictions": counts["evictions"],
            "pending_updates": self._pending(),
            "lag_ms_p50": _percentile(lags, 0.5),
            "lag_ms_p99": _percentile(lags, 0.99),
            **self._counts,
        }

    def clear(self) -> None:
        """Delete this scope's log and claims in Redis and forget the replica and queues."""
        self._drop_queued()
        self._inbox.clear()
        self.index.clear()
        delete_scope(self.node(), self.scope.prefix)

    def claim(self, verify_key: int) -> bool:
        """Record the key here and, in the background, in the scope's set (every process and
        run that shares the scope sees it); False if a row of this process claimed it before.
        `confirmed` says what the server answered."""
        with self._lock:
            if verify_key in self._claimed:
                return False
            self._claimed.add(verify_key)
        self.preclaim([verify_key])
        return True

    def preclaim(self, verify_keys: Sequence[int]) -> None:
        """Send the keys' claims now (the writer wakes at once, without its linger)."""
        if not self._threads:
            self.start()
        with self._lock:
            fresh = [k for k in verify_keys if k not in self._claims]
            for key in fresh:
                self._claims[key] = None
            self._unsent_claims += fresh
            self._counts["unchecked_claims"] += len(fresh)
        if fresh:
            self._urgent = True
            self._wake.set()

    def confirmed(self, verify_key: int) -> bool | None:
        """True once the server has the key as fresh, False if it found it taken, None while
        it has not answered (a server down: until it does)."""
        return self._claims.get(verify_key)

    # -- the decode thread's side ----------------------------------------------------------
    def queue(self, rows: LogRows) -> None:
        """Rows merged here, for the writer to append (the oldest dropped past `max_pending`)."""
        if not self._threads:
            self.start()
        with self._lock:
            self._queued.append((rows, time.time()))
            self._queued_rows += len(rows.ctx)
            while self._queued_rows > self.max_pending and len(self._queued) > 1:
                dropped, _ = self._queued.popleft()
                self._queued_rows -= len(dropped.ctx)
                if not self._counts["lost_updates"]:
                    log.warning("Redis store queue full: dropping the oldest updates")
                self._counts["lost_updates"] += len(dropped.ctx)
        if not self._wake.is_set():
            self._wake.set()

    def merge_remote(self, drafting: bool = False) -> None:
        """Merge what the reader brought (the decode thread's: the replica is its alone).
        `drafting`: a step's merge, before rows draft again; its lag (learned elsewhere ->
        merged here) is what `lag_ms_*` report (a merge at `flush` or `close`, after this
        process's rows are done, is no draft's)."""
        inbox = self._inbox
        while inbox:
            rows, learned_at = inbox.popleft()
            self.index.merge(rows)
            self._counts["remote_updates"] += len(rows.ctx)
            if drafting:
                self._lags.append(1000.0 * (time.time() - learned_at))

    # -- the writer thread -----------------------------------------------------------------
    def _write_loop(self, stop: threading.Event) -> None:
        """Append what is queued as soon as there is some; after a failure, again every
        `retry_s`. Ends at `close` (which has waited for the queue, a bounded time)."""
        while not stop.is_set():
            self._wake.wait(timeout=self.retry_s)
            if not self._urgent:  # the rest of the step's rows: one append a step, not a row
                stop.wait(LINGER_S)
            self._urgent = False
            self._wake.clear()
            if not stop.is_set() and self._send() is False:
                stop.wait(self.retry_s)

    def _send(self) -> bool | None:
        """One round trip: the unacknowledged batches, a new one from the queue, the claims not
        yet sent. None if there was nothing to send, False if any of it failed (the batches
        before the first refused one count as appended: a reader skips their copies)."""
        with self._lock:
            if self._queued and sum(b.rows for b in self._unacked) < FLUSH_ROWS:
                self._unacked.append(self._batch())
            batches, claims = list(self._unacked), list(self._unsent_claims)
        if not batches and not claims:
            return None
        try:
            if time.monotonic() > self._recount_at:
                self._count_replicas()
            appended, fresh, replicated = self._round_trip(batches, claims)
        except ERRORS as e:
            self._fail(e)
            return False
        with self._lock:
            for key, added in zip(claims, fresh, strict=False):
                self._claims[key] = added
                self._counts["unchecked_claims"] -= 1
                if not added and not self._counts["refused_claims"]:
                    log.warning(
                        "a verify key of %s was claimed before (a reused sampling.run_nonce?): "
                        "its rows decode plain (stats: refused_claims)",
                        self.scope.prefix,
                    )
                self._counts["refused_claims"] += not added
            self._unsent_claims = self._unsent_claims[len(fresh) :]
            if replicated:
                self._unacked = self._unacked[appended:]
                self._counts["flushed_updates"] += sum(b.rows for b in batches[:appended])
        if appended < len(batches) or len(fresh) < len(claims):
            self._fail(self._refused)
            return False
        if self._degraded_since is not None:
            log.info("Redis is back: appended %d queued updates", sum(b.rows for b in batches))
            self._counts["reconnects"] += 1
            self._degraded_since = None
        if not replicated:  # only the master holds them: resent next time (readers skip)
            self._counts["replication_waits"] += 1
            self._reroute()
        return True

    def _batch(self) -> Batch:
        """The queued rows (up to about `FLUSH_ROWS`) as the next numbered batch (lock held)."""
        parts, learned, count = [], time.time(), 0
        while self._queued and count < FLUSH_ROWS:
            rows, at = self._queued.popleft()
            parts.append(rows)
            learned, count = min(learned, at), count + len(rows.ctx)
        data = encode_rows(concat_rows(parts))
        self._queued_rows -= count
        self._seq += 1
        return Batch(self._seq, count, learned, data)

    def _round_trip(self, batches: list[Batch], claims: list[int]) -> tuple[int, list[bool], bool]:
        """Append `batches` (and WAIT for a replica where there is one) and add `claims`: how
        many batches were appended before the first the server refused (`_refused` says why),
        the claims answered (fresh or not), and whether a replica holds the batches."""
        scope, node = self.scope, self.node()
        pipe = node.pipeline(transaction=False)
        for b in batches:
            fields = {"w": self._writer, "s": b.seq, "t": repr(b.learned_at), "d": b.data}
            pipe.xadd(scope.log_key, fields, maxlen=scope.log_entries, approximate=True)
        for key in claims:
            pipe.sadd(scope.claims_key, key)
        expire = [k for k, sent in ((scope.log_key, batches), (scope.claims_key, claims)) if sent]
        for key in expire if scope.ttl_s else []:
            pipe.expire(key, scope.ttl_s)
        waiting = bool(batches and self._replicas)
        if waiting:
            pipe.execute_command("WAIT", 1, WAIT_MS)
        replies = pipe.execute(raise_on_error=False)
        self._counts["round_trips"] += 1
        errors = [r for r in replies if isinstance(r, Exception)]
        self._refused = errors[0] if errors else None
        appended = next(
            (i for i, r in enumerate(replies[: len(batches)]) if isinstance(r, Exception)),
            len(batches),
        )
        answers = replies[len(batches) : len(batches) + len(claims)]
        fresh = []
        for r in answers:
            if isinstance(r, Exception):
                break
            fresh.append(int(r) == 1)
        replicated = not waiting or (not errors and int(replies[-1]) >= 1)
        return appended, fresh, replicated

    def _fail(self, e: Exception) -> None:
        self._counts["errors"] += 1
        self._last_error = str(e)
        if isinstance(e, redis.exceptions.OutOfMemoryError):
            self._last_error += " (set maxmemory-policy volatile-lru: every key has a TTL)"
        self._reroute()
        if self._degraded_since is None:
            log.warning("Redis failed (%s): drafting goes on from the local replica", e)
            self._degrade()

    # -- the reader thread -----------------------------------------------------------------
    def _read_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._read(block_ms=self._block_ms(), stop=stop)
            except Exception as e:  # noqa: BLE001 - a client closed under it raises anything
                if stop.is_set():
                    return
                self._counts["errors"] += 1
                self._last_error = str(e)
                self._reroute()
                stop.wait(self.retry_s)

    def _read(self, block_ms: int | None, stop: threading.Event | None = None) -> int:
        """Read the log's next entries after the last one read (waiting up to `block_ms` for
        one); returns how many (none once `stop` is set: a reader left behind by `close`)."""
        node = self.node()
        reply = node.xread({self.scope.log_key: self._last_id}, count=READ_COUNT, block=block_ms)
        entries = reply[0][1] if reply and not (stop is not None and stop.is_set()) else []
        for entry_id, fields in entries:
            try:
                self._take(fields)
            except (KeyError, ValueError) as e:  # not an entry of ours: skipped, counted
                self._counts["bad_entries"] += 1
                log.warning("Redis log entry %s of %s skipped: %s", entry_id, self.scope.log_key, e)
            self._last_id = entry_id
        return len(entries)

    def _take(self, fields: dict) -> None:
        """One log entry: the others' rows to the inbox once each, our own skipped."""
        writer, seq = fields[b"w"], int(fields[b"s"])
        if writer == self._writer:
            return
        rows = decode_rows(fields[b"d"], self.max_order)
        last = self._seen.get(writer, 0)
        if seq <= last:
            self._counts["duplicate_updates"] += len(rows.ctx)
            return
        self._counts["missed_batches"] += seq - last - 1
        self._seen[writer] = seq
        self._inbox.append((rows, float(fields[b"t"])))

    def _block_ms(self) -> int:
        """How long a read waits for an entry: `BLOCK_MS`, less where the client's socket
        timeout is shorter (a blocked read must not time out as a failure)."""
        pool = getattr(self.node(), "connection_pool", None)
        timeout = pool.connection_kwargs.get("socket_timeout") if pool is not None else None
        return BLOCK_MS if not timeout else max(1, min(BLOCK_MS, int(500 * timeout)))

    # -- internals -----------------------------------------------------------------------
    def _degrade(self) -> None:
        self._degraded_since = time.monotonic()
        self._counts["fallbacks"] += 1

    def _pending(self) -> int:
        return self._queued_rows + sum(b.rows for b in self._unacked)

    def _owed(self) -> bool:
        """Whether the writer has rows or claims still to send."""
        return bool(self._pending() or self._unsent_claims)

    def _drop_queued(self) -> int:
        """Forget every row not yet acknowledged; returns how many."""
        with self._lock:
            dropped = self._pending()
            self._queued.clear()
            self._queued_rows = 0
            self._unacked.clear()
        return dropped

    def _report_lost(self) -> None:
        """Say on stderr, never silently, how many updates will not reach Redis."""
        new = self._counts["lost_updates"] - self._reported_lost
        if new > 0:
            print(
                f"tts store: LOST {new} updates of {self.scope.prefix}* (never logged in "
                f"Redis; stats: lost_updates). Last error: {self._last_error or 'none'}",
                file=sys.stderr,
                flush=True,
            )
            self._reported_lost += new


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


def _percentile(values: list[float], q: float) -> float | None:
    return None if not values else round(float(np.quantile(values, q)), 3)
