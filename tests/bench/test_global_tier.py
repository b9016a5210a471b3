"""`bench/global_tier.py`: a problem's store read before a global tier that holds the other
problems' trajectories, replayed as `store.global_scope` runs it."""

from __future__ import annotations

import sys
from pathlib import Path

from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig
from tts_service.replay import LoggedProblem, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from global_tier import leave_one_out, over_global  # noqa: E402

TEXT = [1, 3, 5, 2, 4, 6] * 3
CFG = StandDynDrafterConfig(num_nodes=8, sizing="fixed", compiled=False)


def logged(name: str, prompt: list[int], responses: int) -> LoggedProblem:
    """`responses` copies of TEXT, each position's logged distribution its own token."""
    tops = [[[t] for t in TEXT] for _ in range(responses)]
    probs = [[[1.0] for _ in TEXT] for _ in range(responses)]
    return LoggedProblem(name, prompt, [list(TEXT) for _ in range(responses)], tops, probs)


def test_a_global_tier_drafts_another_problems_text_from_a_problems_first_trajectory():
    other, problem = logged("a", [7], 2), logged("b", [6, 7], 1)  # another prompt, same text
    alone = replay([problem], CFG, 8, vocab_size=8)
    tiered = replay([problem], CFG, 8, vocab_size=8, new_store=over_global([other], CFG, 8))
    assert tiered.tokens == alone.tokens == len(TEXT)
    assert tiered.steps < alone.steps  # the first period is drafted from the global tier


def test_leave_one_out_pools_every_problem_over_the_others():
    problems = [logged("a", [7], 2), logged("b", [6, 7], 1)]
    alone = replay(problems, CFG, 8)
    pooled = leave_one_out(problems, [], CFG, 8)
    assert pooled.tokens == alone.tokens and sorted(pooled.by_index) == [0, 1]
    assert pooled.steps < alone.steps  # each problem drafts from the other's trajectories
    # with nothing else in the global tier, a problem replays as it does alone
    assert leave_one_out(problems[:1], [], CFG, 8).steps == replay(problems[:1], CFG, 8).steps
