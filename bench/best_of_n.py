"""Best-of-N benchmark on SmolLM2-135M at T=0.6: every configuration in one run, ratios against
plain decoding measured in the same run.

    python bench/best_of_n.py [--prompts 2] [--n 16] [--max-new-tokens 128]
        [--sequential plain pld recycle stand stand-det stand-tr80]
        [--batched hf plain-b16 stand-b4 stand-b8 stand-b16] [--log runs/bon-log.jsonl]

Sequential rows (STAND's setting): trajectory i drafts from what trajectories < i stored;
acceptance length is reported over the first N = 1, 4, 8, 16 trajectories. Batched rows:
`hf` is `model.generate(do_sample=True, num_return_sequences=n)`, the peer a user would pick;
`<method>-bK` runs the n trajectories in waves of K rows. `--log` writes the plain sequential
trajectories as a trajectory log for `tts replay`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from store.memory import InMemoryNgramStore
from tts_service.config import (
    ModelConfig,
    PlainDrafterConfig,
    PldDrafterConfig,
    RecyclingDrafterConfig,
    SamplingConfig,
    StandDrafterConfig,
)
from tts_service.engine.batch import nodes_per_row
from tts_service.generation import Generator
from tts_service.replay import LogWriter
from tts_service.solve import solve

PROMPTS = Path(__file__).with_name("prompts.jsonl")
METHODS = {
    "plain": PlainDrafterConfig(),
    "pld": PldDrafterConfig(),
    "recycle": RecyclingDrafterConfig(num_nodes=16),
    "stand": StandDrafterConfig(num_nodes=16),
    "stand-det": StandDrafterConfig(num_nodes=16, stochastic=False),
    "stand-tr80": StandDrafterConfig(num_nodes=16, tree="recycling-80"),
}


def first_n(trajs, n: int) -> float:
    """Acceptance length over the first n trajectories (tokens / forwards, pooled)."""
    sel = trajs[:n]
    return sum(t.output.stats.new_tokens for t in sel) / max(
        1, sum(t.output.stats.target_forwards for t in sel)
    )


def run_hf(gen: Generator, ids: list[int], cfg: SamplingConfig, n: int) -> dict:
    model = gen.loaded.model
    x = torch.tensor([ids], device=model.device)
    torch.manual_seed(cfg.seed)
    t = time.perf_counter()
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
    wall = time.perf_counter() - t
    eos = set(gen.loaded.eos_token_ids)
    tokens, forwards = 0, 0
    for row in out[:, len(ids) :].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        tokens += cut
        forwards += cut
    return {
        "tokens": tokens,
        "wall_s": wall,
        "forwards": forwards,
        "steps": out.shape[1] - len(ids),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--token-budget", type=int, default=64)
    ap.add_argument("--sequential", nargs="*", default=list(METHODS))
    ap.add_argument(
        "--batched", nargs="*", default=["hf", "plain-b16", "stand-b4", "stand-b8", "stand-b16"]
    )
    ap.add_argument("--log", default="runs/bon-log.jsonl")
    ap.add_argument("--out", default="runs/best_of_n.jsonl")
    args = ap.parse_args()

    gen = Generator.load(ModelConfig(name="smollm2-135m"))
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()][: args.prompts]
    encoded = [gen.encode(r["prompt"], chat=True) for r in rows]
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    gen.run(encoded[0], None, sampling.model_copy(update={"max_new_tokens": 8}))  # warm-up
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.log:
        Path(args.log).unlink(missing_ok=True)
    results: dict[str, dict] = {}
    with open(args.out, "w") as f:
        configs = [(m, 1) for m in args.sequential] + [
            (b.rsplit("-b", 1)[0], int(b.rsplit("-b", 1)[1])) if b != "hf" else ("hf", 0)
            for b in args.batched
        ]
        for method, batch in configs:
            name = method if batch == 1 else ("hf" if batch == 0 else f"{method}-b{batch}")
            agg = {"tokens": 0, "forwards": 0, "wall_s": 0.0, "by_n": {}}
            for p, ids in tqdm(list(zip(rows, encoded, strict=True)), desc=name, file=sys.stderr):
                if batch == 0:
                    r = run_hf(gen, ids, sampling, args.n)
                    agg["tokens"] += r["tokens"]
                    agg["forwards"] += r["steps"]  # one batched forward per step
                    agg["wall_s"] += r["wall_s"]
                    continue
                store = InMemoryNgramStore()
                record = bool(args.log) and method == "plain" and batch == 1
                t = time.perf_counter()
                res = solve(
                    gen,
                    ids,
                    args.n,
                    METHODS[method],
                    sampling,
                    store,
                    record=record,
                    batch=batch,
                    token_budget=args.token_budget,
                )
                agg["wall_s"] += time.perf_counter() - t
                total = res.totals()
                agg["tokens"] += total.new_tokens
                agg["forwards"] += total.target_forwards if batch == 1 else 0
                if batch > 1:  # one forward per step for the whole wave
                    agg["forwards"] += sum(
                        max(t.output.stats.target_forwards for t in res.trajectories[i : i + batch])
                        for i in range(0, args.n, batch)
                    )
                for k in (1, 4, 8, 16):
                    if k <= args.n:
                        agg["by_n"].setdefault(k, []).append(first_n(res.trajectories, k))
                agg.setdefault("acc_len", []).append(
                    total.new_tokens / max(1, total.target_forwards)
                )
                if record:
                    LogWriter(Path(args.log)).write(res.logged(p["id"], ids))
            entry = {
                "name": name,
                "method": method,
                "batch": batch,
                **agg,
                "tokens_per_s": agg["tokens"] / agg["wall_s"],
                "per_row_nodes": nodes_per_row(args.token_budget, batch) if batch > 1 else None,
            }
            results[name] = entry
            f.write(json.dumps(entry) + "\n")
            f.flush()
    print(markdown(results, args))


def markdown(results: dict, args) -> str:
    base = results.get("plain", next(iter(results.values())))["tokens_per_s"]
    seq = [r for r in results.values() if r["batch"] == 1]
    ns = [k for k in (1, 4, 8, 16) if k <= args.n]
    lines = [
        f"Sequential best-of-{args.n} (T={args.temperature}, {args.prompts} prompts, "
        f"{args.max_new_tokens} new tokens): acceptance length over the first N "
        "trajectories, and speed vs plain.",
        "",
        "| method | " + " | ".join(f"A (N={k})" for k in ns) + " | tokens/s | vs plain |",
        "|---|" + "---|" * (len(ns) + 2),
    ]
    for r in seq:
        accs = [sum(r["by_n"][k]) / len(r["by_n"][k]) for k in ns]
        lines.append(
            f"| {r['name']} | "
            + " | ".join(f"{a:.2f}" for a in accs)
            + f" | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x |"
        )
    lines += [
        "",
        f"Batched best-of-{args.n} (token budget {args.token_budget} per forward):",
        "",
        "| configuration | wall s | tokens/s | vs plain sequential | tokens per row-forward "
        "| forwards per token | draft nodes per row |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        acc = sum(r.get("acc_len", [0])) / max(1, len(r.get("acc_len", [])))
        fpt = r["forwards"] / max(1, r["tokens"])
        lines.append(
            f"| {r['name']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} "
            f"| {r['tokens_per_s'] / base:.2f}x | {acc:.2f} | {fpt:.3f} "
            f"| {r['per_row_nodes'] if r['per_row_nodes'] is not None else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
