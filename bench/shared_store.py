"""Two actors sharing a problem's store through Redis, against one actor and two that share
nothing: the acceptance each gets, and how late one actor's rows reach the other's drafts.

    python -m bench.shared_store [--problems 2] [--new-tokens 256] [--method stand] [--nodes 8]
        [--json bench/results/shared-store.json]

SmolLM2 on this device, best-of-16 of `--problems` held-out questions at T = 0.6, each row
drafting `--nodes` a step (the runner's fixed speculation: its planner decodes 16 rows plain on
a CPU, and acceptance is what this measures), three ways:
`one`: one process runs all 16 trajectories of each problem over its in-process store;
`shared`: two processes run 8 each (seeds 0-7 and 8-15, as a job's pool splits them) over one
Redis scope per problem (a private redis-server), started together; `apart`: the same two
processes, each over its own in-process store (what two actors with the default store get).
Per way: acceptance length (committed tokens per row forward, over every trajectory), row
forwards, decode seconds; for `shared`, the replication lag (a row learned in one process ->
merged in the other's replica) p50/p99 in milliseconds and in the receiving process's median
steps, and the rows each process merged from the other.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout_prompts.jsonl")


def questions(count: int) -> list[str]:
    lines = [json.loads(x)["question"] for x in PROMPTS.read_text().splitlines() if x]
    return lines[:count]


def actor(args: dict, start, out) -> None:
    """One process: load the model, wait for `start`, solve `n` trajectories (seeds from
    `seed`) of every question over its stores (`url` None: in-process), report."""
    import torch
    from pydantic import TypeAdapter

    from store.config import StoreConfig
    from store.factory import open_store
    from tts_service.config import ModelConfig, SamplingConfig
    from tts_service.drafters.registry import DrafterConfig, method_drafter
    from tts_service.generation import Generator
    from tts_service.runner import TrajectoryRunner
    from tts_service.solve import ProblemInput, solve_problems

    torch.set_num_threads(args["threads"])  # the device's cores shared out: none oversubscribed
    gen = Generator.load(ModelConfig(name="smollm2-135m", device="cpu"))
    drafter = TypeAdapter(DrafterConfig).validate_python(method_drafter(args["method"], {}, "cpu"))
    problems = [
        ProblemInput(
            f"q{p}",
            gen.encode(q, chat=True),
            open_store(StoreConfig(), args["url"], "problem", f"{args['scope']}-{p}"),
        )
        for p, q in enumerate(args["questions"])
    ]
    sampling = SamplingConfig(
        temperature=0.6,
        max_new_tokens=args["new_tokens"],
        ignore_eos=True,
        seed=args["seed"],
        run_nonce=7,
    )
    # every row drafts `nodes` a step (the planner would decode plain at 16 rows on a CPU)
    runner = TrajectoryRunner(gen, 16, "fixed", token_budget=16 * (args["nodes"] + 1))
    start.wait()
    t0 = time.perf_counter()
    solved = solve_problems(runner, problems, args["n"], drafter, sampling)
    decode_s = time.perf_counter() - t0
    for p in problems:
        p.store.flush()
    stats = [p.store.stats() for p in problems]
    for p in problems:
        p.store.close()
    trajectories = [t for r in solved.problems for t in r.trajectories]
    steps = runner.decoder.forwards.forwards
    out.put(
        {
            "tokens": sum(t.output.stats.new_tokens for t in trajectories),
            "row_forwards": sum(t.output.stats.target_forwards for t in trajectories),
            "decode_s": decode_s,
            "step_ms": 1e3 * decode_s / max(steps, 1),
            "lag_ms_p50": max((s.get("lag_ms_p50") or 0.0 for s in stats), default=0.0),
            "lag_ms_p99": max((s.get("lag_ms_p99") or 0.0 for s in stats), default=0.0),
            "remote_updates": sum(s.get("remote_updates", 0) for s in stats),
        }
    )


def way(name: str, url: str | None, actors: int, args: argparse.Namespace) -> dict:
    """Run `actors` processes (16 // actors trajectories each) together; their sum."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    n = 16 // actors
    scope = f"{name}-{time.time_ns()}"
    procs = []
    for a in range(actors):
        spec = {
            "url": url,
            "scope": scope if url is not None else f"{scope}-{a}",
            "questions": questions(args.problems),
            "n": n,
            "seed": a * n,
            "method": args.method,
            "new_tokens": args.new_tokens,
            "threads": max(1, (os.cpu_count() or 1) // actors),
            "nodes": args.nodes,
        }
        procs.append(ctx.Process(target=actor, args=(spec, start, out)))
    for p in procs:
        p.start()
    time.sleep(1.0)
    print(f"[shared] {name}: waiting for {actors} process(es) to load the model", flush=True)
    start.set()
    reports = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    tokens = sum(r["tokens"] for r in reports)
    forwards = sum(r["row_forwards"] for r in reports)
    step_ms = statistics.median(r["step_ms"] for r in reports)
    rec = {
        "way": name,
        "actors": actors,
        "acceptance_length": round(tokens / forwards, 3),
        "row_forwards": forwards,
        "tokens": tokens,
        "decode_s": round(max(r["decode_s"] for r in reports), 1),
        "step_ms": round(step_ms, 1),
    }
    if url is not None:
        rec["lag_ms_p50"] = round(max(r["lag_ms_p50"] for r in reports), 1)
        rec["lag_ms_p99"] = round(max(r["lag_ms_p99"] for r in reports), 1)
        rec["lag_steps_p99"] = round(rec["lag_ms_p99"] / step_ms, 2)
        rec["remote_updates"] = [r["remote_updates"] for r in reports]
    print(f"[shared] {json.dumps(rec)}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--method", default="stand")
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes a row a step")
    ap.add_argument("--json", type=Path, help="write the records here (a JSON list)")
    args = ap.parse_args(argv)
    from store.local_server import LocalRedisServer

    records = []
    with LocalRedisServer() as server:
        for name, url, actors in (
            ("one", None, 1),
            ("shared", server.url, 2),
            ("apart", None, 2),
        ):
            records.append(way(name, url, actors, args))
            if args.json:  # as it goes
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(records, indent=1) + "\n")
    one = records[0]["acceptance_length"]
    for rec in records[1:]:
        rec["acceptance_vs_one"] = round(rec["acceptance_length"] / one, 3)
    print(json.dumps({"records": records, "load": round(os.getloadavg()[0], 2)}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
