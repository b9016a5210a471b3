"""What the shared n-gram store costs per committed token and per problem, on each backend:
in-process, one Redis server, and a Redis Cluster of 3 masters with a replica each (issue 30).

    python -m bench.store_scaling [--concurrency 1 4 16] [--steps 200] [--json PATH]

Each trajectory is one logged response of the held-out log (`bench/trajectories-heldout-
smollm2.jsonl.gz`, real tokens and the target's top-10 at every position) replayed as the
engine would drive the store: per step it commits `--accept` tokens, looks up the contexts of
`--lookups` draft nodes (the next positions' contexts) and then adds one row per committed
token (its context and the logged top-10), which is the store's one round trip of the step.
`concurrency` trajectories of one problem run at once, in threads, each with its own store
object on the problem's one scope (as actors do; the in-process backend is one shared store).
Servers are started here on loopback ports and stopped by PID.

Reported per (backend, concurrency): round trips and bytes on the wire per committed token,
all and per writer (the servers' own `total_net_input_bytes` + `total_net_output_bytes`:
clients' appends and reads of the log; the replication traffic apart), p50/p99 of a step's
`add` (what the step waits for: the local merge; the append runs in the store's writer thread)
and of a lookup, the problem's memory in Redis (`MEMORY USAGE` of its keys on their master; per
committed token), the replication lag p99 (a row learned in one store -> merged in another),
and the servers' CPU time per committed token (`used_cpu_user` + `used_cpu_sys`, every node:
where a master saturates). Before the figures are read, every store has appended what it
learned and read what the others did.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import threading
import time
from pathlib import Path

import redis

from store.base import NgramRow
from store.config import StoreConfig
from store.factory import open_store
from store.local_server import LocalRedisCluster, LocalRedisServer
from store.memory import InMemoryNgramStore
from store.redis_client import client_from_url
from store.redis_store import RedisScope
from tts_service.replay import LoggedProblem, parse_line

LOG = Path(__file__).with_name("trajectories-heldout-smollm2.jsonl.gz")


def responses(path: Path, count: int) -> list[tuple[list[int], list[list[int]], list[list[float]]]]:
    """`count` logged responses with their top-k: (tokens, top ids, top probs) each."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            problem: LoggedProblem = parse_line(line)
            for r, tokens in enumerate(problem.responses):
                if problem.top_ids and problem.top_probs:
                    full = problem.prompt_ids + tokens
                    out.append((full, problem.top_ids[r], problem.top_probs[r]))
                if len(out) == count:
                    return out
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def replay(store, tokens, top_ids, top_probs, prompt_len, args, add_s, lookup_s) -> int:
    """Drive one trajectory's store use; returns the tokens it committed."""
    order = store.max_order
    pos, committed = prompt_len, 0
    end = min(len(tokens), prompt_len + args.steps * args.accept, prompt_len + len(top_ids))
    while pos + args.accept <= end:
        for d in range(args.lookups):  # drafting: the contexts of the next positions
            at = min(pos + d, len(tokens))
            t = time.perf_counter()
            store.lookup(tokens[max(0, at - order) : at])
            lookup_s.append(time.perf_counter() - t)
        rows = []
        for p in range(pos, pos + args.accept):  # what verification saw at each position
            i = p - prompt_len
            rows.append(
                NgramRow(
                    tuple(tokens[max(0, p - order) : p]), tuple(top_ids[i]), tuple(top_probs[i])
                )
            )
        t = time.perf_counter()
        store.add(rows)
        add_s.append(time.perf_counter() - t)
        pos += args.accept
        committed += args.accept
    store.flush()
    return committed


def server_cpu(clients: list[redis.Redis]) -> float:
    """CPU seconds the servers have used (user + system, main thread and children)."""
    total = 0.0
    for c in clients:
        cpu = c.info("cpu")
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


def wire(clients: list[redis.Redis]) -> tuple[int, int]:
    """(client bytes in + out, replication bytes in + out) over the servers (Redis 7's
    `total_net_*` include replication; `total_net_repl_*` are the replication part)."""
    total, repl = 0, 0
    for c in clients:
        stats = c.info("stats")
        both = int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])
        copy = int(stats.get("total_net_repl_input_bytes", 0))
        copy += int(stats.get("total_net_repl_output_bytes", 0))
        total, repl = total + both - copy, repl + copy
    return total, repl


def scope_memory(url: str, prefix: str) -> int:
    """Bytes the scope's keys take on their master (`MEMORY USAGE` of each; replicas hold as
    much again)."""
    client = client_from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    return sum(int(client.memory_usage(k) or 0) for k in keys)


def cell(backend: str, url: str | None, clients, concurrency: int, args, trajectories) -> dict:
    scope_id = f"bench-{backend}-{concurrency}-{time.monotonic_ns()}"
    shared = InMemoryNgramStore() if url is None else None
    stores = [
        shared if shared is not None else open_store(StoreConfig(), url, "problem", scope_id)
        for _ in range(concurrency)
    ]
    before = wire(clients) if clients else (0, 0)
    cpu_before = server_cpu(clients) if clients else 0.0
    add_s: list[float] = []
    lookup_s: list[float] = []
    done = [0] * concurrency

    def run(i: int) -> None:
        tokens, ids, probs = trajectories[i % len(trajectories)]
        prompt_len = len(tokens) - len(ids)
        done[i] = replay(stores[i], tokens, ids, probs, prompt_len, args, add_s, lookup_s)

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if shared is None:  # every reader has what every writer appended (its traffic counted)
        for s in stores:
            s.flush()
        for s in stores:
            s.catch_up()
    stats = [s.stats() for s in stores] if shared is None else [shared.stats()]
    for s in {id(s): s for s in stores}.values():
        s.close()
    after = wire(clients) if clients else (0, 0)
    cpu = server_cpu(clients) - cpu_before if clients else 0.0
    memory = scope_memory(url, RedisScope("problem", scope_id).prefix) if url else None
    tokens = sum(done)
    trips = sum(s.get("round_trips", 0) for s in stats)
    return {
        "backend": backend,
        "concurrency": concurrency,
        "committed_tokens": tokens,
        "round_trips_per_token": trips / tokens,
        "bytes_per_token": (after[0] - before[0]) / tokens,
        "bytes_per_token_per_writer": (after[0] - before[0]) / tokens / concurrency,
        "replication_bytes_per_token": (after[1] - before[1]) / tokens,
        "server_cpu_us_per_token": cpu / tokens * 1e6,
        "add_ms_p50": percentile(add_s, 0.5) * 1e3,
        "add_ms_p99": percentile(add_s, 0.99) * 1e3,
        "lookup_us_p50": percentile(lookup_s, 0.5) * 1e6,
        "lookup_us_p99": percentile(lookup_s, 0.99) * 1e6,
        "lookup_us_mean": statistics.fmean(lookup_s) * 1e6 if lookup_s else 0.0,
        "problem_memory_kb": None if memory is None else memory / 1024,
        "memory_bytes_per_token": None if memory is None else memory / tokens,
        "lag_ms_p99": max((s.get("lag_ms_p99") or 0.0 for s in stats), default=0.0),
        "lost_updates": sum(s.get("lost_updates", 0) for s in stats),
        "replication_waits": sum(s.get("replication_waits", 0) for s in stats),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=200, help="steps per trajectory (at most)")
    ap.add_argument("--accept", type=int, default=2, help="tokens committed per step")
    ap.add_argument("--lookups", type=int, default=8, help="draft-node lookups per step")
    ap.add_argument("--log", type=Path, default=LOG)
    ap.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    args = ap.parse_args(argv)
    trajectories = responses(args.log, max(args.concurrency))
    records = []
    with LocalRedisServer() as server, LocalRedisCluster(masters=3, replicas=1) as cluster:
        single = [redis.Redis(port=server.port)]
        masters = [redis.Redis(port=n.port) for n in cluster.nodes]  # replicas' traffic too
        for concurrency in args.concurrency:
            for backend, url, clients in (
                ("in-process", None, []),
                ("redis", server.url, single),
                ("redis-cluster", cluster.url, masters),
            ):
                rec = cell(backend, url, clients, concurrency, args, trajectories)
                records.append(rec)
                print(
                    f"{backend:14s} x{concurrency:<3d} "
                    f"trips/token {rec['round_trips_per_token']:.2f}"
                    f"  bytes/token {rec['bytes_per_token']:5.0f} "
                    f"({rec['bytes_per_token_per_writer']:.0f} a writer) "
                    f"(+{rec['replication_bytes_per_token']:.0f} repl)  add p50/p99 "
                    f"{rec['add_ms_p50']:.2f}/{rec['add_ms_p99']:.2f} ms  lookup p50/p99 "
                    f"{rec['lookup_us_p50']:.1f}/{rec['lookup_us_p99']:.1f} us  problem "
                    f"{rec['problem_memory_kb'] or 0:.0f} KiB "
                    f"({rec['memory_bytes_per_token'] or 0:.0f} B/token)  lag p99 "
                    f"{rec['lag_ms_p99']:.1f} ms  server cpu "
                    f"{rec['server_cpu_us_per_token']:.1f} us/token  lost {rec['lost_updates']}  "
                    f"waits {rec['replication_waits']}",
                    flush=True,
                )
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(records, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
