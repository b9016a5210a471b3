"""The README demo's vote on the real SmolLM2: its plain-text answers are extracted and win."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.common import load_config
from store.memory import InMemoryNgramStore
from tts_service.aggregate import extract_answer, is_correct, majority_vote
from tts_service.schemas import read_problems
from tts_service.solve import solve

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_demo_problem_gets_a_real_majority_answer(smollm2):
    """Issue 17: the demo's trajectories all voted `None`, since SmolLM2 writes no `\\boxed{}`."""
    problem = next(p for p in read_problems(REPO / "jobs/demo_problems.jsonl") if p.task == "math")
    cfg = load_config(str(REPO / "configs/best_of_16.yaml"), ["n=8", "sampling.max_new_tokens=128"])
    ids = smollm2.encode(problem.question, chat=cfg.chat)
    run = solve(smollm2, ids, cfg.n, cfg.drafter, cfg.sampling, InMemoryNgramStore(), max_rows=8)
    answers = [extract_answer(t.output.text, "math") for t in run.problems[0].trajectories]
    vote = majority_vote(answers, "math")
    assert problem.answer is not None and is_correct(vote.answer, problem.answer, "math"), answers
    assert vote.share >= 0.5 and vote.num_no_answer < cfg.n
