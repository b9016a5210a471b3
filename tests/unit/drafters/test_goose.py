"""Goose on hand-made inputs: the budget split against the paper's worked example, the spine
laid first with branches off it, the bypass to a chain on a long match, and the fallback.

Losslessness is in the shared harnesses (tests/unit/engine/: test_decode, test_decode_sampling,
test_batch, test_verify); these tests pin down what the method drafts.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.drafters.test_gt import _topk
from tts_service.drafters.goose import (
    AdjacencyTable,
    GooseDrafter,
    GooseDrafterConfig,
    spine_tree_budget,
)
from tts_service.engine.seam import DraftContext
from tts_service.engine.verify import Acceptance


def test_goose_budget_split_is_the_papers_worked_example():
    assert spine_tree_budget(59, 5, 0.30, 0.5) == (5, 27, [11, 5, 3, 2, 2])
    assert spine_tree_budget(59, 7, 0.30, 0.5) == (7, 26, [10, 5, 3, 2, 2, 1, 1])
    assert spine_tree_budget(59, 0, 0.30, 0.5)[:2] == (0, 29)  # no match: a TR-only tree


def _goose_with_table(vocab: int = 32) -> GooseDrafter:
    table = AdjacencyTable(vocab, 10)
    # every token t is followed by t+1 (0.6), t+2 (0.3), t+3 (0.05)
    toks = list(range(vocab))
    ids = torch.tensor([[(t + j) % vocab for j in (1, 2, 3)] for t in toks])
    probs = torch.tensor([[0.6, 0.3, 0.05]] * vocab, dtype=torch.float64)
    table.update([-1] * vocab, toks, ids, probs)
    drafter = GooseDrafter(GooseDrafterConfig(num_nodes=20), table)
    drafter.start([])
    return drafter


def test_goose_lays_the_spine_first_and_branches_off_it():
    drafter = _goose_with_table()
    # "5 6 7" earlier; the suffix matches under n=3 only, 6 tokens follow: no bypass
    tokens = [5, 6, 7, 20, 21, 22, 5, 6, 7]
    tree = drafter.draft(DraftContext(tokens, prompt_len=3, max_nodes=20))
    spine = [1, 2, 3, 4, 5, 6]
    assert [tree.tokens[v] for v in spine[:3]] == [20, 21, 22]
    for v in range(tree.size):  # the spine child is tried first at every spine node
        kids = tree.children[v]
        if v in (0, *spine[:2]) and kids:
            assert kids[0] == (spine[spine.index(v) + 1] if v else 1)
        assert len({tree.tokens[k] for k in kids}) == len(kids)  # distinct children
    assert tree.size - 1 <= 20 and tree.size > 8  # branches were hung
    assert tree.tokens[tree.children[0][1]] == 8  # the root's best successor (7 -> 8)
    assert not any(tree.sampled)


def test_goose_bypasses_to_a_chain_on_a_long_match_and_learns_the_spine_rate():
    drafter = _goose_with_table(64)
    long = list(range(40, 52))
    tokens = [3, 4, 5, *long, 9, 3, 4, 5]
    tree = drafter.draft(DraftContext(tokens, prompt_len=3, max_nodes=20))
    assert tree.tokens[1:13] == tuple(long)  # the match's continuation...
    assert tree.parents == tuple(range(-1, tree.size - 1))  # ...as a plain chain
    drafter.observe(tree, Acceptance((1, 2, 3), (40, 41, 42), 43), _topk(tree.size))
    assert drafter.spine_rate == pytest.approx(0.7 * 0.3 + 0.3 * 3 / (tree.size - 1))
    # harvesting: every node's successors were overwritten, rejected ones included
    assert drafter.table.successors(50, 51)[0][0] == 0


def test_goose_falls_back_to_the_root_alone_with_nothing_to_draft():
    drafter = GooseDrafter(GooseDrafterConfig(), AdjacencyTable(16, 10))
    drafter.start([])
    assert drafter.draft(DraftContext([1, 2, 3], 3, 59)).size == 1
