"""Best-of-N throughput on SmolLM2-135M: our runner against `generate(num_return_sequences=N)`,
every configuration in one run, in turn, on the same problems and seeds.

    python bench/best_of_n.py [--prompts 4] [--n 16] [--max-new-tokens 256] [--rounds 1]
        [--configs hf plain stand-waves stand]

Configurations:
- `hf`: `model.generate(do_sample=True, num_return_sequences=n)` problem by problem, the peer a
  user would pick (a finished row stays in the batch until the longest one ends).
- `plain`: our runner, continuous batching of `--max-rows` rows, no drafts.
- `stand-waves`: STAND in waves of `--max-rows` rows (each wave waits for its longest row), a
  fixed budget of `--token-budget` tokens per forward shared out over the rows (the earlier
  rule).
- `stand`: our runner, continuous batching and cost-aware speculation (the allocator picks the
  draft nodes per row at every step from the learned cost surface).

Each round runs every configuration over all problems, in a rotated order. Reports tokens/s,
target forwards per token, mean rows per forward and, for the runner, the draft nodes per row
over time; JSON lines to `--out`, a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from store.memory import InMemoryNgramStore
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.base import PlainDrafterConfig
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.matmul import restore_linear_products, tune_linear_products
from tts_service.generation import Generator
from tts_service.runner import TrajectoryRunner
from tts_service.solve import ProblemInput, solve_problems

PROMPTS = Path(__file__).with_name("prompts.jsonl")
STAND = StandDrafterConfig(num_nodes=16)


def run_hf(gen: Generator, problems: list[list[int]], cfg: SamplingConfig, n: int) -> dict:
    """`generate` on the model as a user loads it: our per-shape products are taken out for
    this run and put back after it."""
    model = gen.loaded.model
    restore_linear_products(model)
    try:
        return _generate(gen, problems, cfg, n)
    finally:
        if model.device.type == "cpu":
            tune_linear_products(model)


def _generate(gen: Generator, problems: list[list[int]], cfg: SamplingConfig, n: int) -> dict:
    model, eos = gen.loaded.model, set(gen.loaded.eos_token_ids)
    tokens = forwards = rows = 0
    t0 = time.perf_counter()
    for ids in problems:
        x = torch.tensor([ids], device=model.device)
        torch.manual_seed(cfg.seed)
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=True,
            temperature=cfg.temperature,
            top_p=1.0,
            top_k=None,
            max_new_tokens=cfg.max_new_tokens,
            num_return_sequences=n,
            pad_token_id=gen.loaded.eos_token_ids[0],
        )
        steps = out.shape[1] - len(ids)
        for row in out[:, len(ids) :].tolist():
            tokens += next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        forwards += steps
        rows += steps * n
    wall = time.perf_counter() - t0
    return {
        "new_tokens": tokens,
        "target_forwards": forwards,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_rows_per_forward": rows / max(1, forwards),
        "acceptance_length": 1.0,
    }


def run_ours(
    gen: Generator,
    problems: list[list[int]],
    cfg: SamplingConfig,
    n: int,
    name: str,
    args: argparse.Namespace,
) -> dict:
    inputs = [ProblemInput(f"p{i}", ids, InMemoryNgramStore()) for i, ids in enumerate(problems)]
    if name == "stand-waves":  # each problem in waves of max_rows rows, a fixed budget
        t0 = time.perf_counter()
        runs = []
        for p in inputs:
            for first in range(0, n, args.max_rows):
                runner = TrajectoryRunner(gen, args.max_rows, "fixed", args.token_budget)
                wave = min(args.max_rows, n - first)
                runs.append(
                    solve_problems(
                        runner, [p], wave, STAND, cfg.model_copy(update={"seed": cfg.seed + first})
                    )
                )
        wall = time.perf_counter() - t0
        stats = [r.stats() for r in runs]
        tokens = sum(s["new_tokens"] for s in stats)
        forwards = sum(s["target_forwards"] for s in stats)
        row_forwards = sum(s["row_forwards"] for s in stats)
        return {
            "new_tokens": tokens,
            "target_forwards": forwards,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "mean_rows_per_forward": row_forwards / max(1, forwards),
            "acceptance_length": tokens / max(1, row_forwards),
            "nodes_per_row": max(0, args.token_budget // args.max_rows - 1),
        }
    drafter = STAND if name == "stand" else PlainDrafterConfig()
    run = solve_problems(TrajectoryRunner(gen, args.max_rows), inputs, n, drafter, cfg)
    out = run.stats()
    trace = run.report.nodes_trace
    out["nodes_trace"] = trace[:: max(1, len(trace) // 40)]  # ~40 points: (t, rows, nodes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--configs", nargs="*", default=["hf", "plain", "stand-waves", "stand"])
    ap.add_argument("--out", default="runs/best_of_n.jsonl")
    args = ap.parse_args()

    gen = Generator.load(ModelConfig(name="smollm2-135m"))
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()][: args.prompts]
    problems = [gen.encode(r["prompt"], chat=True) for r in rows]
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    surface = gen.surface(args.max_rows)  # the cost surface's prior, opened before any timing
    calibration_s = time.perf_counter() - t0
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    with open(args.out, "w") as f:
        f.write(
            json.dumps(
                {
                    "cost_surface": surface.to_dict(),
                    "calibration_s": calibration_s,
                }
            )
            + "\n"
        )
        for rnd in range(args.rounds):
            order = (
                args.configs[rnd % len(args.configs) :] + args.configs[: rnd % len(args.configs)]
            )
            for name in order:
                if name == "hf":
                    r = run_hf(gen, problems, sampling, args.n)
                else:
                    r = run_ours(gen, problems, sampling, args.n, name, args)
                r.update(name=name, round=rnd, load=os.getloadavg()[0])
                results[name].append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"{name}: {r['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    print(markdown(results, args))


def markdown(results: dict[str, list[dict]], args) -> str:
    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in results[name]) / len(results[name])

    base = mean("hf", "tokens_per_s") if results.get("hf") else None
    lines = [
        f"{args.prompts} problems × {args.n} trajectories, ≤ {args.max_new_tokens} new tokens, "
        f"T = {args.temperature}, {args.max_rows} rows, {args.rounds} round(s).",
        "",
        "| configuration | tokens | wall s | tokens/s | vs hf | forwards per token "
        "| rows per forward | tokens per row-forward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in results:
        tps = mean(name, "tokens_per_s")
        lines.append(
            f"| {name} | {mean(name, 'new_tokens'):.0f} | {mean(name, 'wall_s'):.1f} "
            f"| {tps:.1f} | {f'{tps / base:.2f}x' if base else '-'} "
            f"| {mean(name, 'target_forwards') / mean(name, 'new_tokens'):.3f} "
            f"| {mean(name, 'mean_rows_per_forward'):.2f} | {mean(name, 'acceptance_length'):.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
