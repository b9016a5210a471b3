"""Long prompts against one `tts serve` replica: no stall, bounded memory.

    python -m bench.long_context [--long 8000] [--short 16] [--short-tokens 8]
        [--lengths 2048 4096 8000] [--out runs/long_context.jsonl]

It starts a private Ray on 127.0.0.1 and the app `tts serve` builds (SmolLM2 on this CPU, one
replica, as `bench.serve_load` does), warms it with one short request, then:

1. `alone`: `--short` concurrent `/v1/completions` requests of about 20 token ids and
   `--short-tokens` new tokens: their p50/p99 latency.
2. `beside`: one request of `--long` token ids (`max_tokens` 2), and 1 s later the same short
   requests: the long one's status and time, the short ones' p99 against the bar
   2 × p99 alone + one chunk (the longest chunk the replica ran, from its log line).
3. `prefill`: one request of each of `--lengths` token ids alone (`max_tokens` 1): its time, and
   the ratio of each to the first against the ratio of the forward's arithmetic (weights'
   products plus attention's chunk × context products, `flops`).
4. Memory: the replica's RSS (from /proc) sampled every 0.2 s throughout; reported per phase
   as its start, peak and end, and 30 s after the last long request.

One JSON line per phase goes to `--out` as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.serve_load import post, start_app

CHUNK = 512  # the CPU's prefill chunk (`engine.prefill.max_chunk`)


def flops(tokens: int, params: float, layers: int, width: int, chunk: int = CHUNK) -> float:
    """A prefill's arithmetic: 2 × params per token, and per chunk of queries 4 × chunk ×
    context × width per layer (scores and the weighted sum over every key up to its end)."""
    total = 2.0 * params * tokens
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        total += 4.0 * (end - start) * end * width * layers
    return total


class RssWatch:
    """The replica's resident memory, sampled every 0.2 s in a thread (MiB)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples = [(time.monotonic(), self.now())]
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _run(self) -> None:
        while not self.done.wait(0.2):
            self.samples.append((time.monotonic(), self.now()))

    def span(self, t0: float, t1: float) -> dict:
        inside = [m for t, m in self.samples if t0 <= t <= t1] or [self.now()]
        return {"rss_start_mib": round(inside[0]), "rss_peak_mib": round(max(inside)),
                "rss_end_mib": round(inside[-1])}  # fmt: skip


def replica_pid() -> int:
    """The replica's process: Ray titles it `ray::ServeReplica:APP:TTSServer`."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        if "TTSServer" in " ".join(proc.cmdline()):
            return proc.pid
    raise RuntimeError("no TTSServer replica among this process's descendants")


def short_bodies(n: int, tokens: int) -> list[dict]:
    return [
        {
            "prompt": [100 + i + j for j in range(20)],
            "max_tokens": tokens,
            "temperature": 0.6,
            "seed": i,
        }  # fmt: skip
        for i in range(n)
    ]


def latencies(base: str, bodies: list[dict]) -> dict:
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: post(base + "/v1/completions", b), bodies))
    times = sorted(s for _, _, s in replies)
    return {
        "statuses": sorted({c for c, _, _ in replies}),
        "p50_s": round(statistics.median(times), 2),
        "p99_s": round(times[min(len(times) - 1, int(0.99 * len(times)))], 2),
    }


def long_body(n: int, max_tokens: int) -> dict:
    return {"prompt": [1000 + (7 * i) % 30000 for i in range(n)], "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--out", type=Path, default=Path("runs/long_context.jsonl"))
    args = ap.parse_args(argv)

    from ray import serve

    base = start_app("tts-long")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    post(base + "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    rss = RssWatch(replica_pid())

    def record(rec: dict) -> None:
        rec["load"] = round(os.getloadavg()[0], 2)
        print(json.dumps(rec), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    t0 = time.monotonic()
    alone = latencies(base, short_bodies(args.short, args.short_tokens))
    record({"phase": "alone", **alone, **rss.span(t0, time.monotonic())})

    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(post, base + "/v1/completions", long_body(args.long, 2))
        time.sleep(1.0)
        beside = latencies(base, short_bodies(args.short, args.short_tokens))
        status, _, seconds = long.result()
    record({"phase": "beside", "long_tokens": args.long, "long_status": status,
            "long_s": round(seconds, 2), **beside, "alone_p99_s": alone["p99_s"],
            **rss.span(t0, time.monotonic())})  # fmt: skip

    first, prefill_s = None, {}
    for n in args.lengths:
        t0 = time.monotonic()
        status, _, seconds = post(base + "/v1/completions", long_body(n, 1))
        cost = flops(n, 134.5e6, 30, 576)
        first, prefill_s[n] = first or (seconds, cost), seconds
        record({"phase": "prefill", "tokens": n, "status": status, "seconds": round(seconds, 2),
                "time_ratio": round(seconds / first[0], 2),
                "arithmetic_ratio": round(cost / first[1], 2),
                **rss.span(t0, time.monotonic())})  # fmt: skip
    if args.long in prefill_s:  # its last chunk's share of its arithmetic, of its time
        last = flops(args.long, 134.5e6, 30, 576) - flops(args.long - CHUNK, 134.5e6, 30, 576)
        chunk_s = prefill_s[args.long] * last / flops(args.long, 134.5e6, 30, 576)
        bar = 2 * alone["p99_s"] + chunk_s
        record({"phase": "verdict", "chunk_s": round(chunk_s, 2), "bar_s": round(bar, 2),
                "beside_p99_s": beside["p99_s"], "within": beside["p99_s"] <= bar})  # fmt: skip
    settled = time.monotonic()
    time.sleep(30)
    record({"phase": "idle_30s", "rss_mib": round(rss.now()),
            "rss_after_warmup_mib": round(rss.samples[0][1]),
            "since_last_s": round(time.monotonic() - settled)})  # fmt: skip
    rss.done.set()
    serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
