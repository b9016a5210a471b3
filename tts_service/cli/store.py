"""`tts store`, and how every command reaches an n-gram store: the --store flag over
$TTS_STORE_URL (read here, at the edge), 'local-redis' as a private redis-server, and the
Redis admin that looks at or clears a scope.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from store.config import StoreConfig
from tts_service.cli.usage import UsageError


def store_flags(args: argparse.Namespace) -> dict:
    """--store overrides TTS_STORE_URL (read here, at the edge); neither: in-process."""
    url = args.store or os.environ.get("TTS_STORE_URL") or None
    out: dict[str, Any] = {"url": url} if url else {}
    if getattr(args, "store_fallback", False):
        out["fallback"] = True
    return out


@contextlib.contextmanager
def store_server(cfg: StoreConfig) -> Iterator[str | None]:
    """The store's URL, checked to answer (before any model loads), with 'local-redis'
    resolved to a private redis-server that lives as long as the command."""
    if cfg.url != "local-redis":
        from store.factory import check_store
        from store.redis_client import StoreUnavailableError

        try:
            check_store(cfg, cfg.url)
        except (StoreUnavailableError, ValueError) as e:  # down, or a malformed URL
            raise UsageError(f"--store: {e}") from e
        yield cfg.url
        return
    from store.local_server import LocalRedisServer, RedisServerError

    try:
        server = LocalRedisServer().start()
    except RedisServerError as e:
        raise UsageError(f"--store: {e}") from e
    try:
        print(f"tts: started redis-server at {server.url}", file=sys.stderr)
        yield server.url
    finally:
        server.stop()


def add_arguments(sto: argparse.ArgumentParser) -> None:
    actions = sto.add_subparsers(dest="action", required=True, parser_class=type(sto))
    for name, text in (
        (
            "stats",
            "log entries and bytes, claims, memory, eviction policy (all: every scope)",
        ),
        ("clear", "delete a scope's entries (all: every tts: key)"),
    ):
        act = actions.add_parser(name, help=text, description=text)
        act.add_argument(
            "--scope",
            choices=["job", "problem", "global", "all"],
            default="all",
            help="default: %(default)s",
        )
        act.add_argument("--id", help="the scope's id (problem: the prompt hash in stats)")
        act.add_argument(
            "--store",
            help="redis://host:port/db or redis+cluster://host:port,... (default: $TTS_STORE_URL)",
        )
        act.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    url = args.store or os.environ.get("TTS_STORE_URL")
    if not url or not url.startswith(("redis://", "rediss://", "unix://", "redis+cluster://")):
        raise UsageError(
            "--store: give a redis://host:port/db or redis+cluster://host:port,... URL "
            "(or set TTS_STORE_URL)"
        )
    if args.scope != "all" and args.id is None and args.scope != "global":
        raise UsageError(f"--id: the {args.scope} scope needs an id (or use --scope all)")
    from redis.cluster import RedisCluster

    from store.redis_client import ERRORS, client_from_url, delete_scope, scope_stats
    from store.redis_store import RedisScope

    if args.scope == "all":
        prefix = "tts:"
    else:
        prefix = RedisScope(args.scope, args.id or "default").prefix
    try:
        client = client_from_url(url)
    except ValueError as e:  # a malformed host list
        raise UsageError(f"--store: {e}") from e
    except ERRORS as e:
        raise UsageError(f"--store: cannot reach Redis at {url}: {e}") from e
    try:
        if args.action == "stats":
            cluster = isinstance(client, RedisCluster)
            nodes = {"target_nodes": RedisCluster.PRIMARIES} if cluster else {}
            memory = client.info("memory", **nodes)
            policy = client.config_get("maxmemory-policy", **nodes)
            if nodes:  # per node: {node: reply}
                used = {n: m.get("used_memory_human") for n, m in memory.items()}
                policy = next(iter(policy.values()), {})
            else:
                used = memory.get("used_memory_human")
            out = {
                **scope_stats(client, prefix),
                "used_memory": used,
                "maxmemory_policy": policy.get("maxmemory-policy"),
            }
        else:
            out = {"prefix": prefix, "deleted": delete_scope(client, prefix)}
    except ERRORS as e:
        raise UsageError(f"--store: cannot reach Redis at {url}: {e}") from e
    print(json.dumps(out))
    return 0
