"""`bench/prompt_harvest.py`: a problem's store observes its prompt's distributions once, before
its first trajectory, and a store seeded with them drafts what they predict."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig
from tts_service.replay import LoggedProblem, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prompt_harvest import seeding  # noqa: E402


class Counting:
    """A drafter whose prompt observations are counted (everything else, `grouped` included,
    is the inner drafter's)."""

    calls = 0

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def observe_root(self, tokens, topk):
        Counting.calls += 1
        return self.drafter.observe_root(tokens, topk)


def test_a_seeded_store_drafts_the_prompts_continuations_from_the_first_trajectory():
    # after the prompt's 1 the target would say 3 (the prompt's text says 2), after its 3 and
    # its 4 it would say 1: the responses 1 3 1 3 ... follow the target, not the text
    prompt, nxt = [1, 2, 3, 4], [3, 4, 1, 1]
    tops = {tuple(prompt): (np.array([[t] for t in nxt]), np.array([[1.0]] * len(prompt)))}
    problem = LoggedProblem("p", prompt, [[1, 3] * 6, [1, 3] * 6])
    cfg = StandDynDrafterConfig(num_nodes=8, sizing="fixed", compiled=False)
    base = replay([problem], cfg, 8, vocab_size=8)
    seed = seeding(tops)
    seeded = replay([problem], cfg, 8, vocab_size=8, wrap=lambda d: seed(Counting(d)))
    assert Counting.calls == len(prompt)  # once per problem store, not per trajectory
    assert seeded.tokens == base.tokens
    assert seeded.by_index[0][1] < base.by_index[0][1]  # fewer forwards from trajectory 1
