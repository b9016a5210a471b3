"""The target's distributions over the prompt in the store (issue 31's first direction), replayed:
does seeding a problem's store with what the prefill computes help `stand-dyn`?

    python bench/prompt_harvest.py --trajectories bench/trajectories-smollm2.jsonl.gz \
        --temperature 0.6 [--nodes 2 4 8 80] [--out runs/prompt-harvest.jsonl]

The prefill computes the target's distribution after every prefix of the prompt and the engine
keeps only the last. Here the real model (SmolLM2-135M) runs each logged prompt once, and
before a problem's first trajectory its store (and successor table) observes the top-10 at
every prompt position at the log's temperature, as a plain step's root would
(`Drafter.observe_root`, once per problem store). Then the log is replayed as `tts replay`
does, with and without the seeding, at each node cap.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tts_service.config import ModelConfig
from tts_service.engine.decode import STORE_TOPK
from tts_service.engine.seam import OBSERVE_TAIL, Drafter, NodeTopK
from tts_service.models import load_model
from tts_service.replay import LoggedProblem, read_log, replay, replay_config
from tts_service.schemas import ReplayRequest

PromptTopK = dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]]


@torch.inference_mode()
def prompt_topk(problems: list[LoggedProblem], temperature: float) -> PromptTopK:
    """Per prompt, the target's top-k (ids, probabilities) after every prefix of it."""
    model = load_model(ModelConfig(name="smollm2-135m")).model
    out: PromptTopK = {}
    for p in problems:
        logits = model(torch.tensor([p.prompt_ids])).logits[0].float()
        probs, ids = torch.softmax(logits / temperature, -1).topk(STORE_TOPK, -1)
        out[tuple(p.prompt_ids)] = (ids.numpy().astype(np.int64), probs.double().numpy())
    return out


def seeding(tops: PromptTopK):
    """A replay `wrap`: before a problem store's first trajectory, its drafter observes the
    prompt's distributions; everything else is the drafter's own."""
    seen: set[tuple[int, tuple[int, ...]]] = set()

    class PromptSeeded:
        def __init__(self, drafter: Drafter) -> None:
            self.drafter = drafter

        def __getattr__(self, name: str):
            return getattr(self.drafter, name)

        def start(self, prompt_ids: list[int]) -> None:
            self.drafter.start(prompt_ids)
            key = (id(getattr(self.drafter, "store", None)), tuple(prompt_ids))
            if key in seen:
                return
            seen.add(key)
            ids, probs = tops[tuple(prompt_ids)]
            for j in range(len(prompt_ids)):
                tail = prompt_ids[max(0, j + 1 - OBSERVE_TAIL) : j + 1]
                later = self.drafter.observe_root(tail, NodeTopK(ids[j : j + 1], probs[j : j + 1]))
                if later is not None:
                    later()

    return PromptSeeded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=Path, required=True)
    ap.add_argument("--temperature", type=float, required=True, help="the log's temperature")
    ap.add_argument("--nodes", nargs="*", type=int, default=[2, 4, 8, 80])
    ap.add_argument("--method", default="stand-dyn")
    ap.add_argument("--out", type=Path, default=Path("runs/prompt-harvest.jsonl"))
    args = ap.parse_args(argv)
    problems, _ = read_log(args.trajectories, strict=True)
    tops = prompt_topk(problems, args.temperature)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as f:
        for nodes in args.nodes:
            req = ReplayRequest(method=args.method, trajectories=args.trajectories, nodes=nodes)
            cfg = replay_config(req)
            base = replay(problems, cfg, nodes, req.vocab_size).to_dict()
            seeded = replay(problems, cfg, nodes, req.vocab_size, wrap=seeding(tops)).to_dict()
            row = {
                "trajectories": args.trajectories.name,
                "temperature": args.temperature,
                "method": args.method,
                "nodes": nodes,
                **{
                    f"{name}_{key}": rep[key]
                    for name, rep in (("base", base), ("prompt", seeded))
                    for key in ("acceptance_length", "acceptance_length_at_trajectory")
                },
            }
            f.write(json.dumps(row) + "\n")
            a, b = base["acceptance_length"], seeded["acceptance_length"]
            print(f"{args.trajectories.name} {nodes} nodes: {a:.4f} -> {b:.4f} ({b / a:.4f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
