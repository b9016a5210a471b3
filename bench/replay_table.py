"""Every model-free method replayed on one trajectory log at several node caps: the table of
docs/benchmarks.md, "Acceptance length in replay and live" (acceptance length, mean tree
nodes, per trajectory index).

    python bench/replay_table.py --trajectories bench/trajectories-heldout-smollm2.jsonl.gz \
        [--methods pld stand ...] [--nodes 8 16 32 80] [--out runs/replay-heldout.jsonl]

Each cell is `tts replay --method M --nodes N --trajectories LOG --json`; rows are written to
`--out` as they finish and the markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from tts_service.drafters.registry import REPLAY_METHODS
from tts_service.replay import TRAJECTORY_INDICES, read_log, replay, replay_config
from tts_service.schemas import ReplayRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=Path, required=True)
    ap.add_argument("--methods", nargs="*", default=[m for m in REPLAY_METHODS if m != "plain"])
    ap.add_argument("--nodes", nargs="*", type=int, default=[8, 16, 32, 80])
    ap.add_argument("--out", type=Path, default=Path("runs/replay-table.jsonl"))
    args = ap.parse_args()
    problems, errors = read_log(args.trajectories, strict=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("", encoding="utf-8")
    rows = []
    cells = [(m, n) for m in args.methods for n in args.nodes]
    for method, nodes in tqdm(cells, desc="replay", file=sys.stderr):
        req = ReplayRequest(method=method, trajectories=args.trajectories, nodes=nodes)
        report = replay(problems, replay_config(req), nodes, req.vocab_size).to_dict()
        row = {"method": method, "nodes": nodes, **report}
        rows.append(row)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    tokens = sum(len(r) for p in problems for r in p.responses)
    print(
        f"{args.trajectories.name}: {len(problems)} problems, "
        f"{sum(len(p.responses) for p in problems)} trajectories, {tokens} tokens\n"
    )
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    idx = " | ".join(str(i) for i in TRAJECTORY_INDICES)
    lines = [
        f"| method | node cap | mean tree nodes | acceptance length | trajectory {idx} |",
        "|---|---|---|---|" + "---|" * len(TRAJECTORY_INDICES),
    ]
    for r in rows:
        at = r["acceptance_length_at_trajectory"]
        per = " | ".join(f"{at[str(i)]:.2f}" if str(i) in at else "–" for i in TRAJECTORY_INDICES)
        lines.append(
            f"| {r['method']} | {r['nodes']} | {r['mean_tree_nodes']:.1f} | "
            f"{r['acceptance_length']:.2f} | {per} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
