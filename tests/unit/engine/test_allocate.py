"""The allocator follows the cost surface (flat, steep, and by hand), and its slot statistics
forget a cold start."""

from __future__ import annotations

import pytest
import torch

from tts_service.engine.allocate import (
    MAX_DEPTH,
    MAX_RANK,
    BatchCost,
    SlotStats,
    expected_tokens,
    nodes_for_step,
)
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance
from tts_service.runner import MAX_NODES

# tree tokens nearly free: the allocator grants big trees, so drafts are really verified
FLAT = BatchCost((1, 16), (1, 64), ((1.0, 1.01), (1.0, 1.01)), 256)
STEEP = BatchCost((1, 16), (1, 64), ((1.0, 64.0), (16.0, 1024.0)), 256)


def _stats(alpha: float) -> SlotStats:
    """Slot statistics of a method whose chain slots are accepted with probability alpha^d."""
    s = SlotStats(prior_weight=1e-9)
    for _ in range(400):
        tree = DraftTree.chain(0, list(range(1, 9)))
        depth = sum(1 for _ in iter(lambda: torch.rand(()) < alpha, False))
        acc = Acceptance(tuple(range(1, min(depth, 8) + 1)), (), 0)
        s.record(tree, acc)
    return s


def test_the_allocator_grants_the_whole_budget_on_a_flat_surface():
    assert nodes_for_step(FLAT, [_stats(0.8)] * 4, MAX_NODES) == MAX_NODES


def test_the_allocator_grants_nothing_on_a_steep_surface():
    assert nodes_for_step(STEEP, [_stats(0.8)] * 16, MAX_NODES) == 0


def test_the_allocator_by_hand():
    """T(B, w) = B·(1 + 0.5(w - 1)) ms; chain slots accepted with 0.8, 0.5, 0.1 (then 0).

    Rates (tokens per ms) for k = 0..3: 1/1, 1.8/1.5 = 1.2, 2.3/2.0 = 1.15, 2.4/2.5 = 0.96,
    so the allocator picks k = 1. With B = 1 and the cost halved per token the rates become
    1, 1.8/1.25, 2.3/1.5, 2.4/1.75: k = 2."""
    s = SlotStats(prior_weight=1e-9)
    s.drafted[1:4, 0] = 1.0
    s.hits[1:4, 0] = [0.8, 0.5, 0.1]
    s.drafted[4:, 0] = 1.0
    s.drafted[:, 1:] = 1.0  # every sibling slot drafted and never accepted
    s.record(DraftTree.root_only(0), Acceptance((), (), 0))  # no-op: root only
    cost = BatchCost((1, 2), (1, 2), ((1.0, 1.5), (2.0, 3.0)), 256)
    assert nodes_for_step(cost, [s, s], 8) == 1
    half = BatchCost((1, 2), (1, 2), ((1.0, 1.25), (2.0, 2.5)), 256)
    assert nodes_for_step(half, [s], 8) == 2


def test_slot_statistics_forget_a_cold_start_while_nothing_is_drafted():
    """Evidence from steps over a cold store fades back to the prior, so trees get tried again."""
    s = SlotStats()
    for _ in range(16):  # one step of 16 chains, almost all rejected
        s.record(DraftTree.chain(0, [1, 2, 3]), Acceptance((), (), 0))
    s.tick()
    cold = float(s.alphas()[1, 0])
    for _ in range(150):
        s.tick()
    assert cold < 0.25 and float(s.alphas()[1, 0]) > 0.55  # the prior is 0.6


def test_expected_tokens_sum_each_methods_best_slots_over_its_rows():
    """Rows of a method share its statistics: rows + Σ_methods n · (its k best α̂), past the
    table's slots too (more nodes than slots add nothing)."""
    a, b = _stats(0.8), _stats(0.3)
    rows = [a, a, b]
    slots = (MAX_DEPTH + 1 - 1) * (MAX_RANK + 1)
    tokens = expected_tokens(rows, slots + 5)
    for k in (0, 1, 2, 7, slots, slots + 5):
        alphas = {id(s): sorted(s.alphas()[1:].ravel().tolist(), reverse=True) for s in (a, b)}
        want = 3 + sum(sum(alphas[id(s)][:k]) for s in rows)
        assert tokens[k] == pytest.approx(want, rel=1e-12)
    assert tokens[0] == 3.0 and tokens[slots] == tokens[slots + 5]


def test_the_prior_is_torchs_to_the_last_bit():
    """The slot counts moved from torch to numpy; the planner's decisions must not move with
    them (numpy's 0.6**4 is one ulp below torch's)."""
    d = torch.arange(MAX_DEPTH + 1, dtype=torch.float64)[:, None]
    r = torch.arange(MAX_RANK + 1, dtype=torch.float64)[None, :]
    assert (SlotStats().prior == (0.6**d * 0.5**r).numpy()).all()
