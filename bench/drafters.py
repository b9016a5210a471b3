"""Drafter benchmark on SmolLM2-135M: acceptance length and speed vs plain decoding, one run.

    python bench/drafters.py [--prompts 12] [--max-new-tokens 256] [--temperatures 0 0.6]
                             [--methods plain pld recycle-8 hf-pld] [--out runs/drafters.jsonl]

Methods: `plain` (plain decoding through the runner, as `tts generate --method plain`),
`pld[-N]` (N draft tokens), `recycle[-N]` (N tree nodes), `hf-plain` / `hf-pld`
(transformers' `generate`, without / with `prompt_lookup_num_tokens=10`, the peer a user
would pick). Every speed is a ratio against
`plain` measured in the same run, at the same temperature. Rows are written as they finish.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.base import PlainDrafterConfig
from tts_service.drafters.pld import PldDrafterConfig
from tts_service.drafters.recycling import RecyclingDrafterConfig
from tts_service.engine.tree import DraftTree, pack
from tts_service.generation import Generator

PROMPTS = Path(__file__).with_name("prompts.jsonl")


def load_prompts(limit: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return rows[:limit]


def drafter_for(method: str):
    name, _, size = method.partition("-")
    if name == "plain":
        return PlainDrafterConfig()
    if name == "pld":
        return PldDrafterConfig(num_draft_tokens=int(size or 6))
    if name == "recycle":
        return RecyclingDrafterConfig(num_nodes=int(size or 16))
    raise ValueError(f"unknown method {method!r}")


@torch.inference_mode()
def verify_cost(gen: Generator, sizes: list[int], context: int = 300, reps: int = 5) -> dict:
    """Median ms of one verify forward of `k` tree tokens over a `context`-token KV cache."""
    model = gen.loaded.model
    ids = torch.randint(100, 1000, (1, context), device=model.device)
    out = {}
    for k in sizes:
        times = []
        for _ in range(reps + 1):
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache)
            tree = DraftTree.chain(5, list(range(10, 9 + k)))
            x, pos, mask = pack(tree, context, model.dtype, model.device)
            t = time.perf_counter()
            model(x, attention_mask=mask, position_ids=pos, past_key_values=cache)
            times.append(time.perf_counter() - t)
        out[k] = statistics.median(times[1:]) * 1000
    return out


class ForwardCounter:
    """Counts target forwards of transformers' own generate (its acceptance length)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


@torch.inference_mode()
def run_hf(
    gen: Generator, counter: ForwardCounter, ids: list[int], cfg: SamplingConfig, lookup: bool
) -> dict:
    model = gen.loaded.model
    x = torch.tensor([ids], device=model.device)
    kwargs = (
        dict(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=None)
        if not cfg.greedy
        else dict(do_sample=False)
    )
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    torch.manual_seed(cfg.seed)
    before, t = counter.calls, time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=gen.loaded.eos_token_ids[0],
        **kwargs,
    )
    wall = time.perf_counter() - t
    return {
        "new_tokens": out.shape[1] - len(ids),
        "target_forwards": counter.calls - before,
        "wall_s": wall,
    }


def run_ours(gen: Generator, ids: list[int], cfg: SamplingConfig, method: str) -> dict:
    """One generation through the runner, every step drafting the method's whole tree."""
    from store.memory import InMemoryNgramStore
    from tts_service.runner import TrajectoryRunner
    from tts_service.trajectory import trajectory_requests

    runner = TrajectoryRunner(gen, 1, "fixed", token_budget=1025)
    requests = trajectory_requests("q", ids, [0], cfg, drafter_for(method), InMemoryNgramStore())
    s = runner.run(requests).results[0].output.stats
    return {
        "new_tokens": s.new_tokens,
        "target_forwards": s.target_forwards,
        "wall_s": s.wall_s,
        "draft_s": s.draft_s,
        "tree_nodes": s.tree_nodes,
    }


def summarize(rows: list[dict], methods: list[str], temperatures: list[float]) -> list[dict]:
    table = []
    for temp in temperatures:
        agg = {}
        for m in methods:
            sel = [r for r in rows if r["method"] == m and r["temperature"] == temp]
            tok = sum(r["new_tokens"] for r in sel)
            fwd = sum(r["target_forwards"] for r in sel)
            wall = sum(r["wall_s"] for r in sel)
            agg[m] = {
                "tokens": tok,
                "forwards": fwd,
                "wall_s": wall,
                "tree_nodes": sum(r.get("tree_nodes", 0) for r in sel),
            }
        base = agg["plain"]["tokens"] / agg["plain"]["wall_s"]
        for m in methods:
            a = agg[m]
            tps = a["tokens"] / a["wall_s"]
            table.append(
                {
                    "temperature": temp,
                    "method": m,
                    "new_tokens": a["tokens"],
                    "target_forwards": a["forwards"],
                    "acceptance_length": a["tokens"] / a["forwards"],
                    "nodes_per_forward": a["tree_nodes"] / a["forwards"] if a["tree_nodes"] else 0,
                    "tokens_per_s": tps,
                    "speed_vs_plain": tps / base,
                }
            )
    return table


def markdown(table: list[dict], cost: dict) -> str:
    lines = [
        "| T | method | new tokens | target forwards | acceptance length | "
        "draft nodes / forward | tokens/s | speed vs plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['temperature']} | {r['method']} | {r['new_tokens']} | {r['target_forwards']} "
            f"| {r['acceptance_length']:.2f} | {r['nodes_per_forward']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {r['speed_vs_plain']:.2f}x |"
        )
    lines += [
        "",
        "| tree tokens per verify forward (context 300) | "
        + " | ".join(str(k) for k in cost)
        + " |",
        "|---|" + "---|" * len(cost),
        "| median ms | " + " | ".join(f"{v:.0f}" for v in cost.values()) + " |",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["plain", "pld", "recycle-4", "recycle-8", "recycle-16", "hf-plain", "hf-pld"],
    )
    ap.add_argument("--cost-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 80])
    ap.add_argument("--out", default="runs/drafters.jsonl")
    args = ap.parse_args()
    if "plain" not in args.methods:
        ap.error("--methods must include plain (the baseline of every ratio)")

    gen = Generator.load(ModelConfig(name="smollm2-135m"))
    counter = ForwardCounter(gen.loaded.model)
    prompts = load_prompts(args.prompts)
    encoded = [gen.encode(p["prompt"], chat=True) for p in prompts]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, device {gen.loaded.device}",
        file=sys.stderr,
    )
    cost = verify_cost(gen, args.cost_sizes)
    run_ours(gen, encoded[0], SamplingConfig(max_new_tokens=8), "plain")  # warm-up
    rows = []
    with out.open("w") as f:
        for temp in args.temperatures:
            for method in args.methods:
                for p, ids in tqdm(
                    list(zip(prompts, encoded, strict=True)),
                    desc=f"T={temp} {method}",
                    file=sys.stderr,
                ):
                    cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens)
                    if method.startswith("hf-"):
                        r = run_hf(gen, counter, ids, cfg, lookup=method == "hf-pld")
                    else:
                        r = run_ours(gen, ids, cfg, method)
                    r.update(method=method, temperature=temp, prompt_id=p["id"])
                    rows.append(r)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
    table = summarize(rows, args.methods, args.temperatures)
    print(markdown(table, cost))


if __name__ == "__main__":
    main()
