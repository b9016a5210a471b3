"""Speculation never costs the user (issue #26): `tts solve --method auto` against `--method
plain` and, for best-of-16, against `transformers`' `generate(num_return_sequences=16)`, each
run timed as a user runs it (process start to exit, model already cached) and on decode alone.

    python bench/auto_speed.py [--rows 1 4 16] [--n 1 4 16] [--problems 1 3]
        [--temperatures 0 0.6] [--max-new-tokens 64] [--rounds 1] [--methods plain auto]
        [--out runs/auto_speed.jsonl]
    python bench/auto_speed.py --table-from runs/auto_speed.jsonl

A cell is (rows, n, problems, T): `--max-rows`, `--n`, the first 1 or 3 problems of
`bench/heldout_prompts.jsonl` and `--temperature`. In each cell every method is its own
subprocess, `tts solve --problems FILE --n N --max-rows R --temperature T --max-new-tokens L
--seed 0 --json --method M`, and for n = 16 also `bench/hf_peer.py` (`generate` on the same
weights, the chat template `tts solve` applies, new tokens counted as `bench/best_of_n.py` counts
them). The order of the methods rotates from cell to cell and round to round, so drift on this
shared machine lands on every method alike.

Two clocks: process = perf_counter around `subprocess.run`; decode = the run's own
`stats.decode_s`, else `stats.wall_s` (the older CLI's decode wall). tokens/s = new tokens /
seconds. `same_tokens` says whether auto committed exactly plain's token ids in the cell (in every
round); lossless speculation must at T = 0, and with equal seeds it is reported at T = 0.6 too.

The targets checked at the end, on both clocks: auto ≥ 0.97× plain in every cell; auto ≥ 1.35×
plain in every sequential best-of-16 cell (rows = 1, n = 16: each trajectory drafts from the
earlier ones' store, the setting the issue measured); auto ≥ 1.0× `generate` in every
best-of-16 cell (n = 16 with all 16 rows decoded together, rows ≥ 16: the CLI's default on a
CPU). One JSON line
per run goes to `--out` as it finishes; `--table-from` rebuilds the report from such a file.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean

HELDOUT = Path(__file__).with_name("heldout_prompts.jsonl")
PEER = Path(__file__).with_name("hf_peer.py")
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
BASE, SUBJECT, HF = "plain", "auto", "hf"
CLOCKS = ("process", "decode")
EVERY_CELL, SEQUENTIAL, BEST_OF_16 = 0.97, 1.35, 1.0  # the targets, auto ÷ peer


@dataclass(frozen=True)
class Cell:
    rows: int
    n: int
    problems: int
    temperature: float

    def label(self) -> str:
        return f"rows={self.rows} n={self.n} problems={self.problems} T={self.temperature:g}"


def problems_file(count: int, folder: Path) -> Path:
    """The first `count` held-out problems as their own JSONL file."""
    lines = [x for x in HELDOUT.read_text(encoding="utf-8").splitlines() if x.strip()][:count]
    path = folder / f"problems-{count}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def command(method: str, cell: Cell, problems: Path, args: argparse.Namespace) -> list[str]:
    if method == HF:
        return [
            sys.executable,
            str(PEER),
            *("--problems", str(problems), "--n", str(cell.n)),
            *("--temperature", str(cell.temperature), "--max-new-tokens", str(args.max_new_tokens)),
            *("--seed", str(args.seed), "--model", args.model),
        ]
    return [
        args.tts,
        "solve",
        *("--problems", str(problems), "--n", str(cell.n), "--max-rows", str(cell.rows)),
        *("--temperature", str(cell.temperature), "--max-new-tokens", str(args.max_new_tokens)),
        *("--seed", str(args.seed), "--json", "--method", method),
        "--no-early-stop",  # the same N trajectories as the peer decodes
    ]


def model_dir() -> str:
    """The weights `tts solve` loads, for the peer (resolved here, outside every timing)."""
    from tts_service.config import ModelConfig
    from tts_service.models import model_source

    return str(model_source(ModelConfig()))


def first_json(stdout: str) -> dict:
    """The JSON object the command printed (anything printed before it is skipped)."""
    return json.JSONDecoder().raw_decode(stdout[stdout.index("{") :])[0]


def token_digest(out: dict) -> str:
    """One hash over every trajectory's token ids, problem by problem, in trajectory order."""
    ids = [
        [t["token_ids"] for t in sorted(p["trajectories"], key=lambda t: t["index"])]
        for p in out["problems"]
    ]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def from_tts(out: dict) -> dict:
    stats = out["stats"]
    clock = "decode_s" if "decode_s" in stats else "wall_s"
    return {
        "new_tokens": stats["new_tokens"],
        "decode_s": stats[clock],
        "decode_clock": clock,
        "wall_s": stats.get("wall_s"),
        "acceptance_length": stats.get("acceptance_length"),
        "tree_nodes": stats.get("tree_nodes"),
        "speculation": stats.get("speculation"),
        "tokens_sha": token_digest(out),
    }


def from_peer(out: dict) -> dict:
    return {
        "new_tokens": out["new_tokens"],
        "decode_s": out["decode_s"],
        "decode_clock": "decode_s",
        "load_s": out["load_s"],
        "acceptance_length": 1.0,
    }


def run(method: str, cell: Cell, problems: Path, args: argparse.Namespace) -> dict:
    """One timed subprocess; the record written to the JSONL (`error` set if it failed)."""
    env = {**os.environ, **ENV}
    t0 = time.perf_counter()
    proc = subprocess.run(
        command(method, cell, problems, args), env=env, capture_output=True, text=True
    )
    process_s = time.perf_counter() - t0
    record = {"kind": "run", "method": method, **asdict(cell), "process_s": process_s}
    record.update(max_new_tokens=args.max_new_tokens, rc=proc.returncode, load=os.getloadavg()[0])
    if proc.returncode:
        last = proc.stderr.strip().splitlines()[-1:] or [""]
        return {
            **record,
            "error": f"exit {proc.returncode}: {last[0]}",
            "stderr": proc.stderr[-4000:],
        }
    try:
        out = first_json(proc.stdout)
        record.update(from_peer(out) if method == HF else from_tts(out))
    except (ValueError, KeyError) as e:  # no JSON, or not the fields this script reads
        record.update(error=f"{type(e).__name__}: {e}", stdout=proc.stdout[-4000:])
    return record


def rotated(methods: list[str], k: int) -> list[str]:
    k %= len(methods)
    return methods[k:] + methods[:k]


def measure(args: argparse.Namespace) -> list[dict]:
    cells = [
        Cell(r, n, p, t)
        for r, n, p, t in itertools.product(args.rows, args.n, args.problems, args.temperatures)
    ]
    records: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, args.out.open("w", encoding="utf-8") as f:
        files = {p: problems_file(p, Path(tmp)) for p in set(args.problems)}
        f.write(json.dumps({"kind": "meta", "argv": sys.argv[1:], "load": os.getloadavg()}) + "\n")
        for rnd, (i, cell) in itertools.product(range(args.rounds), enumerate(cells)):
            methods = args.methods + ([HF] if cell.n == 16 and not args.no_hf else [])
            for method in rotated(methods, i + rnd):
                record = {"round": rnd, **run(method, cell, files[cell.problems], args)}
                records.append(record)
                f.write(json.dumps(record) + "\n")
                f.flush()
                print(progress(record), file=sys.stderr, flush=True)
        f.write(json.dumps({"kind": "end", "load": os.getloadavg()}) + "\n")
    return records


def progress(r: dict) -> str:
    head = f"round {r['round']} {Cell(r['rows'], r['n'], r['problems'], r['temperature']).label()}"
    if "error" in r:
        return f"{head} {r['method']}: FAILED {r['error']}"
    return (
        f"{head} {r['method']}: {r['new_tokens']} tokens, process {r['process_s']:.1f} s, "
        f"decode {r['decode_s']:.1f} s"
    )


def rates(ok: list[dict]) -> dict[str, float] | None:
    """Pooled tokens/s over a method's successful runs in a cell, per clock."""
    if not ok:
        return None
    tokens = sum(r["new_tokens"] for r in ok)
    return {c: tokens / max(1e-9, sum(r[f"{c}_s"] for r in ok)) for c in CLOCKS}


def same_tokens(runs: list[dict]) -> bool | None:
    """Did auto commit plain's tokens in every round where both ran?"""
    sha: dict[tuple[int, str], str] = {
        (r["round"], r["method"]): r["tokens_sha"] for r in runs if "tokens_sha" in r
    }
    pairs = [
        (sha[(k, BASE)], sha[(k, SUBJECT)]) for k, m in sha if m == BASE and (k, SUBJECT) in sha
    ]
    return all(a == b for a, b in pairs) if pairs else None


def summarize(records: list[dict]) -> list[dict]:
    """One row per cell, in the order the cells first ran."""
    cells: dict[Cell, list[dict]] = {}
    for r in records:
        if r.get("kind") == "run":
            cells.setdefault(Cell(r["rows"], r["n"], r["problems"], r["temperature"]), []).append(r)
    return [cell_row(cell, runs) for cell, runs in cells.items()]


def cell_row(cell: Cell, runs: list[dict]) -> dict:
    ok: dict[str, list[dict]] = {}
    for r in runs:
        ok.setdefault(r["method"], [])
        if "error" not in r:
            ok[r["method"]].append(r)
    tps = {m: rates(rs) for m, rs in ok.items()}
    auto = ok.get(SUBJECT)
    return {
        "cell": cell,
        "tps": tps,
        "tokens": {m: fmean(r["new_tokens"] for r in rs) for m, rs in ok.items() if rs},
        "acceptance": fmean(r["acceptance_length"] for r in auto) if auto else None,
        "same_tokens": same_tokens(runs),
        "vs_plain": ratio(tps.get(SUBJECT), tps.get(BASE)),
        "vs_hf": ratio(tps.get(SUBJECT), tps.get(HF)),
    }


def ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    return {c: a[c] / b[c] for c in CLOCKS} if a and b else None


def pair(x: dict[str, float] | None, fmt: str) -> str:
    return f"{x['process']:{fmt}} / {x['decode']:{fmt}}" if x else "–"


def speed(tps: dict[str, dict[str, float] | None], method: str) -> str:
    """A method's tokens/s pair; `failed` where it ran in the cell and no run succeeded."""
    return "failed" if method in tps and tps[method] is None else pair(tps.get(method), ".1f")


def tokens_cell(tokens: dict[str, float]) -> str:
    seen = dict.fromkeys(f"{tokens[m]:.0f}" for m in (BASE, SUBJECT) if m in tokens)
    return " / ".join(seen) or "–"


def markdown(rows: list[dict], methods: list[str]) -> str:
    others = [m for m in methods if m not in (BASE, SUBJECT)]
    cols = [f"{m} tok/s" for m in [BASE, SUBJECT, *others]]
    head = ["rows", "n", "problems", "T", "tokens", *cols, "auto÷plain", HF + " tok/s", "auto÷hf"]
    head += ["auto acceptance", "same_tokens"]
    lines = [
        "Each pair is process / decode (tokens/s, or the ratio of tokens/s); tokens = plain's "
        "new tokens (/ auto's where they differ).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        c = r["cell"]
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        same = "–" if r["same_tokens"] is None else str(r["same_tokens"]).lower()
        cells = [str(c.rows), str(c.n), str(c.problems), f"{c.temperature:g}"]
        cells += [tokens_cell(r["tokens"])]
        cells += [speed(r["tps"], m) for m in [BASE, SUBJECT, *others]]
        cells += [pair(r["vs_plain"], ".2f"), speed(r["tps"], HF)]
        cells += [pair(r["vs_hf"], ".2f"), acc, same]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    """The minimum ratio per target and clock, and PASS/FAIL against the issue's targets."""
    targets = [
        ("every cell: auto ÷ plain", EVERY_CELL, [r["vs_plain"] for r in rows]),
        (  # the sequential setting: best-of-16, one trajectory after another
            "sequential best-of-16 (rows = 1, n = 16): auto ÷ plain",
            SEQUENTIAL,
            [r["vs_plain"] for r in rows if r["cell"].rows == 1 and r["cell"].n == 16],
        ),
        (
            "best-of-16 (n = 16, rows ≥ 16): auto ÷ hf",
            BEST_OF_16,
            [r["vs_hf"] for r in rows if r["cell"].n == 16 and r["cell"].rows >= 16],
        ),
    ]
    lines = []
    for name, target, found in targets:
        ratios = [x for x in found if x]
        for clock in CLOCKS:
            if not ratios:
                verdict = "FAIL" if found else "SKIP"
                lines.append(f"{name}, {clock}: 0 of {len(found)} cell(s) measured: {verdict}")
                continue
            low = min(x[clock] for x in ratios)
            verdict = "PASS" if low >= target and len(ratios) == len(found) else "FAIL"
            lines.append(
                f"{name}, {clock}: min {low:.2f}x over {len(ratios)} of {len(found)} cell(s) "
                f"(target ≥ {target:g}): {verdict}"
            )
    same = [r["same_tokens"] for r in rows if r["cell"].temperature == 0]
    if any(s is False for s in same):
        lines.append("auto committed other tokens than plain at T = 0: FAIL (lossless)")
    return "\n".join(lines)


def report(records: list[dict], loads: tuple[object, object], methods: list[str]) -> str:
    rows = summarize(records)
    return "\n\n".join(
        [
            f"load average at start: {load_text(loads[0])}",
            markdown(rows, methods),
            verdicts(rows),
            f"load average at end: {load_text(loads[1])}",
        ]
    )


def load_text(load: object) -> str:
    """1, 5 and 15 minute load averages as `os.getloadavg()` gives them (or a note)."""
    if isinstance(load, list | tuple):
        return ", ".join(f"{x:.2f}" for x in load)
    return str(load)


def from_file(path: Path) -> tuple[list[dict], tuple[object, object], list[str]]:
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    meta = {r["kind"]: r for r in lines if r.get("kind") in ("meta", "end")}
    runs = [r for r in lines if r.get("kind") == "run"]
    methods = [m for m in dict.fromkeys(r["method"] for r in runs) if m != HF]
    loads = (meta.get("meta", {}).get("load", "–"), meta.get("end", {}).get("load", "unfinished"))
    return runs, loads, methods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16], help="--max-rows values")
    ap.add_argument("--n", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--problems", nargs="+", type=int, default=[1, 3], help="first k held-out")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.6])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=[BASE, SUBJECT])
    ap.add_argument("--no-hf", action="store_true", help="skip the generate peer at n = 16")
    ap.add_argument("--tts", default=str(Path(sys.executable).with_name("tts")))
    ap.add_argument("--out", type=Path, default=Path("runs/auto_speed.jsonl"))
    ap.add_argument("--table-from", type=Path, help="only rebuild the report from this JSONL")
    args = ap.parse_args()
    args.model = None
    if args.table_from:
        runs, loads, methods = from_file(args.table_from)
        print(report(runs, loads, methods))
        return
    if 16 in args.n and not args.no_hf:
        args.model = model_dir()
    start = os.getloadavg()
    print(f"load average at start: {load_text(start)}", file=sys.stderr, flush=True)
    records = measure(args)
    print(report(records, (start, os.getloadavg()), args.methods))


if __name__ == "__main__":
    main()
