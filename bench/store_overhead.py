"""Store benchmark: Redis vs in-process, in one run.

    python bench/store_overhead.py [--n 4] [--max-new-tokens 96]

Micro: lookup latency (local-cache hit, miss), update throughput (one pipelined round trip
per step). End to end: best-of-n STAND on SmolLM2 with each store; drafting + store time per
step against the whole step.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from store.base import NgramRow
from store.local_server import LocalRedisServer
from store.memory import InMemoryNgramStore
from store.redis_store import RedisLogitNgramStore, RedisScope
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.generation import Generator
from tts_service.solve import solve


def rows(rng: random.Random, k: int) -> list[NgramRow]:
    out = []
    for _ in range(k):
        ctx = tuple(rng.randrange(2000) for _ in range(4))
        ids = tuple(rng.sample(range(49152), 10))
        out.append(NgramRow(ctx, ids, tuple(sorted((rng.random() for _ in ids), reverse=True))))
    return out


def micro(url: str) -> dict:
    rng = random.Random(0)
    result = {}
    for name, store in (
        ("memory", InMemoryNgramStore()),
        ("redis", RedisLogitNgramStore.connect(url, scope=RedisScope("job", "bench"))),
    ):
        steps = [rows(rng, 3) for _ in range(300)]  # 3 committed positions per step
        t = time.perf_counter()
        for step in steps:
            store.add(step)
        add_s = (time.perf_counter() - t) / len(steps)
        hits = [r.context for step in steps for r in step]
        t = time.perf_counter()
        for ctx in hits:
            store.lookup(ctx)
        hit_us = (time.perf_counter() - t) / len(hits) * 1e6
        misses = [tuple(rng.randrange(5000, 9000) for _ in range(4)) for _ in range(2000)]
        t = time.perf_counter()
        for ctx in misses:
            store.lookup(ctx)
        miss_us = (time.perf_counter() - t) / len(misses) * 1e6
        result[name] = {
            "add_ms_per_step": add_s * 1e3,
            "updates_per_s": 3 * 4 / add_s,
            "lookup_hit_us": hit_us,
            "lookup_miss_us": miss_us,
        }
    return result


def end_to_end(gen: Generator, url: str, n: int, max_new: int) -> dict:
    q = (
        "Solve step by step: a rectangle has a perimeter of 30 cm and a length of 9 cm. "
        "What is its area? Put the final answer in \\boxed{}."
    )
    ids = gen.encode(q, chat=True)
    cfg = SamplingConfig(temperature=0.6, max_new_tokens=max_new)
    out = {}
    for name in ("memory", "redis"):
        store = (
            InMemoryNgramStore()
            if name == "memory"
            else RedisLogitNgramStore.connect(
                url, scope=RedisScope("problem", f"e2e-{time.time()}")
            )
        )
        total = solve(gen, ids, n, StandDrafterConfig(num_nodes=16), cfg, store).stats()
        out[name] = {
            "steps": total["target_forwards"],
            "tokens": total["new_tokens"],
            "acceptance_length": total["acceptance_length"],
            "draft_and_store_ms_per_step": total["draft_s"] / total["target_forwards"] * 1e3,
            "step_ms": total["wall_s"] / total["target_forwards"] * 1e3,
            "overhead_share": total["draft_s"] / total["wall_s"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="runs/store.json")
    args = ap.parse_args()
    gen = Generator.load(ModelConfig(name="smollm2-135m"))
    with LocalRedisServer() as server:
        report = {
            "micro": micro(server.url),
            "end_to_end": end_to_end(gen, server.url, args.n, args.max_new_tokens),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("| store | add ms/step | updates/s | lookup hit µs | lookup miss µs |")
    print("|---|---|---|---|---|")
    for name, m in report["micro"].items():
        print(
            f"| {name} | {m['add_ms_per_step']:.2f} | {m['updates_per_s']:.0f} "
            f"| {m['lookup_hit_us']:.1f} | {m['lookup_miss_us']:.1f} |"
        )
    print()
    print("| store | steps | acceptance length | draft+store ms/step | step ms | share |")
    print("|---|---|---|---|---|---|")
    for name, e in report["end_to_end"].items():
        print(
            f"| {name} | {e['steps']} | {e['acceptance_length']:.2f} "
            f"| {e['draft_and_store_ms_per_step']:.2f} | {e['step_ms']:.1f} "
            f"| {100 * e['overhead_share']:.1f}% |"
        )


if __name__ == "__main__":
    main()
