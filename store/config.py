"""`StoreConfig`: the store's own settings, so `store/` depends on nothing above it.

`tts_service.config` re-exports it as part of the job and request schemas.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StoreConfig(BaseModel):
    """The logit n-gram store STAND drafts from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_order: int = Field(4, ge=1, le=8, description="Longest n-gram key.")
    topk: int = Field(10, ge=1, le=10, description="Token ids kept per entry.")
    max_entries: int = Field(1_000_000, ge=1, description="Entry cap per scope (LRU eviction).")
    global_scope: bool = Field(
        False, description="Also keep a store that persists across problems (read second)."
    )
    url: str | None = Field(
        None,
        description="None: in-process; 'redis://host:port/db'; "
        "'redis+cluster://host:port[,host:port...]' (a Redis Cluster); or 'local-redis' (a "
        "private redis-server for this command).",
    )
    fallback: bool = Field(
        False, description="If Redis is unreachable at start, go on with a local store."
    )
    ttl_s: int = Field(24 * 3600, ge=1, description="Redis TTL of a scope's entries.")
    log_entries: int = Field(
        100_000,
        ge=100,
        description="Redis: entries a scope's replication log keeps (one per writer's round "
        "trip; older ones are trimmed, and a process that opens the scope later replays the rest).",
    )
    close_timeout_s: float = Field(
        5.0,
        ge=0.0,
        description="How long closing a store waits for Redis to take its queued updates "
        "(the rest are reported lost).",
    )

    @field_validator("url")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if (
            v is not None
            and v != "local-redis"
            and not v.startswith(("redis://", "rediss://", "unix://", "redis+cluster://"))
        ):
            raise ValueError(
                "expected redis://host:port/db, rediss://..., unix://..., "
                "redis+cluster://host:port[,host:port...] or local-redis"
            )
        return v
