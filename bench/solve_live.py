"""`tts solve` as a user runs it, two settings against each other, interleaved (`python -m
bench.solve_live`; docs/benchmarks.md, "Early stop" and "Confidence"): the whole command's wall
time on a stopwatch, its tokens, and each problem's voted answer, per round.

`--compare early-stop` runs the default (`--early-stop`) against `--no-early-stop`; `--compare
confidence` runs `--confidence` against the default. Greedy (`--temperature 0`) every answer
must be the same in both (the early stop is exact; confidence changes no token); sampled, two
runs of one setting already differ where drafting decides which tokens the verifier's
uniforms pick (drawn children, the learned cost surface between runs), so the answers are
compared in distribution by the property tests instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "early-stop": (["--early-stop"], ["--no-early-stop"]),
    "confidence": (["--confidence"], []),
}


def run(flags: list[str], base: list[str]) -> dict:
    """One `tts solve --json` command: its wall time, tokens and answers by problem id."""
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tts_service", "solve", *base, *flags, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - began
    out = json.loads(proc.stdout)
    problems = out["problems"]
    return {
        "wall_s": round(wall, 2),
        "tokens": sum(p["stats"]["new_tokens"] for p in problems),
        "decoded": sum(p["stats"]["num_trajectories"] for p in problems),
        "answers": {p["id"]: p["answer"] for p in problems},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=sorted(SETTINGS), default="early-stop")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--problems", default="jobs/demo_problems.jsonl")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--out", type=Path, default=Path("bench/results/solve-live.jsonl"))
    args = ap.parse_args(argv)
    base = [
        "--problems", args.problems, "--n", str(args.n),
        "--max-new-tokens", str(args.max_new_tokens), "--method", args.method,
        "--temperature", str(args.temperature),
        "--run-nonce", "7",  # the same verify streams in both settings
    ]  # fmt: skip
    new, old = SETTINGS[args.compare]
    rows = []
    for r in range(args.rounds):
        order = [("new", new), ("old", old)][:: 1 if r % 2 == 0 else -1]
        for name, flags in order:
            row = {"compare": args.compare, "round": r, "setting": name, "flags": flags}
            row |= run(flags, base) | {"load": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                meta = {"method": args.method, "n": args.n, "temperature": args.temperature}
                f.write(json.dumps(row | meta) + "\n")
    by = {s: [r for r in rows if r["setting"] == s] for s in ("new", "old")}
    same = all(a["answers"] == b["answers"] for a, b in zip(by["new"], by["old"], strict=True))
    ratio = {
        k: round(sum(r[k] for r in by["new"]) / sum(r[k] for r in by["old"]), 3)
        for k in ("wall_s", "tokens")
    }
    print(json.dumps({"compare": args.compare, "same_answers": same, "new/old": ratio}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
