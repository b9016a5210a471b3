"""The global store tier under replay (issue 31's third direction): does `stand-dyn` draft more
when each problem's store is read before a global one that holds other problems' text?

    python bench/global_tier.py --log bench/trajectories-tuning-t1-smollm2.jsonl.gz \
        [--extra bench/trajectories-unseen-math-science-smollm2.jsonl.gz ...] \
        [--nodes 4 8 80] [--out runs/global-tier.jsonl]

`store.global_scope` makes a job's problem stores `TieredStore`s: reads prefer the problem's
store and fall back to the global one, writes go to both. Here every problem of `--log` is
replayed as `tts replay` does, once with its own store and once over a global tier that first
took in every other problem of `--log` and every problem of `--extra` (leave-one-out: the
problem is the last of a job that ran the others), and the acceptance lengths are compared
over the same trajectories. The successor table stays per problem, as in a job.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from store.memory import InMemoryNgramStore, TieredStore
from tts_service.drafters.registry import DrafterConfig
from tts_service.replay import LoggedProblem, ReplayReport, read_log, replay, replay_config
from tts_service.schemas import ReplayRequest


def over_global(problems: Sequence[LoggedProblem], cfg: DrafterConfig, nodes: int):
    """A replay `new_store` whose problem stores read before a global store that has taken in
    `problems` (replayed over it, each with its own problem store)."""
    global_ = InMemoryNgramStore()

    def tiered() -> TieredStore:
        return TieredStore(InMemoryNgramStore(), global_)

    if problems:
        replay(problems, cfg, nodes, new_store=tiered)
    return tiered


def leave_one_out(
    problems: Sequence[LoggedProblem],
    extra: Sequence[LoggedProblem],
    cfg: DrafterConfig,
    nodes: int,
) -> ReplayReport:
    """Each problem replayed over a global tier holding every other problem and `extra`."""
    pooled = ReplayReport()
    for i, problem in enumerate(problems):
        others = [p for j, p in enumerate(problems) if j != i] + list(extra)
        pooled.merge(replay([problem], cfg, nodes, new_store=over_global(others, cfg, nodes)))
    return pooled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="the problems measured")
    ap.add_argument("--extra", type=Path, nargs="*", default=[], help="more global-tier text")
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 80])
    ap.add_argument("--out", type=Path, help="JSONL, a row per node cap")
    args = ap.parse_args()
    problems = read_log(args.log)[0]
    extra = [p for path in args.extra for p in read_log(path)[0]]
    for nodes in args.nodes:
        cfg = replay_config(
            ReplayRequest.model_validate(
                {"method": "stand-dyn", "trajectories": str(args.log), "nodes": nodes}
            )
        )
        alone = replay(problems, cfg, nodes).to_dict()
        tiered = leave_one_out(problems, extra, cfg, nodes).to_dict()
        row = {
            "log": str(args.log),
            "extra": [str(p) for p in args.extra],
            "global_problems": len(problems) - 1 + len(extra),
            "nodes": nodes,
            "alone": alone["acceptance_length"],
            "global": tiered["acceptance_length"],
            "gain": round(tiered["acceptance_length"] / alone["acceptance_length"] - 1, 4),
            "alone_at_trajectory": alone["acceptance_length_at_trajectory"],
            "global_at_trajectory": tiered["acceptance_length_at_trajectory"],
            "tokens": [alone["tokens"], tiered["tokens"]],
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
