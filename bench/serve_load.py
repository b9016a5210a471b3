"""Serve under load (issue 32): concurrent OpenAI clients against one `tts serve` replica.

    python -m bench.serve_load [--clients 1 8 32 64] [--methods plain auto] [--max-tokens 64]
        [--solve-clients 1 4] [--solve-n 8] [--poison-every 1] [--out runs/serve_load.jsonl]

It starts a private Ray on 127.0.0.1 and the app `tts serve` builds (`build_app`, SmolLM2 as
`configs/serve.yaml` names it, on this CPU, one replica, the default admission limits), then
for each number of clients and each method (`spec_method`, the order alternating from level to
level) runs `clients` threads that each send chat requests back to back (the held-out prompts,
`--max-tokens` tokens, T = 0.6, a seed per request) until max(clients, 4) requests are done;
then `/v1/solve` with n = `--solve-n` the same way. Per cell it reports throughput (completion
tokens over the cell's wall time), p50/p99/max latency, the HTTP statuses, and the rows in
the replica's batch (`tts_rows_running`, sampled every 0.5 s while requests run: mean and
max). One JSON line per cell goes to `--out` as it finishes. With `--poison-every S`, each chat
cell runs twice, clean and with one poison request (`POISON`: ids out of the vocabulary, a lone
surrogate, no token) every S seconds, in turn: every poison must be a 4xx, every other request
a 200, at the clean run's throughput.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout_prompts.jsonl")


def post(url: str, body: dict) -> tuple[int, dict, float]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, {}, time.perf_counter() - t0


def rows_running(base: str) -> int:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tts_rows_running "):
                return int(float(line.split()[1]))
    return 0


POISON = (
    {"prompt": [-1], "max_tokens": 4},  # a negative id
    {"prompt": [10**9, 5], "max_tokens": 4},  # an id past the vocabulary
    {"prompt": "\ud800", "max_tokens": 4},  # a lone surrogate
    {"prompt": [], "max_tokens": 4},  # no token at all
)
"""Requests that must be refused (4xx) alone: `--poison-every` sends them among the clients'."""


def poisoner(base: str, every_s: float, done: threading.Event, statuses: list[int]) -> None:
    """One poison request every `every_s` seconds until `done`, the kinds in turn."""
    for body in itertools.cycle(POISON):
        if done.wait(every_s):
            return
        statuses.append(post(base + "/v1/completions", body)[0])


def cell(base: str, route: str, bodies: list[dict], clients: int, poison_s: float = 0) -> dict:
    """`bodies` sent by `clients` threads back to back; rows sampled meanwhile; with
    `poison_s`, a poison request that often beside them."""
    samples: list[int] = []
    poisoned: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples.append(rows_running(base))
            time.sleep(0.5)

    threads = [threading.Thread(target=watch)]
    if poison_s:
        threads.append(threading.Thread(target=poisoner, args=(base, poison_s, done, poisoned)))
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda b: post(base + route, b), bodies))
    wall = time.perf_counter() - t0
    done.set()
    for t in threads:
        t.join()
    latencies = sorted(s for _, _, s in replies)
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) for _, r, _ in replies)
    busy = [s for s in samples if s] or [0]
    return {
        "requests": len(bodies),
        "statuses": {
            str(k): sum(1 for c, _, _ in replies if c == k) for k in {c for c, _, _ in replies}
        },
        "wall_s": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "p50_s": round(statistics.median(latencies), 2),
        "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
        "max_s": round(latencies[-1], 2),
        "mean_rows_running": round(statistics.mean(busy), 2),
        "max_rows_running": max(busy),
        "poison_statuses": {str(k): poisoned.count(k) for k in sorted(set(poisoned))},
    }


def start_app(name: str) -> str:
    """A private Ray on 127.0.0.1 and the app `tts serve` builds (SmolLM2 on this CPU, one
    replica, the default admission limits) on a free port; returns its base URL."""
    from ray import serve

    from actors.cluster import start_local
    from store.local_server import free_port
    from tts_service.schemas import ServeConfig
    from tts_service.serve.app import build_app

    start_local(num_cpus=2)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = ServeConfig(model={"name": "smollm2-135m", "device": "cpu"})
    serve.run(build_app(cfg), name=name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--methods", nargs="+", default=["plain", "auto"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--solve-clients", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--solve-n", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/serve_load.jsonl"))
    ap.add_argument(
        "--poison-every",
        type=float,
        default=0,
        help="seconds: each chat cell also runs with one poison request this often (clean and "
        "poisoned in turn; default 0: clean only)",
    )
    args = ap.parse_args(argv)

    from ray import serve

    questions = [json.loads(x)["question"] for x in PROMPTS.read_text().splitlines() if x]
    base = start_app("tts-load")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    seeds = itertools.count()
    load = os.getloadavg()[0]
    post(
        base + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )

    def record(rec: dict) -> None:
        nonlocal load
        rec["load_before"] = round(load, 2)
        load = os.getloadavg()[0]
        print(json.dumps(rec), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    for level, clients in enumerate(args.clients):
        methods = args.methods if level % 2 == 0 else args.methods[::-1]
        for method in methods:
            bodies = [
                {
                    "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0.6,
                    "seed": next(seeds),
                    "spec_method": method,
                }
                for i in range(max(clients, 4))
            ]
            runs = [0.0, args.poison_every] if args.poison_every else [0.0]
            for poison_s in runs if level % 2 == 0 else runs[::-1]:
                stats = cell(base, "/v1/chat/completions", bodies, clients, poison_s)
                rec = {"route": "chat", "method": method, "clients": clients, **stats}
                record({**rec, "poison_every_s": poison_s})
    for clients in args.solve_clients:
        for method in args.methods:
            bodies = [
                {
                    "question": questions[i % len(questions)],
                    "n": args.solve_n,
                    "max_tokens": args.max_tokens,
                    "seed": next(seeds),
                    "method": method,
                }
                for i in range(max(clients, 2))
            ]
            stats = cell(base, "/v1/solve", bodies, clients)
            record(
                {"route": "solve", "method": method, "clients": clients, "n": args.solve_n, **stats}
            )
    serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
