"""Redis-backed logit n-gram store: many actors, one memory, kept across restarts.

Merge rule. Concurrent writers must give the same entries as a sequential merge of the same
updates, whatever the interleaving. STAND's rule (running mean, then truncate to the top 10
after every update) depends on the order, so an atomic Lua script would only guarantee *some*
sequential order. Instead every entry stores the commutative sufficient statistics of the
mean: a count and, per token id, the sum of its probabilities (HINCRBY / HINCRBYFLOAT). The
mean is sum / count, truncated to the top k when read. This is STAND's running mean without
its intermediate truncations (`InMemoryNgramStore(merge="sum")` computes the same thing
in-process), and it is order-independent up to float rounding.

Keys: `tts:{scope}:{scope_id}:{n}:{t1,...,tn}` hold a hash `{"_n": count, "<id>": sum}`;
`tts:{scope}:{scope_id}:_recent` is a sorted set of keys by last write (for the entry cap).
Every write refreshes the scope's TTL.

Reads never wait on the network per node: lookups are served from an actor-local cache, and
a miss is remembered and fetched with the next step's round trip, in the same pipeline as
that step's writes. Cached entries older than `max_staleness_s` are refreshed the same way.

Faults: if Redis goes away, decoding goes on with the local cache (local writes are merged
into it), updates queue up (bounded), and the store reconnects every `retry_s`, flushing the
queue; `stats()` counts it all. Output never depends on the store: drafts carry their own
snapshot of `q` to the verifier.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from store.base import NgramEntry, NgramRow, mean_entry

log = logging.getLogger(__name__)

_ERRORS = (redis.RedisError, OSError)  # lost connection, timeouts, and server refusals (OOM)
FLUSH_ROWS = 512  # rows per round trip: a long outage's queue drains in bounded pipelines


class StoreUnavailableError(RuntimeError):
    """Redis cannot be reached and no local fallback was asked for."""


@dataclass(frozen=True)
class RedisScope:
    """Where entries live and how long: `scope` is job, problem or global."""

    scope: str = "problem"
    scope_id: str = "default"
    ttl_s: int | None = 24 * 3600
    max_entries: int = 1_000_000

    @property
    def prefix(self) -> str:
        return f"tts:{self.scope}:{self.scope_id}:"


def entry_from_hash(raw: dict, topk: int) -> NgramEntry | None:
    """A hash `{"_n": count, id: sum}` -> the mean distribution's top k (ties: lower id)."""
    fields = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}
    count = int(fields.pop("_n", 0))
    return mean_entry(count, {int(k): s for k, s in fields.items()}, topk)


class RedisLogitNgramStore:
    """`NgramStore` over Redis, with an actor-local read cache and a local fallback."""

    def __init__(
        self,
        client: redis.Redis,
        scope: RedisScope = RedisScope(),
        max_order: int = 4,
        topk: int = 10,
        max_staleness_s: float = 2.0,
        refresh_batch: int = 256,
        cache_entries: int = 200_000,
        max_pending: int = 100_000,
        retry_s: float = 1.0,
    ) -> None:
        self.client = client
        self.scope = scope
        self.max_order = max_order
        self.topk = topk
        self.max_staleness_s = max_staleness_s
        self.refresh_batch = refresh_batch
        self.cache_entries = cache_entries
        self.retry_s = retry_s
        # key -> (entry or None for "absent in Redis", fetched at)
        self._cache: OrderedDict[tuple[int, ...], tuple[NgramEntry | None, float]] = OrderedDict()
        self._wanted: set[tuple[int, ...]] = set()
        self._pending: deque[NgramRow] = deque(maxlen=max_pending)
        self._degraded_since: float | None = None
        self._counts = dict(
            hits=0,
            misses=0,
            round_trips=0,
            errors=0,
            fallbacks=0,
            reconnects=0,
            dropped_updates=0,
            flushed_updates=0,
        )

    # -- construction ------------------------------------------------------------------
    @classmethod
    def connect(cls, url: str, fallback: bool = False, **kw) -> RedisLogitNgramStore:
        """Connect and ping. Raises StoreUnavailableError unless `fallback` (then the store
        starts degraded, serving from its local cache, and says so in logs and stats)."""
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        store = cls(client, **kw)
        try:
            client.ping()
            store.warm()
        except _ERRORS as e:
            if not fallback:
                raise StoreUnavailableError(f"cannot reach Redis at {url}: {e}") from e
            log.warning("Redis at %s unreachable (%s): using the local store until it is", url, e)
            store._degrade()
        return store

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
        if len(self._pending) + len(rows) > (self._pending.maxlen or 0):
            self._counts["dropped_updates"] += (
                len(self._pending) + len(rows) - (self._pending.maxlen or 0)
            )
        self._pending.extend(rows)
        self.flush()

    def flush(self) -> None:
        """Push up to `FLUSH_ROWS` pending rows and fetch wanted keys in one pipeline (skipped
        while degraded, except for a reconnect attempt every `retry_s`)."""
        if self._degraded_since is not None:
            if time.monotonic() - self._degraded_since < self.retry_s:
                return
            self._degraded_since = time.monotonic()  # next attempt after another retry_s
        rows = list(itertools.islice(self._pending, FLUSH_ROWS))
        wanted = list(self._wanted)[: self.refresh_batch]
        try:
            replies = self._round_trip(rows, wanted)
        except _ERRORS as e:
            self._counts["errors"] += 1
            if self._degraded_since is None:
                log.warning("Redis lost (%s): drafting goes on from the local cache", e)
                self._degrade()
            return
        if self._degraded_since is not None:
            log.info("Redis is back: flushed %d queued updates", len(rows))
            self._counts["reconnects"] += 1
            self._degraded_since = None
        self._counts["flushed_updates"] += len(rows)
        for _ in rows:
            self._pending.popleft()
        now = time.monotonic()
        for key, raw in zip(wanted, replies, strict=True):
            self._wanted.discard(key)
            self._cache[key] = (entry_from_hash(raw, self.topk), now)
            self._cache.move_to_end(key)
        self._trim()

    def stats(self) -> dict:
        return {
            "backend": "redis",
            "scope": self.scope.scope,
            "scope_id": self.scope.scope_id,
            "degraded": self._degraded_since is not None,
            "cached_entries": len(self._cache),
            "pending_updates": len(self._pending),
            **self._counts,
        }

    def clear(self) -> None:
        """Delete this scope's entries in Redis and forget the local cache."""
        self._cache.clear()
        self._wanted.clear()
        self._pending.clear()
        delete_scope(self.client, self.scope.prefix)

    def warm(self, chunk: int = 1000) -> int:
        """Load the scope's most recently written entries into the local cache, so a new actor
        drafts from what others learned from its first step (a miss is only fetched with the
        next round trip, one step behind a sequence the cache has never seen)."""
        recent = f"{self.scope.prefix}_recent"
        keys = self.client.zrevrange(recent, 0, self.cache_entries - 1)
        now = time.monotonic()
        for start in range(0, len(keys), chunk):
            part = keys[start : start + chunk]
            pipe = self.client.pipeline(transaction=False)
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

    def _key(self, ctx: tuple[int, ...]) -> str:
        return f"{self.scope.prefix}{len(ctx)}:{','.join(map(str, ctx))}"

    def _round_trip(self, rows: list[NgramRow], wanted: list[tuple[int, ...]]) -> list:
        pipe = self.client.pipeline(transaction=False)
        written: set[str] = set()
        for row in rows:
            for n in range(1, min(self.max_order, len(row.context)) + 1):
                key = self._key(tuple(row.context[-n:]))
                pipe.hincrby(key, "_n", 1)
                for token, p in zip(row.ids, row.probs, strict=True):
                    pipe.hincrbyfloat(key, str(token), float(p))
                written.add(key)
        recent = f"{self.scope.prefix}_recent"
        if written:
            now = time.time()
            pipe.zadd(recent, dict.fromkeys(written, now))
            if self.scope.ttl_s:
                for key in written:
                    pipe.expire(key, self.scope.ttl_s)
                pipe.expire(recent, self.scope.ttl_s)
        for ctx in wanted:
            pipe.hgetall(self._key(ctx))
        replies = pipe.execute()
        self._counts["round_trips"] += 1
        if written:
            self._enforce_cap(recent)  # after the writes landed; best effort, never retried
        return replies[len(replies) - len(wanted) :] if wanted else []

    def _enforce_cap(self, recent: str) -> None:
        try:
            excess = int(self.client.zcard(recent)) - self.scope.max_entries
            if excess <= 0:
                return
            old = [k for k, _ in self.client.zpopmin(recent, excess)]
            self.client.unlink(*old)
        except _ERRORS as e:  # the cap is enforced again with the next write
            self._counts["errors"] += 1
            log.warning("Redis entry cap not enforced this step: %s", e)

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


def delete_scope(client: redis.Redis, prefix: str) -> int:
    """Delete every key under `prefix`; returns how many."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            deleted += client.unlink(*batch)
            batch = []
    if batch:
        deleted += client.unlink(*batch)
    return deleted


def scope_stats(client: redis.Redis, prefix: str) -> dict:
    """Entries per n-gram order under `prefix` (a SCAN: for operators, not the hot path)."""
    by_order: dict[str, int] = {}
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        rest = key.decode()[len(prefix) :]
        order = rest.split(":", 1)[0]
        if order.isdigit():
            by_order[order] = by_order.get(order, 0) + 1
    return {
        "prefix": prefix,
        "entries": sum(by_order.values()),
        "entries_by_order": dict(sorted(by_order.items())),
    }
