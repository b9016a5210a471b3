"""Early stop and confidence-weighted votes, simulated over every recorded best-of-16 log in
bench/ (`python -m bench.early_stop`; docs/benchmarks.md, "Early stop").

Every row of a problem starts together and commits at one speed, so trajectory i ends at its
length in tokens. The exact early stop (`aggregate.early_stop`) decides as each one ends; the
rest are cut where they are. Reported per log and in all: tokens spent and latency (the
problem's last finish, or the decision) against the full vote, whether the voted answer is the
full vote's (it must be), and accuracy where the problem has a reference, beside DeepConf's
offline filter (the 10% and 90% most confident by lowest group confidence) from the logged
top-10 distributions (`aggregate.confidence`), which can change answers.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tts_service.aggregate import extract_answer, is_correct, majority_vote, normalize_answer
from tts_service.aggregate.confidence import (
    filtered_vote,
    token_confidences,
    trajectory_confidence,
)
from tts_service.aggregate.early_stop import EarlyStop

BENCH = Path(__file__).resolve().parent
PROBLEM_FILES = ("heldout_prompts.jsonl", "unseen_math_science.jsonl", "unseen_code.jsonl")


def references() -> dict[str, dict]:
    """Problem id -> its task and reference answer (the prompts files that have them)."""
    found = {}
    for name in PROBLEM_FILES:
        for line in (BENCH / name).read_text().splitlines():
            row = json.loads(line)
            found[row["id"]] = {"task": row.get("task", "math"), "answer": row.get("answer")}
    return found


def simulate(lengths: list[int], texts: list[str], task: str) -> dict:
    """One problem under the exact early stop: decided at which finish, tokens and latency."""
    n = len(lengths)
    stop = EarlyStop(n, task)
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    at = max(lengths)
    finished = []
    for i in order:
        finished.append(i)
        if stop.finished("p", i, texts[i]):
            at = lengths[i]
            break
    spent = sum(min(length, at) for length in lengths)
    return {"decided_after": len(finished), "tokens": spent, "latency": at, "kept": finished}


def problem_row(log: str, row: dict, tokenizer, refs: dict) -> dict:
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in row["responses"]]
    lengths = [len(r) for r in row["responses"]]
    meta = refs.get(row["prompt_id"], {"task": "math", "answer": None})
    task, reference = meta["task"], meta["answer"]
    answers = [extract_answer(t, task) for t in texts]
    full = majority_vote(answers, task)
    early = simulate(lengths, texts, task)
    alike = {"math": "\\boxed{1}", "choice": "Answer: A", "code": "```python\nprint(1)\n```"}
    agreeing = simulate(lengths, [alike[task]] * len(texts), task)
    kept = sorted(early["kept"])
    voted = majority_vote([answers[i] for i in kept], task)
    same = normalize_answer(voted.answer, task) == normalize_answer(full.answer, task)
    scores = [
        trajectory_confidence(token_confidences(probs))["lowest_group"]
        for probs in row["top_probs"]
    ]
    votes = {"full": full, "early": voted}
    for keep in (0.1, 0.9):
        votes[f"filtered{int(keep * 100)}"] = filtered_vote(answers, scores, keep, task)
    graded = reference is not None and task != "code"
    return {
        "log": log,
        "problem": row["prompt_id"],
        "task": task,
        "n": len(texts),
        "full_tokens": sum(lengths),
        "full_latency": max(lengths),
        **{k: early[k] for k in ("decided_after", "tokens", "latency")},
        "unanimous_tokens": agreeing["tokens"],  # the same lengths, every answer alike
        "unanimous_latency": agreeing["latency"],
        "same_answer": same,
        **{
            f"correct_{name}": is_correct(v.answer, reference, task) if graded else None
            for name, v in votes.items()
        },
    }


def _ratio(rows: list[dict], key: str, full: str) -> float:
    return round(sum(r[key] for r in rows) / sum(r[full] for r in rows), 4)


def totals(rows: list[dict]) -> dict:
    graded = [r for r in rows if r["correct_full"] is not None]
    out = {
        "problems": len(rows),
        "stopped_early": sum(r["decided_after"] < r["n"] for r in rows),
        "tokens_ratio": _ratio(rows, "tokens", "full_tokens"),
        "latency_ratio": _ratio(rows, "latency", "full_latency"),
        "unanimous_tokens_ratio": _ratio(rows, "unanimous_tokens", "full_tokens"),
        "unanimous_latency_ratio": _ratio(rows, "unanimous_latency", "full_latency"),
        "same_answer": sum(r["same_answer"] for r in rows),
        "graded": len(graded),
    }
    for name in ("full", "early", "filtered10", "filtered90"):
        out[f"accuracy_{name}"] = (
            round(sum(r[f"correct_{name}"] for r in graded) / len(graded), 4) if graded else None
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "early-stop.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from tts_service.config import ModelConfig
    from tts_service.models import model_source

    tokenizer = AutoTokenizer.from_pretrained(model_source(ModelConfig()))
    refs, rows = references(), []
    for path in sorted(BENCH.glob("trajectories-*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                rows.append(problem_row(path.name, json.loads(line), tokenizer, refs))
        print(f"{path.name}: {json.dumps(totals([r for r in rows if r['log'] == path.name]))}")
    summary = totals(rows)
    print(f"all: {json.dumps(summary)}")
    args.out.write_text(json.dumps({"all": summary, "problems": rows}, indent=1))
    return 0 if summary["same_answer"] == summary["problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
