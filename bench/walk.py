"""Rule (c)'s host walk, compiled, on the layouts and copies of real steps.

    python -m bench.walk [--rows 16 64] [--steps 30] [--json PATH]

Runs `bench.host`'s `stand` cells (sampled trees at 8 nodes, the acceptance captured) and keeps
every step's walked layout and copy (`treebatch.walk_sparse_all`'s inputs); then times the
compiled walk (`treebatch.walk_sparse_all`, `engine.walk_compiled`) on them. Writes one record
per row count: {rows, walked, steps, compiled_ms} (the time: a median over the steps and 5
rounds).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench import host
from tts_service.engine import acceptance, collector
from tts_service.engine.treebatch import SparseLayout, walk_sparse_all

ROUNDS = 5


def captured(rows: int, steps: int) -> list[tuple[SparseLayout, np.ndarray]]:
    """The walked layouts and copies of a `stand` cell's steps (`host.measure`)."""
    problems = host.fold(host.read_problems(host.LOG), 256)
    seen: list[tuple[SparseLayout, np.ndarray]] = []

    def keep(layout: SparseLayout, data: np.ndarray):
        seen.append((layout, data.copy()))
        return walk_sparse_all(layout, data)

    acceptance.walk_sparse_all = keep  # type: ignore[assignment]
    try:
        host.measure(problems, 256, rows, 8, "stand", steps, 0.6, graph_acceptance=True)
    finally:
        acceptance.walk_sparse_all = walk_sparse_all  # type: ignore[assignment]
    return seen


def measure(rows: int, steps: int) -> dict:
    """One row count's record: the compiled walk timed on a `stand` cell's steps."""
    seen = captured(rows, steps)
    compiled = []
    for _ in range(ROUNDS):
        for layout, data in seen:
            t0 = time.perf_counter()
            walk_sparse_all(layout, data)
            compiled.append(time.perf_counter() - t0)
    return {
        "rows": rows,
        "walked": round(statistics.mean(len(layout.trees) for layout, _ in seen), 1),
        "steps": len(seen),
        "compiled_ms": round(statistics.median(compiled) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per cell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()  # as `bench.host` runs its cells: the log frozen, the young budget widened
    gc.freeze()
    collector.widen()
    records = []
    for rows in args.rows:
        rec = measure(rows, args.steps)
        records.append(rec)
        print(
            f"rows {rows:3d} ({rec['walked']} walked, {rec['steps']} steps): compiled "
            f"{rec['compiled_ms']:.3f} ms",
            flush=True,
        )
        if args.json:  # as it goes
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
