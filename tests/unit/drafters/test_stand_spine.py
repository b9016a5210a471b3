"""STAND + spine on hand-made inputs: the branch budget, and a spine copied from an earlier
trajectory only with the store's consensus.

Losslessness is in the shared harnesses (tests/unit/engine/: test_decode, test_decode_sampling,
test_batch, test_verify); these tests pin down what the method drafts.
"""

from __future__ import annotations

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tts_service.drafters.matching import ExactMatchIndex
from tts_service.drafters.stand_spine import (
    StandSpineDrafter,
    StandSpineDrafterConfig,
    spine_budget,
)
from tts_service.engine.seam import DraftContext


def test_spine_budget_front_loads_the_branches():
    m, alloc = spine_budget(16, 20, 0.5)
    assert m == 8 and alloc == [7, 1, 0, 0, 0, 0, 0, 0]
    assert spine_budget(16, 3, 0.5) == (3, [8, 3, 2])


def test_stand_spine_copies_an_earlier_trajectory_and_needs_the_stores_consensus():
    store = InMemoryNgramStore()
    index = ExactMatchIndex((6, 5, 4, 3, 2))
    cfg = StandSpineDrafterConfig(num_nodes=12, tree="stand-80", min_match=3, stochastic=False)
    first = StandSpineDrafter(cfg, store, index)
    first.start([1, 2])
    index.sync(first.doc, [1, 2, 30, 31, 32, 33, 34, 35, 36])  # trajectory 1's text
    second = StandSpineDrafter(cfg, store, index)
    second.start([1, 2])
    ctx = DraftContext([1, 2, 30, 31, 32], prompt_len=2, max_nodes=12, greedy=True)
    tree = second.draft(ctx)
    assert tree.tokens[1:5] == (33, 34, 35, 36) and second.spine_steps == 1
    # the store disagrees on the first spine token: no spine, a plain STAND tree
    store.add([NgramRow((30, 31, 32), (7, 8, 9), (0.5, 0.3, 0.2))])
    tree = second.draft(ctx)
    assert second.spine_steps == 1 and 33 not in tree.tokens
    # it agrees (33 in the top 3): spine first, STAND branches after it, 33 never repeated
    store.add([NgramRow((30, 31, 32), (33, 8, 9), (1.0, 0.0, 0.0))] * 3)
    tree = second.draft(ctx)
    assert second.spine_steps == 2 and tree.children[0][0] == 1 and tree.tokens[1] == 33
    assert [tree.tokens[c] for c in tree.children[0]].count(33) == 1
