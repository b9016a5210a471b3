"""Config -> a store for one scope. The only place that picks a backend."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from store.base import NgramStore
from store.memory import InMemoryNgramStore, TieredStore
from store.redis_store import RedisLogitNgramStore, RedisScope
from tts_service.config import StoreConfig


def problem_id(prompt_ids: Sequence[int]) -> str:
    """A stable id for a problem: its prompt tokens, hashed (same problem, same Redis scope)."""
    return hashlib.sha1(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def open_store(cfg: StoreConfig, url: str | None, scope: str, scope_id: str) -> NgramStore:
    """In-process when `url` is None, else Redis (`url` already resolved from 'local-redis')."""
    if url is None:
        return InMemoryNgramStore(cfg.max_order, cfg.topk, cfg.max_entries)
    return RedisLogitNgramStore.connect(
        url,
        fallback=cfg.fallback,
        scope=RedisScope(scope, scope_id, cfg.ttl_s, cfg.max_entries),
        max_order=cfg.max_order,
        topk=cfg.topk,
        max_staleness_s=cfg.max_staleness_s,
    )


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
