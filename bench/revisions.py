"""The same `tts solve` commands on two revisions of this repository, interleaved: does a change
leave the user's speed where it was? (Issue #28: a refactor must leave the runner's plain and
`auto` rows unchanged within noise.)

    python bench/revisions.py --base c7ff196 [--rounds 2] [--methods plain auto]
        [--max-new-tokens 64] [--cells 1,1,1,0.0 4,4,3,0.6] [--out runs/revisions.jsonl]
    python bench/revisions.py --table-from runs/revisions.jsonl

The base revision is checked out into a temporary `git worktree`; both run with this
checkout's virtual environment, the base through `PYTHONPATH` (its own code and presets). A
cell is (rows, n, problems, T) over `bench/heldout_prompts.jsonl`; in every cell each (method,
revision) pair is its own subprocess, in an order that rotates from cell to cell, so drift on a
shared machine lands on both revisions alike. Two clocks, as `bench/auto_speed.py`: process
(perf_counter around the subprocess) and decode (the run's `stats.decode_s`). The table gives
new ÷ base speed per cell, method and clock, and whether both revisions committed the same
tokens (at T = 0 they must; at T > 0 `auto`'s trees follow timing, so its draws may differ).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean

REPO = Path(__file__).resolve().parents[1]
HELDOUT = Path(__file__).with_name("heldout_prompts.jsonl")
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
CELLS = ((1, 16, 1, 0.6), (16, 16, 1, 0.6), (1, 1, 1, 0.0), (4, 4, 3, 0.6))


def tokens_sha(out: dict) -> str:
    ids = [
        [t["token_ids"] for t in sorted(p["trajectories"], key=lambda t: t["index"])]
        for p in out["problems"]
    ]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def run(tree: Path | None, method: str, cell: tuple, problems: Path, args) -> dict:
    """One timed `tts solve`; `tree` None: this checkout, else the base's worktree."""
    rows, n, _, temperature = cell
    env = {**os.environ, **ENV}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [
        str(Path(sys.executable).with_name("tts")),
        "solve",
        *("--problems", str(problems), "--n", str(n), "--max-rows", str(rows)),
        *("--temperature", str(temperature), "--max-new-tokens", str(args.max_new_tokens)),
        *("--seed", "0", "--json", "--method", method),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    record = {
        "revision": "base" if tree is not None else "new",
        "method": method,
        "cell": list(cell),
        "process_s": time.perf_counter() - t0,
        "load": os.getloadavg()[0],
    }
    if proc.returncode:
        return {**record, "error": proc.stderr.strip().splitlines()[-1:]}
    out = json.JSONDecoder().raw_decode(proc.stdout[proc.stdout.index("{") :])[0]
    stats = out["stats"]
    return {
        **record,
        "new_tokens": stats["new_tokens"],
        "decode_s": stats.get("decode_s", stats["wall_s"]),
        "acceptance_length": stats.get("acceptance_length"),
        "tokens_sha": tokens_sha(out),
    }


def measure(args) -> list[dict]:
    prompts = [line for line in HELDOUT.read_text().splitlines() if line.strip()]
    records: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, args.out.open("w", encoding="utf-8") as f:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(base), args.base],
            check=True,
            capture_output=True,
        )
        try:
            cells = itertools.product(range(args.rounds), args.cells)
            for turn, (rnd, cell) in enumerate(cells, start=1):
                problems = Path(tmp) / f"problems-{cell[2]}.jsonl"
                problems.write_text("\n".join(prompts[: cell[2]]) + "\n")
                pairs = list(itertools.product(args.methods, (base, None)))
                for method, tree in pairs[turn % len(pairs) :] + pairs[: turn % len(pairs)]:
                    record = {"round": rnd, **run(tree, method, cell, problems, args)}
                    records.append(record)
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    print(json.dumps(record), file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                capture_output=True,
            )
    return records


def table(records: list[dict]) -> str:
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if "error" not in r:
            runs[(tuple(r["cell"]), r["method"], r["revision"])].append(r)
    lines = [
        "| rows | n | problems | T | method | base process / decode s | new process / decode s "
        "| new ÷ base speed, process / decode | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (cell, method, _), base in sorted(runs.items()):
        if _ != "base" or (cell, method, "new") not in runs:
            continue
        new = runs[(cell, method, "new")]
        bp, bd = fmean(r["process_s"] for r in base), fmean(r["decode_s"] for r in base)
        np_, nd = fmean(r["process_s"] for r in new), fmean(r["decode_s"] for r in new)
        same = {r["tokens_sha"] for r in base} == {r["tokens_sha"] for r in new}
        lines.append(
            f"| {' | '.join(map(str, cell))} | {method} | {bp:.2f} / {bd:.2f} | "
            f"{np_:.2f} / {nd:.2f} | {bp / np_:.3f} / {bd / nd:.3f} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the revision to compare against (a commit, a tag)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["plain", "auto"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--cells",
        nargs="+",
        type=lambda v: (*map(int, v.split(",")[:3]), float(v.split(",")[3])),
        default=list(CELLS),
        help="rows,n,problems,T each (default: the four cells)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/revisions.jsonl"))
    ap.add_argument("--table-from", type=Path, help="print the table of an earlier --out")
    args = ap.parse_args(argv)
    if args.table_from is not None:
        lines = args.table_from.read_text().splitlines()
        print(table([json.loads(x) for x in lines if x.strip()]))
        return 0
    if args.base is None:
        ap.error("--base is required (or --table-from)")
    print(table(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
