"""Redis-backed logit n-gram store: many actors, one memory, kept across restarts.

Merge rule. Concurrent writers must give the same entries as a sequential merge of the same
updates, whatever the interleaving. STAND's rule (running mean, then truncate to the top 10
after every update) depends on the order, so an atomic Lua script would only guarantee *some*
sequential order. Instead every entry stores the commutative sufficient statistics of the
mean: a count and, per token id, the sum of its probabilities (HINCRBY / HINCRBYFLOAT). The
mean is sum / count, truncated to the top k when read. This is STAND's running mean without
its intermediate truncations (`InMemoryNgramStore(merge="sum")` computes the same thing
in-process), and it is order-independent up to float rounding.

Keys: `tts:{<scope>:<scope_id>}:<n>:<t1,...,tn>` hold a hash `{"_n": count, "<id>": sum}`;
`tts:{<scope>:<scope_id>}:_recent` is a sorted set of keys by last write (for the entry cap).
Every write refreshes the scope's TTL. The braces are a Redis Cluster hash tag: every key of a
scope hashes to one slot, so on a cluster (`redis+cluster://`) a scope's script and pipelines
run on the one node that owns it, and scopes spread over the 16,384 slots.

A cluster. The round trips go to the scope's node over its own connection (redis-py's cluster
pipeline refuses scripts); when the cluster moves the slot (a failover promotes a replica, a
resharding migrates it) the node answers MOVED, ASK or TRYAGAIN, or stops answering: that is
a failed round trip like any other (the batch stays unacknowledged, the store degrades and
retries), and the routing is refreshed from the cluster before the next try. Replication is
asynchronous, so a master that dies may take writes it acknowledged with it: on a node with
replicas a round trip also sends WAIT, and its batches count as stored only once a replica
holds them; until then they are resent with every round trip (the master skips what it has,
a promoted replica applies what it lacks; the script always writes, so WAIT covers a resend
too). Batches no replica took by `close()` are reported lost, though the master may hold them.
The replica count is learned at connect and after every failed or unreplicated round trip:
a store that connected to a master without replicas does not wait for one added later.

Exactly once. A round trip that times out may still run: its commands wait in the socket of
a hung server and execute when it resumes, and the retry would add them a second time. So
writes go in numbered batches (writer id, sequence number), applied by one Lua script that
also records the writer's last applied number in `..._batches` and counts the rows in
`..._applied`, atomically. A batch is resent unchanged until acknowledged; a copy whose number
is already recorded does nothing. The script is refused as a whole (its first write) when
Redis is out of memory. `_batches` and `_applied` have no TTL while writers are active (so
`volatile-lru` never evicts them); `close()` gives them the scope's TTL.

Reads never wait on the network per node: lookups are served from an actor-local cache, and
a miss is remembered and fetched with the next step's round trip, in the same pipeline as
that step's writes. Cached entries older than `max_staleness_s` are refreshed the same way.

Faults: if Redis goes away or refuses writes, decoding goes on with the local cache (local
writes are merged into it), updates queue up (bounded), and the store retries every `retry_s`,
flushing the queue; `close()` keeps trying for `close_timeout_s`. Updates that never reach
Redis are counted in `lost_updates` and reported on stderr. Output never depends on the store:
drafts carry their own snapshot of `q` to the verifier.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster

from store.base import NgramEntry, NgramRow, mean_entry
from store.redis_client import ERRORS, Client, StoreUnavailableError, client_from_url, delete_scope

log = logging.getLogger(__name__)

FLUSH_ROWS = 512  # rows per round trip: a long outage's queue drains in bounded pipelines
WAIT_MS = 50  # how long a cluster write waits for a replica to hold it (Redis WAIT)

# KEYS: _recent, _applied, _batches, then the entry keys of every batch in order.
# ARGV: writer, ttl (0: none), now, then per batch: seq, rows, nkeys, and per key: count,
# nfields, field/sum pairs. Batches at or below the writer's recorded number are skipped.
# The first write is HINCRBY or INCRBY, which an out-of-memory server refuses before any
# write lands. Returns the number of rows applied (the rest were already stored).
APPLY_BATCHES = """
local recent, applied, batches = KEYS[1], KEYS[2], KEYS[3]
local writer, ttl, now = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local last = tonumber(redis.call('HGET', batches, writer) or 0)
local k, a, done = 4, 4, 0
while a <= #ARGV do
  local seq, rows, nkeys = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local fresh = seq > last
  a = a + 3
  for _ = 1, nkeys do
    local key, nfields = KEYS[k], tonumber(ARGV[a + 1])
    if fresh then
      redis.call('HINCRBY', key, '_n', ARGV[a])
      for j = a + 2, a + 2 * nfields, 2 do
        redis.call('HINCRBYFLOAT', key, ARGV[j], ARGV[j + 1])
      end
      redis.call('ZADD', recent, now, key)
      if ttl > 0 then redis.call('EXPIRE', key, ttl) end
    end
    k, a = k + 1, a + 2 + 2 * nfields
  end
  if fresh then
    redis.call('INCRBY', applied, rows)
    last, done = seq, done + rows
  end
end
redis.call('HSET', batches, writer, last)  -- always a write: WAIT then covers this batch
if done > 0 then
  redis.call('PERSIST', applied)
  redis.call('PERSIST', batches)
  if ttl > 0 then redis.call('EXPIRE', recent, ttl) end
end
return done
"""
APPLY_SHA = hashlib.sha1(APPLY_BATCHES.encode()).hexdigest()


@dataclass(frozen=True)
class RedisScope:
    """Where entries live and how long: `scope` is job, problem or global."""

    scope: str = "problem"
    scope_id: str = "default"
    ttl_s: int | None = 24 * 3600
    max_entries: int = 1_000_000

    @property
    def prefix(self) -> str:
        return f"tts:{{{self.scope}:{self.scope_id}}}:"  # a cluster hash tag: one slot

    @property
    def meta_keys(self) -> tuple[str, str, str]:
        """The sorted set of keys by last write, the applied-rows counter, and the writers'
        last applied batch numbers."""
        return (f"{self.prefix}_recent", f"{self.prefix}_applied", f"{self.prefix}_batches")


@dataclass(frozen=True)
class Batch:
    """Rows folded per key into the script's arguments, numbered once and resent unchanged."""

    rows: int
    keys: list[str]
    args: list[int | str]


def entry_from_hash(raw: dict, topk: int) -> NgramEntry | None:
    """A hash `{"_n": count, id: sum}` -> the mean distribution's top k (ties: lower id)."""
    fields = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}
    count = int(fields.pop("_n", 0))
    return mean_entry(count, {int(k): s for k, s in fields.items()}, topk)


class RedisLogitNgramStore:
    """`NgramStore` over Redis, with an actor-local read cache and a local fallback."""

    def __init__(
        self,
        client: Client | None,
        scope: RedisScope = RedisScope(),
        max_order: int = 4,
        topk: int = 10,
        max_staleness_s: float = 2.0,
        refresh_batch: int = 256,
        cache_entries: int = 200_000,
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
        self.max_order = max_order
        self.topk = topk
        self.max_staleness_s = max_staleness_s
        self.refresh_batch = refresh_batch
        self.cache_entries = cache_entries
        self.retry_s = retry_s
        self.close_timeout_s = close_timeout_s
        # key -> (entry or None for "absent in Redis", fetched at)
        self._cache: OrderedDict[tuple[int, ...], tuple[NgramEntry | None, float]] = OrderedDict()
        self._wanted: set[tuple[int, ...]] = set()
        self._pending: deque[NgramRow] = deque(maxlen=max_pending)
        self._unacked: list[Batch] = []  # sent, not acknowledged: resent as they are
        self._writer = uuid.uuid4().hex
        self._seq = 0
        self._sending = threading.Lock()  # a store dropped by another thread is closed there
        self._degraded_since: float | None = None
        self._replicas = 0  # a cluster node's replicas: batches wait until one holds them
        self._last_error = ""
        self._reported_lost = 0
        self._counts = dict(
            hits=0,
            misses=0,
            round_trips=0,
            errors=0,
            fallbacks=0,
            reconnects=0,
            flushed_updates=0,  # acknowledged: stored exactly once
            duplicate_updates=0,  # resent after a timeout, found already stored
            lost_updates=0,  # will never be stored: dropped from the full queue, or at close
            replication_waits=0,  # round trips whose batches no replica held in time: resent
            unchecked_claims=0,  # verify keys claimed while Redis was unreachable
        )
        self._claims: set[int] = set()  # verify keys claimed through this client

    # -- construction ------------------------------------------------------------------
    @classmethod
    def connect(cls, url: str, fallback: bool = False, **kw) -> RedisLogitNgramStore:
        """Connect and ping. Raises StoreUnavailableError unless `fallback` (then the store
        starts degraded, serving from its local cache, and says so in logs and stats; a
        cluster that did not answer is connected to at the first retry that it does)."""
        try:
            client = client_from_url(url)
        except ERRORS as e:  # a cluster answers its slots as the client is made
            if not fallback:
                raise StoreUnavailableError(f"cannot reach the Redis Cluster at {url}: {e}") from e
            log.warning("Redis at %s unreachable (%s): using the local store until it is", url, e)
            store = cls(None, connect=lambda: client_from_url(url), **kw)
            store._degrade()
            return store
        store = cls(client, **kw)
        try:
            store.node().ping()
            store.node().script_load(APPLY_BATCHES)
            store._replicas = store._count_replicas()
            store.warm()
        except ERRORS as e:
            if not fallback:
                raise StoreUnavailableError(f"cannot reach Redis at {url}: {e}") from e
            log.warning("Redis at %s unreachable (%s): using the local store until it is", url, e)
            store._degrade()
        return store

    def node(self) -> redis.Redis:
        """The connection that serves this scope's keys: the server itself, or on a cluster
        the node that owns the scope's slot now (as the client last learned the slots)."""
        if self.client is None:  # a cluster unreachable at start: connect now, or raise
            self.client = self._connect()
            self._replicas = self._count_replicas()
        if not isinstance(self.client, RedisCluster):
            return self.client
        owner = self.client.get_node_from_key(self.scope.meta_keys[0])
        return self.client.get_redis_connection(owner)

    def _reroute(self) -> None:
        """After a failed round trip on a cluster: learn the slots again (a failover or a
        resharding may have moved the scope's), so the next try goes to the new owner, and
        how many replicas that owner has now."""
        if isinstance(self.client, RedisCluster):
            try:
                self.client.nodes_manager.initialize()
                self._replicas = self._count_replicas()
            except ERRORS as e:  # no node answers yet: the next retry asks again
                log.info("Redis Cluster slots not refreshed: %s", e)

    def _count_replicas(self) -> int:
        """The replicas of the scope's node on a cluster (0 for one server: writes are as safe
        as that server's persistence, and WAIT would only add its timeout)."""
        if not isinstance(self.client, RedisCluster):
            return 0
        return int(self.node().info("replication").get("connected_slaves", 0))

    # -- NgramStore ----------------------------------------------------------------------
    def lookup(self, context: Sequence[int]) -> NgramEntry | None:
        now = time.monotonic()
        for n in range(min(self.max_order, len(context)), 0, -1):
            key = tuple(context[-n:])
            cached = self._cache.get(key)
            if cached is None:
                self._want(key)
                continue
            entry, fetched = cached
            if now - fetched > self.max_staleness_s:
                self._want(key)
            if entry is not None:
                self._counts["hits"] += 1
                return NgramEntry(entry.ids, entry.probs, entry.count, n)
        self._counts["misses"] += 1
        return None

    def add(self, rows: Sequence[NgramRow]) -> None:
        """Merge a step's rows locally, then one round trip: writes + wanted reads."""
        for row in rows:
            for n in range(1, min(self.max_order, len(row.context)) + 1):
                self._merge_local(tuple(row.context[-n:]), row.ids, row.probs)
        overflow = len(self._pending) + len(rows) - (self._pending.maxlen or 0)
        if overflow > 0:  # the deque drops its oldest rows
            if not self._counts["lost_updates"]:
                log.warning("Redis store queue full: dropping the oldest updates")
            self._counts["lost_updates"] += overflow
        self._pending.extend(rows)
        self.flush()

    def flush(self) -> None:
        """Push up to `FLUSH_ROWS` pending rows and fetch wanted keys in one pipeline (skipped
        while degraded, except for a reconnect attempt every `retry_s`)."""
        if self._degraded_since is not None:
            if time.monotonic() - self._degraded_since < self.retry_s:
                return
            self._degraded_since = time.monotonic()  # next attempt after another retry_s
        self._send()

    def close(self) -> None:
        """Push every queued update, retrying for up to `close_timeout_s` (plus one socket
        timeout); what is still unacknowledged then is lost: counted in `lost_updates` and
        reported on stderr. A batch that timed out on a hung server may still land when it
        resumes. The store stays usable (it reconnects)."""
        deadline = time.monotonic() + self.close_timeout_s
        while self._pending or self._unacked:
            sent = self._send()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not sent:
                time.sleep(min(0.1, left))
        lost = self._queued()
        if lost:
            self._pending.clear()
            self._unacked.clear()
            self._counts["lost_updates"] += lost
        elif self._seq:
            self._expire_counters()
        self._report_lost()
        if self.client is not None:
            self.client.close()

    def stats(self) -> dict:
        return {
            "backend": "redis",
            "scope": self.scope.scope,
            "scope_id": self.scope.scope_id,
            "degraded": self._degraded_since is not None,
            "cached_entries": len(self._cache),
            "pending_updates": self._queued(),
            **self._counts,
        }

    def clear(self) -> None:
        """Delete this scope's entries in Redis and forget the local cache and queue."""
        self._cache.clear()
        self._wanted.clear()
        self._pending.clear()
        self._unacked.clear()
        delete_scope(self.node(), self.scope.prefix)

    def claim(self, verify_key: int) -> bool:
        """SADD to the scope's claims (every process and run that shares the scope sees them).
        A server that cannot be reached, or is known to be down, is counted (`unchecked_claims`)
        and the claim checked in-process only, never waited on: the row then drafts from this
        process's cache until Redis is back (docs/design.md, "Random streams")."""
        fresh = verify_key not in self._claims
        self._claims.add(verify_key)
        if self._degraded_since is not None:  # never wait on a server known to be down
            self._counts["unchecked_claims"] += 1
            return fresh
        key = f"{self.scope.prefix}_claims"
        try:
            pipe = self.node().pipeline(transaction=False)
            pipe.sadd(key, verify_key)
            if self.scope.ttl_s:
                pipe.expire(key, self.scope.ttl_s)
            added = pipe.execute()[0]
        except ERRORS as e:
            self._counts["unchecked_claims"] += 1
            log.warning("Redis claim not checked (%s): checked in this process only", e)
            self._reroute()
            self._degrade()  # the next round trip retries after retry_s, as writes do
            return fresh
        return fresh and int(added) == 1

    def warm(self, chunk: int = 1000) -> int:
        """Load the scope's most recently written entries into the local cache, so a new actor
        drafts from what others learned from its first step (a miss is only fetched with the
        next round trip, one step behind a sequence the cache has never seen)."""
        node = self.node()
        keys = node.zrevrange(self.scope.meta_keys[0], 0, self.cache_entries - 1)
        now = time.monotonic()
        for start in range(0, len(keys), chunk):
            part = keys[start : start + chunk]
            pipe = node.pipeline(transaction=False)
            for key in part:
                pipe.hgetall(key)
            for key, raw in zip(part, pipe.execute(), strict=True):
                ctx = tuple(int(t) for t in key.decode().rsplit(":", 1)[1].split(","))
                self._cache[ctx] = (entry_from_hash(raw, self.topk), now)
        self._counts["round_trips"] += 1 + len(keys) // chunk
        return len(keys)

    # -- internals -----------------------------------------------------------------------
    def _degrade(self) -> None:
        self._degraded_since = time.monotonic()
        self._counts["fallbacks"] += 1

    def _queued(self) -> int:
        return len(self._pending) + sum(b.rows for b in self._unacked)

    def _key(self, ctx: tuple[int, ...]) -> str:
        return f"{self.scope.prefix}{len(ctx)}:{','.join(map(str, ctx))}"

    def _send(self) -> bool:
        """One round trip: the unacknowledged batches, a new batch from the queue (up to
        `FLUSH_ROWS` rows in all) and the wanted reads. False if it failed."""
        with self._sending:
            return self._send_locked()

    def _send_locked(self) -> bool:
        room = FLUSH_ROWS - sum(b.rows for b in self._unacked)
        if room > 0 and self._pending:
            rows = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            self._unacked.append(self._batch(rows))
        wanted = list(self._wanted)[: self.refresh_batch]
        try:
            applied, replies, replicated = self._round_trip(wanted)
        except ERRORS as e:
            self._counts["errors"] += 1
            self._last_error = str(e)
            self._reroute()
            if isinstance(e, redis.exceptions.OutOfMemoryError):
                self._last_error += " (set maxmemory-policy volatile-lru: every key has a TTL)"
            if self._degraded_since is None:
                log.warning("Redis failed (%s): drafting goes on from the local cache", e)
                self._degrade()
            return False
        sent = sum(b.rows for b in self._unacked)
        if self._degraded_since is not None:
            log.info("Redis is back: flushed %d queued updates", sent)
            self._counts["reconnects"] += 1
            self._degraded_since = None
        if replicated:
            self._counts["flushed_updates"] += sent
            self._counts["duplicate_updates"] += sent - applied
            self._unacked.clear()
        else:  # only the master holds them: resent with the next round trip (it skips them)
            self._counts["replication_waits"] += 1
            try:
                self._replicas = self._count_replicas()  # a replica gone for good: stop waiting
            except ERRORS as e:  # the master going too: the next round trip finds out
                log.info("Redis replicas not recounted: %s", e)
        now = time.monotonic()
        for key, raw in zip(wanted, replies, strict=True):
            self._wanted.discard(key)
            self._cache[key] = (entry_from_hash(raw, self.topk), now)
            self._cache.move_to_end(key)
        self._trim()
        return replicated

    def _batch(self, rows: list[NgramRow]) -> Batch:
        """Number `rows` and fold them per key (a count and one sum per id) for the script."""
        counts: dict[str, int] = {}
        sums: dict[str, dict[int, float]] = {}
        for row in rows:
            for n in range(1, min(self.max_order, len(row.context)) + 1):
                key = self._key(tuple(row.context[-n:]))
                counts[key] = counts.get(key, 0) + 1
                acc = sums.setdefault(key, {})
                for token, p in zip(row.ids, row.probs, strict=True):
                    acc[token] = acc.get(token, 0.0) + float(p)
        self._seq += 1
        args: list[int | str] = [self._seq, len(rows), len(counts)]
        for key, count in counts.items():
            args += [count, len(sums[key])]
            for token, total in sums[key].items():
                args += [token, repr(total)]
        return Batch(len(rows), list(counts), args)

    def _round_trip(self, wanted: list[tuple[int, ...]]) -> tuple[int, list, bool]:
        """(rows applied, the wanted hashes, whether a replica holds the batches: always on a
        node without replicas). A server that lost the script (a restart) gets it again, and
        the round trip is redone: NOSCRIPT means nothing ran."""
        node = self.node()
        replies = self._pipeline(node, wanted)
        if self._unacked and isinstance(replies[0], redis.exceptions.NoScriptError):
            node.script_load(APPLY_BATCHES)  # a restarted server, a promoted replica
            replies = self._pipeline(node, wanted)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if not self._unacked:
            return 0, replies, True
        applied, replies = int(replies[0]), replies[1:]
        replicated = True
        if self._replicas:  # WAIT's reply: the replicas that hold the batches now
            replicated, replies = int(replies[0]) >= 1, replies[1:]
        self._enforce_cap(node)  # after the writes landed; best effort, never retried
        return applied, replies, replicated

    def _pipeline(self, node: redis.Redis, wanted: list[tuple[int, ...]]) -> list:
        pipe = node.pipeline(transaction=False)
        if self._unacked:
            keys = [*self.scope.meta_keys, *(k for b in self._unacked for k in b.keys)]
            args = [self._writer, self.scope.ttl_s or 0, repr(time.time())]
            args += [a for b in self._unacked for a in b.args]
            pipe.evalsha(APPLY_SHA, len(keys), *keys, *args)
            if self._replicas:
                pipe.execute_command("WAIT", 1, WAIT_MS)
        for ctx in wanted:
            pipe.hgetall(self._key(ctx))
        replies = pipe.execute(raise_on_error=False)
        self._counts["round_trips"] += 1
        return replies

    def _enforce_cap(self, node: redis.Redis) -> None:
        recent = self.scope.meta_keys[0]
        try:
            excess = int(node.zcard(recent)) - self.scope.max_entries
            if excess <= 0:
                return
            old = [k for k, _ in node.zpopmin(recent, excess)]
            node.unlink(*old)
        except ERRORS as e:  # the cap is enforced again with the next write
            self._counts["errors"] += 1
            log.warning("Redis entry cap not enforced this step: %s", e)

    def _expire_counters(self) -> None:
        """Give `_applied` and `_batches` the scope's TTL once our writes are all stored (an
        active writer's next batch takes it away again, so eviction never reaches them)."""
        if not self.scope.ttl_s:
            return
        try:
            pipe = self.node().pipeline(transaction=False)
            for key in self.scope.meta_keys[1:]:
                pipe.expire(key, self.scope.ttl_s)
            pipe.execute()
        except ERRORS as e:  # they expire after the next writer's close
            log.warning("Redis store counters keep no TTL: %s", e)

    def _report_lost(self) -> None:
        """Say on stderr, never silently, how many updates will not reach Redis."""
        new = self._counts["lost_updates"] - self._reported_lost
        if new > 0:
            print(
                f"tts store: LOST {new} updates of {self.scope.prefix}* (never stored in "
                f"Redis; stats: lost_updates). Last error: {self._last_error or 'none'}",
                file=sys.stderr,
                flush=True,
            )
            self._reported_lost += new

    def _want(self, key: tuple[int, ...]) -> None:
        if len(self._wanted) < 16 * self.refresh_batch:
            self._wanted.add(key)

    def _trim(self) -> None:
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    def _merge_local(self, key: tuple[int, ...], ids, probs) -> None:
        """Fold our own write into the cached snapshot (top-k only: a drafting-quality
        approximation until the next fetch; Redis holds the exact sums). A key we have not
        fetched yet is cached as stale, so its next lookup also fetches it."""
        cached = self._cache.get(key)
        entry, fetched = cached if cached is not None else (None, 0.0)
        k = entry.count if entry is not None else 0
        sums = {str(i): p * k for i, p in zip(entry.ids, entry.probs, strict=True)} if entry else {}
        for token, p in zip(ids, probs, strict=True):
            sums[str(token)] = sums.get(str(token), 0.0) + float(p)
        self._cache[key] = (entry_from_hash({"_n": k + 1, **sums}, self.topk), fetched)
        self._cache.move_to_end(key)
        self._trim()
