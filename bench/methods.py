"""Every speculative method side by side on SmolLM2-135M: best-of-N sequential trajectories,
acceptance length, tree size used and speed against plain decoding measured in the same run.

    python bench/methods.py [--prompts 1] [--prompts-file bench/prompts.jsonl] [--n 16]
        [--max-new-tokens 128] [--temperature 0.6] [--methods plain pld recycle ...]
        [--out runs/methods-t0.6.jsonl] [--assume-flat-cost] [--nodes N] [--set drawn=false]

Each method runs the same prompts with the same seeds. Trajectory i drafts from what
trajectories < i left behind (the store, the successor tables, the spine index), exactly as in
`tts solve`, and trajectory i of every method runs before trajectory i + 1 of any. The figures
for N = 1, 4, 16 are the pooled rates over the first N trajectories: A = committed tokens per
target forward, nodes = draft nodes per forward, speed = tokens/s over those trajectories / the
same for plain. The verify cost the GT methods size their trees by is read off the learned cost
surface (opened before any timing, shared by every method) and printed. Every method gets a
fresh generator over the one loaded model, so no method inherits another's successor table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import TypeAdapter
from tqdm import tqdm

from store.memory import InMemoryNgramStore
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import (
    DRAFTER_CONFIGS,
    METHODS,
    DrafterConfig,
    method_drafter,
    resolve_method,
)
from tts_service.engine.cost import GPU_LIKE_COST, CostModel
from tts_service.generation import Generator
from tts_service.replay import MAX_NODES, sized_fields
from tts_service.runner import TrajectoryRunner
from tts_service.solve import ProblemInput, solve_problems

PROMPTS = Path(__file__).with_name("prompts.jsonl")
DEFAULT = list(METHODS)
NS = (1, 4, 16)


def pooled(trajs, n: int) -> dict:
    sel = [t.output.stats for t in trajs[:n]]
    tokens = sum(s.new_tokens for s in sel)
    forwards = sum(s.target_forwards for s in sel)
    return {
        "tokens": tokens,
        "forwards": forwards,
        "nodes": sum(s.tree_nodes for s in sel),
        "wall_s": sum(s.wall_s for s in sel),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1, help="how many of the file's prompts")
    ap.add_argument("--prompts-file", type=Path, default=PROMPTS, help="JSONL with a 'prompt'")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--methods", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--nodes", type=int, help="cap every method's tree at N draft nodes (as tts replay does)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a drafter field (a JSON value) for every method whose drafter has it: an ablation",
    )
    ap.add_argument(
        "--assume-flat-cost",
        action="store_true",
        help="size GT trees by a GPU-like flat cost curve instead of this machine's, and give "
        "every step the whole node cap (the runner's fixed budget, not this machine's cost "
        "surface): the trees and acceptance lengths where tree tokens are nearly free, as "
        "tts replay sizes them (the speed column then means nothing)",
    )
    args = ap.parse_args()
    out = Path(args.out or f"runs/methods-t{args.temperature}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)

    base = Generator.load(ModelConfig(name="smollm2-135m"))
    lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(x) for x in lines if x.strip()][: args.prompts]
    questions = [r.get("prompt", r.get("question")) for r in rows]  # bench or job problems
    encoded = [base.encode(q, chat=True) for q in questions]
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    adapter = TypeAdapter(DrafterConfig)
    warm = sampling.model_copy(update={"max_new_tokens": 8})
    plain = adapter.validate_python(method_drafter("plain", {}, "cpu"))
    warm_up = ProblemInput("warm-up", encoded[0], InMemoryNgramStore())
    solve_problems(TrajectoryRunner(base, 1), [warm_up], 1, plain, warm)
    if args.assume_flat_cost:
        base.cost = CostModel.fixed(GPU_LIKE_COST)
    for ctx in {len(ids) + args.max_new_tokens for ids in encoded}:
        base.cost.at(ctx)  # the cost opened now (the surface's prior), outside every timing
    fields = {m: method_drafter(m, {}, "cpu") for m in args.methods}
    if args.nodes:
        fields = {m: sized_fields(f, args.nodes) for m, f in fields.items()}
    cfgs = {m: adapter.validate_python(with_fields(f, args.set)) for m, f in fields.items()}
    # per method and prompt: a fresh generator over the one model (no inherited tables) and
    # its own store; trajectories are interleaved across methods, so a slow spell on this
    # shared machine lands on every method alike
    surface = None if args.assume_flat_cost else base.surface()  # one device, one surface
    state = {
        (m, p): (Generator(base.loaded, cost=base.cost, surface=surface), InMemoryNgramStore())
        for m in args.methods
        for p in range(len(encoded))
    }
    trajs: dict[str, list[list]] = {m: [[] for _ in encoded] for m in args.methods}
    for i in tqdm(range(args.n), desc="trajectory", file=sys.stderr):
        for m in args.methods:
            for p, ids in enumerate(encoded):
                gen, store = state[(m, p)]
                cfg = sampling.model_copy(update={"seed": sampling.seed + i})
                if args.assume_flat_cost:  # one row: the budget is the cap plus the root
                    budget = (args.nodes or MAX_NODES) + 1
                    runner = TrajectoryRunner(gen, 1, speculation="fixed", token_budget=budget)
                else:
                    runner = TrajectoryRunner(gen, 1)
                problem = ProblemInput(f"p{p}", ids, store)
                run = solve_problems(runner, [problem], 1, cfgs[m], cfg)
                trajs[m][p] += run.problems[0].trajectories
    results = {}
    with open(out, "w") as f:
        f.write(json.dumps({"cost": [c.to_dict() for c in base.cost.curves.values()]}) + "\n")
        for m in args.methods:
            by_n = {n: {"tokens": 0, "forwards": 0, "nodes": 0, "wall_s": 0.0} for n in NS}
            for per_prompt in trajs[m]:
                for n in NS:
                    for k, v in pooled(per_prompt, n).items():
                        by_n[n][k] += v
            results[m] = by_n
            f.write(json.dumps({"method": m, "kind": cfgs[m].kind, "by_n": by_n}) + "\n")
    print(markdown(results, args, base))


def with_fields(fields: dict, overrides: list[str]) -> dict:
    """`fields` with each FIELD=VALUE of `overrides` that its drafter kind takes."""
    known = DRAFTER_CONFIGS[fields["kind"]].model_fields
    out = dict(fields)
    for item in overrides:
        key, _, value = item.partition("=")
        if key in known:
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
    return out


def markdown(results: dict, args, gen: Generator) -> str:
    plain = results.get("plain")
    ns = [n for n in NS if n <= args.n]
    head = " | ".join(f"A / nodes / speed (N={n})" for n in ns)
    lines = [
        f"Sequential best-of-{args.n}, T={args.temperature}, {args.prompts} prompt(s), "
        f"{args.max_new_tokens} new tokens. A = tokens per target forward; nodes = draft nodes "
        "per forward; speed = tokens/s vs plain over the same first N trajectories.",
        "",
        f"| method | {head} |",
        "|---|" + "---|" * len(ns),
    ]
    for method, by_n in results.items():
        cells = []
        for n in ns:
            r = by_n[n]
            acc = r["tokens"] / max(1, r["forwards"])
            nodes = r["nodes"] / max(1, r["forwards"])
            rate = r["tokens"] / max(1e-9, r["wall_s"])
            ratio = rate / (plain[n]["tokens"] / plain[n]["wall_s"]) if plain else float("nan")
            cells.append(f"{acc:.2f} / {nodes:.1f} / {ratio:.2f}x")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    curves = "; ".join(
        f"context {c.context_len}: "
        + ", ".join(f"{s}->{t * 1e3:.0f}" for s, t in zip(c.sizes, c.seconds, strict=True))
        for c in gen.cost.curves.values()
    )
    lines += ["", f"Verify cost (tree tokens -> ms): {curves}."]
    lines += ["", f"`auto` on this machine runs `{resolve_method('auto', 'cpu')}`."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
