"""The held-out prompt set is a valid problems file for `jobs.best_of_n`, and shares nothing
with the prompts used for tuning (issue 19: report on prompts the drafters never saw)."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.best_of_n import load_problems

ROOT = Path(__file__).resolve().parents[3]


def test_heldout_prompts_are_new_and_load_as_problems():
    problems = load_problems(ROOT / "bench/heldout_prompts.jsonl")
    assert len(problems) >= 12 and {p.task for p in problems} == {"math", "choice", "code"}
    tuning = [
        json.loads(line)
        for f in ("bench/prompts.jsonl", "configs/calibration.jsonl")
        for line in (ROOT / f).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert not {p.id for p in problems} & {t["id"] for t in tuning}
    assert not {p.question for p in problems} & {t["prompt"] for t in tuning}
