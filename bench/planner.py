"""The planner's own host time per step: recording one tree's slot statistics and one fresh
decision (`SpeculationPlanner.plan` after a recorded tree, on a surface that is learning),
16 rows of one method, a 7B's roofline on one H100 (`bench.host.gpu_surface`). Every step of
`auto` pays these, plain steps included.

    python -m bench.planner [--steps 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.host import gpu_surface
from tts_service.engine.allocate import SlotStats, SpeculationPlanner
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance
from tts_service.runner import MAX_NODES


def median_us(samples: list[float]) -> float:
    return round(sorted(samples)[len(samples) // 2] * 1e6, 1)


def measure(steps: int) -> dict:
    surface, stats = gpu_surface(), SlotStats()
    rows = [stats] * 16
    planner = SpeculationPlanner(surface=surface, max_nodes=MAX_NODES, max_step_tokens=1024)
    tree, acc = DraftTree.chain(0, list(range(1, 9))), Acceptance((1, 2), (1, 2), 0)
    record, decide = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        stats.record(tree, acc)
        t1 = time.perf_counter()
        stats.tick()
        planner.plan(200 + i, rows, 1e-5)
        t2 = time.perf_counter()
        record.append(t1 - t0)
        decide.append(t2 - t1)
        if i % 2:  # a surprise every other step: the cost lines are re-read then
            surface.record(16, 1 + i % 9, 200 + i, 0.012 * (1 + (i % 7) / 3))
    warm = steps // 6
    return {
        "record_tree_us": median_us(record[warm:]),
        "fresh_decision_us": median_us(decide[warm:]),
        "mean_fresh_decision_us": round(sum(decide[warm:]) / (steps - warm) * 1e6, 1),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rec = measure(args.steps)
    print(json.dumps(rec))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
