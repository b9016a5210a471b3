"""Config -> a store for one scope. The only place that picks a backend: by the URL's scheme.

'local-redis' never gets here: the edges (`tts_service.cli`, `jobs.common`) resolve it to the
URL of a private redis-server first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from store.base import NgramStore
from store.config import StoreConfig
from store.memory import InMemoryNgramStore, TieredStore
from store.redis_client import CLUSTER_SCHEME, cluster_nodes, ping
from store.redis_store import RedisLogitNgramStore, RedisScope


def problem_id(prompt_ids: Sequence[int]) -> str:
    """A stable id for a problem: its prompt tokens, hashed (same problem, same Redis scope)."""
    return hashlib.sha1(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def _in_memory(cfg: StoreConfig, url: str | None, scope: str, scope_id: str) -> NgramStore:
    return InMemoryNgramStore(cfg.max_order, cfg.topk, cfg.max_entries)


def _redis(cfg: StoreConfig, url: str | None, scope: str, scope_id: str) -> NgramStore:
    return RedisLogitNgramStore.connect(
        url,
        fallback=cfg.fallback,
        scope=RedisScope(scope, scope_id, cfg.ttl_s, cfg.max_entries, cfg.log_entries),
        max_order=cfg.max_order,
        topk=cfg.topk,
        close_timeout_s=cfg.close_timeout_s,
    )


Opener = Callable[[StoreConfig, str | None, str, str], NgramStore]

# URL scheme -> backend (None: no URL, in-process). Add a backend here and nowhere else.
BACKENDS: dict[str | None, Opener] = {
    None: _in_memory,
    "redis": _redis,
    "rediss": _redis,
    "unix": _redis,
    "redis+cluster": _redis,  # a Redis Cluster: scopes spread over its slots
}


def open_store(cfg: StoreConfig, url: str | None, scope: str, scope_id: str) -> NgramStore:
    """The store of one scope, from the backend of `url`'s scheme (in-process for None).

    Raises:
        ValueError: a URL whose scheme has no backend (the message lists the known ones).
    """
    opener = BACKENDS.get(None if url is None else urlsplit(url).scheme)
    if opener is None:
        known = ", ".join(f"{s}://" for s in BACKENDS if s is not None)
        raise ValueError(f"store URL {url!r}: unknown scheme (known: {known}; None: in-process)")
    return opener(cfg, url, scope, scope_id)


def check_store(cfg: StoreConfig, url: str | None) -> None:
    """Fail fast (StoreUnavailableError) if `url` names a Redis that does not answer and no
    fallback was asked for, and (ValueError) on a malformed cluster URL, fallback or not; the
    in-process store always answers."""
    if url is not None and urlsplit(url).scheme == CLUSTER_SCHEME:
        cluster_nodes(url)
    if url is not None and not cfg.fallback:
        ping(url)


def open_global_store(cfg: StoreConfig, url: str | None) -> NgramStore | None:
    """The scope that persists across problems, when `cfg.global_scope` asks for it."""
    return open_store(cfg, url, "global", "default") if cfg.global_scope else None


def open_problem_store(
    cfg: StoreConfig,
    url: str | None,
    scope_id: str,
    global_store: NgramStore | None = None,
) -> NgramStore:
    """A problem's store, read before `global_store` (from `open_global_store`) if given."""
    local = open_store(cfg, url, "problem", scope_id)
    return local if global_store is None else TieredStore(local, global_store)
