"""Reaching Redis, one server or a Redis Cluster (`redis+cluster://`): the client for a store
URL, the errors a round trip may raise, the fail-fast ping the edges run before a model loads,
and the operators' view of a key prefix (`tts store`: stats, delete). The store over it, and
the key layout it writes, are `store.redis_store`'s.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

# lost connection, timeouts, server refusals (OOM), a cluster's redirections (MOVED, ASK,
# TRYAGAIN, CLUSTERDOWN) and cluster client errors
ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class StoreUnavailableError(RuntimeError):
    """Redis cannot be reached and no local fallback was asked for."""


CLUSTER_SCHEME = "redis+cluster"
Client = redis.Redis | RedisCluster


def client_from_url(url: str) -> Client:
    """A client for `url`: `redis+cluster://[:password@]host:port[,host:port...]` is a
    Redis Cluster reached through any of its nodes; anything else is one server."""
    timeouts = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
    if urlsplit(url).scheme != CLUSTER_SCHEME:
        return redis.Redis.from_url(url, **timeouts)
    auth, nodes = cluster_nodes(url)
    user, _, password = auth.partition(":")
    return RedisCluster(
        startup_nodes=nodes, username=user or None, password=password or None, **timeouts
    )


def cluster_nodes(url: str) -> tuple[str, list[ClusterNode]]:
    """A `redis+cluster://` URL's credentials and nodes. Raises ValueError naming what is
    malformed (checked before any model loads, with or without a fallback)."""
    auth, _, hosts = urlsplit(url).netloc.rpartition("@")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store URL {url!r}: expected host:port, not {host!r}")
        nodes.append(ClusterNode(name, int(port)))
    return auth, nodes


def ping(url: str) -> None:
    """Raise StoreUnavailableError unless the Redis at `url` answers: the edges call it before
    a model loads, so that a wrong URL fails in seconds, not after the load."""
    try:
        client = client_from_url(url)
    except ERRORS as e:  # a cluster client asks its nodes for the slots as it is made
        raise StoreUnavailableError(f"cannot reach Redis at {url}: {e}") from e
    try:
        client.ping()
    except ERRORS as e:
        raise StoreUnavailableError(f"cannot reach Redis at {url}: {e}") from e
    finally:
        client.close()


def delete_scope(client: Client, prefix: str) -> int:
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


def scope_stats(client: Client, prefix: str) -> dict:
    """The replication logs under `prefix`, which may span scopes ("tts:" is all of them):
    scopes, log entries and bytes (each scope's log: `store.redis_store`), claimed verify keys.
    A SCAN: for operators and tests, not the hot path."""
    logs, claims = [], []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        name = key.decode()
        if name.endswith(":log"):
            logs.append(key)
        elif name.endswith(":_claims"):
            claims.append(key)
    return {
        "prefix": prefix,
        "scopes": len(logs),
        "log_entries": sum(int(client.xlen(k)) for k in logs),
        "log_bytes": sum(int(client.memory_usage(k) or 0) for k in logs),
        "claims": sum(int(client.scard(k)) for k in claims),
    }
