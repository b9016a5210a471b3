"""Best-of-16 at reasoning length: per-step cost as the context grows, and peak memory.

    python -m bench.long_trajectories [--problems 2] [--n 16] [--prompt-tokens 2048]
        [--new-tokens 2048] [--method auto] [--store memory|redis] [--out runs/long.jsonl]

SmolLM2 on this device, `--problems` problems of `--prompt-tokens` prompt tokens each (the
held-out questions' text, repeated to length), `--n` trajectories each on 16 rows, T = 0.6,
`ignore_eos` so every trajectory reaches `--new-tokens`. It steps the runner itself and keeps
every step's context (cache slots attention spans), rows, draft/forward/observe seconds and
wall time; it reports, per 512-slot context bucket, the median step's forward (device) and host
(draft + observe + the rest of the tick) seconds, the ratio of the last bucket's forward to the
first's against the ratio the step's arithmetic predicts (`step_flops`), peak RSS and the KV
cache's largest size, and the drafting figures (acceptance length, nodes a step). With
`--store redis` the problems' stores are a private redis-server's. One JSON object goes to
`--out`; every step so far to `OUT.steps.jsonl` every 200 steps (a cut run keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout_prompts.jsonl")
PARAMS, LAYERS, WIDTH = 134.5e6, 30, 576  # SmolLM2-135M


def step_flops(rows: int, tokens: int, context: int) -> float:
    """A step's arithmetic: the weights' products per token, and attention over the context."""
    return rows * tokens * (2.0 * PARAMS + 4.0 * context * WIDTH * LAYERS)


def long_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` ids: the held-out questions' text, each prompt from its own
    starting question, repeated to length."""
    questions = [json.loads(x)["question"] for x in PROMPTS.read_text().splitlines() if x]
    out = []
    for p in range(count):
        ids: list[int] = []
        i = p
        while len(ids) < tokens:
            ids += tokenizer(questions[i % len(questions)] + "\n\n")["input_ids"]
            i += 1
        out.append(ids[:tokens])
    return out


class SteppedRuns:
    """`solve_problems`' runner, stepped here so that every step is timed."""

    def __init__(self, runner, steps_out: Path) -> None:
        self.runner, self.steps, self.kv_peak = runner, [], 0
        self.steps_out = steps_out  # every step, written as it goes (a cut run keeps them)

    def run(self, requests, on_result=None, skip=None):
        sub = self.runner.submit(requests, on_result, skip)
        dec = self.runner.decoder
        while not sub.done.is_set():
            before, t0 = dec.forwards.forwards, time.perf_counter()
            self.runner.tick()
            f = dec.forwards
            self.kv_peak = max(self.kv_peak, dec.cache.nbytes)
            if f.forwards > before:
                rows, width = f.trace[-1]
                self.steps.append(
                    (f.last_context, rows, width, f.last_draft_s, f.last_forward_s,
                     f.last_observe_s, time.perf_counter() - t0)
                )  # fmt: skip
                if len(self.steps) % 200 == 0:  # progress, on stderr; the steps so far, on disk
                    self.flush()
                    print(
                        f"[long] step {len(self.steps)}: context {f.last_context}, {rows} rows, "
                        f"forward {1e3 * f.last_forward_s:.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
        self.flush()
        return sub.wait()

    def flush(self) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        with self.steps_out.open("w") as f:
            for step in self.steps:
                f.write(json.dumps(step) + "\n")
            f.write(json.dumps({"peak_rss_mib": rss, "kv_cache_peak_mib": self.kv_peak >> 20}))


def buckets(steps: list[tuple]) -> list[dict]:
    """Median step per 512-slot context bucket, over the steps with at least half the rows
    (the batch full, not its last rows draining)."""
    out, full = [], max(s[1] for s in steps)
    for lo in range(0, max(s[0] for s in steps) + 1, 512):
        inside = [s for s in steps if lo <= s[0] < lo + 512 and 2 * s[1] >= full]
        if not inside:
            continue
        forward = statistics.median(s[4] for s in inside)
        host = statistics.median(s[6] - s[4] for s in inside)
        rows = statistics.median(s[1] for s in inside)
        width = statistics.median(s[2] for s in inside)
        out.append({"context": lo, "steps": len(inside), "rows": rows, "width": width,
                    "forward_ms": round(1e3 * forward, 1), "host_ms": round(1e3 * host, 1),
                    "draft_ms": round(1e3 * statistics.median(s[3] for s in inside), 2),
                    "observe_ms": round(1e3 * statistics.median(s[5] for s in inside), 2),
                    "flops": step_flops(int(rows), int(width), lo + 256)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--store", choices=["memory", "redis"], default="memory")
    ap.add_argument("--out", type=Path, default=Path("runs/long_trajectories.jsonl"))
    args = ap.parse_args(argv)

    from pydantic import TypeAdapter

    from store.config import StoreConfig
    from store.factory import open_store
    from store.local_server import LocalRedisServer
    from tts_service.config import ModelConfig, SamplingConfig
    from tts_service.drafters.registry import DrafterConfig, method_drafter
    from tts_service.generation import Generator
    from tts_service.runner import TrajectoryRunner
    from tts_service.solve import ProblemInput, solve_problems

    t0 = time.perf_counter()
    gen = Generator.load(ModelConfig(name="smollm2-135m", device="cpu"))
    drafter = TypeAdapter(DrafterConfig).validate_python(method_drafter(args.method, {}, "cpu"))
    prompts = long_prompts(gen.loaded.tokenizer, args.problems, args.prompt_tokens)
    server = LocalRedisServer().start() if args.store == "redis" else None
    url = server.url if server is not None else None
    problems = [
        ProblemInput(f"long-{p}", ids, open_store(StoreConfig(), url, "problem", f"long-{p}"))
        for p, ids in enumerate(prompts)
    ]
    sampling = SamplingConfig(
        temperature=0.6, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = SteppedRuns(TrajectoryRunner(gen, 16), args.out.with_suffix(".steps.jsonl"))
    started = time.perf_counter()
    solved = solve_problems(runs, problems, args.n, drafter, sampling)
    decode_s = time.perf_counter() - started
    steps = runs.steps
    table = buckets(steps)
    settled = [b for b in table if b["steps"] >= 10] or table  # not the prefill's tick alone
    first, last = settled[0], settled[-1]
    rec = {
        "problems": args.problems, "n": args.n, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "method": args.method, "store": args.store,
        "steps": len(steps), "decode_s": round(decode_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "tokens": sum(len(t.output.token_ids) for r in solved.problems for t in r.trajectories),
        "forward_ratio_last_first": round(last["forward_ms"] / first["forward_ms"], 2),
        "arithmetic_ratio_last_first": round(last["flops"] / first["flops"], 2),
        "host_ratio_last_first": round(last["host_ms"] / max(first["host_ms"], 1e-9), 2),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "kv_cache_peak_mib": runs.kv_peak >> 20,
        "buckets": [{k: v for k, v in b.items() if k != "flops"} for b in table],
        "summary": {k: v for k, v in solved.stats().items() if not isinstance(v, list | dict)},
        "load": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    print(json.dumps(rec, indent=1), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    if server is not None:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
